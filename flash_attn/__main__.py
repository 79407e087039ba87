"""``python -m flash_attn``: print what was built (or why nothing was)."""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any, Dict, List, Tuple

from flash_attn.build_info import build_info

_DTYPE_ORDER = ("fp16", "bf16", "e4m3")


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
    lines.append("features by code path (compute capability 9.0 | 8.x; "
                 "FLASH_ATTN_FORCE_SM80=1 puts 9.0 on the 8.x column):")
    width = max(len(f) for f, _, _ in feature_paths(kernels))
    for feature, sm90, sm80 in feature_paths(kernels):
        lines.append(f"  {feature:<{width}}  {sm90} | {sm80}")
    return "\n".join(lines)


def _tiers(kernels: List[Dict[str, Any]], arch: int, kind: str,
           fp8: bool = False) -> List[int]:
    """Head-dim tiers of the (arch, kind) kernels: fp16/bf16 ones, or the e4m3 ones (`fp8`)."""
    return sorted({k.get("headdim") for k in kernels
                   if k.get("arch") == arch and k.get("kind") == kind
                   and (k.get("dtype") == "e4m3") == fp8})


def feature_paths(kernels: List[Dict[str, Any]]) -> List[Tuple[str, str, str]]:
    """(feature, what runs it on compute capability 9.0, what runs it on 8.x): the binding's
    dispatch rules (csrc/flash_api.cpp, ``code_path`` and the forward's ``sm90_ok``) applied to
    the kernels this build registered."""
    fwd90 = _tiers(kernels, 90, "fwd")
    bwd90 = _tiers(kernels, 90, "bwd")
    fp8_90 = _tiers(kernels, 90, "fwd", fp8=True)

    def sm90(tiers: List[int], what: str) -> str:
        if not tiers:
            return "SM80 (no SM90 kernels built)"
        return f"SM90 for head-dim tiers {', '.join(map(str, tiers))}, else SM80" + what

    unsupported = "NotImplementedError"
    return [
        ("forward", sm90(fwd90, ""), "SM80"),
        ("forward with alibi_slopes", sm90(fwd90, ""), "SM80"),
        ("paged KV (block_table), pages of any size",
         "SM90 for pages of a multiple of 8 rows, else SM80", "SM80"),
        ("paged KV with cache_leftpad", "SM80", "SM80"),
        ("backward (alibi_slopes too)", sm90(bwd90, ""), "SM80"),
        ("deterministic=True backward", sm90(bwd90, ""), "SM80"),
        ("learnable sink (s_aux)", sm90(fwd90, ""), "SM80"),
        ("dropout_p > 0", "SM80", "SM80"),
        ("FP8 e4m3 inputs (CPU: the reference)",
         (f"SM90 for head-dim tiers {', '.join(map(str, fp8_90))} (forward, bf16 out), "
          f"else {unsupported}") if fp8_90 else f"{unsupported} (no e4m3 kernels built)",
         unsupported),
        ("FP8 e4m3 KV cache, paged or left-padded",
         (f"SM90 for pages of a multiple of 8 rows and cache_leftpad without pages, else "
          f"{unsupported}") if fp8_90 else f"{unsupported} (no e4m3 kernels built)",
         unsupported),
        ("v head dim != q's (the wider one's kernels, padded)", sm90(fwd90, ""), "SM80"),
    ]


def main() -> int:
    print(format_build_info(build_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
