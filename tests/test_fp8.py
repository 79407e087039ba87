"""FP8 (float8_e4m3fn) inputs on the CPU reference path (issue 30 item 3; the CUDA kernels do
not take them yet): the bf16 output against a float32 attention of the same dequantized inputs
(x.float() * descale per (batch, kv head)), batched and varlen, GQA and causal; the argument
checks; the NotImplementedError of a backward and of a CUDA call.

Accuracy bound: both sides compute the same float32 attention of the same dequantized values;
ours then rounds to bfloat16 (relative error <= 2^-9 per element), so
|ours - ref| <= 2^-8 * |ref| + 1e-6 holds with room for float32 summation order.
"""

import os
import sys

import pytest
import torch

from flash_attn import _fp8, flash_attn_func, flash_attn_varlen_func

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


def test_cuda_not_implemented_yet():
    """A CUDA call raises before any work: checked with an e4m3 tensor that reports a CUDA
    device (the check reads q.device.type)."""

    class CudaDevice:
        type = "cuda"

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return CudaDevice()

    t = torch.randn(1, 4, 2, 16).to(E4M3).as_subclass(OnCuda)
    with pytest.raises(NotImplementedError, match="FP8 .* not implemented by the CUDA kernels"):
        _fp8.check_inputs("flash_attn_func", t, t, t)
