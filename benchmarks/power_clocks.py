"""SM clock and board power while each kernel runs back to back (about 3 s per kernel).

The H100 of the device tool holds its 700 W power cap under every attention and GEMM kernel
measured so far, so a kernel's speed is its work per clock times the clock the cap leaves it
(docs/measurement.md, "The power cap sets the clock"). This prints, per kernel: TFLOP/s over
the loop, and the median SM clock, power and throttle reasons that `nvidia-smi` sampled every
50 ms over the last three quarters of it. Shapes follow the benchmark grid (16k tokens, hidden
2048), bf16, non-causal; the attention calls are benchmark_attn.py's.

    python benchmarks/power_clocks.py
    python benchmarks/power_clocks.py --bwd [--fa3 PATH]

`--bwd`: the backward instead, d128 16k tokens in one sequence (the shape where our non-causal
backward runs below our causal one while FlashAttention-3's does not): non-causal, causal, and
non-causal with ALiBi (whose P is near zero far from the diagonal, so its tensor-core data
toggles less); with `--fa3`, FlashAttention-3's backward at the same shapes. If the non-causal
kernel runs at a lower clock under the same cap, the cap sets its pace and the lever is the
energy per step (shared-memory traffic), not the instruction count.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import time
from typing import Callable

import torch

from benchmark_attn import backend_context, backend_fn


def sample(name: str, fn: Callable[[], object], flops: float, secs: float = 3.0) -> None:
    """Run `fn` back to back for `secs` seconds and print its rate, clock and power."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
         "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    t0 = time.time()
    start.record()
    while time.time() - t0 < secs:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / calls
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].strip().splitlines() if line.count(",") == 3]
    rows = rows[len(rows) // 4:]
    if not rows:
        print(f"{name:28s} {flops / ms / 1e9:7.1f} TFLOP/s  (nvidia-smi gave no samples)", flush=True)
        return
    clock = statistics.median(float(r[0]) for r in rows)
    power = statistics.median(float(r[1]) for r in rows)
    reasons = collections.Counter(r[3].strip() for r in rows).most_common(2)
    print(f"{name:28s} {flops / ms / 1e9:7.1f} TFLOP/s  sm clock {clock:6.0f} MHz  "
          f"power {power:6.1f} W  temp {rows[-1][2].strip()}  reasons {reasons}", flush=True)


def backward_kernels(fa3: str | None) -> None:
    """Our backward binding (and FlashAttention-3's), each on its own forward's output."""
    from flash_attn import ops

    d, s, heads = 128, 16384, 16
    q, k, v, dout = (torch.randn(1, s, heads, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
    if fa3:
        torch.ops.load_library(fa3)
    for causal in (False, True):
        flops = 2.5 * 4 * heads * s * s * d / (2 if causal else 1)
        for alibi in ((None, slopes) if not causal else (None,)):
            out, lse = ops.flash_attn_fwd(q, k, v, None, None, None, s, s, d ** -0.5, causal,
                                          -1, 0 if causal else -1, 0.0, alibi_slopes=alibi)
            sample(f"ours bwd d{d} s{s} {'causal' if causal else 'nc'}"
                   + (" alibi" if alibi is not None else ""),
                   lambda: ops.flash_attn_bwd(dout, q, k, v, out, lse, None, None, s, s,
                                              d ** -0.5, causal, -1, 0 if causal else -1, 0.0,
                                              False, alibi_slopes=alibi), flops)
        if fa3:
            f3 = torch.ops.flash_attn_3
            out3, lse3, *_ = f3.fwd(q, k, v, is_causal=causal)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            sample(f"fa3 bwd d{d} s{s} {'causal' if causal else 'nc'}",
                   lambda: f3.bwd(dout, q, k, v, out3, lse3, dq, dk, dv, is_causal=causal),
                   flops)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bwd", action="store_true", help="the backward kernels (see above)")
    p.add_argument("--fa3", metavar="PATH", help="FlashAttention-3's _C library (with --bwd)")
    args = p.parse_args()
    if args.bwd:
        backward_kernels(args.fa3)
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sample("cublas 8192^3 bf16", lambda: a @ b, 2 * 8192**3)
    for d, s in ((128, 8192), (128, 2048), (64, 8192)):
        batch, heads = 16384 // s, 2048 // d
        q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        flops = 4 * batch * heads * s * s * d
        # The grid's calls: ours, and cuDNN through SDPA on the transposed views.
        for backend, label in (("ours", "ours"), ("sdpa-cudnn", "cudnn")):
            fn = backend_fn(backend, causal=False)
            with backend_context(backend):
                sample(f"{label} d{d} s{s} nc", lambda: fn(q, k, v), flops)
    sample("cublas 8192^3 bf16 again", lambda: a @ b, 2 * 8192**3)


if __name__ == "__main__":
    main()
