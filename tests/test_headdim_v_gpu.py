"""A v head dim other than q's and k's (MLA) on the CUDA kernels: out and dq, dk, dv against the
float64 reference with the accuracy rule (tests/attn_ref.py), batched and varlen, causal and
not, GQA. The interface pads the narrower of q/k and v to the wider head dim, so each pair runs
the kernel of that head dim (a subset build skips the pairs it lacks).
"""

import os
import sys

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import compare_to_ref, plain_qkv, rand  # noqa: E402
from attn_ref import kernel_path, poisoned_allocator  # noqa: E402,F401  (autouse fixtures)

# (q/k head dim, v head dim): the MLA pairs, v wider than q/k, and widths that are not
# multiples of 8 on one side.
PAIRS = [(192, 128), (128, 64), (256, 128), (64, 128), (72, 128), (128, 100)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dv", PAIRS, ids=[f"d{a}-dv{b}" for a, b in PAIRS])
def test_batched(d: int, dv: int, causal: bool, dtype: torch.dtype):
    torch.manual_seed(d + dv)
    q = rand(2, 200, 4, d, dtype=dtype)
    k = rand(2, 333, 2, d, dtype=dtype)
    v = rand(2, 333, 2, dv, dtype=dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    assert out.shape == (2, 200, 4, dv) and out.dtype == dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    compare_to_ref(out, grads, (q, k, v), plain_qkv, dict(causal=causal), dout)


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64)], ids=["d192-dv128", "d128-dv64"])
def test_varlen(d: int, dv: int):
    torch.manual_seed(7)
    h, hk = 4, 1
    lens_q, lens_k = [3, 0, 150, 64], [5, 9, 150, 300]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = rand(sum(lens_q), h, d, dtype=torch.bfloat16)
    k = rand(sum(lens_k), hk, d, dtype=torch.bfloat16)
    v = rand(sum(lens_k), hk, dv, dtype=torch.bfloat16)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    assert out.shape == (sum(lens_q), h, dv)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        leaves = [x.detach()[None, a:e].requires_grad_() for x, (a, e) in
                  zip((q, k, v), ((q0, q1), (k0, k1), (k0, k1)))]
        seq_grads = [g[None, a:e] for g, (a, e) in
                     zip(grads, ((q0, q1), (k0, k1), (k0, k1)))]
        compare_to_ref(out[None, q0:q1], seq_grads, leaves, plain_qkv, dict(causal=True),
                       dout[None, q0:q1], tag=f" (sequence {b})")
