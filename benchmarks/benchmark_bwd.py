#!/usr/bin/env python3
"""Backward benchmark: ours (the default path and the SM80 kernels with FLASH_ATTN_FORCE_SM80=1,
each also with deterministic=True),
FlashAttention-3 (a library built by ../shared/peers/build_fa3.sh, loaded into this process),
and PyTorch SDPA's cuDNN and FlashAttention-2 backends, on the same tensors.

Grid (../shared/anchors/README.md): (batch, seqlen, heads, hdim) bf16, 16k tokens per call,
hidden 2048; backward FLOPs = 2.5 x forward = 10 * batch * heads * seqlen^2 * hdim, halved
when causal. Every backend's backward is captured in a CUDA graph and the replays are timed
(median of triton.testing.do_bench, L2 flushed between repetitions), so the numbers are GPU time:
ours and FlashAttention-3 call their backward ops directly on saved forward outputs, the SDPA
backends run torch.autograd.grad on a retained graph.

    python benchmarks/benchmark_bwd.py --fa3 PATH/_C.abi3.so --hdims 64,128 --markdown out.md
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--fa3", metavar="PATH", help="FlashAttention-3's extension library")
    p.add_argument("--no-sm80", action="store_true", help="skip our SM80 kernels")
    p.add_argument("--no-deterministic", action="store_true",
                   help="skip our deterministic=True backward")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA backends")
    p.add_argument("--markdown", metavar="PATH", help="also write the table here")
    return p.parse_args(argv)


def load_fa3(path: Optional[str]):
    """FlashAttention-3's ops (torch.ops.flash_attn_3) from the library at `path`, or None."""
    if not path:
        return None
    torch.ops.load_library(path)
    return torch.ops.flash_attn_3


def graph_time_ms(fn: Callable[[], None]) -> float:
    """Median GPU time of one call of fn, replayed from a CUDA graph."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def shape_row(d: int, s: int, causal: bool, args, fa3) -> Dict[str, Optional[float]]:
    from flash_attn.ops import load_extension

    ext = load_extension()

    batch, heads = args.tokens // s, args.hidden // d
    flops = 10.0 * batch * heads * s * s * d / (2 if causal else 1)
    dev = "cuda"
    q, k, v, dout = (torch.randn(batch, s, heads, d, device=dev, dtype=torch.bfloat16)
                     for _ in range(4))
    scale = d ** -0.5
    right = 0 if causal else -1
    out, lse = ext.fwd(q, k, v, None, None, None, s, s, scale, causal, -1, right, 0.0)
    row: Dict[str, Optional[float]] = {}

    def ours(deterministic: bool = False):
        ext.bwd(dout, q, k, v, out, lse, None, None, s, s, scale, causal, -1, right, 0.0,
                deterministic, None)

    def timed(name: str, fn: Callable[[], None]) -> None:
        try:
            row[name] = flops / graph_time_ms(fn) / 1e9
        except Exception as e:  # a peer missing a shape must not stop the table
            print(f"  {name} d={d} s={s} causal={causal}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            row[name] = None

    timed("ours", ours)
    if not args.no_deterministic:
        timed("ours-det", lambda: ours(True))
    if not args.no_sm80:
        os.environ["FLASH_ATTN_FORCE_SM80"] = "1"
        timed("ours-sm80", ours)
        if not args.no_deterministic:
            timed("ours-sm80-det", lambda: ours(True))
        del os.environ["FLASH_ATTN_FORCE_SM80"]
    if fa3 is not None:
        o3, lse3, *_ = fa3.fwd(q, k, v, is_causal=causal)
        d3q, d3k, d3v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        timed("fa3", lambda: fa3.bwd(dout, q, k, v, o3, lse3, d3q, d3k, d3v, is_causal=causal))
    if not args.no_sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(backend):
                try:
                    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                         is_causal=causal)
                except Exception as e:
                    print(f"  {name}: {e}", file=sys.stderr)
                    row[name] = None
                    continue
                do_t = dout.transpose(1, 2)
                timed(name, lambda: torch.autograd.grad(o, (qt, kt, vt), do_t,
                                                        retain_graph=True))
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    fa3 = load_fa3(args.fa3)
    names = ["ours"] + ([] if args.no_deterministic else ["ours-det"])
    sm80 = ["ours-sm80"] + ([] if args.no_deterministic else ["ours-sm80-det"])
    names += ([] if args.no_sm80 else sm80) + (["fa3"] if fa3 else [])
    names += [] if args.no_sdpa else ["cudnn", "sdpa-flash"]
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    lines = [f"Backward TFLOP/s, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}",
             "", "| hdim | seqlen | causal | " + " | ".join(names)
             + (" | ours / fa3 |" if fa3 else " |"),
             "|---" * (3 + len(names) + (1 if fa3 else 0)) + "|"]
    print("\n".join(lines), flush=True)
    for d in (int(x) for x in args.hdims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for c in causals:
                r = shape_row(d, s, c, args, fa3)
                cells = [f"{r[n]:.0f}" if r.get(n) else "-" for n in names]
                if fa3:
                    ratio = r["ours"] / r["fa3"] if r.get("ours") and r.get("fa3") else None
                    cells.append(f"{ratio:.2f}" if ratio else "-")
                line = f"| {d} | {s} | {'yes' if c else 'no'} | " + " | ".join(cells) + " |"
                lines.append(line)
                print(line, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
