"""Out-of-range device-valued inputs, reported without a device sync.

The CUDA kernels read some arguments' values on the device: ``cu_seqlens_q/k``, ``seqused_k``
(``cache_seqlens``), ``cache_batch_idx``, ``cache_leftpad`` and ``block_table``, and they check
each sequence against ``max_seqlen_q/k``. Checking those values on the host would need a device
sync per call. Instead the kernels clamp a bad value, so that nothing outside the tensors is read
or written, and record it in a word of host-mapped memory, one per device
(``csrc/common/bad_input.h``). Every entry point reads that word at its start (a plain load from
host memory, no sync) and raises the recorded error as a ``ValueError``: the call that passed the
bad value returns a wrong result, and the next call into the package on that device (from any
thread), or :func:`check_bad_inputs` (which syncs first), raises. Nothing traps, so the CUDA
context stays usable. ``FLASH_ATTN_BAD_INPUTS=warn`` turns the error into a ``RuntimeWarning``
and ``=off`` stops reading the word (for a server where one request's bad input must not fail
another's call). A launch inside a CUDA-graph capture before the word exists records nothing
(allocating it would break the capture). ``FLASH_ATTN_CHECK_INPUTS=1`` still checks cu_seqlens
and max_seqlen before each call, with a sync. While ``torch.compile`` traces, the word is not
read; compiled code's bad values are raised by the next eager call or by
:func:`check_bad_inputs`. Ring attention's entry points do not read it either: an error raised
on one rank alone would leave the others waiting in the ring.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import Dict, Optional, Union

import torch

# Code (bits 56-63 of the word) -> (argument, what the index is, what the value must satisfy).
# The codes are csrc/common/bad_input.h's BadInput: keep the two in step.
_CODES: Dict[int, tuple] = {
    1: ("cu_seqlens_q", "entry", "entry 0 must be 0, and each entry at least the one before it "
        "and at most q's row count"),
    2: ("cu_seqlens_k", "entry", "entry 0 must be 0, and each entry at least the one before it "
        "and at most k's row count (with a block_table: the keys the pages can hold)"),
    3: ("seqused_k (cache_seqlens in flash_attn_with_kvcache)", "batch index",
        "it must be in [0, the keys of the sequence or the cache's capacity]"),
    4: ("cache_batch_idx", "batch index", "it must be in [0, the cache's batch size)"),
    5: ("cache_leftpad", "batch index",
        "it must be in [0, cache_seqlens] (with the new rows appended)"),
    6: ("block_table", "the entry at element offset",
        "entries must be in [0, the number of pages) (the offset's row is offset // "
        "block_table.stride(0))"),
    7: ("max_seqlen_q", "batch index",
         "the value is the sequence's query count, which max_seqlen_q must not be below"),
    8: ("max_seqlen_k", "batch index",
         "the value is the sequence's key count, which max_seqlen_k (and, paged, the keys its "
         "block_table row holds) must not be below"),
    9: ("cache_seqlens", "batch index",
        "it must be >= 0, and with the new k/v rows appended at most the cache's capacity"),
}

_WORDS: Dict[int, ctypes.c_uint64] = {}
_MODES = ("raise", "warn", "off")


def _mode() -> str:
    mode = os.environ.get("FLASH_ATTN_BAD_INPUTS", "raise")
    if mode not in _MODES:
        raise ValueError(f"FLASH_ATTN_BAD_INPUTS must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


def describe(word: int) -> str:
    """The message for a recorded word (code, index, value as csrc/common/bad_input.h packs
    them)."""
    code, index = word >> 56, (word >> 32) & 0xFFFFFF
    value = ctypes.c_int32(word & 0xFFFFFFFF).value
    name, index_kind, rule = _CODES.get(
        code, (f"an argument (code {code})", "index", "it is out of range"))
    at = f"{index_kind} {index}" if index < 0xFFFFFF else f"{index_kind} >= {index}"
    return (f"flash_attn: {name} was out of range in an earlier CUDA call on this device "
            f"(possibly another thread's): {at} has value {value}; {rule}. The kernels clamped "
            f"the value to stay within the tensors, so that call's result may be wrong. Raised "
            f"by the next call into flash_attn or by flash_attn.check_bad_inputs(); "
            f"FLASH_ATTN_BAD_INPUTS=warn or =off turns the error into a warning or off.")


def _word(index: int) -> Optional[ctypes.c_uint64]:
    """The device's word, or None while no launch has created it."""
    word = _WORDS.get(index)
    if word is None:
        from .ops import load_extension

        address = load_extension().bad_input_word_address(index)
        if not address:
            return None
        word = _WORDS[index] = ctypes.c_uint64.from_address(address)
    return word


def _pending(index: int) -> bool:
    """Whether device ``index``'s word holds a record: a plain read of host memory."""
    word = _word(index)
    return word is not None and word.value != 0


def take(index: int) -> int:
    """Device ``index``'s recorded word, cleared in the same atomic exchange (the binding's
    ``take_bad_input``), or 0: nothing recorded, no word yet, or another thread took it."""
    from . import ops

    return ops._EXT.take_bad_input(index) if _pending(index) else 0


def raise_pending(device: torch.device) -> None:
    """Raise the bad input recorded on ``device`` (CUDA) since the last check, if any, and
    clear it (FLASH_ATTN_BAD_INPUTS=warn: warn instead; =off: nothing). No sync: a kernel still
    running may record one later. Free when the extension is not loaded yet (no kernel has
    run)."""
    from . import ops

    if device.type != "cuda" or torch.compiler.is_compiling() or ops._EXT is None:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _pending(index):
        return
    mode = _mode()
    if mode == "off":
        return
    value = take(index)
    if not value:
        return
    if mode == "warn":
        warnings.warn(describe(value), RuntimeWarning, stacklevel=3)
        return
    raise ValueError(describe(value))


def check_bad_inputs(device: Optional[Union[torch.device, str, int]] = None) -> None:
    """Wait for ``device``'s work (default: the current CUDA device) and raise a ValueError if a
    kernel of this package recorded an out-of-range device-valued input (cu_seqlens, seqused_k /
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table, or a too-small max_seqlen) since
    the last check. Without this call, the next call into flash_attn raises it."""
    from . import ops

    if ops._EXT is None or not torch.cuda.is_available():
        return  # no kernel of this package has run
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    torch.cuda.synchronize(dev)
    raise_pending(dev)
