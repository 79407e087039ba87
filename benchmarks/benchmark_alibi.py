"""What ALiBi costs: the forward and backward with and without ``alibi_slopes``, bf16, 16k tokens
per call, hidden 2048 (the grid of RESULTS.md), each call replayed from a CUDA graph.

Columns (TFLOP/s, median over graph replays): the forward on the default path (the SM90 kernels
on H100/H200) without and with ALiBi and their ratio (the goal: >= 0.95), the forward
with ALiBi on the SM80 kernels (``FLASH_ATTN_FORCE_SM80=1``, what H100 ran before the SM90
forward took ALiBi), and the backward without and with ALiBi and their ratio. Slopes are the
usual 2^(-8 i / nheads), times ``--slope-scale``: with tiny slopes the bias barely moves a
row's running max from one key block to the next, with the usual ones it moves it by up to
slope x block_n, which makes the online softmax rescale the output; the two runs side by side
say how much of ALiBi's cost is that.

    python benchmarks/benchmark_alibi.py
    python benchmarks/benchmark_alibi.py --slope-scale 0.001 --hdims 128
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_bwd import graph_time_ms  # noqa: E402  (this folder: the scripts run as files)

from flash_attn import ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slope-scale", type=float, default=1.0,
                    help="multiplies every slope (default 1: the usual slopes)")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, TFLOP/s "
          f"(CUDA graphs), slopes x {args.slope_scale:g}")
    print("| hdim | seqlen | causal | fwd | fwd + alibi | ratio | fwd sm80 + alibi | bwd | "
          "bwd + alibi | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    forced = os.environ.get("FLASH_ATTN_FORCE_SM80")
    for d in (int(x) for x in args.hdims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                                 for _ in range(4))
                slopes = torch.tensor([args.slope_scale * 2.0 ** (-8 * (i + 1) / h)
                                       for i in range(h)], device="cuda")
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                scale = d ** -0.5
                right = 0 if causal else -1

                def fwd(al):
                    return ops.flash_attn_fwd(q, k, v, None, None, None, s, s, scale, causal,
                                              -1, right, 0.0, alibi_slopes=al)

                res = []
                for force, al in (("0", None), ("0", slopes), ("1", slopes)):
                    os.environ["FLASH_ATTN_FORCE_SM80"] = force
                    res.append(flops / graph_time_ms(lambda: fwd(al)) / 1e9)
                os.environ["FLASH_ATTN_FORCE_SM80"] = "0"
                for al in (None, slopes):
                    out, lse = fwd(al)
                    res.append(2.5 * flops / graph_time_ms(lambda: ops.flash_attn_bwd(
                        dout, q, k, v, out, lse, None, None, s, s, scale, causal, -1, right,
                        0.0, False, alibi_slopes=al)) / 1e9)
                cells = res[:2] + [res[1] / res[0]] + res[2:] + [res[4] / res[3]]
                print(f"| {d} | {s} | {'yes' if causal else 'no'} | "
                      + " | ".join(f"{x:.3f}" if i in (2, 6) else f"{x:.0f}"
                                   for i, x in enumerate(cells))
                      + " |")
    if forced is None:
        os.environ.pop("FLASH_ATTN_FORCE_SM80", None)
    else:
        os.environ["FLASH_ATTN_FORCE_SM80"] = forced


if __name__ == "__main__":
    main()
