#!/usr/bin/env python3
"""Runner of bwd_step_timeline.patch: one backward at d=128, 8k tokens per sequence, batch 2,
16 heads, bf16, without and with the causal mask; the patched kernel prints its "TL" lines
between the "RUN ..." and "END" markers."""

from __future__ import annotations

import torch

from flash_attn import flash_attn_func


def main() -> None:
    for causal in (False, True):
        torch.manual_seed(0)
        shape = (2, 8192, 16, 128)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        out = flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        print("RUN causal" if causal else "RUN full", flush=True)
        torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        print("END", flush=True)


if __name__ == "__main__":
    main()
