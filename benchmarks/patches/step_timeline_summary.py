#!/usr/bin/env python3
"""Summarises the "TL cta group step t0 ... tK" lines that bwd_step_timeline.patch (ours) and
fa3_step_timeline.py (FlashAttention-3) make a backward print: per phase (from one stamp to the
next) the median and range in SM cycles, the step time (start to start) and how far apart the
two warp groups start their steps. Lines after a "RUN <name>" line are summarised under that
name. Usage: python step_timeline_summary.py LOG [LOG ...]"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

Row = Tuple[int, int, int, List[int]]


def read(paths: List[str]) -> Dict[str, List[Row]]:
    runs: Dict[str, List[Row]] = defaultdict(list)
    for path in paths:
        name = path
        with open(path) as f:
            for line in f:
                fields = line.split()
                if fields[:1] == ["RUN"]:
                    name = f"{path}: {' '.join(fields[1:])}"
                elif fields[:1] == ["TL"]:
                    cta, group, step = (int(x) for x in fields[1:4])
                    runs[name].append((cta, group, step, [int(x) for x in fields[4:]]))
    return runs


def summarise(name: str, rows: List[Row]) -> None:
    print(f"{name}: {len(rows)} steps")
    points = len(rows[0][3])
    for i in range(points - 1):
        d = [ts[i + 1] - ts[i] for _, _, _, ts in rows]
        print(f"  t{i} -> t{i + 1}: median {statistics.median(d):7.0f}  "
              f"range {min(d)}-{max(d)}")
    by_key: Dict[Tuple[int, int], Dict[int, List[int]]] = defaultdict(dict)
    for cta, group, step, ts in rows:
        by_key[(cta, group)][step] = ts
    steps = [d[t + 1][0] - d[t][0] for d in by_key.values() for t in d if t + 1 in d]
    if steps:
        print(f"  step, start to start: median {statistics.median(steps):.0f}  "
              f"range {min(steps)}-{max(steps)}")
    offsets = [by_key[(cta, 1)][t][0] - d[t][0] for (cta, group), d in by_key.items()
               if group == 0 and (cta, 1) in by_key for t in d if t in by_key[(cta, 1)]]
    if offsets:
        print(f"  group 1 starts after group 0 by: median {statistics.median(offsets):.0f}")


def main(argv: List[str]) -> int:
    for name, rows in read(argv[1:]).items():
        summarise(name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
