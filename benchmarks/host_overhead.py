"""Host time per call of the package on CUDA: eager wall time of small calls, whose GPU time is
far below their host time, so that the number is the Python wrappers' and the binding's cost.

    python3 benchmarks/host_overhead.py [--profile]

Shapes (bf16): "decode" is q (8, 1, 32, 128) against k, v (8, 4096, 8, 128), the shape of
RESULTS.md's "Host time per call" section; "small" is q, k, v (1, 128, 8, 64), causal. Rows:
the forward without grad, the forward with q/k/v requiring grad, forward + backward, and the
extension's forward op alone (what `flash_attn.ops` calls). Each number is the best of three
loops of `--iters` calls, in microseconds per call, after a warm-up, with a device
synchronization only at the ends of a loop. `--profile` adds torch.profiler's CPU table of 20
small forward calls (where the host time goes, by op).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

import flash_attn
from flash_attn import flash_attn_func
from flash_attn.ops import load_extension


def per_call_us(fn: Callable[[], object], iters: int) -> float:
    """Best of three loops of `iters` calls, microseconds per call."""
    for _ in range(max(iters // 10, 10)):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def extension_fwd(ext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> Callable[[], object]:
    """The extension's forward op alone, as flash_attn.ops calls it. Builds whose `fwd` still
    takes the preallocated `out` (the pybind11 binding: a plain function, not a torch op or
    op overload) get it as None."""
    s_q, s_k, d = q.shape[1], k.shape[1], q.shape[-1]
    args = [q, k, v, None, None, None, s_q, s_k, d ** -0.5, causal, -1, 0 if causal else -1, 0.0]
    if not isinstance(ext.fwd, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        args.insert(3, None)
    return lambda: ext.fwd(*args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    print(f"flash_attn {flash_attn.__version__} from {flash_attn.__file__}; torch "
          f"{torch.__version__}; {torch.cuda.get_device_name()}")
    shapes = {
        "decode": ((8, 1, 32, 128), (8, 4096, 8, 128), False),
        "small": ((1, 128, 8, 64), (1, 128, 8, 64), True),
    }
    ext = load_extension()
    print("| shape | fwd, no grad | fwd, grad | fwd + bwd | extension fwd op |")
    print("|---|---|---|---|---|")
    for name, (q_shape, kv_shape, causal) in shapes.items():
        q = torch.randn(q_shape, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(kv_shape, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(kv_shape, device=dev, dtype=dt, requires_grad=True)
        with torch.no_grad():
            no_grad = per_call_us(lambda: flash_attn_func(q, k, v, causal=causal), args.iters)
            op = per_call_us(extension_fwd(ext, q, k, v, causal), args.iters)
        grad = per_call_us(lambda: flash_attn_func(q, k, v, causal=causal), args.iters)
        fwd_bwd = per_call_us(lambda: flash_attn_func(q, k, v, causal=causal).sum().backward(),
                              max(args.iters // 4, 50))
        print(f"| {name} | {no_grad:.1f} | {grad:.1f} | {fwd_bwd:.1f} | {op:.1f} |")
    if args.profile:
        q, k, v = (torch.randn(1, 128, 8, 64, device=dev, dtype=dt) for _ in range(3))
        with torch.no_grad():
            for _ in range(20):
                flash_attn_func(q, k, v, causal=True)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    flash_attn_func(q, k, v, causal=True)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
