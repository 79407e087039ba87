"""The learnable sink (``s_aux`` / ``learnable_sink``) on CUDA, every entry point family, both
kernel paths: out, dq, dk, dv and the sink's gradient against the float64 reference of
tests/attn_ref.py (a softmax with one more column per row holding the sink's logit), under the
accuracy rule; softmax_lse includes the sink; rows without a kept key get the sink's logit as
their lse and a zero output; the KV-cache decode (its split-KV kernels too).
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import (  # noqa: E402
    REF_DTYPE,
    assert_accuracy,
    assert_lse,
    attention_ref,
    compare_to_ref,
    plain_qkv,
    rand,
)
from attn_ref import kernel_path, poisoned_allocator  # noqa: E402,F401  (autouse fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def check_sink_grad(out, lse, sink, dout, ref_fn, varlen=False):
    """dsink of our out against the float64 reference's. Ours is
    -sum_r exp(sink - lse_r) * rowsum(dout * out)_r over head h's rows r, from out as returned:
    rounded to bf16, 2^-8 of each |out| at most, so its error may exceed the accuracy rule's
    3 x the bf16 baseline's by sum_r exp(sink - lse_r) * rowsum(|dout| * |out|)_r * 2^-8."""
    (g,) = torch.autograd.grad(out, [sink], dout, retain_graph=True)
    s_ref = sink.detach().to(REF_DTYPE).requires_grad_()
    out_ref = ref_fn(s_ref, REF_DTYPE)
    (g_ref,) = torch.autograd.grad(out_ref, [s_ref], dout.to(REF_DTYPE))
    s_pt = sink.detach().clone().requires_grad_()
    out_pt = ref_fn(s_pt, out.dtype)
    (g_pt,) = torch.autograd.grad(out_pt, [s_pt], dout)
    mag = (dout.double().abs() * out.detach().double().abs()).sum(-1)  # (.., rows, heads)
    mag = mag.transpose(0, 1) if varlen else mag.transpose(1, 2)   # lse's layout
    p_sink = torch.exp(sink.detach().double().view(-1, 1) - lse.double()) if varlen else \
        torch.exp(sink.detach().double().view(1, -1, 1) - lse.double())
    rounding = (p_sink * mag).sum(-1) if varlen else (p_sink * mag).sum((0, 2))
    err = (g.double() - g_ref).abs()
    allowed = 3 * (g_pt.double() - g_ref).abs().max() + rounding * 2.0 ** -8 + 1e-5
    assert (err <= allowed).all(), f"dsink: errors {err.tolist()} > allowed {allowed.tolist()}"


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(40, 7)),
    "softcap_causal": dict(causal=True, softcap=15.0),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("seqlens", [(113, 203), (256, 256), (203, 113)], ids=str)
def test_batched(case, d, seqlens):
    torch.manual_seed(40)
    sq, sk = seqlens
    kw = CASES[case]
    b, h, hk = 2, 4, 2
    q = rand(b, sq, h, d, dtype=torch.bfloat16)
    k = rand(b, sk, hk, d, dtype=torch.bfloat16)
    v = rand(b, sk, hk, d, dtype=torch.bfloat16)
    sink = (torch.randn(h, device="cuda") * 2).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, **kw, s_aux=sink, return_attn_probs=True)
    ref_kw = dict(kw, sink=sink.detach().to(REF_DTYPE))
    _, lse_ref = attention_ref(*(x.detach().to(REF_DTYPE) for x in (q, k, v)),
                               compute_dtype=REF_DTYPE, **ref_kw)
    assert_lse("lse", lse, lse_ref)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], dout, retain_graph=True)
    # compare_to_ref takes the sink as a constant of the reference (q, k, v are the leaves).
    compare_to_ref(out, grads, [q, k, v], plain_qkv, ref_kw, dout)

    def ref_fn(s, dt):
        qkv = [x.detach().to(dt) for x in (q, k, v)]
        return attention_ref(*qkv, compute_dtype=dt, **dict(kw, sink=s))[0]

    check_sink_grad(out, lse, sink, dout, ref_fn)


def test_rows_without_keys_get_the_sink():
    """Causal with seqlen_q > seqlen_k: the first rows see no key. Their output is 0 and their
    lse the sink's logit (+inf where the sink is -inf); other heads' rows are unaffected."""
    torch.manual_seed(41)
    b, sq, sk, h, d = 1, 64, 16, 3, 64
    q, k, v = (rand(b, s, h, d, dtype=torch.bfloat16, requires_grad=False)
               for s in (sq, sk, sk))
    sink = torch.tensor([0.5, -math.inf, -3.0], device="cuda")
    out, lse, _ = flash_attn_func(q, k, v, causal=True, s_aux=sink, return_attn_probs=True)
    empty = sq - sk  # rows 0 .. sq - sk - 1 see no key
    assert (out[:, :empty] == 0).all()
    expect = torch.tensor([0.5, math.inf, -3.0], device="cuda").view(1, h, 1).expand(b, h, empty)
    assert torch.equal(lse[:, :, :empty], expect)
    assert torch.isfinite(lse[:, :, empty:]).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(causal):
    torch.manual_seed(42)
    lq, lk = [5, 0, 130, 64, 300], [7, 3, 0, 200, 257]
    h, hk, d = 4, 1, 128
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), device="cuda",
                        dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), device="cuda",
                        dtype=torch.int32)
    q = rand(sum(lq), h, d, dtype=torch.bfloat16)
    k = rand(sum(lk), hk, d, dtype=torch.bfloat16)
    v = rand(sum(lk), hk, d, dtype=torch.bfloat16)
    sink = torch.randn(h, device="cuda").requires_grad_()
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                         learnable_sink=sink, return_attn_probs=True)
    ref_kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], dout, retain_graph=True)
    compare_to_ref(out, grads, [q, k, v], plain_qkv,
                   dict(ref_kw, sink=sink.detach().to(REF_DTYPE)), dout)

    def ref_fn(s, dt):
        qkv = [x.detach().to(dt) for x in (q, k, v)]
        return attention_ref(*qkv, compute_dtype=dt, sink=s, **ref_kw)[0]

    check_sink_grad(out, lse, sink, dout, ref_fn, varlen=True)


@pytest.mark.parametrize("split", ["0", "1"])
def test_kvcache_decode(split, monkeypatch):
    """One new token against caches of different fill, with the split-KV decode kernels forced
    on and off (FLASH_ATTN_SPLIT)."""
    monkeypatch.setenv("FLASH_ATTN_SPLIT", split)
    torch.manual_seed(43)
    b, cap, h, hk, d = 3, 4096, 8, 2, 128
    lens = torch.tensor([1, 1000, 4095], device="cuda", dtype=torch.int32)
    k_cache = rand(b, cap, hk, d, dtype=torch.bfloat16, requires_grad=False)
    v_cache = rand(b, cap, hk, d, dtype=torch.bfloat16, requires_grad=False)
    q = rand(b, 1, h, d, dtype=torch.bfloat16, requires_grad=False)
    sink = torch.randn(h, device="cuda") * 3
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                       s_aux=sink, return_softmax_lse=True)
    for i in range(b):
        n = int(lens[i])
        sl = lambda x, dt: x[i:i + 1, :n].to(dt)  # noqa: E731
        o_ref, l_ref = attention_ref(q[i:i + 1].to(REF_DTYPE), sl(k_cache, REF_DTYPE),
                                     sl(v_cache, REF_DTYPE), causal=True,
                                     compute_dtype=REF_DTYPE, sink=sink.to(REF_DTYPE))
        o_pt, _ = attention_ref(q[i:i + 1], sl(k_cache, torch.bfloat16),
                                sl(v_cache, torch.bfloat16), causal=True,
                                compute_dtype=torch.bfloat16, sink=sink)
        assert_accuracy(f"out[{i}]", out[i:i + 1], o_ref, o_pt, 2)
        assert_lse(f"lse[{i}]", lse[i:i + 1], l_ref)
