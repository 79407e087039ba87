"""Dropout on the CPU reference path (``dropout_p > 0``; the CUDA kernels:
tests/test_dropout_gpu.py, and here the manual_seed test on CUDA too): the output against an explicit float64
attention that replays the mask of flash_attn/dropout.py from the call's generator state, the
gradients against autograd of that computation, ``return_attn_probs`` showing the dropped
entries negated, reproducibility under ``torch.manual_seed``, the kept fraction and the mean,
varlen, GQA, causal, ``torch.compile``.
"""

import math
import os
import sys

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.dropout import dropout_factor, new_rng_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import attention_ref  # noqa: E402

F64 = torch.float64


def state_after_seed(seed):
    """The generator state a call draws right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return new_rng_state()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 37, 53, 4, 2, 16), (1, 64, 40, 3, 3, 32)],
                         ids=["gqa", "mha"])
def test_output_and_grads_replay_the_mask(causal, shape):
    b, sq, sk, h, hk, d = shape
    p = 0.3
    torch.manual_seed(1)
    q = torch.randn(b, sq, h, d, dtype=F64, requires_grad=True)
    k = torch.randn(b, sk, hk, d, dtype=F64, requires_grad=True)
    v = torch.randn(b, sk, hk, d, dtype=F64, requires_grad=True)
    torch.manual_seed(7)
    out = flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    factor = dropout_factor(state_after_seed(7), p, 0, b, h, sq, sk, F64)
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = attention_ref(qr, kr, vr, causal=causal, compute_dtype=F64, drop=factor)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads_ref = torch.autograd.grad(ref, (qr, kr, vr), dout)
    for name, a, r in zip("qkv", grads, grads_ref):
        torch.testing.assert_close(a, r, atol=1e-11, rtol=1e-9, msg=f"d{name}")


def test_varlen_replays_each_sequence_mask():
    """Sequence b of a varlen call draws the mask of batch entry b at its own positions."""
    torch.manual_seed(2)
    lens_q, lens_k, h, d, p = [5, 0, 19, 33], [8, 4, 19, 20], 2, 16, 0.25
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d, dtype=F64)
    k = torch.randn(sum(lens_k), h, d, dtype=F64)
    v = torch.randn(sum(lens_k), h, d, dtype=F64)
    torch.manual_seed(11)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=p,
                                 causal=True)
    state = state_after_seed(11)
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        factor = dropout_factor(state, p, b, 1, h, q1 - q0, k1 - k0, F64)
        ref = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True,
                            compute_dtype=F64, drop=factor)[0]
        torch.testing.assert_close(out[q0:q1], ref[0], atol=1e-12, rtol=1e-10)


def test_return_attn_probs_negates_the_dropped():
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 24, 2, 16, dtype=F64) for _ in range(3))
    torch.manual_seed(5)
    out, lse, probs = flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    factor = dropout_factor(state_after_seed(5), 0.4, 0, 2, 2, 24, 24, F64)
    torch.manual_seed(5)
    plain = flash_attn_func(q, k, v, return_attn_probs=True)[2]
    torch.testing.assert_close(probs, torch.where(factor > 0, plain, -plain))
    # out is the kept probabilities, scaled, times V (probs come from the float32 lse)
    torch.testing.assert_close(
        out, torch.einsum("bhqk,bkhd->bqhd", probs.clamp(min=0) / 0.6, v), atol=1e-6,
        rtol=1e-6)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA GPU"))])
def test_reproducible_and_fresh_per_call(device):
    """torch.manual_seed reproduces a call's mask (the CUDA kernels' too); the next call draws
    another."""
    torch.manual_seed(4)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 256, 2, 64, device=device, dtype=dtype) for _ in range(3))
    torch.manual_seed(9)
    a = flash_attn_func(q, k, v, dropout_p=0.5)
    b = flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(9)
    c = flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def test_kept_fraction_and_mean():
    """Over many calls the kept fraction of return_attn_probs is 1 - p, and the mean output
    is the output without dropout (dropout rescales the kept probabilities)."""
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 16, 2, 16, dtype=F64) for _ in range(3))
    p, calls = 0.3, 300
    plain = flash_attn_func(q, k, v)
    total = torch.zeros_like(plain)
    kept = 0.0
    for _ in range(calls):
        out, _, probs = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
        total += out
        kept += (probs > 0).double().mean().item()
    kept /= calls
    n = calls * probs.numel()
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    # Each output element averages `calls` draws; its spread over draws is below |V|'s scale.
    err = (total / calls - plain).abs().max().item()
    assert err < 6 * v.abs().max().item() * math.sqrt(p / (1 - p) / calls)


def test_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.2, causal=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(12)
    out = compiled(q, k, v)
    torch.manual_seed(12)
    ref = f(q, k, v)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("with_sink", [False, True], ids=["plain", "sink"])
def test_gradcheck_with_a_fixed_mask(with_sink):
    """float64 gradcheck of q, k, v (and the learnable sink) under dropout: every evaluation
    draws its mask right after the same torch.manual_seed, so the function is deterministic."""
    torch.manual_seed(13)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=F64, requires_grad=True) for _ in range(3))
    sink = torch.randn(2, dtype=F64, requires_grad=True)

    def f(q, k, v, sink):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(21)
            return flash_attn_func(q, k, v, dropout_p=0.3, causal=True,
                                   s_aux=sink if with_sink else None)

    assert torch.autograd.gradcheck(f, (q, k, v, sink))
