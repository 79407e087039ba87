#!/usr/bin/env python3
"""Decode-shape benchmark of the Hopper forward's GQA packing and split-KV: a few query rows
against a long KV cache, with the query heads of one KV head packed into shared tiles
(FLASH_ATTN_PACK_GQA=1) and not (=0), and packed with each tile's keys split over SMs (the
default where the tiles are few) and not (FLASH_ATTN_SPLIT=0), in one process, on the same
tensors; SDPA (default backend choice, K/V expanded to every query head, as a model without
GQA support would call it) alongside, and `flash_attn_with_kvcache` on the same keys held in a
cache twice as long: it writes the step's seqlen_q new K/V rows at row seqlen_k - seqlen_q and
attends to the first seqlen_k rows (default settings), with cache_seqlens an int and an int32
tensor, and with cache_batch_idx selecting the batch's entries (every other one, in reverse) of
a cache of 2 x batch entries: read in place, and, for comparison, gathered into a copy first
(`k_cache[idx]`, what a kernel without a batch index needs); and on a paged cache (pages of
--pages rows, default 256, in shuffled order, block_table; a page size written with a
trailing "o", e.g. 16o, keeps the pages in order: the same kernel on a contiguous layout).

Shapes: q (batch, seqlen_q, nheads, hdim), k/v (batch, seqlen_k, nheads_k, hdim), bf16 (or
e4m3 with --dtype e4m3: q, k, v and the caches in float8_e4m3fn with descales of 1, SDPA on their
bf16 values; a column whose call raises NotImplementedError shows "nan"), causal
(bottom-right aligned, as in decoding). Each call is captured once in a CUDA graph and the
replays are timed (triton.testing.do_bench, median, L2 flushed between repetitions), so the
numbers are GPU time without the host's dispatch. GB/s counts the K and V bytes read once.

Examples:
    python benchmarks/benchmark_decode.py
    python benchmarks/benchmark_decode.py --seqlens-q 1,8 --seqlens-k 8192 --heads 32:8
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchmark_attn import import_flash_attn, make_timer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlens-q", default="1,4,16", help="comma list (default 1,4,16)")
    p.add_argument("--seqlens-k", default="4096,16384", help="comma list (default 4096,16384)")
    p.add_argument("--heads", default="32:8,32:4,64:8",
                   help="comma list of nheads:nheads_k (default 32:8,32:4,64:8)")
    p.add_argument("--pages", default="256",
                   help="comma list of page sizes for the paged cache's columns (default 256); "
                        "a trailing 'o' (16o) keeps the pages in order instead of shuffled")
    p.add_argument("--dtype", choices=["bf16", "e4m3"], default="bf16",
                   help="e4m3: FP8 q, k, v and caches (FlashAttention-3's descales, all 1)")
    p.add_argument("--warmup", type=float, default=25.0, help="ms")
    p.add_argument("--rep", type=float, default=100.0, help="ms")
    return p.parse_args(argv)


def heads_list(spec: str) -> List[Tuple[int, int]]:
    return [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]


def graphed_ms(fn, timer, args) -> float:
    """Median GPU time of fn() replayed from a CUDA graph; NaN where fn raises
    NotImplementedError (a combination the build or the dtype does not run)."""
    import torch

    try:
        fn()  # warm up outside the capture (first-call setup)
    except NotImplementedError:
        return float("nan")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timer(graph.replay, args.warmup, args.rep)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    flash_attn = import_flash_attn()
    pages = args.pages.split(",")
    timer_name, timer = make_timer()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {timer_name}, "
          f"batch {args.batch}, hdim {args.hdim}, {args.dtype}, causal")
    print("| seqlen_q | seqlen_k | heads:kv | unpacked us | packed us | packed / unpacked "
          "speedup | packed, unsplit us | split speedup | packed GB/s | with_kvcache us "
          "| with_kvcache, lengths tensor us | with_kvcache, cache_batch_idx us "
          "| gathered copy us | "
          + "".join(f"with_kvcache, pages of {page.rstrip('o')}"
                    f"{', in order' if page.endswith('o') else ''} us | " for page in pages)
          + "SDPA us |")
    print("|---" * (14 + len(pages)) + "|")
    settings = {"0": {"FLASH_ATTN_PACK_GQA": "0"}, "1": {"FLASH_ATTN_PACK_GQA": "1"},
                "unsplit": {"FLASH_ATTN_PACK_GQA": "1", "FLASH_ATTN_SPLIT": "0"}}
    fp8 = args.dtype == "e4m3"
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).to(dt)

    def zeros(*shape):
        # Through bytes: zeros are zero bytes in both dtypes.
        return torch.zeros(*shape, device="cuda", dtype=torch.uint8 if fp8 else dt).view(dt)

    def raw(x):  # gathers and scatters on bytes (float8 has no indexing kernels)
        return x.view(torch.uint8) if fp8 else x

    torch.manual_seed(0)
    for sk in [int(x) for x in args.seqlens_k.split(",")]:
        for sq in [int(x) for x in args.seqlens_q.split(",")]:
            for h, hk in heads_list(args.heads):
                q = rand(args.batch, sq, h, args.hdim)
                k, v = rand(args.batch, sk, hk, args.hdim), rand(args.batch, sk, hk, args.hdim)
                ones = torch.ones(args.batch, hk, device="cuda")
                fkw = dict(q_descale=ones, k_descale=ones, v_descale=ones) if fp8 else {}
                us = {}
                with torch.no_grad():
                    for name, env in settings.items():
                        os.environ.update(env)
                        us[name] = 1e3 * graphed_ms(
                            lambda: flash_attn.flash_attn_func(q, k, v, causal=True, **fkw),
                            timer, args)
                        for var in env:
                            os.environ.pop(var)
                    k_cache = zeros(args.batch, 2 * sk, hk, args.hdim)
                    v_cache = zeros(args.batch, 2 * sk, hk, args.hdim)
                    raw(k_cache)[:, :sk], raw(v_cache)[:, :sk] = raw(k), raw(v)
                    k_new, v_new = k[:, sk - sq:].clone(), v[:, sk - sq:].clone()
                    us["kvcache"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, k_cache, v_cache, k_new, v_new, cache_seqlens=sk - sq,
                            causal=True, **fkw), timer, args)
                    lens = torch.full((args.batch,), sk - sq, dtype=torch.int32, device="cuda")
                    us["kvcache_t"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                            causal=True, **fkw), timer, args)
                    # Batch b uses entry 2 * (batch - 1 - b) + 1 of a 2 x batch cache.
                    idx = torch.arange(2 * args.batch - 1, 0, -2, dtype=torch.int32,
                                       device="cuda")
                    k_cache = raw(k_cache).repeat_interleave(2, dim=0).view(dt)
                    v_cache = raw(v_cache).repeat_interleave(2, dim=0).view(dt)
                    us["kvcache_idx"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                            cache_batch_idx=idx, causal=True, **fkw), timer, args)
                    us["kvcache_gather"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, raw(k_cache)[idx].view(dt), raw(v_cache)[idx].view(dt), k_new,
                            v_new, cache_seqlens=lens, causal=True, **fkw), timer, args)
                    k_cache = v_cache = None  # freed before the paged caches
                    for spec in pages:
                        page = int(spec.rstrip("o"))
                        blocks = args.batch * 2 * sk // page
                        order = (torch.arange(blocks, device="cuda") if spec.endswith("o")
                                 else torch.randperm(blocks, device="cuda"))
                        table = order.to(torch.int32).reshape(args.batch, 2 * sk // page)
                        k_pages = zeros(blocks, page, hk, args.hdim)
                        v_pages = zeros(blocks, page, hk, args.hdim)
                        raw(k_pages)[table.long()] = torch.cat(
                            [raw(k), torch.zeros_like(raw(k))], 1).unflatten(1, (-1, page))
                        raw(v_pages)[table.long()] = torch.cat(
                            [raw(v), torch.zeros_like(raw(v))], 1).unflatten(1, (-1, page))
                        us[f"paged{spec}"] = 1e3 * graphed_ms(
                            lambda: flash_attn.flash_attn_with_kvcache(
                                q, k_pages, v_pages, k_new, v_new, cache_seqlens=lens,
                                block_table=table, causal=True, **fkw), timer, args)
                        k_pages = v_pages = None
                    qt = q.to(torch.bfloat16).transpose(1, 2)
                    kt = k.to(torch.bfloat16).transpose(1, 2).repeat_interleave(h // hk, dim=1)
                    vt = v.to(torch.bfloat16).transpose(1, 2).repeat_interleave(h // hk, dim=1)
                    # Bottom-right causal mask as a boolean mask (SDPA's is_causal is top-left).
                    mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)
                    us["sdpa"] = 1e3 * graphed_ms(
                        lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask),
                        timer, args)
                kv_bytes = 2 * k.numel() * k.element_size()
                print(f"| {sq} | {sk} | {h}:{hk} | {us['0']:.1f} | {us['1']:.1f} | "
                      f"{us['0'] / us['1']:.2f} | {us['unsplit']:.1f} | "
                      f"{us['unsplit'] / us['1']:.2f} | "
                      f"{kv_bytes / (us['1'] * 1e-6) / 1e9:.0f} | {us['kvcache']:.1f} | "
                      f"{us['kvcache_t']:.1f} | {us['kvcache_idx']:.1f} | "
                      f"{us['kvcache_gather']:.1f} | "
                      + "".join(f"{us[f'paged{page}']:.1f} | " for page in pages)
                      + f"{us['sdpa']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
