"""fp16 against bf16 forward speed, ours and cuDNN (SDPA), timed in turns in one process.

Each grid shape (16k tokens, hidden 2048) runs as a CUDA graph in bf16, in fp16, and in fp16 on
tensors that hold bf16-representable values ("fp16, 8-bit values": the fp16 kernel with the
mantissa bits that bf16 inputs would toggle). Under the H100's 700 W cap the clock follows the
power the tensor cores draw, which grows with the toggling bits of the operands: where the
8-bit column matches bf16 and full fp16 does not, the gap is power, not instructions
(docs/measurement.md, "fp16 against bf16"; current table in benchmarks/RESULTS.md).

    python benchmarks/fp16_vs_bf16.py --rounds 2
"""
from __future__ import annotations

import argparse
import statistics
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmark_attn import make_timer

# (label, dtype of the tensors, dtype the values are rounded through first)
VARIANTS = (
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("fp16", torch.float16, torch.float16),
    ("fp16, 8-bit values", torch.float16, torch.bfloat16),
)


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Capture one call of `fn` (after a warm-up call outside the graph)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_shape(hdim: int, seqlen: int, causal: bool, rounds: int,
              timer: Callable) -> Dict[Tuple[str, str], float]:
    """TFLOP/s of ours and cuDNN per variant (cuDNN not on the 8-bit variant)."""
    from flash_attn import flash_attn_func

    batch, heads = 16384 // seqlen, 2048 // hdim
    flops = 4.0 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)
    graphs = {}
    tensors = []
    for label, dtype, through in VARIANTS:
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, heads, hdim, dtype=through, device="cuda")
                   .to(dtype) for _ in range(3))
        tensors.append((q, k, v))
        graphs[("ours", label)] = graph_of(lambda: flash_attn_func(q, k, v, causal=causal))
        if label != "fp16, 8-bit values":
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                graphs[("cudnn", label)] = graph_of(
                    lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    times = {key: [] for key in graphs}
    for _ in range(rounds):
        for key, graph in graphs.items():
            times[key].append(timer(graph.replay, 25, 100))
    return {key: flops / (statistics.median(t) * 1e-3) / 1e12 for key, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="turns per variant and shape")
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    args = p.parse_args()
    timer = make_timer()[1]
    print("| hdim | seqlen | causal | ours bf16 | ours fp16 | fp16 / bf16 "
          "| ours fp16, 8-bit values | that / bf16 | cuDNN bf16 | cuDNN fp16 | cuDNN fp16 / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for hdim in map(int, args.hdims.split(",")):
        for seqlen in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                r = run_shape(hdim, seqlen, causal, args.rounds, timer)
                ob, of, o8 = (r[("ours", v[0])] for v in VARIANTS)
                cb, cf = r[("cudnn", "bf16")], r[("cudnn", "fp16")]
                print(f"| {hdim} | {seqlen} | {'yes' if causal else 'no'} | {ob:.0f} | {of:.0f} "
                      f"| {of / ob:.3f} | {o8:.0f} | {o8 / ob:.3f} | {cb:.0f} | {cf:.0f} "
                      f"| {cf / cb:.3f} |", flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
