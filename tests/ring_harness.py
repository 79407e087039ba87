"""The multi-process harness of the ring-attention tests (CPU over gloo, GPUs over NCCL): every
rank runs every case and writes "ok" or the traceback per case to a file, which the tests read
back per case after the processes end."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_attn import zigzag_shard_varlen, zigzag_unshard_varlen


def run_cases(rank: int, out_dir: str, names: Sequence[str], run_case: Callable[[str], None],
              after_case: Callable[[], None] = lambda: None) -> None:
    """In a rank's process (its group initialized): run each case, record the outcome, and
    destroy the group at the end."""
    results: Dict[str, str] = {}
    try:
        for name in names:
            try:
                run_case(name)
                after_case()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            # A failing case on one rank must not leave the others mid-ring for the next one.
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def spawn_ranks(worker: Callable, world: int, out_dir: Path) -> List[Dict[str, str]]:
    """Run ``worker(rank, world, init_file, out_dir)`` in ``world`` spawned processes; returns
    each rank's results."""
    mp.start_processes(worker, args=(world, str(out_dir / "init"), str(out_dir)), nprocs=world,
                       join=True, start_method="spawn")
    results = []
    for r in range(world):
        with open(out_dir / f"rank{r}.json") as f:
            results.append(json.load(f))
    return results


def assert_case_ok(results: List[Dict[str, str]], name: str) -> None:
    failures = {r: res.get(name, "not run") for r, res in enumerate(results)
                if res.get(name) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


def shard_varlen(x: torch.Tensor, cu: torch.Tensor, world: int, rank: int,
                 zigzag: bool) -> torch.Tensor:
    """This rank's rows of packed sequences ``x`` (cu_seqlens ``cu``): zigzag chunks, or each
    sequence's contiguous 1/world."""
    if zigzag:
        x_local, cu_local = zigzag_shard_varlen(x, cu)
        assert torch.equal(cu_local, torch.div(cu, world, rounding_mode="floor").to(cu.dtype))
        return x_local
    bounds = cu.tolist()
    return torch.cat([x[a + rank * (b - a) // world:a + (rank + 1) * (b - a) // world]
                      for a, b in zip(bounds, bounds[1:])])


def unshard_varlen(x: torch.Tensor, cu_local: torch.Tensor, world: int,
                   zigzag: bool) -> torch.Tensor:
    """The inverse of shard_varlen, on every rank (``cu_local``: the shards' cu_seqlens)."""
    if zigzag:
        return zigzag_unshard_varlen(x, cu_local)
    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x.contiguous())
    bounds = cu_local.tolist()
    return torch.cat([p[a:b] for a, b in zip(bounds, bounds[1:]) for p in every])
