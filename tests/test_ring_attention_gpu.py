"""Ring attention (flash_attn.ring_attention) on GPUs: 2 (and 4, where the machine has them)
processes over NCCL, one GPU each, with the CUDA kernels.

Like tests/test_ring_attention.py, each world size is spawned once: every rank runs every case
and writes "ok" or the traceback per case to a file. Each case gathers the ranks' outputs and
gradients into the full sequence and applies the accuracy rule (attn_ref.compare_to_ref) against
float64 attention on the full sequence.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist

from flash_attn import (ring_flash_attn_func, ring_flash_attn_varlen_func, zigzag_shard,
                        zigzag_unshard)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_harness import (assert_case_ok, run_cases, shard_varlen, spawn_ranks,  # noqa: E402
                          unshard_varlen)

# Rows per zigzag chunk: not a multiple of any tile, so every sub-block ends mid-tile.
CHUNK = 200
# name -> (zigzag, causal, window_size, softcap, nheads, nheads_k, headdim, dtype)
CASES = {
    "causal_zigzag_gqa_d128": (True, True, (-1, -1), 0.0, 4, 2, 128, torch.bfloat16),
    "noncausal_zigzag_d64_fp16": (True, False, (-1, -1), 0.0, 2, 2, 64, torch.float16),
    "causal_contiguous_d128": (False, True, (-1, -1), 0.0, 2, 2, 128, torch.bfloat16),
    "window_zigzag_softcap_d128": (True, False, (300, 40), 5.0, 2, 1, 128, torch.bfloat16),
    "window_causal_contiguous_d64": (False, True, (250, -1), 0.0, 2, 2, 64, torch.bfloat16),
}
VARLEN_CHUNKS = (2, 1, 3)  # sequence i is 2 * world * 64 * VARLEN_CHUNKS[i] long
VARLEN_CASES = {
    "varlen_causal_zigzag_gqa_d128": (True, True, (-1, -1), 0.0, 4, 2, 128, torch.bfloat16),
    "varlen_window_contiguous_d64": (False, False, (100, 20), 0.0, 2, 2, 64, torch.bfloat16),
    # ALiBi with a row of slopes per sequence.
    "varlen_alibi_causal_zigzag_d128": (True, True, (-1, -1), 0.0, 2, 2, 128, torch.bfloat16),
}
# The learnable sink (s_aux), one head's logit -inf.
SINK_CASES = {
    "sink_causal_zigzag_gqa_d128": (True, True, (-1, -1), 0.0, 4, 2, 128, torch.bfloat16),
    "sink_window_contiguous_d64": (False, False, (150, 30), 0.0, 2, 2, 64, torch.bfloat16),
}
# ALiBi over global positions (the kernels' alibi_offset per sub-block); slopes per head, or
# per (batch, head) where the last field says so.
ALIBI_CASES = {
    "alibi_causal_zigzag_gqa_d128": (True, True, (-1, -1), 0.0, 4, 2, 128, torch.bfloat16,
                                     False),
    "alibi_noncausal_contiguous_d64": (False, False, (-1, -1), 0.0, 2, 2, 64, torch.bfloat16,
                                       True),
}
# Dropout's mask at global positions (the SM80 kernels, whose blocks draw it from a positioned
# generator state), zigzag chunks of DROPOUT_CHUNK rows, a multiple of 16.
DROPOUT_CASES = {
    "dropout_causal_zigzag_gqa_d128": (True, True, (-1, -1), 0.0, 4, 2, 128, torch.bfloat16),
    "dropout_window_contiguous_d64": (False, False, (150, 30), 0.0, 2, 2, 64, torch.bfloat16),
}
DROPOUT_CHUNK = 208
ERROR_CASES = ["cuda_with_gloo", "unequal_shards"]
ALL_CASES = (list(CASES) + list(VARLEN_CASES) + list(SINK_CASES) + list(ALIBI_CASES)
             + list(DROPOUT_CASES) + ERROR_CASES)


def _gather_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _batched(seed: int, world: int, rank: int, chunk: int, zigzag: bool, h: int, hk: int,
             d: int, dtype: torch.dtype):
    """q, k, v, dout of batch 2 over 2 * world * chunk tokens (from ``seed``), and this rank's
    shard / unshard of them: zigzag chunks, or contiguous rows (unshard all-gathers)."""
    seqlen = 2 * world * chunk
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(2, seqlen, n, d, generator=g, device="cuda").to(dtype)
                     for n in (h, hk, hk, h))
    s = seqlen // world

    def shard(x):
        return zigzag_shard(x, 1) if zigzag else x[:, rank * s:(rank + 1) * s].contiguous()

    def unshard(x):
        return zigzag_unshard(x, 1) if zigzag else _gather_rows(x, 1)

    return q, k, v, dout, shard, unshard


def _check_case(name: str, world: int, rank: int) -> None:
    from attn_ref import compare_to_ref, plain_qkv

    zigzag, causal, window, softcap, h, hk, d, dtype = CASES[name]
    q, k, v, dout, shard, unshard = _batched(list(CASES).index(name), world, rank, CHUNK,
                                             zigzag, h, hk, d, dtype)
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    out = ring_flash_attn_func(qs, ks, vs, causal=causal, window_size=window, softcap=softcap,
                               zigzag=zigzag)
    out.backward(shard(dout))
    grads = [unshard(x.grad) for x in (qs, ks, vs)]
    compare_to_ref(unshard(out.detach()), grads, [q, k, v], plain_qkv,
                   {"causal": causal, "window_size": window, "softcap": softcap}, dout)


def _check_alibi_case(name: str, world: int, rank: int) -> None:
    """out, dq, dk, dv under the accuracy rule against float64 attention with ALiBi on the full
    sequence (slopes 0.02-0.1: over 2 * world * CHUNK positions the bias spans tens)."""
    from attn_ref import compare_to_ref, plain_qkv

    zigzag, causal, window, softcap, h, hk, d, dtype, per_batch = ALIBI_CASES[name]
    seed = 300 + list(ALIBI_CASES).index(name)
    q, k, v, dout, shard, unshard = _batched(seed, world, rank, CHUNK, zigzag, h, hk, d, dtype)
    g = torch.Generator(device="cuda").manual_seed(seed + 1000)
    slopes = 0.02 + 0.08 * torch.rand((2, h) if per_batch else (h,), generator=g,
                                      device="cuda")
    kw = {"causal": causal, "window_size": window, "softcap": softcap, "alibi_slopes": slopes}
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    out = ring_flash_attn_func(qs, ks, vs, zigzag=zigzag, **kw)
    out.backward(shard(dout))
    grads = [unshard(x.grad) for x in (qs, ks, vs)]
    compare_to_ref(unshard(out.detach()), grads, [q, k, v], plain_qkv, kw, dout)


def _check_dropout_case(name: str, world: int, rank: int) -> None:
    """out, dq, dk, dv under the accuracy rule against float64 attention on the full sequence
    with the mask that one call on it draws from the same generator state (every rank seeds
    alike)."""
    from attn_ref import compare_to_ref, plain_qkv
    from flash_attn.dropout import dropout_factor, new_rng_state

    zigzag, causal, window, softcap, h, hk, d, dtype = DROPOUT_CASES[name]
    p, seed = 0.2, 500 + list(DROPOUT_CASES).index(name)
    q, k, v, dout, shard, unshard = _batched(seed, world, rank, DROPOUT_CHUNK, zigzag, h, hk, d,
                                             dtype)
    seqlen = 2 * world * DROPOUT_CHUNK
    kw = {"causal": causal, "window_size": window, "softcap": softcap}
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    torch.manual_seed(seed)
    state = new_rng_state(q.device)
    torch.manual_seed(seed)
    out = ring_flash_attn_func(qs, ks, vs, zigzag=zigzag, dropout_p=p, **kw)
    out.backward(shard(dout))
    grads = [unshard(x.grad) for x in (qs, ks, vs)]
    factor = dropout_factor(state, p, 0, 2, h, seqlen, seqlen, torch.float64, device="cuda")
    compare_to_ref(unshard(out.detach()), grads, [q, k, v], plain_qkv, {**kw, "drop": factor},
                   dout)


def _check_sink_case(name: str, world: int, rank: int) -> None:
    """out, dq, dk, dv under the accuracy rule against float64 attention with the sink on the
    full sequence; the sink's gradient (all-reduced, so the whole sequence's on every rank)
    within 3 x the bf16 baseline's error plus the rounding of the bf16 out it is computed from
    (as tests/test_sink_gpu.py bounds the single-GPU one)."""
    from attn_ref import REF_DTYPE, attention_ref, compare_to_ref, plain_qkv

    zigzag, causal, window, softcap, h, hk, d, dtype = SINK_CASES[name]
    seqlen = 2 * world * CHUNK
    g = torch.Generator(device="cuda").manual_seed(200 + list(SINK_CASES).index(name))
    q, k, v, dout = (torch.randn(2, seqlen, n, d, generator=g, device="cuda").to(dtype)
                     for n in (h, hk, hk, h))
    sink = torch.randn(h, generator=g, device="cuda") * 2
    sink[-1] = float("-inf")
    s = seqlen // world

    def shard(x, dim=1):
        return zigzag_shard(x, dim) if zigzag else x.narrow(dim, rank * s, s).contiguous()

    def unshard(x, dim=1):
        return zigzag_unshard(x, dim) if zigzag else _gather_rows(x, dim)

    kw = {"causal": causal, "window_size": window, "softcap": softcap}
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    ss = sink.clone().requires_grad_()
    out, lse = ring_flash_attn_func(qs, ks, vs, zigzag=zigzag, s_aux=ss,
                                    return_softmax_lse=True, **kw)
    out.backward(shard(dout))
    full_out, full_lse = unshard(out.detach()), unshard(lse, 2)
    grads = [unshard(x.grad) for x in (qs, ks, vs)]
    compare_to_ref(full_out, grads, [q, k, v], plain_qkv, dict(kw, sink=sink.to(REF_DTYPE)),
                   dout)
    s_ref = sink.to(REF_DTYPE).requires_grad_()
    out_ref = attention_ref(*(x.to(REF_DTYPE) for x in (q, k, v)), compute_dtype=REF_DTYPE,
                            sink=s_ref, **kw)[0]
    (g_ref,) = torch.autograd.grad(out_ref, [s_ref], dout.to(REF_DTYPE))
    s_pt = sink.clone().requires_grad_()
    out_pt = attention_ref(q, k, v, compute_dtype=dtype, sink=s_pt, **kw)[0]
    (g_pt,) = torch.autograd.grad(out_pt, [s_pt], dout)
    mag = (dout.double().abs() * full_out.double().abs()).sum(-1).transpose(1, 2)
    rounding = (torch.exp(sink.double().view(1, -1, 1) - full_lse.double()) * mag).sum((0, 2))
    err = (ss.grad.double() - g_ref).abs()
    allowed = 3 * (g_pt.double() - g_ref).abs().max() + rounding * 2.0 ** -8 + 1e-5
    assert (err <= allowed).all(), f"dsink: errors {err.tolist()} > allowed {allowed.tolist()}"


def _check_varlen_case(name: str, world: int, rank: int) -> None:
    from attn_ref import compare_to_ref, plain_qkv

    zigzag, causal, window, softcap, h, hk, d, dtype = VARLEN_CASES[name]
    lens = [2 * world * 64 * c for c in VARLEN_CHUNKS]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    g = torch.Generator(device="cuda").manual_seed(100 + list(VARLEN_CASES).index(name))
    q, k, v, dout = (torch.randn(total, n, d, generator=g, device="cuda").to(dtype)
                     for n in (h, hk, hk, h))
    cu_local = torch.div(cu, world, rounding_mode="floor").to(torch.int32)
    bounds = cu.tolist()

    def shard(x):
        return shard_varlen(x, cu, world, rank, zigzag)

    def unshard(x):
        return unshard_varlen(x, cu_local, world, zigzag)

    slopes = None
    if "alibi" in name:
        slopes = 0.02 + 0.08 * torch.rand(len(lens), h, generator=g, device="cuda")
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    out = ring_flash_attn_varlen_func(qs, ks, vs, cu_local, max(lens) // world, causal=causal,
                                      window_size=window, softcap=softcap, zigzag=zigzag,
                                      alibi_slopes=slopes)
    out.backward(shard(dout))
    grads = [unshard(x.grad) for x in (qs, ks, vs)]
    full_out = unshard(out.detach())
    # The reference per sequence (batch of one), each sequence's rows checked on their own.
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        kw = {"causal": causal, "window_size": window, "softcap": softcap}
        if slopes is not None:
            kw["alibi_slopes"] = slopes[i]
        compare_to_ref(full_out[a:b][None], [x[a:b][None] for x in grads],
                       [x[a:b][None] for x in (q, k, v)], plain_qkv, kw, dout[a:b][None],
                       tag=f" rows {a}:{b}")


def _check_error(name: str, world: int, rank: int) -> None:
    x = torch.randn(1, 2 * 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    if name == "cuda_with_gloo":
        gloo = dist.new_group(backend="gloo")
        try:
            ring_flash_attn_func(x, x, x, group=gloo)
        except ValueError as e:
            assert "gloo" in str(e), str(e)
        else:
            raise AssertionError("no ValueError for CUDA tensors through a gloo group")
    elif name == "unequal_shards":
        y = x[:, :64] if rank == 0 else x
        try:
            ring_flash_attn_func(y, y, y)
        except ValueError as e:
            assert "same shapes" in str(e), str(e)
        else:
            raise AssertionError("no ValueError for unequal shards")
    else:
        raise KeyError(name)


def _run_case(name: str, world: int, rank: int) -> None:
    if name in CASES:
        _check_case(name, world, rank)
    elif name in VARLEN_CASES:
        _check_varlen_case(name, world, rank)
    elif name in SINK_CASES:
        _check_sink_case(name, world, rank)
    elif name in ALIBI_CASES:
        _check_alibi_case(name, world, rank)
    elif name in DROPOUT_CASES:
        _check_dropout_case(name, world, rank)
    else:
        _check_error(name, world, rank)


def _worker(transport: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    import flash_attn.ring_attention as ring_attention

    ring_attention._TRANSPORT = transport
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    run_cases(rank, out_dir, ALL_CASES, lambda name: _run_case(name, world, rank),
              torch.cuda.synchronize)


def _worlds() -> list:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [w for w in (2, 4) if w <= n] or [2]


# The transfers by NCCL's kernels, and by the copy engines (flash_attn.ring_attention's
# _CopyEngineRing).
TRANSPORTS = ("nccl", "copy_engine")


@pytest.fixture(scope="module", params=[(w, t) for w in _worlds() for t in TRANSPORTS],
                ids=lambda p: f"world{p[0]}-{p[1]}")
def ring_results(request, tmp_path_factory):
    world, transport = request.param
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    return spawn_ranks(functools.partial(_worker, transport), world,
                       tmp_path_factory.mktemp(f"ring_gpu{world}_{transport}"))


@pytest.mark.parametrize("name", ALL_CASES)
def test_ring_gpu(ring_results, name):
    assert_case_ok(ring_results, name)
