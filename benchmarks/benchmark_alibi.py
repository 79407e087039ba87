"""What ALiBi costs: ``flash_attn_func`` with and without ``alibi_slopes``, bf16, 16k tokens
per call, hidden 2048 (the grid of RESULTS.md).

Columns (TFLOP/s, median of ``triton.testing.do_bench``): the forward on the default path (SM90
kernels on an H100) without and with ALiBi and their ratio, the forward with ALiBi on the SM80
kernels (``FLASH_ATTN_FORCE_SM80=1``, what H100 ran before the SM90 forward took ALiBi), and the
backward without and with ALiBi. Slopes are the usual 2^(-8 i / nheads), times
``--slope-scale``: with tiny slopes the bias barely moves a row's running max from one key block
to the next, with the usual ones it moves it by up to slope x block_n, which makes the online
softmax rescale the output; the two runs side by side say how much of ALiBi's cost is that.

    python benchmarks/benchmark_alibi.py
    python benchmarks/benchmark_alibi.py --slope-scale 0.001
"""

import argparse
import os

import torch
from triton.testing import do_bench

from flash_attn import flash_attn_func


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slope-scale", type=float, default=1.0,
                    help="multiplies every slope (default 1: the usual slopes)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, TFLOP/s, "
          f"slopes x {args.slope_scale:g}")
    print("| hdim | seqlen | causal | fwd | fwd + alibi | ratio | fwd sm80 + alibi | bwd | "
          "bwd + alibi |")
    print("|---|---|---|---|---|---|---|---|---|")
    forced = os.environ.get("FLASH_ATTN_FORCE_SM80")
    for d in (64, 128):
        for s in (1024, 4096, 16384):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                slopes = torch.tensor([args.slope_scale * 2.0 ** (-8 * (i + 1) / h)
                                       for i in range(h)],
                                      device="cuda")
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                res = []
                for force, al in (("0", None), ("0", slopes), ("1", slopes)):
                    os.environ["FLASH_ATTN_FORCE_SM80"] = force
                    with torch.no_grad():
                        t = do_bench(lambda: flash_attn_func(q, k, v, causal=causal,
                                                             alibi_slopes=al),
                                     return_mode="median")
                    res.append(flops / t / 1e9)
                os.environ["FLASH_ATTN_FORCE_SM80"] = "0"
                for al in (None, slopes):
                    out = flash_attn_func(q, k, v, causal=causal, alibi_slopes=al)
                    g = torch.randn_like(out)
                    t = do_bench(lambda: torch.autograd.grad(out, (q, k, v), g,
                                                             retain_graph=True),
                                 return_mode="median")
                    res.append(2.5 * flops / t / 1e9)
                res.insert(2, res[1] / res[0])
                print(f"| {d} | {s} | {'yes' if causal else 'no'} | "
                      + " | ".join(f"{x:.2f}" if i == 2 else f"{x:.0f}" for i, x in enumerate(res))
                      + " |")
    if forced is None:
        os.environ.pop("FLASH_ATTN_FORCE_SM80", None)
    else:
        os.environ["FLASH_ATTN_FORCE_SM80"] = forced


if __name__ == "__main__":
    main()
