"""Dropout on CUDA (the SM80 kernels draw the mask of flash_attn/dropout.py, on every GPU):
out, dq, dk, dv against the float64 reference that replays the mask from the call's generator
state, under the accuracy rule; varlen per sequence; return_attn_probs negating the dropped
entries; the kernel's kept fraction and the mean; dropout with ALiBi, a sink, softcap,
deterministic and paged K/V; a CUDA graph drawing a fresh mask on each replay.
torch.manual_seed reproducing a CUDA call is tested in tests/test_dropout.py.
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import compare_to_ref, plain_qkv, rand  # noqa: E402
from attn_ref import poisoned_allocator  # noqa: E402,F401  (autouse fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    from flash_attn.dropout import dropout_factor, keep_threshold, new_rng_state

F64 = torch.float64


def state_after_seed(seed: int) -> torch.Tensor:
    """The generator state a CUDA call draws right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return new_rng_state("cuda")


CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window, p)
    (2, 128, 128, 4, 4, 64, False, (-1, -1), 0.1),
    (2, 197, 301, 4, 2, 128, True, (-1, -1), 0.3),
    (1, 300, 300, 2, 1, 128, False, (64, 16), 0.5),
    (3, 75, 40, 2, 2, 64, False, (-1, -1), 0.2),
    (1, 1, 129, 2, 2, 128, False, (-1, -1), 0.17),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}x{c[2]}-d{c[5]}-p{c[8]}" for c in CASES])
def test_fwd_bwd_replays_the_mask(case, dtype):
    b, sq, sk, h, hk, d, causal, window, p = case
    q, k, v = rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), \
        rand(b, sk, hk, d, dtype=dtype)
    torch.manual_seed(7)
    out = flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window)
    factor = dropout_factor(state_after_seed(7), p, 0, b, h, sq, sk, F64, device="cuda")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    compare_to_ref(out, grads, [q, k, v], plain_qkv,
                   {"causal": causal, "window_size": window, "drop": factor}, dout)


def test_varlen_replays_each_sequence_mask():
    lens_q, lens_k, h, d, p = [65, 0, 130, 17], [80, 33, 130, 200], 2, 64, 0.25
    dev = "cuda"
    cu_q = torch.tensor([0] + lens_q, device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=dev).cumsum(0).to(torch.int32)
    q = rand(sum(lens_q), h, d, dtype=torch.bfloat16)
    k = rand(sum(lens_k), h, d, dtype=torch.bfloat16)
    v = rand(sum(lens_k), h, d, dtype=torch.bfloat16)
    torch.manual_seed(11)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=p,
                                 causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    state = state_after_seed(11)
    for bi in range(len(lens_q)):
        q0, q1 = int(cu_q[bi]), int(cu_q[bi + 1])
        k0, k1 = int(cu_k[bi]), int(cu_k[bi + 1])
        if q1 == q0:
            continue
        factor = dropout_factor(state, p, bi, 1, h, q1 - q0, k1 - k0, F64, device=dev)
        leaves = [x[None, a:z].detach() for x, a, z in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        compare_to_ref(out[None, q0:q1], [grads[0][None, q0:q1], grads[1][None, k0:k1],
                                          grads[2][None, k0:k1]],
                       leaves, plain_qkv, {"causal": True, "drop": factor}, dout[None, q0:q1],
                       tag=f" sequence {bi}")


@pytest.mark.parametrize("causal", [False, True])
def test_positioned_state_draws_the_larger_mask(causal):
    # A five-element state (seed, offset, entry0, row0, col0), as ring attention hands each
    # block: the kernels must draw the scores of entry b + entry0, row i + row0, column
    # j + col0 (fresh positions each run; row0, col0 multiples of 16).
    from flash_attn import ops
    from flash_attn.dropout import at_positions

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    entry0, row0, col0 = (int(torch.randint(0, 8, (1,), generator=gen)) * m for m in (1, 16, 16))
    b, sq, sk, h, d, p = 2, 96, 160, 2, 64, 0.3
    q, k, v = rand(b, sq, h, d, dtype=torch.bfloat16), rand(b, sk, h, d, dtype=torch.bfloat16), \
        rand(b, sk, h, d, dtype=torch.bfloat16)
    state = at_positions(state_after_seed(3), entry0, row0, col0)
    out, lse = ops.flash_attn_fwd(q, k, v, None, None, None, sq, sk, d ** -0.5, causal, -1,
                                  0 if causal else -1, 0.0, dropout_p=p, rng_state=state)
    dout = torch.randn_like(out)
    grads = ops.flash_attn_bwd(dout, q, k, v, out, lse, None, None, sq, sk, d ** -0.5, causal,
                               -1, 0 if causal else -1, 0.0, False, dropout_p=p,
                               rng_state=state)
    full = dropout_factor(state[:2], p, 0, entry0 + b, h, row0 + sq, col0 + sk, F64,
                          device="cuda")
    factor = full[entry0:, :, row0:, col0:]
    assert torch.equal(factor, dropout_factor(state, p, 0, b, h, sq, sk, F64, device="cuda"))
    compare_to_ref(out, list(grads), [q, k, v], plain_qkv, {"causal": causal, "drop": factor},
                   dout)


def test_return_attn_probs_negates_the_dropped():
    q, k, v = (rand(2, 96, 2, 64, dtype=torch.bfloat16, requires_grad=False) for _ in range(3))
    torch.manual_seed(5)
    _, _, probs = flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    factor = dropout_factor(state_after_seed(5), 0.4, 0, 2, 2, 96, 96, F64, device="cuda")
    assert torch.equal(probs < 0, factor == 0)


def test_kernel_kept_fraction():
    """With V the identity (seqlen_k = headdim), out[i, j] is key j's kept, scaled probability,
    so the nonzero fraction of the kernel's output is its kept fraction: 1 - p within 5
    standard deviations (quantized as keep_threshold says)."""
    b, sq, h, d, p = 2, 512, 4, 64, 0.3
    q, k = (rand(b, n, h, d, dtype=torch.bfloat16, requires_grad=False) for n in (sq, d))
    v = torch.eye(d, device="cuda", dtype=torch.bfloat16).view(1, d, 1, d).expand(b, d, h, d)
    out = flash_attn_func(q, k, v.contiguous(), dropout_p=p)
    keep = keep_threshold(p) / 65536
    n = out.numel()
    assert abs((out != 0).double().mean().item() - keep) < 5 * math.sqrt(keep * (1 - keep) / n)


def test_mean_is_the_output_without_dropout():
    """Over many calls the mean output is the output without dropout (kept probabilities are
    rescaled by 1 / (1 - p))."""
    q, k, v = (rand(1, 128, 2, 64, dtype=torch.float16, requires_grad=False) for _ in range(3))
    p, calls = 0.3, 400
    plain = flash_attn_func(q, k, v).double()
    total = torch.zeros_like(plain)
    for _ in range(calls):
        total += flash_attn_func(q, k, v, dropout_p=p).double()
    err = (total / calls - plain).abs().max().item()
    assert err < 6 * v.abs().max().item() * math.sqrt(p / (1 - p) / calls)


@pytest.mark.parametrize("extra", ["alibi", "sink", "softcap", "deterministic"])
def test_dropout_with(extra):
    """Dropout together with the arguments that share its kernel instantiation or its rows."""
    b, sq, sk, h, d, p = 2, 150, 170, 4, 64, 0.2
    q, k, v = (rand(b, n, h, d, dtype=torch.bfloat16) for n in (sq, sk, sk))
    kw, ref_kw = {}, {}
    if extra == "alibi":
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")
        kw["alibi_slopes"] = ref_kw["alibi_slopes"] = slopes
    elif extra == "sink":
        sink = torch.randn(h, device="cuda")
        kw["s_aux"], ref_kw["sink"] = sink, sink.to(F64)
    elif extra == "softcap":
        kw["softcap"] = ref_kw["softcap"] = 5.0
    else:
        kw["deterministic"] = True
    torch.manual_seed(3)
    out = flash_attn_func(q, k, v, dropout_p=p, causal=True, **kw)
    factor = dropout_factor(state_after_seed(3), p, 0, b, h, sq, sk, F64, device="cuda")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    compare_to_ref(out, grads, [q, k, v], plain_qkv, dict(causal=True, drop=factor, **ref_kw),
                   dout)


def test_paged_forward():
    """Paged K/V (block_table) under dropout, forward: each sequence against the reference that
    replays its mask."""
    from test_varlen_gpu import cu_seqlens, to_pages

    lq, lk, h, d, page, p = [70, 130], [200, 64], 2, 64, 64, 0.25
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), h, d, dtype=torch.bfloat16, requires_grad=False)
    k = rand(sum(lk), h, d, dtype=torch.bfloat16, requires_grad=False)
    v = rand(sum(lk), h, d, dtype=torch.bfloat16, requires_grad=False)
    perm = torch.randperm(len(lk) * 4 + 1).tolist()
    k_pages, table = to_pages(k, lk, page, perm)
    v_pages, _ = to_pages(v, lk, page, perm)
    torch.manual_seed(13)
    out = flash_attn_varlen_func(q, k_pages, v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(lq), max_seqlen_k=max(lk), dropout_p=p,
                                 block_table=table)
    state = state_after_seed(13)
    for bi in range(len(lq)):
        q0, q1, k0, k1 = int(cu_q[bi]), int(cu_q[bi + 1]), int(cu_k[bi]), int(cu_k[bi + 1])
        factor = dropout_factor(state, p, bi, 1, h, q1 - q0, k1 - k0, F64, device="cuda")
        compare_to_ref(out[None, q0:q1], None, [q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]],
                       plain_qkv, {"drop": factor}, None, tag=f" sequence {bi}")


def test_cuda_graph_replays_draw_fresh_masks():
    q, k, v = (rand(1, 256, 2, 64, dtype=torch.bfloat16, requires_grad=False)
               for _ in range(3))
    flash_attn_func(q, k, v, dropout_p=0.3)  # warm-up outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = flash_attn_func(q, k, v, dropout_p=0.3)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    first = out.clone()
    g.replay()
    assert not torch.equal(first, out)
    plain = flash_attn_func(q, k, v)
    assert (first.float() - plain.float()).abs().max().item() > 0
