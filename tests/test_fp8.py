"""FP8 (float8_e4m3fn) inputs without a GPU: the CPU reference's bf16 output
against a float32 attention of the same dequantized inputs (x.float() * descale per (batch, kv
head)), batched and varlen, GQA and causal, the packed variants, padded head dims,
flash_attn_with_kvcache (appended rows, cache_batch_idx, pages, cache_leftpad); the argument
checks; the NotImplementedError of a backward. The CUDA path's Python side on fake CUDA tensors
(what it refuses before any kernel, the op's bf16 fake output), with a stand-in extension (the
arguments `flash_attn_cuda.fwd` gets) and a stand-in build (require_kernel's FP8 rules); the
kernels themselves are tested by tests/test_fp8_gpu.py.

Accuracy bound: both sides compute the same float32 attention of the same dequantized values;
ours then rounds to bfloat16 (relative error <= 2^-9 per element), so
|ours - ref| <= 2^-8 * |ref| + 1e-6 holds with room for float32 summation order.
"""

import os
import re
import sys

import pytest
import torch

from flash_attn import (
    _fp8,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    ops,
    reference,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import attention_ref  # noqa: E402

E4M3 = torch.float8_e4m3fn


def attention_f32(q, k, v, causal=False):
    """float32 attention of already dequantized inputs (tests/attn_ref.py)."""
    return attention_ref(q, k, v, causal=causal, compute_dtype=torch.float32)[0]


def within_bound(out, ref):
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs()
    assert (err <= 2.0 ** -8 * ref.abs() + 1e-6).all(), err.max().item()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batched_matches_dequantized_attention(causal):
    torch.manual_seed(0)
    b, sq, sk, h, hk, d = 2, 13, 17, 4, 2, 64
    q, k, v = (torch.randn(b, s, n, d).to(E4M3) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    qd, kd, vd = (torch.rand(b, hk) + 0.5 for _ in range(3))
    out = flash_attn_func(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.shape == (b, sq, h, d)
    rep = lambda x: x.repeat_interleave(h // hk, 1)[:, None, :, None]  # noqa: E731
    ref = attention_f32(q.float() * rep(qd), k.float() * kd[:, None, :, None],
                        v.float() * vd[:, None, :, None], causal)
    within_bound(out, ref)
    # Without descales the scale is 1.
    within_bound(flash_attn_func(q, k, v, causal=causal),
                 attention_f32(q.float(), k.float(), v.float(), causal))


def test_varlen_uses_each_sequences_descale():
    torch.manual_seed(1)
    h, d = 2, 32
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)  # lengths 3, 0, 6
    q, k, v = (torch.randn(9, h, d).to(E4M3) for _ in range(3))
    qd, kd, vd = (torch.rand(3, h) + 0.5 for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True, q_descale=qd,
                                 k_descale=kd, v_descale=vd)
    assert out.shape == (9, h, d) and out.dtype == torch.bfloat16
    for bi, (s0, s1) in enumerate(((0, 3), (3, 3), (3, 9))):
        if s1 == s0:
            continue
        ref = attention_f32(q[None, s0:s1].float() * qd[bi][None, None, :, None],
                            k[None, s0:s1].float() * kd[bi][None, None, :, None],
                            v[None, s0:s1].float() * vd[bi][None, None, :, None], causal=True)
        within_bound(out[s0:s1], ref[0])


def test_argument_errors():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="descale are for float8_e4m3fn inputs"):
        flash_attn_func(q, q, q, q_descale=torch.ones(1, 2))
    f8 = q.to(E4M3)
    with pytest.raises(TypeError, match="must all be float8_e4m3fn"):
        flash_attn_func(f8, q, q)
    with pytest.raises(ValueError, match=r"q_descale must be a float32 tensor of shape"):
        flash_attn_func(f8, f8, f8, q_descale=torch.ones(2, 2))


@pytest.mark.parametrize("which", ["q", "v", "k_descale", "s_aux"])
def test_backward_raises(which):
    """Whichever input requires grad (an FP8 tensor, a descale, the sink), a backward through
    the FP8 call raises NotImplementedError."""
    q, k, v = (torch.randn(1, 4, 2, 16).to(E4M3) for _ in range(3))
    kw = dict(k_descale=torch.ones(1, 2), s_aux=torch.zeros(2))
    if which in ("q", "v"):
        (q if which == "q" else v).requires_grad_()
    else:
        kw[which].requires_grad_()
    out = flash_attn_func(q, k, v, **kw)
    with pytest.raises(NotImplementedError, match="backward of an FP8"):
        out.float().sum().backward()


def test_shape_and_cu_seqlens_errors_are_those_of_any_call():
    f8 = lambda *shape: torch.randn(*shape).to(E4M3)  # noqa: E731
    with pytest.raises(ValueError, match="4-D"):
        flash_attn_func(f8(6, 2, 16), f8(6, 2, 16), f8(6, 2, 16))
    with pytest.raises(ValueError, match="batch"):
        flash_attn_func(f8(2, 4, 2, 16), f8(1, 4, 2, 16), f8(1, 4, 2, 16))
    with pytest.raises(ValueError, match="same shape"):
        flash_attn_func(f8(1, 4, 2, 16), f8(1, 4, 2, 16), f8(1, 4, 1, 16))
    q = f8(9, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_attn_varlen_func(q, q, q, torch.tensor([0, 5, 3], dtype=torch.int32),
                               torch.tensor([0, 5, 9], dtype=torch.int32), 5, 5)


def test_varlen_gqa_descale_per_kv_head():
    torch.manual_seed(3)
    h, hk, d = 4, 2, 16
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q = torch.randn(12, h, d).to(E4M3)
    k, v = (torch.randn(12, hk, d).to(E4M3) for _ in range(2))
    qd, kd, vd = (torch.rand(2, hk) + 0.5 for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, q_descale=qd, k_descale=kd,
                                 v_descale=vd)
    for bi, (s0, s1) in enumerate(((0, 5), (5, 12))):
        ref = attention_f32(
            q[None, s0:s1].float() * qd[bi].repeat_interleave(2)[None, None, :, None],
            k[None, s0:s1].float() * kd[bi][None, None, :, None],
            v[None, s0:s1].float() * vd[bi][None, None, :, None])
        within_bound(out[s0:s1], ref[0])


def test_packed_variants_take_fp8():
    """qkvpacked / kvpacked (batched and varlen) take FP8 with the descales, as flash_attn_func
    and flash_attn_varlen_func on the unbound views."""
    torch.manual_seed(4)
    b, s, h, d = 2, 9, 2, 32
    qkv = torch.randn(b, s, 3, h, d).to(E4M3)
    qd, kd, vd = (torch.rand(b, h) + 0.5 for _ in range(3))
    kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    ref = flash_attn_func(*qkv.unbind(2), **kw)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, **kw), ref)
    assert torch.equal(flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], **kw), ref)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    flat = qkv[0].clone()
    ref = flash_attn_varlen_func(*flat.unbind(1), cu, cu, 5, 5, **kw)
    assert ref.dtype == torch.bfloat16
    assert torch.equal(flash_attn_varlen_qkvpacked_func(flat, cu, 5, **kw), ref)
    assert torch.equal(flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 5, 5,
                                                       **kw), ref)


def test_padded_headdim_probs_and_sink():
    """A head dim that is not a multiple of 16 (zero-padded through a uint8 view), a bf16 sink,
    an expanded descale (as vLLM passes a scalar scale) and return_attn_probs on CPU."""
    torch.manual_seed(5)
    b, sq, sk, h, hk, d = 2, 5, 7, 4, 2, 20
    q = torch.randn(b, sq, h, d).to(E4M3)
    k, v = (torch.randn(b, sk, hk, d).to(E4M3) for _ in range(2))
    qd = torch.tensor(1.5).expand(b, hk)
    kd, vd = (torch.rand(b, hk) + 0.5 for _ in range(2))
    sink = torch.randn(h).bfloat16()
    out, lse, probs = flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                      s_aux=sink, return_attn_probs=True)
    assert out.shape == (b, sq, h, d) and out.dtype == torch.bfloat16
    rep = lambda x: x.repeat_interleave(h // hk, 1)[:, None, :, None]  # noqa: E731
    qf, kf, vf = q.float() * rep(qd), k.float() * kd[:, None, :, None], v.float() * vd[:, None, :, None]
    ref, ref_lse = attention_ref(qf, kf, vf, sink=sink.float(), compute_dtype=torch.float32)
    within_bound(out, ref)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    ref_probs = reference.attention_probs_ref(qf, kf, lse, None, None, sq, sk, d ** -0.5,
                                              False, -1, -1, 0.0)
    torch.testing.assert_close(probs, ref_probs)


def test_backward_raises_with_padded_headdim_and_under_no_grad():
    q, k, v = (torch.randn(1, 4, 2, 20).to(E4M3) for _ in range(3))
    out = flash_attn_func(q.requires_grad_(), k, v)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="backward of an FP8"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not flash_attn_func(q, k, v).requires_grad


def _dequantized(x, descale, b):
    """Sequence b's rows x (rows, hk, d) in float32 times its descale row (hk,)."""
    return x.float() * descale[b][None, :, None]


@pytest.mark.parametrize("indexed", [False, True], ids=["direct", "batch_idx"])
def test_kvcache_appends_and_keeps_each_sequences_descale(indexed):
    """flash_attn_with_kvcache on e4m3 caches: the new rows land as they are (bytes), and
    sequence b's output is the attention of its entry's first cache_seqlens[b] + seqlen_new
    rows with row b of the descales, whichever entry it reads. GQA 4:2, causal."""
    torch.manual_seed(2)
    b, sq, h, hk, d, sc, snew = 3, 2, 4, 2, 32, 24, 2
    q = torch.randn(b, sq, h, d).to(E4M3)
    k_cache, v_cache = (torch.randn(5, sc, hk, d).to(E4M3) for _ in range(2))
    k_new, v_new = (torch.randn(b, snew, hk, d).to(E4M3) for _ in range(2))
    qd, kd, vd = (torch.rand(b, hk) + 0.5 for _ in range(3))
    lens = torch.tensor([0, 9, sc - snew], dtype=torch.int32)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32) if indexed else torch.arange(b).int()
    before = k_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                  cache_batch_idx=idx if indexed else None, causal=True,
                                  q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.shape == (b, sq, h, d) and out.dtype == torch.bfloat16
    for i, e in enumerate(idx.tolist()):
        start, end = int(lens[i]), int(lens[i]) + snew
        got = k_cache.view(torch.uint8)[e]
        assert torch.equal(got[start:end], k_new.view(torch.uint8)[i])
        assert torch.equal(got[:start], before.view(torch.uint8)[e, :start])
        rep = qd[i].repeat_interleave(h // hk)[None, None, :, None]
        ref = attention_f32(q[i:i + 1].float() * rep,
                            _dequantized(k_cache[e, :end], kd, i)[None],
                            _dequantized(v_cache[e, :end], vd, i)[None], causal=True)
        within_bound(out[i:i + 1], ref)


def test_pages_and_leftpad_on_the_reference():
    """CPU: a paged K/V (varlen and flash_attn_with_kvcache) and cache_leftpad, with pages too,
    run on the reference with each sequence's descales."""
    torch.manual_seed(3)
    b, h, hk, d, page, pages_per_seq = 2, 2, 1, 16, 4, 3
    pages_k, pages_v = (torch.randn(b * pages_per_seq, page, hk, d).to(E4M3)
                        for _ in range(2))
    table = torch.randperm(b * pages_per_seq).reshape(b, pages_per_seq).int()
    qd, kd, vd = (torch.rand(b, hk) + 0.5 for _ in range(3))
    lens = [7, 12]

    def seq_kv(i, pages):
        return pages[table[i].long()].reshape(-1, hk, d)[:lens[i]]

    q = torch.randn(b, 1, h, d).to(E4M3)
    out = flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=torch.tensor(lens).int(),
                                  block_table=table, q_descale=qd, k_descale=kd, v_descale=vd)
    qv = q[:, 0]
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
    out_v = flash_attn_varlen_func(qv, pages_k, pages_v, cu, cu_k, 1, max(lens),
                                   block_table=table, q_descale=qd, k_descale=kd, v_descale=vd)
    pad = torch.tensor([2, 5], dtype=torch.int32)
    out_p = flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=torch.tensor(lens).int(),
                                    block_table=table, cache_leftpad=pad, q_descale=qd,
                                    k_descale=kd, v_descale=vd)
    for i in range(b):
        rep = qd[i].repeat_interleave(h // hk)[None, None, :, None]
        qf = q[i:i + 1].float() * rep
        kf, vf = _dequantized(seq_kv(i, pages_k), kd, i), _dequantized(seq_kv(i, pages_v), vd, i)
        ref = attention_f32(qf, kf[None], vf[None])
        within_bound(out[i:i + 1], ref)
        within_bound(out_v[i:i + 1], ref[0])
        first = int(pad[i])
        within_bound(out_p[i:i + 1], attention_f32(qf, kf[None, first:], vf[None, first:]))


def test_kvcache_errors():
    q = torch.randn(1, 1, 2, 16).to(E4M3)
    cache = torch.randn(1, 8, 2, 16).to(E4M3)
    new = torch.randn(1, 1, 2, 16)
    lens = torch.tensor([3], dtype=torch.int32)
    table = torch.ones(64, 8)
    with pytest.raises(NotImplementedError, match="rotary embedding with FP8"):
        flash_attn_with_kvcache(q, cache, cache.clone(), new.to(E4M3), new.to(E4M3),
                                rotary_cos=table, rotary_sin=table, cache_seqlens=lens)
    with pytest.raises(TypeError, match="must all be float8_e4m3fn"):
        flash_attn_with_kvcache(q, cache, cache.clone(), new, new.to(E4M3), cache_seqlens=lens)
    with pytest.raises(TypeError, match="must all be float8_e4m3fn"):
        flash_attn_with_kvcache(q.float(), cache, cache)
    with pytest.raises(ValueError, match="descale are for float8_e4m3fn inputs"):
        flash_attn_with_kvcache(q.float(), cache.float(), cache.float(),
                                k_descale=torch.ones(1, 2))


@pytest.fixture
def fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    try:
        with mode:
            torch.empty(1, device="cuda", dtype=E4M3)
    except Exception as e:  # pragma: no cover
        pytest.skip(f"fake CUDA tensors unavailable: {e}")
    return mode


def test_cuda_call_reaches_the_op_with_the_descales(fake_cuda):
    """On (fake) CUDA tensors an FP8 call passes validation and reaches the custom op, whose
    fake implementation gives out in bfloat16 (q's shape with v's head dim) and lse float32;
    the descales must sit on q's device."""
    with fake_cuda:
        q = torch.empty(2, 77, 4, 80, device="cuda", dtype=E4M3)
        k = torch.empty(2, 300, 2, 80, device="cuda", dtype=E4M3)
        qd = torch.ones(2, 2, device="cuda")
        out = flash_attn_func(q, k, k, q_descale=qd, k_descale=qd, v_descale=qd, causal=True,
                              window_size=(64, 0), softcap=10.0,
                              s_aux=torch.zeros(4, device="cuda"))
        assert out.shape == (2, 77, 4, 80) and out.dtype == torch.bfloat16
        cu = torch.empty(3, dtype=torch.int32, device="cuda")  # values unread on CUDA
        qv, kv = (torch.empty(77, n, 80, device="cuda", dtype=E4M3) for n in (4, 2))
        out = flash_attn_varlen_func(qv, kv, kv, cu, cu, 72, 72, q_descale=qd, v_descale=qd)
        assert out.shape == (77, 4, 80) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="q_descale must be a float32 tensor .* on q's device"):
            flash_attn_func(q, k, k, q_descale=torch.ones(2, 2))


@pytest.mark.parametrize("what", ["alibi", "dropout", "probs", "mla"])
def test_cuda_unsupported_combinations(fake_cuda, what):
    """What the CUDA FP8 kernels lack raises NotImplementedError naming it, before any kernel
    (the CPU reference runs all four)."""
    with fake_cuda:
        q = torch.empty(1, 8, 2, 64, device="cuda", dtype=E4M3)
        v = torch.empty(1, 8, 2, 32, device="cuda", dtype=E4M3) if what == "mla" else q
        kw = dict(alibi=dict(alibi_slopes=torch.ones(2, device="cuda")),
                  dropout=dict(dropout_p=0.1), probs=dict(return_attn_probs=True),
                  mla={})[what]
        name = dict(alibi="alibi_slopes", dropout="dropout_p > 0",
                    probs="return_attn_probs=True", mla="v head dim")[what]
        with pytest.raises(NotImplementedError, match=f"CUDA FP8 .* {re.escape(name)}"):
            flash_attn_func(q, q, v, **kw)
    q = torch.randn(1, 8, 2, 64).to(E4M3)
    v = torch.randn(1, 8, 2, 32).to(E4M3) if what == "mla" else q
    kw = dict(alibi=dict(alibi_slopes=torch.ones(2)), dropout=dict(dropout_p=0.1),
              probs=dict(return_attn_probs=True), mla={})[what]
    res = flash_attn_func(q, q, v, **kw)
    out = res[0] if isinstance(res, tuple) else res
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("what", ["pages of 12", "leftpad with pages"])
def test_cuda_unsupported_kvcache(fake_cuda, what):
    """On CUDA an FP8 cache runs with cache_seqlens, cache_batch_idx, cache_leftpad and pages of
    a multiple of 8 rows (out bfloat16 from the op's fake); pages of other sizes and
    cache_leftpad with pages (the SM80 kernels' cases) raise NotImplementedError naming them."""
    with fake_cuda:
        q = torch.empty(2, 1, 4, 64, device="cuda", dtype=E4M3)
        cache = torch.empty(3, 64, 2, 64, device="cuda", dtype=E4M3)
        new = torch.empty(2, 1, 2, 64, device="cuda", dtype=E4M3)
        lens = torch.empty(2, dtype=torch.int32, device="cuda")
        qd = torch.ones(2, 2, device="cuda")
        table = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
        pages16 = torch.empty(8, 16, 2, 64, device="cuda", dtype=E4M3)
        # (with cache_batch_idx: no slice of the cache, which fake CUDA tensors of a CPU build
        # cannot take)
        for kw in (dict(cache_batch_idx=lens), dict(cache_batch_idx=lens, cache_leftpad=lens)):
            out = flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=lens,
                                          q_descale=qd, v_descale=qd, **kw)
            assert out.shape == (2, 1, 4, 64) and out.dtype == torch.bfloat16
        out = flash_attn_with_kvcache(q, pages16, pages16.clone(), cache_seqlens=lens,
                                      block_table=table)
        assert out.dtype == torch.bfloat16
        if what == "pages of 12":
            pages, kw = torch.empty(8, 12, 2, 64, device="cuda", dtype=E4M3), {}
            match = "pages of 12 rows"
        else:
            pages, kw = pages16, dict(cache_leftpad=lens)
            match = "cache_leftpad together with block_table"
        with pytest.raises(NotImplementedError, match=f"CUDA FP8 .*{match}"):
            flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table, **kw)


class _FakeExt:
    """A stand-in extension: ``fwd`` with FP8's trailing descales, recording its arguments and
    running the CPU reference on the dequantized inputs (no fwd_plain: FP8 must not take it)."""

    def __init__(self):
        self.calls = []

    def fwd(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, window_right, softcap, kv_batch_idx,
            block_table, leftpad_k, alibi_slopes, sink, dropout_p, rng_state, sm_margin,
            q_descale=None, k_descale=None, v_descale=None):
        self.calls.append(dict(dtype=q.dtype, descales=(q_descale, k_descale, v_descale),
                               sm_margin=sm_margin, sink=sink))
        return ops._fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                            max_seqlen_k, softmax_scale, causal, window_left, window_right,
                            softcap, False, kv_batch_idx, block_table, leftpad_k, alibi_slopes,
                            sink, dropout_p, rng_state, sm_margin, q_descale, k_descale,
                            v_descale)


def test_cuda_impl_passes_fp8_and_descales_to_fwd(monkeypatch):
    """ops._fwd_cuda hands FP8 q, k, v as they are to the extension's fwd (never fwd_plain),
    the descales last, after sm_margin; the result is what the op returns."""
    ext = _FakeExt()
    monkeypatch.setattr(ops, "_EXT", ext)
    monkeypatch.setattr(ops, "require_kernel", lambda *args: None)
    torch.manual_seed(6)
    q = torch.randn(2, 5, 4, 16).to(E4M3)
    k, v = (torch.randn(2, 6, 2, 16).to(E4M3) for _ in range(2))
    qd, kd, vd = (torch.rand(2, 2) + 0.5 for _ in range(3))
    args = (q, k, v, None, None, None, 5, 6, 0.25, True, -1, 0, 0.0)
    out, lse = ops._fwd_cuda(*args, False, None, None, None, None, None, 0.0, None, 3, qd, kd,
                             vd)
    (call,) = ext.calls
    assert call["dtype"] == E4M3 and call["sm_margin"] == 3
    assert all(a is b for a, b in zip(call["descales"], (qd, kd, vd)))
    ref_out, ref_lse = ops._fwd_cpu(*args, False, None, None, None, None, None, 0.0, None, 0,
                                    qd, kd, vd)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # no descales: None reaches the extension (1)
    ops._fwd_cuda(*args)
    assert ext.calls[-1]["descales"] == (None, None, None)


def test_require_kernel_fp8_rules(monkeypatch):
    """e4m3 kernels are SM90 forward kernels: another GPU, FLASH_ATTN_FORCE_SM80=1 or a missing
    tier raise NotImplementedError; bf16 kernels of the same tier do not count."""
    dev = torch.device("cuda", 0)
    built = {("fwd", 90, "e4m3", 128), ("fwd", 80, "bf16", 64), ("fwd", 90, "bf16", 64)}
    monkeypatch.setattr(ops, "_BUILT_KERNELS", built)
    monkeypatch.delenv("FLASH_ATTN_FORCE_SM80", raising=False)
    monkeypatch.setattr(ops, "_capability", lambda device: (8, 0))
    with pytest.raises(NotImplementedError, match=r"H100-class \(sm90\) GPU"):
        ops.require_kernel("fwd", E4M3, 128, dev)
    monkeypatch.setattr(ops, "_capability", lambda device: (9, 0))
    ops.require_kernel("fwd", E4M3, 128, dev)
    ops.require_kernel("fwd", E4M3, 112, dev)  # tier 128
    with pytest.raises(NotImplementedError, match="kernel was built for e4m3 head dim 64"):
        ops.require_kernel("fwd", E4M3, 64, dev)
    with pytest.raises(NotImplementedError, match="kernel was built for e4m3"):
        ops.require_kernel("bwd", E4M3, 128, dev)
    monkeypatch.setenv("FLASH_ATTN_FORCE_SM80", "1")
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_FORCE_SM80=1"):
        ops.require_kernel("fwd", E4M3, 128, dev)
    ops.require_kernel("fwd", torch.bfloat16, 64, dev)  # unchanged for bf16


def test_kvcache_update_refuses_before_writing(monkeypatch):
    """On CUDA the cache update checks that the attention after it has a kernel (an FP8 cache
    on a GPU other than sm90, say) before it writes the caches: the extension is not called."""
    calls = []

    class _Ext:
        def kvcache_update(self, *args):
            calls.append(args)

    def refuse(kind, dtype, headdim, device):
        calls.append((kind, dtype, headdim))
        raise NotImplementedError("no kernel")

    monkeypatch.setattr(ops, "load_extension", lambda: _Ext())
    monkeypatch.setattr(ops, "require_kernel", refuse)
    q = torch.randn(1, 1, 2, 72).to(E4M3)
    cache = torch.randn(1, 8, 2, 72).to(E4M3)
    with pytest.raises(NotImplementedError, match="no kernel"):
        ops._kvcache_update_cuda(cache, cache.clone(), None, q, q, q, None, 0, None, None, None,
                                 True, False)
    assert calls == [("fwd", E4M3, 80)]  # the head dim padded to a multiple of 16, no update


def test_dequantize_rows_past_the_last_sequence():
    """Varlen rows past cu_seqlens[-1] (which the reference leaves alone) keep a descale of 1."""
    x = torch.full((5, 2, 4), 2.0).to(E4M3)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    d = torch.tensor([[3.0, 5.0], [7.0, 11.0]])
    out = _fp8.dequantize(x, d, cu)
    expect = torch.tensor([[3.0, 5.0], [7.0, 11.0], [7.0, 11.0], [1.0, 1.0], [1.0, 1.0]]) * 2
    assert torch.equal(out, expect[:, :, None].expand(5, 2, 4))


def test_compile_fullgraph_fp8():
    """torch.compile traces an FP8 call as one op node (the fake gives bf16), with the same
    result as eager."""
    torch.manual_seed(7)
    q = torch.randn(2, 5, 4, 16).to(E4M3)
    k, v = (torch.randn(2, 6, 2, 16).to(E4M3) for _ in range(2))
    qd, kd, vd = (torch.rand(2, 2) + 0.5 for _ in range(3))

    def f(q, k, v, qd, kd, vd):
        return flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    torch._dynamo.reset()
    out_c = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qd, kd, vd)
    out_e = f(q, k, v, qd, kd, vd)
    assert out_c.dtype == torch.bfloat16 and torch.equal(out_c, out_e)


def test_opcheck_fp8_fwd():
    torch.manual_seed(8)
    q = torch.randn(2, 4, 4, 16).to(E4M3)
    k, v = (torch.randn(2, 5, 2, 16).to(E4M3) for _ in range(2))
    qd, kd, vd = (torch.rand(2, 2) + 0.5 for _ in range(3))
    # test_schema is left out: it multiplies the inputs, which CPU torch has no e4m3 kernel for.
    res = torch.library.opcheck(
        torch.ops.flash_attn._fwd.default,
        (q, k, v, None, None, None, 4, 5, 0.3, True, -1, 0, 0.0, False, None, None, None,
         None, None, 0.0, None, 0, qd, kd, vd),
        test_utils=("test_autograd_registration", "test_faketensor",
                    "test_aot_dispatch_dynamic"))
    assert all(r == "SUCCESS" for r in res.values()), res
