#!/usr/bin/env python3
"""The SASS lines where a kernel's warps stall most, from Nsight Compute's source page.

    ncu -k regex:flash_bwd_sm90_kernel -c 1 --clock-control none --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass --csv \\
        python benchmarks/profile_kernels.py --hdim 128 --seqlen 8192 --iters 1 > src.csv
    python benchmarks/ncu_source_top.py src.csv 40

Prints each line's share of all warp stall samples, its address and instruction, highest
first (the CSV holds thousands of lines; the few at the top say where a step waits).
"""

from __future__ import annotations

import csv
import sys
from typing import List


def _value(row: List[str], col: int) -> float:
    try:
        return float(row[col].replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, errors="replace") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling" in c for c in r))
    header = rows[head]
    body = [r for r in rows[head + 1:] if len(r) == len(header)]
    samples = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
    source = next((i for i, c in enumerate(header) if c.strip() == "Source"), 1)
    address = next((i for i, c in enumerate(header) if "Address" in c), 0)
    total = sum(_value(r, samples) for r in body) or 1.0
    print(f"{len(body)} SASS lines, {total:.0f} stall samples")
    for r in sorted(body, key=lambda r: _value(r, samples), reverse=True)[:top]:
        print(f"{100 * _value(r, samples) / total:5.1f}%  {r[address]}  {r[source][:110]}")


if __name__ == "__main__":
    main()
