"""A/B of several builds of the extension in one process: forward or backward TFLOP/s, timed
interleaved.

Separate processes run minutes apart and the H100's clocks drift between them (the same build
measured 3% apart in two calls); timing the builds in turns inside one process, over several
rounds, leaves that drift out of the comparison. Each build must come from its own copy of the
tree, compiled with FLASH_ATTN_AB_BUILD=1: otherwise the builds share one kernel registry (GNU
unique symbols bind it process-wide) and every "variant" runs the first build's kernels.

    FLASH_ATTN_AB_BUILD=1 FLASH_ATTN_HEADDIMS=128 FLASH_ATTN_DTYPES=bf16 \\
        FLASH_ATTN_DISABLE_BACKWARD=1 python setup.py build_ext --inplace   # in each copy
    python benchmarks/ab_builds.py base=/tmp/a/flash_attn/_C.cpython-312-x86_64-linux-gnu.so \\
        new=/tmp/b/flash_attn/_C.cpython-312-x86_64-linux-gnu.so \\
        --hdims 128 --seqlens 512,2048,8192 --causal both

Shapes follow the benchmark grid (16k tokens, at least one sequence; hidden 2048). Prints a
markdown table: the median TFLOP/s of each build over the rounds and each build's ratio to the
first. `--pass bwd` times the backward binding alone (its input: each build's own forward output
and lse), FLOPs as in benchmark_attn.py (2.5 x forward). FLASH_ATTN_FORCE_SM80=1 makes every build
run its SM80 forward.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import shutil
import statistics
import subprocess
from typing import Any, Callable

import torch


def has_unique_symbols(path: str) -> bool:
    """Whether the shared object exports GNU unique symbols of our own code, such as the
    kernel registry (built without FLASH_ATTN_AB_BUILD=1). A statically linked libstdc++ brings
    unique symbols of its own, which do not matter. Without readelf it cannot tell and says no.
    """
    readelf = shutil.which("readelf")
    if readelf is None:
        return False
    out = subprocess.run([readelf, "-W", "--dyn-syms", path], capture_output=True, text=True)
    return any(" UNIQUE " in line and "flash" in line for line in out.stdout.splitlines())


def load_build(name: str, path: str) -> Any:
    """Load one build's `_C` extension module from `path` under a name of its own, and return
    its kernels' ops (``torch.ops.<namespace>``; an A/B build registers them in a namespace of
    its own)."""
    loader = importlib.machinery.ExtensionFileLoader(f"ab_{name}._C", path)
    spec = importlib.util.spec_from_loader(f"ab_{name}._C", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return getattr(torch.ops, module.op_namespace)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("builds", nargs="+", metavar="NAME=PATH", help="a build's _C*.so (two or more)")
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--seqlens", default="512,2048,8192")
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument("--dtype", choices=["bf16", "fp16", "e4m3"], default="bf16",
                   help="e4m3: the forward on inputs cast from bf16, no descales")
    p.add_argument("--rounds", type=int, default=3, help="turns per build and shape")
    p.add_argument("--pass", dest="which", choices=["fwd", "bwd"], default="fwd")
    p.add_argument("--deterministic", action="store_true", help="bwd: deterministic=True")
    p.add_argument("--varlen", action="store_true",
                   help="the same sequences packed, through cu_seqlens (the band kernels)")
    p.add_argument("--gqa", type=int, default=1,
                   help="query heads per K/V head (K and V get heads / GQA heads)")
    p.add_argument("--alibi", action="store_true",
                   help="ALiBi slopes 2^(-8 (h + 1) / heads) per head, as in the ALiBi paper")
    return p.parse_args(argv)


def make_call(ext: Any, which: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool, deterministic: bool = False,
              alibi_slopes: torch.Tensor | None = None,
              varlen: bool = False) -> Callable[[], object]:
    """The timed call: the forward binding, or the backward binding on this build's own
    forward output. q, k, v: (batch, seqlen, nheads, headdim); alibi_slopes: (nheads,) fp32;
    varlen: the batch's sequences packed to (batch * seqlen, nheads, headdim), with cu_seqlens."""
    batch, s, d = q.shape[0], q.shape[1], q.shape[-1]
    cu = None
    if varlen:
        q, k, v = (t.reshape(batch * s, *t.shape[2:]) for t in (q, k, v))
        cu = torch.arange(0, (batch + 1) * s, s, device=q.device, dtype=torch.int32)

    def fwd() -> list[torch.Tensor]:
        return ext.fwd(q, k, v, cu, cu, None, s, s, d ** -0.5, causal, -1, -1, 0.0,
                       alibi_slopes=alibi_slopes)

    if which == "fwd":
        return fwd
    out, lse = fwd()[:2]
    dout = torch.randn_like(out)

    def bwd() -> list[torch.Tensor]:
        return ext.bwd(dout, q, k, v, out, lse, cu, cu, s, s, d ** -0.5, causal, -1, -1,
                       0.0, deterministic, alibi_slopes=alibi_slopes)

    return bwd


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from triton.testing import do_bench  # on the GPU machine only

    builds = {}
    for spec in args.builds:
        name, sep, path = spec.partition("=")
        if not sep or not name or name in builds:
            raise SystemExit(f"ab_builds: {spec!r}: expected NAME=PATH with a name not used before")
        if len(args.builds) > 1 and has_unique_symbols(path):
            raise SystemExit(f"ab_builds: {path} has GNU unique symbols: rebuild it with "
                             "FLASH_ATTN_AB_BUILD=1, else every build runs the first one's kernels")
        builds[name] = load_build(name, path)
    names = list(builds)
    if args.dtype == "e4m3" and args.which != "fwd":
        raise SystemExit("ab_builds: e4m3 has a forward only")
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]

    print("| hdim | seqlen | causal | " + " | ".join(names) + " | "
          + " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " |")
    print("|---" * (3 + 2 * len(names) - 1) + "|")
    for d in (int(x) for x in args.hdims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            batch, heads = max(1, 16384 // s), 2048 // d
            if heads % args.gqa:
                raise SystemExit(f"ab_builds: --gqa {args.gqa} does not divide {heads} heads")
            q = torch.randn(batch, s, heads, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(batch, s, heads // args.gqa, d, device="cuda", dtype=dtype)
                    for _ in range(2))
            if args.dtype == "e4m3":
                q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            slopes = None
            if args.alibi:
                slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)],
                                      device="cuda", dtype=torch.float32)
            for causal in causals:
                flops = 4 * batch * heads * s * s * d / (2 if causal else 1)
                if args.which == "bwd":
                    flops *= 2.5
                calls = {n: make_call(ext, args.which, q, k, v, causal, args.deterministic, slopes,
                                      args.varlen)
                         for n, ext in builds.items()}
                tflops: dict[str, list[float]] = {n: [] for n in names}
                for _ in range(args.rounds):
                    for n, call in calls.items():
                        ms = do_bench(call, warmup=25, rep=100, return_mode="median")
                        tflops[n].append(flops / ms / 1e9)
                med = {n: statistics.median(x) for n, x in tflops.items()}
                print(f"| {d} | {s} | {'yes' if causal else 'no'} | "
                      + " | ".join(f"{med[n]:.0f}" for n in names) + " | "
                      + " | ".join(f"{med[n] / med[names[0]]:.3f}" for n in names[1:]) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
