"""The learnable attention sink (``s_aux`` / ``learnable_sink``, as in gpt-oss) on the CPU
reference path: forward and backward against an independent float64 implementation written
here (an explicit softmax over the scores plus one more column holding the sink's logit),
gradcheck, the two argument names, validation errors, the empty-row and ``-inf`` conventions,
``torch.compile``. The CUDA path is tested in tests/test_sink_gpu.py.
"""

import math

import pytest
import torch

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_attn import ops

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# Independent float64 reference
# --------------------------------------------------------------------------------------------


def sink_attention_ref(q, k, v, sink, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                       alibi=None, seqlen_k=None):
    """q (b, sq, h, d), k/v (b, sk, hk, d), sink (h,) or None; alibi slopes (h,) or None;
    seqlen_k: use only the first seqlen_k keys (a KV cache's filled rows). Everything in float64.

    The scores (scaled, softcapped, ALiBi-biased, masked to -inf) get one more column, the sink's
    logit, and the softmax runs over all columns; the sink's column is then dropped (it has no
    value). Returns out (b, sq, h, d) and lse (b, h, sq) over all columns; a row whose columns
    are all -inf gets p = 0, out = 0 and lse = +inf. Differentiable without NaNs."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    if seqlen_k is not None:
        k, v = k[:, :seqlen_k], v[:, :seqlen_k]
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    diag = i + sk - sq
    if alibi is not None:
        s = s - alibi.to(F64).view(1, h, 1, 1) * (diag - j).abs()
    left, right = window
    right = 0 if causal else right
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    s = s.masked_fill(~keep, -math.inf)
    col = torch.full((h,), -math.inf, dtype=F64) if sink is None else sink.to(F64)
    full = torch.cat([s, col.view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    m = full.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(full - m)
    denom = e.sum(dim=-1, keepdim=True)
    ok = denom > 0
    denom = torch.where(ok, denom, torch.ones_like(denom))
    p = (e / denom)[..., :sk]  # the sink's column carries no value
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    lse = torch.where(ok, m + torch.log(denom), torch.full_like(m, math.inf)).squeeze(-1)
    return out, lse


def varlen_ref(q, k, v, cu_q, cu_k, sink, **kw):
    """Per-sequence sink_attention_ref of packed q (total_q, h, d), k/v (total_k, hk, d):
    out (total_q, h, d), lse (h, total_q)."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bq) - 1):
        o, l = sink_attention_ref(q[None, bq[b]:bq[b + 1]], k[None, bk[b]:bk[b + 1]],
                                  v[None, bk[b]:bk[b + 1]], sink, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout, allow_unused=True)


def leaves(*shapes, dtype=torch.float32):
    return [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]


def close(a, b, atol=2e-5, rtol=2e-5):
    torch.testing.assert_close(a.to(F64), b.to(F64), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------
# Forward and backward against the reference
# --------------------------------------------------------------------------------------------

BATCHED_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(2, 1)),
    "causal_window_softcap": dict(causal=True, window=(3, 0), softcap=1.5),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi=True),
    "alibi_causal_softcap": dict(alibi=True, causal=True, softcap=1.2),
    "scale": dict(scale=0.7),
}


@pytest.mark.parametrize("case", list(BATCHED_CASES))
@pytest.mark.parametrize("shape", [(2, 5, 7, 4, 2, 16), (1, 7, 4, 3, 3, 12), (2, 6, 6, 4, 1, 8)],
                         ids=["gqa_sq<sk", "mha_sq>sk_hd12", "mqa"])
def test_batched_forward_backward(case, shape):
    """flash_attn_func with a sink (out, lse, dq, dk, dv, dsink) against the float64 reference,
    with GQA/MQA, seqlen_q != seqlen_k, a zero-padded head dim, and each score option."""
    torch.manual_seed(0)
    b, sq, sk, h, hk, d = shape
    kw = dict(BATCHED_CASES[case])
    q, k, v = leaves((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
    sink = (torch.randn(h) * 2).requires_grad_()
    alibi = torch.rand(h) * 0.5 if kw.pop("alibi", False) else None
    api = dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
               softcap=kw.get("softcap", 0.0), softmax_scale=kw.get("scale"),
               alibi_slopes=alibi)
    out, lse, _ = flash_attn_func(q, k, v, **api, return_attn_probs=True, s_aux=sink)
    ref_out, ref_lse = sink_attention_ref(q, k, v, sink, alibi=alibi, **kw)
    close(out, ref_out)
    close(lse, ref_lse)
    dout = torch.randn_like(out)
    g = grads(out, [q, k, v, sink], dout)
    g_ref = grads(ref_out, [q, k, v, sink], dout.to(F64))
    for name, a, r in zip(("dq", "dk", "dv", "dsink"), g, g_ref):
        assert a.dtype == (torch.float32), name
        close(a, r, atol=5e-5, rtol=5e-5)


def test_causal_rows_without_keys():
    """Causal with seqlen_q > seqlen_k: the first rows keep no key. With a sink their output is
    0 and their lse is the sink's logit (finite); gradients are finite and match the
    reference; with a -inf sink those rows have lse +inf as without a sink."""
    torch.manual_seed(1)
    q, k, v = leaves((2, 6, 2, 8), (2, 3, 2, 8), (2, 3, 2, 8))
    sink = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                  learnable_sink=sink)
    empty = slice(0, 3)  # rows 0..2: i + (3 - 6) < 0
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.equal(lse[:, :, empty], sink.detach().view(1, 2, 1).expand(2, 2, 3))
    ref_out, ref_lse = sink_attention_ref(q, k, v, sink, causal=True)
    close(out, ref_out)
    close(lse, ref_lse)
    dout = torch.randn_like(out)
    for a, r in zip(grads(out, [q, k, v, sink], dout), grads(ref_out, [q, k, v, sink], dout)):
        assert torch.isfinite(a).all()
        close(a, r, atol=5e-5, rtol=5e-5)
    _, lse_inf, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                    s_aux=torch.full((2,), -math.inf))
    assert torch.isinf(lse_inf[:, :, empty]).all() and (lse_inf[:, :, empty] > 0).all()


def test_eager_gpt_oss_semantics():
    """transformers' eager gpt-oss attention (scores, then the sink as one more column of a
    plain softmax, the column dropped) gives the same output, written out as it does."""
    torch.manual_seed(2)
    b, s, h, hk, d = 2, 5, 4, 2, 16
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    sinks = torch.randn(h)
    scaling = d ** -0.5
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(h // hk, 1), vt.repeat_interleave(h // hk, 1)
    w = qt @ kt.transpose(2, 3) * scaling
    w = w + torch.full((s, s), torch.finfo(w.dtype).min).triu(1)  # transformers' causal mask
    logits = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    eager = (probs @ vt).transpose(1, 2)
    close(flash_attn_func(q, k, v, causal=True, s_aux=sinks), eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(1, 2), softcap=1.5),
                                dict(alibi=True, causal=True)],
                         ids=["plain", "causal", "window_softcap", "alibi_causal"])
def test_varlen_forward_backward(kw):
    """flash_attn_varlen_func with a sink, GQA, sequences of different lengths (one without
    keys: its rows have out 0 and lse = sink), against the per-sequence reference."""
    torch.manual_seed(3)
    kw = dict(kw)
    h, hk, d = 4, 2, 8
    lens_q, lens_k = [3, 5, 2, 4], [4, 5, 0, 6]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = leaves((sum(lens_q), h, d), (sum(lens_k), hk, d), (sum(lens_k), hk, d))
    sink = torch.randn(h, requires_grad=True)
    alibi = torch.rand(h) * 0.5 if kw.pop("alibi", False) else None
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=kw.get("causal", False),
        window_size=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
        alibi_slopes=alibi, return_attn_probs=True, s_aux=sink)
    ref_out, ref_lse = varlen_ref(q, k, v, cu_q, cu_k, sink, alibi=alibi, **kw)
    close(out, ref_out)
    close(lse, ref_lse)
    no_keys = slice(8, 10)  # sequence 2
    assert torch.equal(out[no_keys], torch.zeros_like(out[no_keys]))
    assert torch.equal(lse[:, no_keys], sink.detach()[:, None].expand(h, 2))
    dout = torch.randn_like(out)
    for a, r in zip(grads(out, [q, k, v, sink], dout), grads(ref_out, [q, k, v, sink], dout)):
        close(a, r, atol=5e-5, rtol=5e-5)


def test_varlen_rows_past_the_last_sequence():
    """Rows of q past cu_seqlens_q[-1] belong to no sequence (the custom op takes them; the
    public functions refuse them on CPU): out 0, lse = the sink's logit, +inf for -inf."""
    torch.manual_seed(4)
    q, k, v = torch.randn(7, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 5], dtype=torch.int32)
    sink = torch.tensor([0.25, -math.inf])
    out, lse = torch.ops.flash_attn._fwd(q, k, v, cu_q, cu_k, None, 3, 3, 0.3, False, -1, -1,
                                         0.0, False, None, None, None, None, sink)
    assert torch.equal(out[5:], torch.zeros(2, 2, 8))
    assert torch.equal(lse[:, 5:], torch.tensor([[0.25, 0.25], [math.inf, math.inf]]))


def test_packed_variants_match_unpacked():
    """The qkvpacked / kvpacked variants (batched and varlen) with a sink give flash_attn_func's
    and flash_attn_varlen_func's output and sink gradient."""
    torch.manual_seed(5)
    b, s, h, d = 2, 5, 4, 8
    qkv = torch.randn(b, s, 3, h, d)
    sink = torch.randn(h)

    def run(fn, *args, **kw):
        sk = sink.clone().requires_grad_()
        out = fn(*args, causal=True, s_aux=sk, **kw)
        (g,) = torch.autograd.grad(out, sk, torch.ones_like(out))
        return out, g

    ref = run(flash_attn_func, *qkv.unbind(2))
    for got in (run(flash_attn_qkvpacked_func, qkv),
                run(flash_attn_kvpacked_func, qkv[:, :, 0], qkv[:, :, 1:])):
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-6)
    flat = qkv.reshape(b * s, 3, h, d)
    cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
    ref_v = run(flash_attn_varlen_func, *flat.unbind(1), cu, cu, s, s)
    for got in (run(flash_attn_varlen_qkvpacked_func, flat, cu, s),
                run(flash_attn_varlen_kvpacked_func, flat[:, 0], flat[:, 1:], cu, cu, s, s)):
        for a, r in zip(got, ref_v):
            torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref_v[0].reshape(b, s, h, d), ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref_v[1], ref[1], atol=1e-5, rtol=1e-5)


def test_kvcache():
    """flash_attn_with_kvcache with a sink: new rows appended, each sequence attends to its
    cache_seqlens + seqlen_new rows (GQA, causal); out and lse against the reference; the cache
    is written as without a sink."""
    torch.manual_seed(6)
    b, sq, h, hk, d, cache = 2, 2, 4, 2, 16, 12
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sq, hk, d), torch.randn(b, sq, hk, d)
    k_cache, v_cache = torch.randn(b, cache, hk, d), torch.randn(b, cache, hk, d)
    lens = torch.tensor([3, 7], dtype=torch.int32)
    sink = torch.randn(h)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True,
                                       return_softmax_lse=True, learnable_sink=sink)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    flash_attn_with_kvcache(q, kc0, vc0, k, v, cache_seqlens=lens, causal=True)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    for i, n in enumerate(lens.tolist()):
        ro, rl = sink_attention_ref(q[i:i + 1], kc[i:i + 1], vc[i:i + 1], sink, causal=True,
                                    seqlen_k=n + sq)
        close(out[i:i + 1], ro)
        close(lse[i:i + 1], rl)


def test_kvcache_whole_cache_is_differentiable_in_the_sink():
    """Without cache_seqlens the KV-cache call is an ordinary attention over the whole cache,
    differentiable (the sink included); with cache_batch_idx the entries are read in place."""
    torch.manual_seed(7)
    q, kc, vc = leaves((2, 3, 4, 8), (3, 5, 2, 8), (3, 5, 2, 8))
    sink = torch.randn(4, requires_grad=True)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=idx, window_size=(2, 0),
                                  s_aux=sink)
    ref_out, _ = sink_attention_ref(q, kc[idx.long()], vc[idx.long()], sink, window=(2, 0))
    close(out, ref_out)
    dout = torch.randn_like(out)
    for a, r in zip(grads(out, [q, kc, vc, sink], dout),
                    grads(ref_out, [q, kc, vc, sink], dout)):
        close(a, r, atol=5e-5, rtol=5e-5)


# --------------------------------------------------------------------------------------------
# gradcheck (float64, the sink included)
# --------------------------------------------------------------------------------------------


def test_gradcheck_batched():
    torch.manual_seed(8)
    q, k, v = leaves((1, 4, 4, 8), (1, 5, 2, 8), (1, 5, 2, 8), dtype=F64)
    sink = torch.randn(4, dtype=F64, requires_grad=True)
    alibi = torch.rand(4) * 0.3

    def f(q, k, v, sink):
        return flash_attn_func(q, k, v, causal=True, softcap=2.0, alibi_slopes=alibi,
                               s_aux=sink)

    assert torch.autograd.gradcheck(f, (q, k, v, sink))


def test_gradcheck_varlen_with_empty_rows():
    """Varlen, causal with more queries than keys in one sequence (rows without keys)."""
    torch.manual_seed(9)
    q, k, v = leaves((7, 2, 8), (5, 2, 8), (5, 2, 8), dtype=F64)
    sink = torch.randn(2, dtype=F64, requires_grad=True)
    cu_q = torch.tensor([0, 4, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 5], dtype=torch.int32)

    def f(q, k, v, sink):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 3, causal=True,
                                      learnable_sink=sink)

    assert torch.autograd.gradcheck(f, (q, k, v, sink))


def test_gradcheck_sink_only():
    """Only the sink requires grad: the backward computes its gradient alone."""
    torch.manual_seed(10)
    q, k, v = (torch.randn(2, 3, 2, 8, dtype=F64) for _ in range(3))
    sink = torch.randn(2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: flash_attn_func(q, k, v, s_aux=s), (sink,))


# --------------------------------------------------------------------------------------------
# Argument names, dtypes, conventions
# --------------------------------------------------------------------------------------------


def test_both_names_give_identical_results():
    torch.manual_seed(11)
    q, k, v = torch.randn(2, 4, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    sink = torch.randn(4)
    results = []
    for name in ("s_aux", "learnable_sink"):
        qq, kk, vv, ss = (t.clone().requires_grad_() for t in (q, k, v, sink))
        out, lse, _ = flash_attn_func(qq, kk, vv, causal=True, return_attn_probs=True,
                                      **{name: ss})
        out.backward(torch.ones_like(out))
        results.append((out, lse, qq.grad, kk.grad, vv.grad, ss.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_passing_both_names_is_a_value_error():
    q = torch.randn(1, 2, 2, 8)
    sink = torch.zeros(2)
    calls = [
        lambda: flash_attn_func(q, q, q, s_aux=sink, learnable_sink=sink),
        lambda: flash_attn_qkvpacked_func(torch.stack([q] * 3, 2), s_aux=sink,
                                          learnable_sink=sink),
        lambda: flash_attn_with_kvcache(q, q, q, s_aux=sink, learnable_sink=sink.clone()),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="s_aux and learnable_sink"):
            call()


@pytest.mark.parametrize("bad,err,match", [
    (torch.zeros(3), ValueError, r"s_aux must have shape \(nheads,\) = \(2,\)"),
    (torch.zeros(1, 2), ValueError, r"s_aux must have shape"),
    (torch.zeros(()), ValueError, r"s_aux must have shape"),
    (torch.zeros(2, dtype=torch.float16), TypeError, r"s_aux must be a float32 tensor"),
    (torch.zeros(2, dtype=torch.int32), TypeError, r"s_aux must be a float32 tensor"),
    (torch.zeros(2, dtype=F64), TypeError, r"s_aux must be a float32 tensor"),
    ([0.0, 0.0], TypeError, r"s_aux must be a torch.Tensor"),
    (torch.zeros(2, device="meta"), ValueError, r"s_aux must be on the same device as q"),
], ids=["len3", "2d", "0d", "fp16", "int32", "fp64", "list", "meta"])
def test_validation_errors(bad, err, match):
    q = torch.randn(1, 3, 2, 8)  # float32, 2 heads
    with pytest.raises(err, match=match):
        flash_attn_func(q, q, q, s_aux=bad)
    with pytest.raises(err, match=match.replace("s_aux", "learnable_sink")):
        flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 3], dtype=torch.int32),
                               torch.tensor([0, 3], dtype=torch.int32), 3, 3,
                               learnable_sink=bad)
    with pytest.raises(err, match=match):
        flash_attn_with_kvcache(q, q, q, s_aux=bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_sink_in_q_dtype(dtype):
    """A sink of q's dtype (transformers passes s_aux.to(query.dtype)) is accepted; its
    gradient comes back in its own dtype; the result equals that of the same sink in float32
    (float64 stays float64)."""
    torch.manual_seed(12)
    q = torch.randn(1, 4, 2, 16, dtype=dtype)
    sink = torch.randn(2).to(dtype).requires_grad_()
    out = flash_attn_func(q, q, q, causal=True, s_aux=sink)
    out.float().sum().backward()
    assert sink.grad.dtype == dtype
    sink32 = sink.detach().float().requires_grad_()
    out32 = flash_attn_func(q, q, q, causal=True, s_aux=sink32)
    out32.float().sum().backward()
    if dtype == F64:
        torch.testing.assert_close(out, out32, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(out, out32)
        torch.testing.assert_close(sink.grad.float(), sink32.grad, atol=1e-2, rtol=1e-2)


def test_neg_inf_sink_is_no_sink():
    """A -inf sink changes nothing: out, lse and q/k/v gradients equal those without a sink
    bit for bit, and its own gradient is 0."""
    torch.manual_seed(13)
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    runs = []
    for sink in (None, torch.full((4,), -math.inf)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ss = None if sink is None else sink.clone().requires_grad_()
        out, lse, _ = flash_attn_func(qq, kk, vv, window_size=(2, 1), softcap=1.5,
                                      return_attn_probs=True, s_aux=ss)
        out.backward(torch.ones_like(out))
        runs.append((out, lse, qq.grad, kk.grad, vv.grad))
        if ss is not None:
            assert torch.equal(ss.grad, torch.zeros(4))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_lse_includes_the_sink():
    """lse with a sink = logaddexp(lse without it, sink); out = out without it times the
    probability mass left to the keys, exp(lse_without - lse_with)."""
    torch.manual_seed(14)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 6, 3, 8), torch.randn(2, 6, 3, 8)
    sink = torch.tensor([-1.0, 0.0, 2.5])
    out0, lse0, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out1, lse1, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                        s_aux=sink)
    torch.testing.assert_close(lse1, torch.logaddexp(lse0, sink.view(1, 3, 1)))
    scale = torch.exp(lse0 - lse1).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(out1, out0 * scale)
    # return_attn_probs' probabilities leave the sink's column out: rows sum to below 1
    torch.testing.assert_close(probs.sum(-1), torch.exp(lse0 - lse1))


def test_fast_path_matches_custom_op():
    """ops.flash_attn_fwd (eager fast path) and torch.ops.flash_attn._fwd with a sink give the
    same outputs and gradients, including the sink's."""
    torch.manual_seed(15)
    q, k, v = torch.randn(2, 4, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)
    sink = torch.randn(4)
    res = []
    for fwd in (ops.flash_attn_fwd, torch.ops.flash_attn._fwd):
        qq, kk, vv, ss = (t.clone().requires_grad_() for t in (q, k, v, sink))
        out, lse = fwd(qq, kk, vv, None, None, None, 4, 5, 0.3, True, -1, 0, 0.0, False, None,
                       None, None, None, ss)
        out.backward(torch.ones_like(out))
        res.append((out, lse, qq.grad, kk.grad, vv.grad, ss.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_opcheck_with_sink():
    torch.manual_seed(16)
    q = torch.randn(2, 4, 4, 8, requires_grad=True)
    k = torch.randn(2, 5, 2, 8, requires_grad=True)
    v = torch.randn(2, 5, 2, 8, requires_grad=True)
    sink = torch.randn(4, requires_grad=True)
    fwd, bwd = torch.ops.flash_attn._fwd.default, torch.ops.flash_attn._bwd.default
    for args in [(q, k, v, None, None, None, 4, 5, 0.3, True, -1, 0, 0.0, False, None, None,
                  None, None, sink),
                 (q, k, v, None, None, None, 4, 5, 0.3, False, 2, 1, 1.5, False, None, None,
                  None, torch.rand(4), sink)]:
        res = torch.library.opcheck(fwd, args)
        assert all(r == "SUCCESS" for r in res.values()), res
    out, lse = torch.ops.flash_attn._fwd(q, k, v, None, None, None, 4, 5, 0.3, True, -1, 0,
                                         0.0, False, None, None, None, None, sink)
    res = torch.library.opcheck(bwd, (torch.randn_like(out), q.detach(), k.detach(),
                                      v.detach(), out.detach(), lse, None, None, 4, 5, 0.3,
                                      True, -1, 0, 0.0, False, None, sink.detach()))
    assert all(r == "SUCCESS" for r in res.values()), res


class SinkAttention(torch.nn.Module):
    """gpt-oss style: a learnable per-head sink parameter."""

    def __init__(self, nheads: int):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(nheads))

    def forward(self, q, k, v, cu=None):
        if cu is None:
            out = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), s_aux=self.sinks)
        else:
            out = flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True,
                                         learnable_sink=self.sinks)
        return out * 2.0 + 1.0


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_compile_fullgraph(varlen):
    """torch.compile(fullgraph=True) (aot_eager) with a learnable sink: no graph break; output,
    q/k/v gradients and the sink parameter's gradient equal eager mode's."""
    torch.manual_seed(17)
    torch._dynamo.reset()
    mod = SinkAttention(4)
    if varlen:
        shapes, cu = [(7, 4, 8), (7, 2, 8), (7, 2, 8)], torch.tensor([0, 3, 7], dtype=torch.int32)
    else:
        shapes, cu = [(2, 5, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)], None
    inputs = [torch.randn(*s) for s in shapes]
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    res = []
    for fn in (compiled, mod):
        mod.zero_grad()
        ins = [t.clone().requires_grad_() for t in inputs]
        out = fn(*ins, cu)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin())
        res.append((out.detach(), *[t.grad for t in ins], mod.sinks.grad.clone()))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_sink_without_grad():
    """A sink that does not require grad (a buffer) leaves q/k/v's gradients those of a
    grad-requiring one."""
    torch.manual_seed(18)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    sink = torch.randn(2)
    res = []
    for req in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qq, kk, vv, causal=True, s_aux=sink.clone().requires_grad_(req))
        out.backward(torch.ones_like(out))
        res.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_transformers_gpt_oss_cpu(monkeypatch):
    """transformers' gpt-oss (a tiny random config; a sliding and a full attention layer) with
    attn_implementation="flash_attention_2" runs on this package on CPU, transformers passing
    the sinks as s_aux (it reads the functions' signatures): logits with and without left
    padding (the varlen path) and the sinks' gradients match its eager attention. Skipped
    without transformers."""
    transformers = pytest.importorskip("transformers")
    fau = pytest.importorskip("transformers.modeling_flash_attention_utils")
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    import copy

    monkeypatch.setattr(fau, "is_flash_attn_2_available", lambda: True)  # it checks for CUDA
    torch.manual_seed(19)
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    eager = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    flash = copy.deepcopy(eager)
    for m in flash.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "flash_attention_2"
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        for kw in (dict(), dict(attention_mask=mask)):
            a, b = eager(ids, **kw).logits, flash(ids, **kw).logits
            kept = mask.bool() if kw else slice(None)
            torch.testing.assert_close(b[kept], a[kept], atol=1e-5, rtol=1e-5)
    for model in (eager, flash):
        model(ids).logits.square().mean().backward()
    for la, lb in zip(eager.model.layers, flash.model.layers):
        torch.testing.assert_close(lb.self_attn.sinks.grad, la.self_attn.sinks.grad,
                                   atol=1e-8, rtol=1e-4)
