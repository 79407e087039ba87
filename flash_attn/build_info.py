"""What was built: ``build_info()`` reports the compiled kernels, or why there are none."""

from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["build_info"]


def _versions() -> Dict[str, Any]:
    from . import __version__

    return {
        "flash_attn": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }


def build_info() -> Dict[str, Any]:
    """Describe the compiled extension ``flash_attn._C``.

    Return:
        A dict. Always present: ``available`` (bool), ``flash_attn`` (package version),
        ``torch`` (torch version), ``torch_cuda`` (the CUDA version torch was built with, or
        None), ``cuda_available`` (``torch.cuda.is_available()``).
        When the extension loads, also what its ``_C.build_info()`` returns: ``archs`` (list of
        ints, e.g. ``[80, 90]``), ``kernels`` (list of dicts with ``kind`` ("fwd"/"bwd"),
        ``arch``, ``dtype`` ("fp16"/"bf16", or "e4m3" for the SM90 FP8 forward kernels) and
        ``headdim`` (tier)), ``cuda`` (the CUDA version it was compiled with) and ``cutlass``.
        Otherwise ``reason`` (str): why nothing is available (import error text; torch without
        CUDA). CPU tensors always work, through the PyTorch reference.
    """
    info: Dict[str, Any] = _versions()
    try:
        from . import _C
    except Exception as e:  # ImportError, OSError, undefined symbols, ...
        reason = f"flash_attn._C could not be imported ({type(e).__name__}: {e})"
        if torch.version.cuda is None:
            reason = (
                "torch has no CUDA (a CPU-only torch build), so the CUDA extension was not "
                f"built; {reason}"
            )
        info.update(available=False, reason=reason)
        return info
    try:
        ext_info = dict(_C.build_info())
    except Exception as e:
        info.update(
            available=False,
            reason=f"flash_attn._C loaded but _C.build_info() failed ({type(e).__name__}: {e})",
        )
        return info
    info.update(ext_info)
    info["available"] = True
    return info
