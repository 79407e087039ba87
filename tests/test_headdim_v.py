"""A v head dim other than q's and k's (MLA-style 192/128, 128/64, 256/128, and an odd one) on
the CPU reference path: out (headdim_v wide) and its gradients against an explicit float64
attention and gradcheck, batched and varlen, GQA and causal, the shapes of everything
returned, and the head-dim limits a CUDA call gets (the CUDA path is
tests/test_headdim_v_gpu.py).
"""

import os
import sys

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn import _validation as V

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import attention_ref  # noqa: E402

F64 = torch.float64


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (256, 128), (40, 13)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batched(d, dv, causal):
    torch.manual_seed(0)
    q = torch.randn(2, 9, 4, d, dtype=F64, requires_grad=True)
    k = torch.randn(2, 11, 2, d, dtype=F64, requires_grad=True)
    v = torch.randn(2, 11, 2, dv, dtype=F64, requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 9, 4, dv) and lse.shape == (2, 4, 9)
    ref = attention_ref(q, k, v, causal=causal, compute_dtype=F64)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    grads_ref = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, r in zip("qkv", grads, grads_ref):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, atol=1e-11, rtol=1e-9, msg=f"d{name}")


def test_gradcheck():
    torch.manual_seed(1)
    q = torch.randn(1, 5, 2, 24, dtype=F64, requires_grad=True)
    k = torch.randn(1, 7, 1, 24, dtype=F64, requires_grad=True)
    v = torch.randn(1, 7, 1, 16, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=True),
                                    (q, k, v))


def test_varlen():
    torch.manual_seed(2)
    h, d, dv = 2, 32, 16
    cu_q = torch.tensor([0, 3, 3, 11], dtype=torch.int32)  # lengths 3, 0, 8
    cu_k = torch.tensor([0, 5, 7, 15], dtype=torch.int32)  # lengths 5, 2, 8
    q = torch.randn(11, h, d, dtype=F64)
    k = torch.randn(15, h, d, dtype=F64)
    v = torch.randn(15, h, dv, dtype=F64)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 8, causal=True)
    assert out.shape == (11, h, dv)
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 > q0:
            ref = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True,
                                compute_dtype=F64)[0]
            torch.testing.assert_close(out[q0:q1], ref[0], atol=1e-12, rtol=1e-10)


def test_shape_errors_and_cuda():
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="same shape but for the last dim"):
        flash_attn_func(q, k, torch.randn(1, 5, 2, 8))
    with pytest.raises(ValueError, match=r"headdim_v .*<= 256 on CUDA, got 264"):
        V._check_headdim_v("flash_attn_func", "v", 264, "cuda")
    V._check_headdim_v("flash_attn_func", "v", 8, "cuda")
    V._check_headdim_v("flash_attn_func", "v", 16, "cuda")
    V._check_headdim_v("flash_attn_func", "v", 8, "cpu")
