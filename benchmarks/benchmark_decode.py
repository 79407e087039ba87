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
--pages rows, default 256, in shuffled order, block_table).

Shapes: q (batch, seqlen_q, nheads, hdim), k/v (batch, seqlen_k, nheads_k, hdim), bf16, causal
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
                   help="comma list of page sizes for the paged cache's columns (default 256)")
    p.add_argument("--warmup", type=float, default=25.0, help="ms")
    p.add_argument("--rep", type=float, default=100.0, help="ms")
    return p.parse_args(argv)


def heads_list(spec: str) -> List[Tuple[int, int]]:
    return [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]


def graphed_ms(fn, timer, args) -> float:
    """Median GPU time of fn() replayed from a CUDA graph."""
    import torch

    fn()  # warm up outside the capture (first-call setup)
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
    pages = [int(x) for x in args.pages.split(",")]
    timer_name, timer = make_timer()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {timer_name}, "
          f"batch {args.batch}, hdim {args.hdim}, bf16, causal")
    print("| seqlen_q | seqlen_k | heads:kv | unpacked us | packed us | packed / unpacked "
          "speedup | packed, unsplit us | split speedup | packed GB/s | with_kvcache us "
          "| with_kvcache, lengths tensor us | with_kvcache, cache_batch_idx us "
          "| gathered copy us | "
          + "".join(f"with_kvcache, pages of {page} us | " for page in pages) + "SDPA us |")
    print("|---" * (14 + len(pages)) + "|")
    settings = {"0": {"FLASH_ATTN_PACK_GQA": "0"}, "1": {"FLASH_ATTN_PACK_GQA": "1"},
                "unsplit": {"FLASH_ATTN_PACK_GQA": "1", "FLASH_ATTN_SPLIT": "0"}}
    torch.manual_seed(0)
    for sk in [int(x) for x in args.seqlens_k.split(",")]:
        for sq in [int(x) for x in args.seqlens_q.split(",")]:
            for h, hk in heads_list(args.heads):
                dt = torch.bfloat16
                q = torch.randn(args.batch, sq, h, args.hdim, device="cuda", dtype=dt)
                k = torch.randn(args.batch, sk, hk, args.hdim, device="cuda", dtype=dt)
                v = torch.randn_like(k)
                us = {}
                with torch.no_grad():
                    for name, env in settings.items():
                        os.environ.update(env)
                        us[name] = 1e3 * graphed_ms(
                            lambda: flash_attn.flash_attn_func(q, k, v, causal=True), timer, args)
                        for var in env:
                            os.environ.pop(var)
                    k_cache = torch.zeros(args.batch, 2 * sk, hk, args.hdim, device="cuda",
                                          dtype=dt)
                    v_cache = torch.zeros_like(k_cache)
                    k_cache[:, :sk], v_cache[:, :sk] = k, v
                    k_new, v_new = k[:, sk - sq:].clone(), v[:, sk - sq:].clone()
                    us["kvcache"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, k_cache, v_cache, k_new, v_new, cache_seqlens=sk - sq,
                            causal=True), timer, args)
                    lens = torch.full((args.batch,), sk - sq, dtype=torch.int32, device="cuda")
                    us["kvcache_t"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                            causal=True), timer, args)
                    # Batch b uses entry 2 * (batch - 1 - b) + 1 of a 2 x batch cache.
                    idx = torch.arange(2 * args.batch - 1, 0, -2, dtype=torch.int32,
                                       device="cuda")
                    k_cache = k_cache.repeat_interleave(2, dim=0)
                    v_cache = v_cache.repeat_interleave(2, dim=0)
                    us["kvcache_idx"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                            cache_batch_idx=idx, causal=True), timer, args)
                    us["kvcache_gather"] = 1e3 * graphed_ms(
                        lambda: flash_attn.flash_attn_with_kvcache(
                            q, k_cache[idx], v_cache[idx], k_new, v_new, cache_seqlens=lens,
                            causal=True), timer, args)
                    del k_cache, v_cache
                    for page in pages:
                        blocks = args.batch * 2 * sk // page
                        table = torch.randperm(blocks, device="cuda").to(torch.int32).reshape(
                            args.batch, 2 * sk // page)
                        k_pages = torch.zeros(blocks, page, hk, args.hdim, device="cuda",
                                              dtype=dt)
                        v_pages = torch.zeros_like(k_pages)
                        k_pages[table.long()] = torch.cat(
                            [k, torch.zeros_like(k)], 1).unflatten(1, (-1, page))
                        v_pages[table.long()] = torch.cat(
                            [v, torch.zeros_like(v)], 1).unflatten(1, (-1, page))
                        us[f"paged{page}"] = 1e3 * graphed_ms(
                            lambda: flash_attn.flash_attn_with_kvcache(
                                q, k_pages, v_pages, k_new, v_new, cache_seqlens=lens,
                                block_table=table, causal=True), timer, args)
                        del k_pages, v_pages
                    qt = q.transpose(1, 2)
                    kt = k.transpose(1, 2).repeat_interleave(h // hk, dim=1)
                    vt = v.transpose(1, 2).repeat_interleave(h // hk, dim=1)
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
