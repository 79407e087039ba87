"""Ring attention (flash_attn.ring_attention) on CPU: 2 and 4 processes over gloo.

Each world size is spawned once (module-scoped fixture): every rank runs every case and writes
"ok" or the traceback per case to a file; the tests below read them. Each case compares this
rank's output and gradients with flash_attn_func (the CPU reference) on the full sequence, in
float64.
"""

from __future__ import annotations

import math
import os
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import flash_attn
from flash_attn import (ring_flash_attn_func, ring_flash_attn_varlen_func, zigzag_shard,
                        zigzag_unshard)
from flash_attn.ring_attention import _backend_error

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_harness import (assert_case_ok, run_cases, shard_varlen, spawn_ranks,  # noqa: E402
                          unshard_varlen)

CHUNK = 3  # rows per zigzag chunk: the sequence is 2 * world * CHUNK long
RTOL = 1e-10

# name -> (zigzag, causal, window_size, softcap, nheads, nheads_k)
CASES = {
    "noncausal_zigzag": (True, False, (-1, -1), 0.0, 2, 2),
    "causal_zigzag": (True, True, (-1, -1), 0.0, 2, 2),
    "noncausal_contiguous": (False, False, (-1, -1), 0.0, 2, 2),
    "causal_contiguous": (False, True, (-1, -1), 0.0, 2, 2),
    "causal_zigzag_gqa": (True, True, (-1, -1), 0.0, 4, 2),
    "noncausal_contiguous_mqa": (False, False, (-1, -1), 0.0, 3, 1),
    "causal_zigzag_softcap": (True, True, (-1, -1), 2.5, 2, 2),
    "window_4_0_zigzag": (True, False, (4, 0), 0.0, 2, 2),
    "window_5_2_zigzag_gqa": (True, False, (5, 2), 0.0, 4, 2),
    "window_1_7_contiguous": (False, False, (1, 7), 0.0, 2, 2),
    "window_0_0_zigzag": (True, False, (0, 0), 0.0, 2, 2),
    "window_left_only_causal_contiguous": (False, True, (7, -1), 0.0, 2, 2),
    "window_right_only_zigzag_softcap": (True, False, (-1, 2), 1.5, 2, 2),
}
# bf16 shards, checked with the accuracy rule (attn_ref) against float64 attention.
BF16_CASES = {
    "bf16_causal_zigzag_gqa": (True, True, (-1, -1), 0.0, 4, 2),
    "bf16_window_contiguous_softcap": (False, False, (4, 1), 3.0, 2, 2),
}
# Packed sequences; each sequence's length is 2 * world * (an entry of VARLEN_CHUNKS).
VARLEN_CHUNKS = (2, 3, 1)
VARLEN_CASES = {
    "varlen_causal_zigzag_gqa": (True, True, (-1, -1), 0.0, 4, 2),
    "varlen_noncausal_contiguous": (False, False, (-1, -1), 0.0, 2, 2),
    "varlen_window_zigzag_softcap": (True, False, (3, 1), 2.0, 2, 2),
    "varlen_window_causal_contiguous": (False, True, (4, -1), 0.0, 2, 1),
}
# The learnable sink (s_aux / learnable_sink), one head's logit -inf (no sink there); with
# window (0, 0) at contiguous shards some rows of a rank keep few keys; varlen too.
SINK_CASES = {
    "sink_causal_zigzag_gqa": (True, True, (-1, -1), 0.0, 4, 2),
    "sink_noncausal_contiguous_softcap": (False, False, (-1, -1), 1.5, 2, 2),
    "sink_window_contiguous": (False, False, (0, 0), 0.0, 2, 1),
    "sink_varlen_causal_zigzag": (True, True, (-1, -1), 0.0, 2, 2),
}
# ALiBi over global positions: slopes (nheads,), (batch, nheads), or (nseqs, nheads) for varlen.
# name -> (zigzag, causal, window_size, softcap, nheads, nheads_k, per_row slopes)
ALIBI_CASES = {
    "alibi_causal_zigzag_gqa": (True, True, (-1, -1), 0.0, 4, 2, False),
    "alibi_noncausal_zigzag_per_batch": (True, False, (-1, -1), 0.0, 2, 2, True),
    "alibi_noncausal_contiguous_softcap": (False, False, (-1, -1), 2.0, 2, 1, False),
    "alibi_window_zigzag": (True, False, (5, 2), 0.0, 2, 2, True),
    "alibi_varlen_causal_zigzag": (True, True, (-1, -1), 0.0, 2, 2, True),
    "alibi_varlen_noncausal_contiguous": (False, False, (-1, -1), 0.0, 4, 2, False),
}
# Dropout's mask at global positions, drawn in 16 x 16 blocks: chunks of 16 rows (varlen:
# 16 * VARLEN_CHUNKS). name -> (zigzag, causal, window_size, softcap, nheads, nheads_k, alibi)
DROPOUT_CASES = {
    "dropout_causal_zigzag_gqa": (True, True, (-1, -1), 0.0, 4, 2, False),
    "dropout_window_contiguous_softcap": (False, False, (20, 3), 1.5, 2, 2, False),
    "dropout_noncausal_zigzag_alibi": (True, False, (-1, -1), 0.0, 2, 1, True),
    "dropout_varlen_causal_zigzag": (True, True, (-1, -1), 0.0, 2, 2, False),
    "dropout_varlen_window_contiguous": (False, False, (9, 0), 0.0, 2, 1, False),
}
DROPOUT_CHUNK = 16
ERROR_CASES = ["unequal_shards", "bad_sink_on_one_rank", "bad_alibi_on_one_rank", "zigzag_odd",
               "shard_indivisible", "meta_with_gloo",
               "not_implemented", "group_of_one", "varlen_unequal_cu_seqlens",
               "varlen_bad_cu_seqlens", "varlen_group_of_one", "host_group_of_an_nccl_group"]
ALL_CASES = (list(CASES) + list(BF16_CASES) + list(VARLEN_CASES) + list(SINK_CASES)
             + list(ALIBI_CASES) + list(DROPOUT_CASES) + ERROR_CASES)


def _batched_sharding(zigzag: bool, world: int, rank: int, seqlen: int):
    """(shard, unshard) of a (batch, seqlen, ...) tensor on this rank: zigzag chunks, or
    contiguous rows (unshard all-gathers)."""
    s = seqlen // world

    def shard(x):
        return zigzag_shard(x, 1) if zigzag else x[:, rank * s:(rank + 1) * s].contiguous()

    def unshard(x):
        if zigzag:
            return zigzag_unshard(x, 1)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    return shard, unshard


def _varlen_sharding(zigzag: bool, world: int, rank: int, unit: int = 1):
    """(lens, cu, cu_local, shard, unshard) of packed sequences of 2 * world * unit *
    VARLEN_CHUNKS rows: each sequence sharded on its own (shard_varlen)."""
    lens = [2 * world * unit * c for c in VARLEN_CHUNKS]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_local = torch.div(cu, world, rounding_mode="floor").to(torch.int32)

    def shard(x):
        return shard_varlen(x, cu, world, rank, zigzag)

    def unshard(x):
        return unshard_varlen(x, cu_local, world, zigzag)

    return lens, cu, cu_local, shard, unshard


def _assert_close(pairs, tol=None) -> None:
    """Max error of each (name, got, want) within RTOL (or tol[name]) of max |want|, floored at
    1 (the inputs' scale: with window (0, 0) dq is 0, up to rounding)."""
    for what, got, want in pairs:
        err = (got - want).abs().max().item()
        scale = max(want.abs().max().item(), 1.0)
        limit = (tol or {}).get(what, RTOL)
        assert err <= limit * scale, f"{what}: max error {err:.3e} vs max |ref| {scale:.3e}"


def _check_case(name: str, world: int, rank: int) -> None:
    bf16 = name in BF16_CASES
    zigzag, causal, window, softcap, h, hk = (BF16_CASES if bf16 else CASES)[name]
    seqlen = 2 * world * CHUNK
    g = torch.Generator().manual_seed(list(CASES).index(name) if name in CASES else 99)
    b, d = 2, 8
    dtype = torch.bfloat16 if bf16 else torch.float64
    q, k, v, dout = (torch.randn(b, seqlen, n, d, generator=g, dtype=torch.float64).to(dtype)
                     for n in (h, hk, hk, h))
    shard, unshard = _batched_sharding(zigzag, world, rank, seqlen)
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    out = ring_flash_attn_func(qs, ks, vs, causal=causal, window_size=window, softcap=softcap,
                               zigzag=zigzag)
    out.backward(shard(dout))
    if bf16:
        from attn_ref import compare_to_ref, plain_qkv

        grads = [unshard(x.grad) for x in (qs, ks, vs)]
        compare_to_ref(unshard(out.detach()), grads, [q, k, v], plain_qkv,
                       {"causal": causal, "window_size": window, "softcap": softcap}, dout)
        return
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = flash_attn.flash_attn_func(qr, kr, vr, causal=causal, window_size=window,
                                     softcap=softcap)
    ref.backward(dout)
    _assert_close((("out", unshard(out.detach()), ref.detach()),
                   ("dq", unshard(qs.grad), qr.grad), ("dk", unshard(ks.grad), kr.grad),
                   ("dv", unshard(vs.grad), vr.grad)))


def _check_varlen_case(name: str, world: int, rank: int) -> None:
    zigzag, causal, window, softcap, h, hk = VARLEN_CASES[name]
    lens, cu, cu_local, shard, unshard = _varlen_sharding(zigzag, world, rank)
    g = torch.Generator().manual_seed(list(VARLEN_CASES).index(name))
    q, k, v, dout = (torch.randn(int(cu[-1]), n, 8, generator=g, dtype=torch.float64)
                     for n in (h, hk, hk, h))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = flash_attn.flash_attn_varlen_func(qr, kr, vr, cu, cu, max(lens), max(lens),
                                            causal=causal, window_size=window, softcap=softcap)
    ref.backward(dout)
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    out, lse = ring_flash_attn_varlen_func(qs, ks, vs, cu_local, max(lens) // world,
                                           causal=causal, window_size=window, softcap=softcap,
                                           zigzag=zigzag, return_softmax_lse=True)
    assert lse.shape == (h, qs.shape[0])
    out.backward(shard(dout))
    _assert_close((("out", unshard(out.detach()), ref.detach()),
                   ("dq", unshard(qs.grad), qr.grad), ("dk", unshard(ks.grad), kr.grad),
                   ("dv", unshard(vs.grad), vr.grad)))


def _layout(name: str, world: int, rank: int, zigzag: bool, h: int, hk: int,
            g: torch.Generator, unit: int = 1):
    """float64 q, k, v, dout (head dim 8) of the batched layout (batch 2, chunks of CHUNK rows,
    or of ``unit`` rows when it is not 1), or of packed sequences where ``name`` says varlen
    (_varlen_sharding's unit);
    the number of sequences; shard / unshard; and the reference and ring calls on them, which
    take further keyword arguments."""
    if "varlen" in name:
        lens, cu, cu_local, shard, unshard = _varlen_sharding(zigzag, world, rank, unit)
        q, k, v, dout = (torch.randn(int(cu[-1]), n, 8, generator=g, dtype=torch.float64)
                         for n in (h, hk, hk, h))

        def ref_fn(q, k, v, **kw):
            return flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **kw)

        def ring_fn(q, k, v, **kw):
            return ring_flash_attn_varlen_func(q, k, v, cu_local, max(lens) // world,
                                               zigzag=zigzag, **kw)

        return q, k, v, dout, len(lens), shard, unshard, ref_fn, ring_fn
    seqlen = 2 * world * (CHUNK if unit == 1 else unit)
    q, k, v, dout = (torch.randn(2, seqlen, n, 8, generator=g, dtype=torch.float64)
                     for n in (h, hk, hk, h))
    shard, unshard = _batched_sharding(zigzag, world, rank, seqlen)

    def ref_fn(q, k, v, **kw):
        return flash_attn.flash_attn_func(q, k, v, **kw)

    def ring_fn(q, k, v, **kw):
        return ring_flash_attn_func(q, k, v, zigzag=zigzag, **kw)

    return q, k, v, dout, 2, shard, unshard, ref_fn, ring_fn


def _check_sink_case(name: str, world: int, rank: int) -> None:
    """Output, gradients and the sink's gradient against the reference on the full sequence;
    the sink's gradient (an all_reduce) must be the whole sequence's on every rank. The ring
    takes the sink as learnable_sink (varlen) or s_aux (batched)."""
    zigzag, causal, window, softcap, h, hk = SINK_CASES[name]
    g = torch.Generator().manual_seed(50 + list(SINK_CASES).index(name))
    sink = torch.randn(h, generator=g, dtype=torch.float64)
    sink[-1] = float("-inf")
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    q, k, v, dout, _, shard, unshard, ref_fn, ring_fn = _layout(name, world, rank, zigzag, h,
                                                                hk, g)
    qr, kr, vr, sr = (x.clone().requires_grad_() for x in (q, k, v, sink))
    ref = ref_fn(qr, kr, vr, s_aux=sr, **kwargs)
    ref.backward(dout)
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    ss = sink.clone().requires_grad_()
    out = ring_fn(qs, ks, vs, **{"learnable_sink" if "varlen" in name else "s_aux": ss},
                  **kwargs)
    out.backward(shard(dout))
    # The reference op's sink gradient reads its float32 softmax_lse (the ring's is float64
    # here): within float32's rounding, not float64's.
    _assert_close((("out", unshard(out.detach()), ref.detach()),
                   ("dq", unshard(qs.grad), qr.grad), ("dk", unshard(ks.grad), kr.grad),
                   ("dv", unshard(vs.grad), vr.grad), ("dsink", ss.grad, sr.grad)),
                  {"dsink": 1e-6})


def _check_alibi_case(name: str, world: int, rank: int) -> None:
    """Output and gradients against the reference on the full sequence with the same slopes:
    every block's bias must be that of its global positions, and blocks are joined only where
    one offset serves the joined block."""
    zigzag, causal, window, softcap, h, hk, per_row = ALIBI_CASES[name]
    g = torch.Generator().manual_seed(70 + list(ALIBI_CASES).index(name))
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    q, k, v, dout, rows, shard, unshard, ref_fn, ring_fn = _layout(name, world, rank, zigzag,
                                                                   h, hk, g)
    # Steep slopes, so that a bias taken at the wrong positions shows.
    slopes = torch.rand((rows, h) if per_row else (h,), generator=g, dtype=torch.float64)
    slopes = (0.2 + slopes).float()
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = ref_fn(qr, kr, vr, alibi_slopes=slopes, **kwargs)
    ref.backward(dout)
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    out = ring_fn(qs, ks, vs, alibi_slopes=slopes, **kwargs)
    out.backward(shard(dout))
    _assert_close((("out", unshard(out.detach()), ref.detach()),
                   ("dq", unshard(qs.grad), qr.grad), ("dk", unshard(ks.grad), kr.grad),
                   ("dv", unshard(vs.grad), vr.grad)))


def _check_dropout_case(name: str, world: int, rank: int) -> None:
    """Output and gradients against the reference on the full sequence under the same
    generator state: every block's mask must be drawn at its global positions (a block drawn
    at its local ones, or on the wrong 16-row grid, keeps other scores)."""
    zigzag, causal, window, softcap, h, hk, alibi = DROPOUT_CASES[name]
    g = torch.Generator().manual_seed(90 + list(DROPOUT_CASES).index(name))
    q, k, v, dout, rows, shard, unshard, ref_fn, ring_fn = _layout(name, world, rank, zigzag,
                                                                   h, hk, g, DROPOUT_CHUNK)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, dropout_p=0.3)
    if alibi:
        kwargs["alibi_slopes"] = (0.05 + torch.rand(h, generator=g)).float()
    seed = 1234 + list(DROPOUT_CASES).index(name)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    torch.manual_seed(seed)
    ref = ref_fn(qr, kr, vr, **kwargs)
    ref.backward(dout)
    qs, ks, vs = (shard(x).requires_grad_() for x in (q, k, v))
    torch.manual_seed(seed)
    out = ring_fn(qs, ks, vs, **kwargs)
    out.backward(shard(dout))
    _assert_close((("out", unshard(out.detach()), ref.detach()),
                   ("dq", unshard(qs.grad), qr.grad), ("dk", unshard(ks.grad), kr.grad),
                   ("dv", unshard(vs.grad), vr.grad)))


def _raises(exc, fn, *words):
    try:
        fn()
    except exc as e:
        for w in words:
            assert w in str(e), f"{w!r} not in {e}"
        return
    raise AssertionError(f"no {exc.__name__}")


def _check_error(name: str, world: int, rank: int) -> None:
    x = torch.randn(1, 2 * CHUNK, 2, 8, dtype=torch.float64)
    if name == "unequal_shards":
        # Rank 0's shard is shorter: every rank gets the ValueError from the shape check.
        y = x[:, :2] if rank == 0 else x
        _raises(ValueError, lambda: ring_flash_attn_func(y, y, y), "same shapes")
    elif name == "bad_sink_on_one_rank":
        # Rank 0's sink has the wrong length: every rank raises, none waits in the ring.
        sink = torch.zeros(3 if rank == 0 else 2, dtype=torch.float64)
        words = ("s_aux",) if rank == 0 else ("rank(s) [0]",)
        _raises(ValueError, lambda: ring_flash_attn_func(x, x, x, s_aux=sink), *words)
    elif name == "bad_alibi_on_one_rank":
        # Rank 0's slopes have the wrong length: every rank raises, none waits in the ring.
        slopes = torch.ones(3 if rank == 0 else 2)
        words = ("alibi_slopes",) if rank == 0 else ("rank(s) [0]",)
        _raises(ValueError, lambda: ring_flash_attn_func(x, x, x, alibi_slopes=slopes), *words)
    elif name == "zigzag_odd":
        y = x[:, :3]
        _raises(ValueError, lambda: ring_flash_attn_func(y, y, y, zigzag=True), "even")
    elif name == "shard_indivisible":
        full = torch.randn(1, 2 * world + 1, 2, 8)
        _raises(ValueError, lambda: zigzag_shard(full, 1), "divisible by 2 * world size")
    elif name == "meta_with_gloo":
        y = torch.empty(1, 4, 2, 8, device="meta")
        _raises(ValueError, lambda: ring_flash_attn_func(y, y, y), "gloo")
    elif name == "not_implemented":
        for kwargs, word in (({"dropout_p": 0.1}, "multiple of 16"),
                             ({"return_attn_probs": True}, "return_attn_probs")):
            _raises(NotImplementedError, lambda: ring_flash_attn_func(x, x, x, **kwargs), word)
        x8 = x.to(torch.float8_e4m3fn)  # a named error, not shards merged in e4m3
        _raises(NotImplementedError, lambda: ring_flash_attn_func(x8, x8, x8), "float8")
    elif name == "group_of_one":
        # Every rank must take part in creating every group.
        groups = [dist.new_group([r]) for r in range(world)]
        xr = x.clone().requires_grad_()
        out, lse = ring_flash_attn_func(xr, x, x, group=groups[rank], causal=True,
                                        return_softmax_lse=True)
        ref = flash_attn.flash_attn_func(x, x, x, causal=True)
        assert torch.equal(out, ref) and lse.shape == (1, 2, 2 * CHUNK)
        out.sum().backward()
        assert xr.grad is not None
        # Dropout: the single-device call's mask, drawn from the same generator state.
        torch.manual_seed(21)
        out = ring_flash_attn_func(x, x, x, group=groups[rank], dropout_p=0.4)
        torch.manual_seed(21)
        assert torch.equal(out, flash_attn.flash_attn_func(x, x, x, dropout_p=0.4))
    elif name == "varlen_unequal_cu_seqlens":
        y = x[0]  # (2 * CHUNK, 2, 8): two sequences, split differently on rank 0
        cu = torch.tensor([0, 2, 2 * CHUNK] if rank == 0 else [0, 4, 2 * CHUNK],
                          dtype=torch.int32)
        _raises(ValueError, lambda: ring_flash_attn_varlen_func(y, y, y, cu, 4),
                "cu_seqlens must be the same on every rank")
    elif name == "varlen_bad_cu_seqlens":
        y = x[0]
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)  # ends short of total_local (6)
        _raises(ValueError, lambda: ring_flash_attn_varlen_func(y, y, y, cu, 3), "cu_seqlens")
    elif name == "host_group_of_an_nccl_group":
        # A group whose collectives take no CPU tensors gets a gloo group of its ranks for the
        # shape check, made once.
        from flash_attn import ring_attention
        with mock.patch.object(ring_attention, "_serves_cpu", return_value=False):
            side = ring_attention._host_group(None)
            assert side is not dist.group.WORLD and ring_attention._host_group(None) is side
            every = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(every, torch.tensor([rank]), group=side)
            assert [int(t) for t in every] == list(range(world))
            y = x.clone()
            ring_flash_attn_func(y, y, y, causal=True)  # the shape check goes through it
    elif name == "varlen_group_of_one":
        groups = [dist.new_group([r]) for r in range(world)]
        y = x[0]
        cu = torch.tensor([0, 2, 2 * CHUNK], dtype=torch.int32)
        out = ring_flash_attn_varlen_func(y, y, y, cu, 4, group=groups[rank], causal=True)
        ref = flash_attn.flash_attn_varlen_func(y, y, y, cu, cu, 4, 4, causal=True)
        assert torch.equal(out, ref)
    else:
        raise KeyError(name)


def _run_case(name: str, world: int, rank: int) -> None:
    if name in VARLEN_CASES:
        _check_varlen_case(name, world, rank)
    elif name in SINK_CASES:
        _check_sink_case(name, world, rank)
    elif name in ALIBI_CASES:
        _check_alibi_case(name, world, rank)
    elif name in DROPOUT_CASES:
        _check_dropout_case(name, world, rank)
    elif name not in ERROR_CASES:
        _check_case(name, world, rank)
    else:
        _check_error(name, world, rank)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    run_cases(rank, out_dir, ALL_CASES, lambda name: _run_case(name, world, rank))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ring_results(request, tmp_path_factory):
    world = request.param
    return spawn_ranks(_worker, world, tmp_path_factory.mktemp(f"ring{world}"))


@pytest.mark.parametrize("name", ALL_CASES)
def test_ring(ring_results, name):
    assert_case_ok(ring_results, name)


def test_not_initialized_is_a_group_of_one():
    assert not dist.is_initialized()
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    out = ring_flash_attn_func(x, x, x, causal=True, window_size=(2, 0), softcap=1.0)
    ref = flash_attn.flash_attn_func(x, x, x, causal=True, window_size=(2, 0), softcap=1.0)
    assert torch.equal(out, ref)
    assert torch.equal(zigzag_unshard(zigzag_shard(x[:, :4], 1), 1), x[:, :4])
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = ring_flash_attn_varlen_func(x[0], x[0], x[0], cu, 3, causal=True)
    assert torch.equal(out, flash_attn.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 3, 3,
                                                              causal=True))


def test_backend_device_rule():
    assert _backend_error(torch.device("cpu"), "gloo") is None
    assert _backend_error(torch.device("cuda", 0), "nccl") is None
    assert "nccl" in _backend_error(torch.device("cpu"), "nccl")
    assert "gloo" in _backend_error(torch.device("cuda", 0), "gloo")
    assert _backend_error(torch.device("cpu"), "cpu:gloo,cuda:nccl") is None
    assert _backend_error(torch.device("cuda"), "cpu:gloo,cuda:nccl") is None


def test_transport_setting(monkeypatch):
    from flash_attn.ring_attention import _transport
    monkeypatch.delenv("FLASH_ATTN_RING_TRANSPORT", raising=False)
    assert _transport() == "nccl"
    monkeypatch.setenv("FLASH_ATTN_RING_TRANSPORT", "copy_engine")
    assert _transport() == "copy_engine"
    monkeypatch.setenv("FLASH_ATTN_RING_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="FLASH_ATTN_RING_TRANSPORT='shm'"):
        _transport()


def test_accumulate_matches_a_zeroed_accumulator():
    # The backward's accumulators start uninitialised (poisoned here with NaN): rows a block
    # reaches first are written, rows reached again are added to, partly reached slices zero
    # their new rows first, and rows never reached are zeroed at the end; the result must equal
    # summing the same blocks into zeros.
    from flash_attn.ring_attention import _accumulate, _zero_rows

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = 12
    acc = torch.full((2, rows, 3), float("nan"), dtype=torch.float64)
    want = torch.zeros(2, rows, 3, dtype=torch.float64)
    touched = torch.zeros(rows, dtype=torch.bool)
    for sl in (slice(2, 5), slice(3, 8), slice(2, 5), slice(9, 10)):  # rows 0, 1, 8, 10, 11: none
        g = torch.randn(2, sl.stop - sl.start, 3, generator=gen).to(torch.bfloat16)
        _accumulate([(acc, g)], sl, touched)
        want[:, sl] += g.double()
    _zero_rows(acc, ~touched)
    assert torch.equal(acc, want)


def test_window_blocks_cover_the_band():
    # Every (query chunk, key chunk) pair's sub-block, masked as the kernel masks it, equals the
    # global window restricted to the pair.
    from flash_attn.reference import keep_mask
    from flash_attn.ring_attention import _block

    n = 4
    for left, right in ((math.inf, 0), (3, 0), (0, 0), (2, 5), (math.inf, 2), (6, math.inf),
                        (math.inf, math.inf)):
        for qi in range(2 * n):
            for ki in range(2 * n):
                want = torch.zeros(n, n, dtype=torch.bool)
                for i in range(n):
                    for j in range(n):
                        delta = (ki * n + j) - (qi * n + i)
                        want[i, j] = -left <= delta <= right
                got = torch.zeros(n, n, dtype=torch.bool)
                blk = _block((qi * n, 0, n), (ki * n, 0, n), left, right)
                if blk is not None:
                    rows, cols = blk.rows, blk.cols
                    got[rows, cols] = keep_mask(rows.stop - rows.start, cols.stop - cols.start,
                                                blk.causal, blk.window_left, blk.window_right)
                assert torch.equal(got, want), (left, right, qi, ki)


def test_coalesced_blocks_cover_the_band_once():
    # After _coalesce, the sub-blocks of a rank against each K/V owner, masked as the kernel masks
    # them, still cover exactly the global band, each kept (query, key) pair once; zigzag causal
    # needs at most 2 kernel calls per step.
    from flash_attn.reference import keep_mask
    from flash_attn.ring_attention import _blocks, _segments

    for world in (2, 3, 4):
        for zigzag in (True, False):
            n = 2 * world * 3 if zigzag else world * 5
            s_local = n // world
            for left, right in ((math.inf, 0), (math.inf, math.inf), (4, 0), (5, 2), (0, 0),
                                (math.inf, 3), (7, math.inf)):
                for rank in range(world):
                    qsegs = _segments(rank, world, [s_local], zigzag)
                    for owner in range(world):
                        ksegs = _segments(owner, world, [s_local], zigzag)
                        got = torch.zeros(s_local, s_local, dtype=torch.int32)
                        blocks = _blocks(qsegs, ksegs, left, right)
                        for blk in blocks:
                            got[blk.rows, blk.cols] += keep_mask(
                                blk.rows.stop - blk.rows.start, blk.cols.stop - blk.cols.start,
                                blk.causal, blk.window_left, blk.window_right).int()
                        want = torch.zeros(s_local, s_local, dtype=torch.int32)
                        for q0, ql0, sq in qsegs[0]:
                            for k0, kl0, sk in ksegs[0]:
                                for i in range(sq):
                                    for j in range(sk):
                                        delta = (k0 + j) - (q0 + i)
                                        want[ql0 + i, kl0 + j] = int(-left <= delta <= right)
                        assert torch.equal(got, want), (world, zigzag, left, right, rank, owner)
                        if zigzag and (left, right) == (math.inf, 0):
                            assert len(blocks) <= 2, (world, rank, owner, len(blocks))


def test_positional_blocks_carry_global_distances():
    # With ALiBi (positional=True) every block's pos gives each kept (query, key) pair its
    # global distance, after _coalesce too, and the blocks still cover the band once.
    from flash_attn.reference import keep_mask
    from flash_attn.ring_attention import _blocks, _segments

    for world in (2, 3):
        for zigzag in (True, False):
            n = 2 * world * 3 if zigzag else world * 5
            s_local = n // world
            for left, right in ((math.inf, 0), (math.inf, math.inf), (5, 2)):
                for rank in range(world):
                    qsegs = _segments(rank, world, [s_local], zigzag)
                    qpos = torch.cat([torch.arange(q0, q0 + sq) for q0, _, sq in qsegs[0]])
                    for owner in range(world):
                        ksegs = _segments(owner, world, [s_local], zigzag)
                        kpos = torch.cat([torch.arange(k0, k0 + sk) for k0, _, sk in ksegs[0]])
                        covered = torch.zeros(s_local, s_local, dtype=torch.int32)
                        for blk in _blocks(qsegs, ksegs, left, right, positional=True):
                            nr = blk.rows.stop - blk.rows.start
                            nc = blk.cols.stop - blk.cols.start
                            keep = keep_mask(nr, nc, blk.causal, blk.window_left,
                                             blk.window_right).expand(nr, nc)
                            covered[blk.rows, blk.cols] += keep.int()
                            local = (blk.pos + torch.arange(nr)[:, None]
                                     - torch.arange(nc)[None, :])
                            glob = qpos[blk.rows][:, None] - kpos[blk.cols][None, :]
                            assert torch.equal(local[keep], glob[keep]), (world, zigzag, rank)
                            # The kernels' distance i + (ncols - nrows) + offset - j.
                            kernel = local - blk.pos + (nc - nr) + blk.alibi_offset()
                            assert torch.equal(kernel[keep], glob[keep]), (world, zigzag, rank)
                        want = ((kpos[None, :] - qpos[:, None] >= -left)
                                & (kpos[None, :] - qpos[:, None] <= right)).int()
                        assert torch.equal(covered, want), (world, zigzag, left, right, rank)
