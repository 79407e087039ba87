#!/usr/bin/env python3
"""Per-kernel GPU time of one forward + backward, ours next to SDPA's flash backend.

Separates kernel time from Python/launch overhead, and the backward's pieces (row dot, main
kernel, dq write, GQA sum) from each other. Example:

    python benchmarks/profile_kernels.py --hdim 128 --seqlen 4096 --causal
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    from flash_attn import flash_attn_func

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    batch, heads = 16384 // args.seqlen, 2048 // args.hdim
    shape = (batch, args.seqlen, heads, args.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dtype)

    def ours():
        out = flash_attn_func(q, k, v, causal=args.causal)
        torch.autograd.grad(out, (q, k, v), dout)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal)
            torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))

    for name, fn in (("ours", ours), ("sdpa-flash", sdpa)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        print(f"== {name}: hdim {args.hdim} seqlen {args.seqlen} causal {args.causal}, "
              f"per-iteration GPU time by kernel")
        rows = [(e.key, e.device_time_total / args.iters, e.count // args.iters)
                for e in prof.key_averages() if e.device_time_total > 0]
        for key, us, count in sorted(rows, key=lambda r: -r[1]):
            print(f"  {us / 1000:8.3f} ms  x{count:<3d} {key[:110]}")


if __name__ == "__main__":
    main()
