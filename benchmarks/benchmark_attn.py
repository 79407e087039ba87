#!/usr/bin/env python3
"""Attention benchmark: ours (flash_attn_func) against PyTorch SDPA's FlashAttention-2 and cuDNN
backends, in one process, on the same tensors, with the peers' FA3 / FA4 numbers from
benchmarks/anchors.json alongside.

Grid (the FlashAttention papers', see ../shared/anchors/README.md): q, k, v of shape
(batch, seqlen, heads, hdim), 16k tokens per call (batch = 16384 / seqlen), hidden 2048
(heads = 2048 / hdim), hdim in {64, 128, 256}, seqlen in {512, ..., 16384}, causal or not, bf16.
FLOPs: forward = 4 * batch * heads * seqlen^2 * hdim, halved when causal; backward = 2.5 x forward.
Time: median of triton.testing.do_bench (L2 flushed before every repetition; CUDA events if
triton is missing). The forward is captured once in a CUDA graph per backend and the replays are
timed (--fwd-timing graph, the default), so every backend's number is GPU time: with the L2
flush between repetitions, eager timing adds whatever host time (Python dispatch, argument
checks) exceeds the flush, which dominates short sequences and varies from run to run.
`--fwd-timing eager` times plain calls with autograd on. The backward is timed alone, eagerly:
torch.autograd.grad on a retained graph.
The SDPA backends get the same tensors as views q.transpose(1, 2). `--fa3 PATH` adds
FlashAttention-3 measured live in this process (the library ../shared/peers/build_fa3.sh builds):
its forward op, and for the backward its backward op on that forward's output and lse, and an
"ours / best peer" column (the fastest of the measured peers, forward and backward each).

Examples:
    python benchmarks/benchmark_attn.py --quick
    python benchmarks/benchmark_attn.py --json out.json --markdown out.md
    python benchmarks/benchmark_attn.py --hdims 128 --seqlens 2048,16384 --causal 1 --no-bwd
    python benchmarks/benchmark_attn.py --fa3 build/peers/fa3/hopper/flash_attn_3/_C.abi3.so
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_BACKENDS = ("ours", "sdpa-flash", "sdpa-cudnn")
ANCHOR_BACKENDS = ("fa3", "fa4")
QUICK_SHAPES = (
    [(d, s, c) for d in (64, 128) for s in (2048, 8192) for c in (False, True)]
    + [(256, 2048, False)]
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Numbers go into benchmarks/RESULTS.md only after they were measured on the device.",
    )
    p.add_argument("--quick", action="store_true",
                   help="subset (~1 min on an H100): hdim 64/128 x seqlen 2048/8192 x causal "
                        "both, plus hdim 256 seqlen 2048 non-causal; overrides --hdims/--seqlens/"
                        "--causal")
    p.add_argument("--hdims", default="64,128,256", help="comma list (default 64,128,256)")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384",
                   help="comma list (default 512,...,16384)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--no-bwd", action="store_true", help="forward only")
    p.add_argument("--backends", default=",".join(ALL_BACKENDS),
                   help=f"comma list from {','.join(ALL_BACKENDS)} (default all)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per call (default 16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * hdim (default 2048)")
    p.add_argument("--fwd-timing", choices=("graph", "eager"), default="graph",
                   help="forward timing: CUDA-graph replays (GPU time, default) or eager calls")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench rep, ms (default 100)")
    p.add_argument("--anchors", default=os.path.join(HERE, "anchors.json"),
                   help="peer numbers (default benchmarks/anchors.json)")
    p.add_argument("--no-ceilings", action="store_true",
                   help="skip measuring the bf16 matmul and device-copy ceilings")
    p.add_argument("--json", metavar="PATH", help="write all rows and metadata as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the final table as markdown")
    p.add_argument("--fa3", metavar="PATH",
                   help="FlashAttention-3's extension library: adds the live 'fa3' backend")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.fa3 and "fa3" not in args.backends:
        args.backends.append("fa3")
    bad = [b for b in args.backends if b not in ALL_BACKENDS + ("fa3",) or
           (b == "fa3" and not args.fa3)]
    if bad:
        p.error(f"unknown backend(s) {bad}; choose from {ALL_BACKENDS} (fa3: with --fa3)")
    if "ours" not in args.backends:
        print("note: 'ours' not in --backends: ratios and output checks are left out",
              file=sys.stderr)
    try:
        hdims = [int(x) for x in args.hdims.split(",") if x.strip()]
        seqlens = [int(x) for x in args.seqlens.split(",") if x.strip()]
    except ValueError as e:
        p.error(f"--hdims / --seqlens must be comma lists of ints ({e})")
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    if args.quick:
        args.shapes = list(QUICK_SHAPES)
    else:
        args.shapes = [(d, s, c) for d in hdims for s in seqlens for c in causals]
    return args


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _bench_events(fn: Callable, warmup_ms: float, rep_ms: float) -> float:
    """Fallback for triton.testing.do_bench: CUDA events, L2 flushed before each repetition,
    median in ms."""
    import torch

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(5, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def make_timer():
    try:
        from triton.testing import do_bench
    except ImportError:
        return "cuda-events (triton missing)", _bench_events

    def timer(fn, warmup_ms, rep_ms):
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return "triton.testing.do_bench(return_mode='median')", timer


# ---------------------------------------------------------------------------------------------
# Backends: each returns f(q, k, v) -> out in (batch, seqlen, heads, hdim) layout
# ---------------------------------------------------------------------------------------------


def import_flash_attn():
    """The installed flash_attn; failing that, the one in this checkout (editable layout)."""
    try:
        import flash_attn
    except ImportError:
        sys.path.insert(0, os.path.dirname(HERE))
        import flash_attn
    return flash_attn


def _fa3_fn(ops, causal: bool):
    """FlashAttention-3's forward and backward ops (torch.ops.flash_attn_3, no autograd of their
    own) as one differentiable call, so that it is timed like the other backends."""
    import torch

    class Fa3(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse, *_ = ops.fwd(q, k, v, is_causal=causal)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            ops.bwd(dout.contiguous(), q, k, v, out, lse, dq, dk, dv, is_causal=causal)
            return dq, dk, dv

    return Fa3.apply


_FA3_OPS = None


def backend_fn(name: str, causal: bool):
    import torch.nn.functional as F

    if name == "ours":
        flash_attn_func = import_flash_attn().flash_attn_func

        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)
    if name == "fa3":
        return _fa3_fn(_FA3_OPS, causal)

    def sdpa(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    return sdpa


def backend_context(name: str):
    """The SDPA backends run under torch.nn.attention.sdpa_kernel (forward and backward)."""
    import contextlib

    if name in ("ours", "fa3"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"sdpa-flash": SDPBackend.FLASH_ATTENTION,
                        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[name])


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:160] if msg else ''}"


# ---------------------------------------------------------------------------------------------
# Ceilings and anchors
# ---------------------------------------------------------------------------------------------


def measure_ceilings(timer, dtype) -> Dict[str, float]:
    import torch

    n = 8192
    a = torch.randn(n, n, dtype=dtype, device="cuda")
    b = torch.randn(n, n, dtype=dtype, device="cuda")
    ms = timer(lambda: torch.mm(a, b), 25, 200)
    matmul = 2 * n ** 3 / (ms * 1e-3) / 1e12
    del a, b
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), 25, 200)
    copy = 2 * src.numel() / (ms * 1e-3) / 1e12  # bytes read + written
    del src, dst
    torch.cuda.empty_cache()
    return {"matmul_tflops": round(matmul, 1), "copy_tbps": round(copy, 3)}


def load_anchors(path: str):
    """{(backend, hdim, seqlen, causal): row} for the fa3 / fa4 rows, plus the file's notes."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"note: no anchors ({_short(e)})", file=sys.stderr)
        return {}, None
    rows = {}
    for r in data.get("rows", []):
        if r.get("backend") in ANCHOR_BACKENDS:
            rows[(r["backend"], int(r["hdim"]), int(r["seqlen"]), bool(r["causal"]))] = r
    return rows, data.get("notes")


# ---------------------------------------------------------------------------------------------
# One shape
# ---------------------------------------------------------------------------------------------


def run_shape(hdim, seqlen, causal, args, timer, dtype) -> List[dict]:
    import torch

    batch = max(1, args.tokens // seqlen)
    heads = max(1, args.hidden // hdim)
    flops_fwd = 4.0 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)
    flops_bwd = 2.5 * flops_fwd
    base = dict(hdim=hdim, seqlen=seqlen, causal=causal, batch=batch, heads=heads,
                dtype=args.dtype)
    rows = []
    try:
        torch.manual_seed(0)
        shape = (batch, seqlen, heads, hdim)
        q, k, v = (torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(shape, dtype=dtype, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return [dict(base, backend=b, error=f"OOM allocating inputs: {_short(e)}")
                for b in args.backends]

    out_ours = None
    # ours first, so that the others' outputs can be compared with it
    order = sorted(args.backends, key=lambda b: b != "ours")
    for name in order:
        row = dict(base, backend=name, fwd_ms=None, bwd_ms=None, fwd_tflops=None,
                   bwd_tflops=None, relerr_vs_ours=None, error=None)
        rows.append(row)
        fn = backend_fn(name, causal)
        out = None
        try:
            with backend_context(name):
                with torch.no_grad():
                    check = fn(q, k, v)
                if name == "ours":
                    out_ours = check.float()
                elif out_ours is not None:
                    diff = (check.float() - out_ours).norm() / out_ours.norm().clamp_min(1e-30)
                    row["relerr_vs_ours"] = float(diff)
                del check

                def fwd():  # grad enabled: the forward of a training step
                    fn(q, k, v)

                if args.fwd_timing == "graph":
                    graph = torch.cuda.CUDAGraph()
                    with torch.no_grad(), torch.cuda.graph(graph):
                        fn(q, k, v)
                    ms = timer(graph.replay, args.warmup, args.rep)
                    del graph
                else:
                    ms = timer(fwd, args.warmup, args.rep)
                row["fwd_ms"], row["fwd_tflops"] = ms, flops_fwd / (ms * 1e-3) / 1e12
                if not args.no_bwd:
                    out = fn(q, k, v)

                    def bwd():
                        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                    ms = timer(bwd, args.warmup, args.rep)
                    row["bwd_ms"], row["bwd_tflops"] = ms, flops_bwd / (ms * 1e-3) / 1e12
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"OOM: {_short(e)}"
        except Exception as e:  # a backend that does not support this shape: n/a, go on
            row["error"] = _short(e)
        finally:
            out = None  # noqa: F841  (drop the retained graph)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        print(_progress_line(row), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _f(x, fmt="{:.0f}"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _pair(a, b, fmt="{:.0f}"):
    return f"{_f(a, fmt)} / {_f(b, fmt)}"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _progress_line(r):
    shape = f"hdim {r['hdim']:3d} seqlen {r['seqlen']:5d} {'causal' if r['causal'] else 'full  '}"
    if r.get("error"):
        return f"{shape} {r['backend']:>10}: n/a ({r['error']})"
    err = "" if r.get("relerr_vs_ours") is None else f"  relerr vs ours {r['relerr_vs_ours']:.2e}"
    bwd = "" if r["bwd_ms"] is None else (f"  bwd {r['bwd_ms']:8.3f} ms "
                                         f"{r['bwd_tflops']:6.1f} TFLOP/s")
    return (f"{shape} {r['backend']:>10}: fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} "
            f"TFLOP/s{bwd}{err}")


def build_table(rows: List[dict], anchors, args) -> str:
    by_shape: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        by_shape.setdefault((r["hdim"], r["seqlen"], r["causal"]), {})[r["backend"]] = r
    use_anchors = args.dtype == "bf16" and args.tokens == 16384 and args.hidden == 2048
    cols = ["hdim", "seqlen", "causal"]
    names = {"ours": "ours", "sdpa-flash": "FA2 (sdpa-flash)", "sdpa-cudnn": "cuDNN (sdpa)",
             "fa3": "FA3 (live)"}
    peers = [b for b in args.backends if b != "ours"]
    for b in args.backends:
        cols.append(f"{names[b]} fwd / bwd")
    if "ours" in args.backends:
        for b in args.backends:
            if b != "ours":
                cols.append(f"ours / {names[b].split(' ')[0]}")
        if len(peers) > 1:
            cols.append("ours / best peer")
    if use_anchors:
        cols += ["FA3* fwd / bwd", "FA4* fwd / bwd"]
        if "ours" in args.backends:
            cols.append("ours / FA3*")
    cols.append("max relerr vs ours")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def tf(r, key):
        return None if r is None or r.get("error") else r.get(key)

    for (d, s, c), per in sorted(by_shape.items()):
        cells = [str(d), str(s), "yes" if c else "no"]
        for b in args.backends:
            r = per.get(b)
            cells.append(_pair(tf(r, "fwd_tflops"), tf(r, "bwd_tflops")))
        ours = per.get("ours")
        if "ours" in args.backends:
            for b in args.backends:
                if b == "ours":
                    continue
                r = per.get(b)
                cells.append(_pair(_ratio(tf(ours, "fwd_tflops"), tf(r, "fwd_tflops")),
                                   _ratio(tf(ours, "bwd_tflops"), tf(r, "bwd_tflops")), "{:.2f}"))
            if len(peers) > 1:
                best = [max((x for x in (tf(per.get(b), key) for b in peers) if x is not None),
                            default=None) for key in ("fwd_tflops", "bwd_tflops")]
                cells.append(_pair(_ratio(tf(ours, "fwd_tflops"), best[0]),
                                   _ratio(tf(ours, "bwd_tflops"), best[1]), "{:.2f}"))
        if use_anchors:
            fa3, fa4 = anchors.get(("fa3", d, s, c)), anchors.get(("fa4", d, s, c))
            batch, heads = args.tokens // s, args.hidden // d
            fa3 = fa3 if fa3 and (fa3["batch"], fa3["heads"]) == (batch, heads) else None
            fa4 = fa4 if fa4 and (fa4["batch"], fa4["heads"]) == (batch, heads) else None
            cells.append(_pair(tf(fa3, "fwd_tflops"), tf(fa3, "bwd_tflops")))
            cells.append(_pair(tf(fa4, "fwd_tflops"), tf(fa4, "bwd_tflops")))
            if "ours" in args.backends:
                cells.append(_pair(_ratio(tf(ours, "fwd_tflops"), tf(fa3, "fwd_tflops")),
                                   _ratio(tf(ours, "bwd_tflops"), tf(fa3, "bwd_tflops")),
                                   "{:.2f}"))
        errs = [r["relerr_vs_ours"] for r in per.values() if r.get("relerr_vs_ours") is not None]
        cells.append(_f(max(errs) if errs else None, "{:.1e}"))
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["TFLOP/s, median of do_bench; ratios > 1 mean ours is faster."]
    if use_anchors:
        notes.append("* FA3 / FA4: peer numbers from benchmarks/anchors.json (H100 80GB HBM3, "
                     "2026-11-21), not measured in this run.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def environment(timer_name, ceilings, args) -> dict:
    import torch

    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "timer": timer_name,
        "fwd_timing": args.fwd_timing,
        "warmup_ms": args.warmup,
        "rep_ms": args.rep,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "FLASH_ATTN_FORCE_SM80": os.environ.get("FLASH_ATTN_FORCE_SM80"),
        "ceilings": ceilings,
        "argv": sys.argv[1:],
    }
    try:
        flash_attn = import_flash_attn()
        meta["flash_attn"] = getattr(flash_attn, "__version__", None)
        info = flash_attn.build_info()
        meta["flash_attn_build"] = {k: info[k] for k in ("archs", "cuda", "cutlass") if k in info}
    except Exception as e:  # the benchmark still runs the SDPA backends without it
        meta["flash_attn"] = f"unavailable ({_short(e)})"
    try:
        meta["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
        meta["git_dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True,
            timeout=10).stdout.strip())
    except Exception:
        meta["git_commit"] = None
    return meta


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    timer_name, timer = make_timer()
    anchors, _notes = load_anchors(args.anchors)
    if args.fa3:
        global _FA3_OPS
        torch.ops.load_library(args.fa3)
        _FA3_OPS = torch.ops.flash_attn_3
    ceilings = None
    if not args.no_ceilings:
        ceilings = measure_ceilings(timer, dtype)
        print(f"ceilings: {args.dtype} matmul 8192^3 {ceilings['matmul_tflops']} TFLOP/s, "
              f"device copy 2 GiB {ceilings['copy_tbps']} TB/s (read + write)", flush=True)
    meta = environment(timer_name, ceilings, args)
    print(f"{meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
          f"flash_attn {meta.get('flash_attn')}, timer {timer_name}", flush=True)

    rows: List[dict] = []
    for hdim, seqlen, causal in args.shapes:
        rows += run_shape(hdim, seqlen, causal, args, timer, dtype)

    table = build_table(rows, anchors, args)
    print()
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if args.markdown:
        head = (f"{meta['date_utc']} UTC, {meta['device']}, torch {meta['torch']}, "
                f"cuDNN {meta['cudnn']}, flash_attn {meta.get('flash_attn')}, commit "
                f"{meta.get('git_commit')}{' (dirty)' if meta.get('git_dirty') else ''}, "
                f"{args.dtype}, {args.tokens} tokens, hidden {args.hidden}.")
        if ceilings:
            head += (f" Ceilings this run: matmul {ceilings['matmul_tflops']} TFLOP/s, copy "
                     f"{ceilings['copy_tbps']} TB/s.")
        with open(args.markdown, "w") as f:
            f.write(head + "\n\n" + table)
        print(f"wrote {args.markdown}")
    failed = [r for r in rows if r.get("error") and r["backend"] == "ours"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
