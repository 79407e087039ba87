"""The e4m3 forward against FlashAttention-3's e4m3 forward and our bf16 forward, in one process.

Grid of ``benchmarks/RESULTS.md`` ("Grid"): 16k tokens, hidden 2048, hdim 64/128/256, seqlen
512-16k, causal or not. q, k, v are bf16 inputs quantized to float8_e4m3fn with per-(batch,
KV head) descales of 1; each backend's forward is captured in a CUDA graph and the replays are
timed (``triton.testing.do_bench``, median). ``relerr`` is ||out_e4m3 - out_bf16|| / ||out_bf16||
of our two forwards on the same (quantized) values, a check that the e4m3 kernel computed the
same function. FlashAttention-3: ``--fa3 PATH`` (the library ``../shared/peers/build_fa3.sh``
prints, built with FP8=1).

    python benchmarks/benchmark_fp8.py [--fa3 PATH] [--hdims 64,128,256] [--seqlens ...]
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
from benchmark_bwd import graph_time_ms, load_fa3  # this folder: the scripts run as files

from flash_attn import flash_attn_func


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fa3", default=None, help="FlashAttention-3's library (built with FP8=1)")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    fa3 = load_fa3(args.fa3)
    e4m3 = torch.float8_e4m3fn
    print(f"# e4m3 forward, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| hdim | seqlen | causal | ours e4m3 | fa3 e4m3 | ours bf16 | e4m3 / fa3 | relerr |")
    print("|---|---|---|---|---|---|---|---|")
    for d in (int(x) for x in args.hdims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                batch, heads = max(args.tokens // s, 1), args.hidden // d
                torch.manual_seed(0)
                q, k, v = (torch.randn(batch, s, heads, d, device="cuda").to(e4m3)
                           for _ in range(3))
                qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
                ones = torch.ones(batch, heads, device="cuda")
                flops = 4.0 * batch * heads * s * s * d / (2 if causal else 1)

                def tflops(ms: Optional[float]) -> Optional[float]:
                    return None if ms is None else flops / (ms * 1e-3) / 1e12

                with torch.no_grad():
                    out8 = flash_attn_func(q, k, v, causal=causal, q_descale=ones,
                                           k_descale=ones, v_descale=ones)
                    out16 = flash_attn_func(qb, kb, vb, causal=causal)
                    relerr = float((out8.float() - out16.float()).norm() / out16.float().norm())
                    ours8 = tflops(graph_time_ms(lambda: flash_attn_func(
                        q, k, v, causal=causal, q_descale=ones, k_descale=ones, v_descale=ones)))
                    ours16 = tflops(graph_time_ms(lambda: flash_attn_func(qb, kb, vb,
                                                                          causal=causal)))
                    theirs = None
                    if fa3 is not None:
                        try:
                            theirs = tflops(graph_time_ms(lambda: fa3.fwd(
                                q, k, v, is_causal=causal, q_descale=ones, k_descale=ones,
                                v_descale=ones)))
                        except Exception as e:  # a shape its build lacks
                            print(f"<!-- fa3 {d} {s} {causal}: {str(e).splitlines()[0][:120]} -->")

                def cell(x: Optional[float]) -> str:
                    return "-" if x is None else f"{x:.0f}"

                ratio = "-" if theirs is None else f"{ours8 / theirs:.2f}"
                print(f"| {d} | {s} | {'yes' if causal else 'no'} | {cell(ours8)} | "
                      f"{cell(theirs)} | {cell(ours16)} | {ratio} | {relerr:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
