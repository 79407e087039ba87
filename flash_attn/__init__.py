"""FlashAttention-2 compatible attention: CUDA kernels (``flash_attn._C``) with a PyTorch
reference on CPU. ``python -m flash_attn`` shows what was built."""

__version__ = "0.1.0"

from .build_info import build_info  # noqa: E402  (replaces the submodule attribute)
from .flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "__version__",
    "build_info",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]
