"""Ring attention throughput per GPU against one GPU running the same shard length alone.

For a total sequence of S tokens on N GPUs (zigzag shards of S / N), the per-GPU throughput is
attention's FLOPs over the full sequence / time / N; the baseline is flash_attn_func on one GPU
at S / N tokens. Issue 31's bar: 128k tokens on 4 GPUs >= 0.9 of one GPU at 32k (d128, causal).

Timing: CUDA events around ``--iters`` back-to-back calls after a warm-up, the ranks lined up by a
barrier first; a ring time is the slowest rank's. The NCCL transfers are not captured in CUDA
graphs, so the one-GPU baseline is timed the same way (at these sizes a call takes milliseconds,
far above launch overhead).

    python benchmarks/benchmark_ring.py --world 2 --seqlens 65536 --causal both

``--trace DIR`` also records one fwd+bwd call per rank with torch.profiler after the timing
(DIR/ring_{seqlen}_{causal}_rank{r}.json, Chrome trace format; the one-GPU baseline's in
DIR/single_{seqlen}_{causal}.json) and prints rank 0's kernels by device time;
``--env NCCL_X=Y`` sets NCCL variables in the ranks, for an A/B of NCCL settings.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor


def _flops(seqlen: int, nheads: int, hdim: int, causal: bool, what: str) -> float:
    pairs = seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen
    fwd = 4.0 * nheads * hdim * pairs
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[what]


def _time(fn: Callable[[], None], iters: int,
          barrier: Optional[Callable[[], None]] = None) -> float:
    """Seconds per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _runs(q: Tensor, k: Tensor, v: Tensor, call: Callable[..., Tensor],
          causal: bool) -> Dict[str, Callable[[], None]]:
    """fwd and fwd+bwd closures for ``call(q, k, v, causal) -> out``."""
    dout = torch.randn_like(q)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def fwd() -> None:
        with torch.no_grad():
            call(q, k, v, causal)

    def fwd_bwd() -> None:
        out = call(*leaves, causal)
        torch.autograd.grad(out, leaves, dout)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _inputs(seqlen: int, nheads: int, hdim: int, device: str) -> List[Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, seqlen, nheads, hdim, generator=g, device=device,
                        dtype=torch.bfloat16) for _ in range(3)]


def _breakdown(q: Tensor, k: Tensor, v: Tensor, seqlen: int, iters: int) -> Dict:
    """One non-causal ring step taken apart, on this rank, slowest rank of each: the forward's
    K/V exchange alone, its kernel alone and both at once as a ring step issues them; the same
    for the backward, whose step also sends the fp32 dK/dV accumulators."""
    import flash_attn.ring_attention as ring_attention
    from flash_attn import ops

    world, rank = dist.get_world_size(), dist.get_rank()
    scale = q.shape[-1] ** -0.5
    kv = torch.stack([k, v])
    dkv = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)
    bufs = {id(x): torch.empty_like(x) for x in (kv, dkv)}
    out, lse = ops.flash_attn_fwd(q, k, v, None, None, None, q.shape[1], k.shape[1], scale,
                                  False, -1, -1, 0.0)
    dout = torch.randn_like(out)

    def exchange(*xs: Tensor) -> list:
        ops_ = []
        for x in xs:
            ops_ += [dist.P2POp(dist.isend, x, (rank + 1) % world),
                     dist.P2POp(dist.irecv, bufs[id(x)], (rank - 1) % world)]
        return dist.batch_isend_irecv(ops_)

    def wait(reqs: list) -> None:
        for r in reqs:
            r.wait()

    def fwd_kernel() -> None:
        ops.flash_attn_fwd(q, k, v, None, None, None, q.shape[1], k.shape[1], scale, False,
                           -1, -1, 0.0, sm_margin=ring_attention._SM_MARGIN)

    def bwd_kernel() -> None:
        ops.flash_attn_bwd(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], scale,
                           False, -1, -1, 0.0, False)

    def overlapped(kernel: Callable[[], None], *xs: Tensor) -> Callable[[], None]:
        def step() -> None:
            reqs = exchange(*xs)
            kernel()
            wait(reqs)
        return step

    steps = {
        "xfer": lambda: wait(exchange(kv)),
        "kernel": fwd_kernel,
        "both": overlapped(fwd_kernel, kv),
        "bwd_xfer": lambda: wait(exchange(kv, dkv)),
        "bwd_kernel": bwd_kernel,
        "bwd_both": overlapped(bwd_kernel, kv, dkv),
    }
    row = {"seqlen": seqlen, "breakdown": True, "bytes": kv.numel() * kv.element_size(),
           "bwd_bytes": kv.numel() * kv.element_size() + dkv.numel() * dkv.element_size()}
    for name, fn in steps.items():
        t = torch.tensor([_time(fn, iters, dist.barrier)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row[name] = t.item()
    return row


def _trace(fn: Callable[[], None], path: str, table: bool,
           barrier: Optional[Callable[[], None]] = dist.barrier) -> None:
    """One call of ``fn`` under torch.profiler, written to ``path``; ``table``: print its
    operators and kernels by self device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    if table:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))


def _worker(rank: int, world: int, init_file: str, out_file: str,
            args: argparse.Namespace) -> None:
    from flash_attn import ring_flash_attn_func

    for kv in args.env:
        key, _, value = kv.partition("=")
        os.environ[key] = value
    torch.cuda.set_device(rank)
    import flash_attn.ring_attention as ring_attention

    ring_attention._TRANSPORT = args.transport
    if args.sm_margin is not None:
        ring_attention._SM_MARGIN = args.sm_margin
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    rows: List[Dict] = []
    for seqlen in args.seqlens:
        for causal in args.causal:
            q, k, v = _inputs(seqlen // world, args.nheads, args.hdim, "cuda")
            for what, fn in _runs(q, k, v, lambda a, b, c, cz: ring_flash_attn_func(
                    a, b, c, causal=cz, zigzag=True), causal).items():
                t = torch.tensor([_time(fn, args.iters, dist.barrier)], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows.append({"seqlen": seqlen, "causal": causal, "what": what,
                             "seconds": t.item()})
                if args.trace and what == "fwd+bwd":
                    os.makedirs(args.trace, exist_ok=True)
                    name = f"ring_{seqlen}_{causal}_rank{rank}.json"
                    _trace(fn, os.path.join(args.trace, name), rank == 0)
            if args.breakdown and not causal:
                rows.append(_breakdown(q, k, v, seqlen, args.iters))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[65536], help="total tokens over all GPUs")
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", choices=["true", "false", "both"], default="true")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sm-margin", type=int, default=None,
                   help="SMs the forward leaves to NCCL during a transfer (default: the "
                        "module's _SM_MARGIN), for an A/B")
    p.add_argument("--breakdown", action="store_true",
                   help="also time one non-causal ring step's exchange and kernel, alone and "
                        "together, forward and backward (the exchange by NCCL whatever "
                        "--transport says)")
    p.add_argument("--transport", choices=["nccl", "copy_engine"], default="nccl",
                   help="how K/V and dK/dV go round the ring (flash_attn.ring_attention)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="record one fwd+bwd call per rank with torch.profiler into DIR")
    p.add_argument("--env", action="append", default=[], metavar="NCCL_X=Y",
                   help="an environment variable for the ranks (repeatable)")
    args = p.parse_args()
    args.causal = {"true": [True], "false": [False], "both": [True, False]}[args.causal]

    from flash_attn import flash_attn_func

    single = {}
    for seqlen in args.seqlens:
        for causal in args.causal:
            q, k, v = _inputs(seqlen // args.world, args.nheads, args.hdim, "cuda")
            for what, fn in _runs(q, k, v, lambda a, b, c, cz: flash_attn_func(
                    a, b, c, causal=cz), causal).items():
                single[(seqlen, causal, what)] = _time(fn, args.iters)
                if args.trace and what == "fwd+bwd":
                    os.makedirs(args.trace, exist_ok=True)
                    _trace(fn, os.path.join(args.trace, f"single_{seqlen}_{causal}.json"),
                           False, None)
            del q, k, v
    torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory() as d:
        out_file = os.path.join(d, "rows.json")
        mp.start_processes(_worker, args=(args.world, os.path.join(d, "init"), out_file, args),
                           nprocs=args.world, join=True, start_method="spawn")
        with open(out_file) as f:
            rows = json.load(f)

    name = torch.cuda.get_device_name()
    print(f"Ring attention, {args.world} x {name}, bf16, batch 1, {args.nheads} heads, "
          f"d{args.hdim}, zigzag, transfers by {args.transport}; one-GPU baseline at "
          f"seqlen / {args.world}")
    print()
    print("| total seqlen | causal | pass | ring ms | ring TFLOP/s per GPU | 1 GPU at seqlen/N ms "
          "| 1 GPU TFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in (r for r in rows if "breakdown" not in r):
        s, c, what, t = r["seqlen"], r["causal"], r["what"], r["seconds"]
        per_gpu = _flops(s, args.nheads, args.hdim, c, what) / t / args.world / 1e12
        t1 = single[(s, c, what)]
        one = _flops(s // args.world, args.nheads, args.hdim, c, what) / t1 / 1e12
        print(f"| {s} | {c} | {what} | {t * 1e3:.2f} | {per_gpu:.0f} | {t1 * 1e3:.2f} | "
              f"{one:.0f} | {per_gpu / one:.2f} |")
    parts = [r for r in rows if "breakdown" in r]
    if parts:
        print()
        print("One non-causal ring step (slowest rank): the exchange alone, the kernel alone, "
              "both (the backward's exchange also sends the fp32 dK/dV accumulators)")
        print()
        print("| total seqlen | pass | exchange MB | exchange ms | GB/s | kernel ms | both ms |")
        print("|---|---|---|---|---|---|---|")
        for r in parts:
            for what, pre, nbytes in (("fwd", "", r["bytes"]), ("bwd", "bwd_", r["bwd_bytes"])):
                x, kern, both = r[pre + "xfer"], r[pre + "kernel"], r[pre + "both"]
                print(f"| {r['seqlen']} | {what} | {nbytes / 1e6:.0f} | {x * 1e3:.2f} | "
                      f"{nbytes / x / 1e9:.0f} | {kern * 1e3:.2f} | {both * 1e3:.2f} |")


if __name__ == "__main__":
    main()
