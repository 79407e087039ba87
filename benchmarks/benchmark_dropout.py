"""What dropout costs: ``flash_attn_func`` forward and forward + backward with ``dropout_p``
against the same call without it (on the SM80 kernels, which draw the mask, and on the default
path), and against PyTorch SDPA's flash backend (FlashAttention-2) with the same dropout.
bf16, 16k tokens per call, hidden 2048 (the grid of RESULTS.md); TFLOP/s from the median of
``triton.testing.do_bench`` (not graph-timed).

    python benchmarks/benchmark_dropout.py
"""

import os
from typing import Callable, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flash_attn import flash_attn_func


def _tflops(fn: Callable[[], object], flops: float) -> float:
    return flops / do_bench(fn, return_mode="median") / 1e9


def _fwd_bwd(call: Callable[[], torch.Tensor],
             leaves: Tuple[torch.Tensor, ...]) -> Callable[[], None]:
    out = call()
    g = torch.randn_like(out)

    def run() -> None:
        torch.autograd.grad(call(), leaves, g)

    return run


def main() -> None:
    p = 0.1
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, dropout_p={p}, "
          f"TFLOP/s (fwd+bwd counts 3.5x the forward's FLOPs)")
    cols = ["default", "sm80", "sm80 + dropout", "sdpa-flash + dropout"]
    print("| hdim | seqlen | causal | pass | " + " | ".join(cols) + " | dropout / sm80 |")
    print("|---|---|---|---|" + "---|" * (len(cols) + 1))
    for d in (64, 128):
        for s in (1024, 4096):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
                fl = 4 * b * h * s * s * d / (2 if causal else 1)
                calls = {
                    "default": ("0", lambda: flash_attn_func(q, k, v, causal=causal)),
                    "sm80": ("1", lambda: flash_attn_func(q, k, v, causal=causal)),
                    "sm80 + dropout": ("0", lambda: flash_attn_func(q, k, v, causal=causal,
                                                                    dropout_p=p)),
                }
                for what, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                    res = []
                    for name in cols[:3]:
                        force, call = calls[name]
                        os.environ["FLASH_ATTN_FORCE_SM80"] = force
                        if what == "fwd":
                            with torch.no_grad():
                                res.append(_tflops(call, fl))
                        else:
                            res.append(_tflops(_fwd_bwd(call, (q, k, v)), mult * fl))
                    os.environ["FLASH_ATTN_FORCE_SM80"] = "0"
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        def sdpa():
                            return F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p,
                                                                  is_causal=causal)
                        if what == "fwd":
                            with torch.no_grad():
                                res.append(_tflops(sdpa, fl))
                        else:
                            res.append(_tflops(_fwd_bwd(sdpa, (qt, kt, vt)), mult * fl))
                    print(f"| {d} | {s} | {'yes' if causal else 'no'} | {what} | "
                          + " | ".join(f"{x:.0f}" for x in res) + f" | {res[2] / res[1]:.2f} |")
    os.environ.pop("FLASH_ATTN_FORCE_SM80", None)


if __name__ == "__main__":
    main()
