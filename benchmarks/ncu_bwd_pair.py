#!/usr/bin/env python3
"""One backward of ours and one of FlashAttention-3 on the same tensors, to run under ncu, so
that the two main kernels' profiles can be compared line by line. Example (on the H100):

    ncu --clock-control none --set full --kernel-name-base demangled \\
        -k regex:"flash_bwd_sm90_kernel|FlashAttnBwdSm90" -o bwd_pair \\
        python benchmarks/ncu_bwd_pair.py --fa3 PATH/_C.abi3.so --hdim 128 --seqlen 8192
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fa3", required=True, help="FlashAttention-3's extension library")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--which", default="ours,fa3", help="comma list of ours, fa3")
    args = p.parse_args()
    which = args.which.split(",")

    torch.ops.load_library(args.fa3)
    fa3 = torch.ops.flash_attn_3
    batch, heads = max(1, 16384 // args.seqlen), 2048 // args.hdim
    shape = (batch, args.seqlen, heads, args.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if "ours" in which:
        from flash_attn import flash_attn_func

        out = flash_attn_func(q, k, v, causal=args.causal)
        torch.autograd.grad(out, (q, k, v), dout)
    if "fa3" not in which:
        return
    o3, lse3, *_ = fa3.fwd(q.detach(), k.detach(), v.detach(), is_causal=args.causal)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fa3.bwd(dout, q.detach(), k.detach(), v.detach(), o3, lse3, dq, dk, dv, is_causal=args.causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
