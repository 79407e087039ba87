"""``python -m flash_attn``: print what was built (or why nothing was)."""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any, Dict, List

from flash_attn.build_info import build_info

_DTYPE_ORDER = ("fp16", "bf16")


def format_build_info(info: Dict[str, Any]) -> str:
    lines: List[str] = []
    lines.append(f"flash_attn {info.get('flash_attn')}")
    lines.append(
        f"torch {info.get('torch')} (CUDA {info.get('torch_cuda') or 'none'}; "
        f"GPU available: {'yes' if info.get('cuda_available') else 'no'})"
    )
    if not info.get("available"):
        lines.append("CUDA extension: not available")
        lines.append(f"  reason: {info.get('reason', 'unknown')}")
        lines.append("CPU tensors run the PyTorch reference implementation.")
        return "\n".join(lines)

    lines.append(
        f"CUDA extension: built with CUDA {info.get('cuda', '?')}, "
        f"CUTLASS {info.get('cutlass', '?')}"
    )
    archs = info.get("archs") or []
    lines.append("kernel code paths: " + (", ".join(f"sm_{a}" for a in archs) if archs else "none"))
    sass = info.get("sass_archs")
    if sass:
        lines.append("SASS targets: " + ", ".join(f"sm_{a}" for a in str(sass).split(",")))
    kernels = info.get("kernels") or []
    if not kernels:
        lines.append("kernels: none registered")
        return "\n".join(lines)
    # (arch, kind, dtype) -> sorted head dims
    table: Dict[tuple, set] = defaultdict(set)
    for kern in kernels:
        table[(kern.get("arch"), kern.get("kind"), kern.get("dtype"))].add(kern.get("headdim"))
    lines.append(f"kernels ({len(kernels)}):")

    def dtype_key(d):
        return (_DTYPE_ORDER.index(d) if d in _DTYPE_ORDER else len(_DTYPE_ORDER), str(d))

    for arch in sorted({k[0] for k in table}, key=lambda a: (a is None, a)):
        for kind in ("fwd", "bwd"):
            for dtype in sorted({k[2] for k in table if k[0] == arch}, key=dtype_key):
                dims = table.get((arch, kind, dtype))
                if dims:
                    hd = ", ".join(str(d) for d in sorted(dims, key=lambda x: (x is None, x)))
                    lines.append(f"  sm_{arch} {kind} {dtype}: headdim {hd}")
    kinds = sorted({k[1] for k in table})
    if "bwd" not in kinds:
        lines.append("  (no backward kernels: built with FLASH_ATTN_DISABLE_BACKWARD=1?)")
    return "\n".join(lines)


def main() -> int:
    print(format_build_info(build_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
