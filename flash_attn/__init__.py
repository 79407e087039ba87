"""FlashAttention-2 compatible attention: CUDA kernels (``flash_attn._C``) with a PyTorch
reference on CPU. ``python -m flash_attn`` shows what was built."""

# <FlashAttention-2 release whose Python API this implements>.<our release>: the first three
# numbers let clients that gate on FlashAttention-2 versions (transformers wants >= 2.3.3) pick
# the right code path; the fourth counts our releases at that API level (README, "Versions").
__version__ = "2.8.3.1"

# Importing one of FlashAttention-2's modules this package lacks (flash_attn.ops.rms_norm, ...)
# raises a ModuleNotFoundError that says so and lists what is provided instead.
from . import _missing_modules  # noqa: E402

_missing_modules.install()

from ._bad_input import check_bad_inputs  # noqa: E402
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
from .ring_attention import (  # noqa: E402
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)

__all__ = [
    "__version__",
    "build_info",
    "check_bad_inputs",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "zigzag_shard",
    "zigzag_shard_varlen",
    "zigzag_unshard",
    "zigzag_unshard_varlen",
]
