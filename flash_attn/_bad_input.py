"""Out-of-range device-valued inputs, reported without a device sync.

The CUDA kernels read some arguments' values on the device: ``cu_seqlens_q/k``, ``seqused_k``
(``cache_seqlens``), ``cache_batch_idx``, ``cache_leftpad`` and ``block_table``, and they check
each sequence against ``max_seqlen_q/k``. Checking those values on the host would need a device
sync per call. Instead the kernels clamp a bad value, so that nothing outside the tensors is read
or written, and record it in a word of host-mapped memory, one per device
(``csrc/common/bad_input.h``). Every entry point reads that word at its start (a plain load from
host memory, no sync) and raises the recorded error as a ``ValueError``: the call that passed the
bad value returns a wrong result, and the next call into the package, or
:func:`check_bad_inputs` (which syncs first), raises. Nothing traps, so the CUDA context stays
usable. ``FLASH_ATTN_CHECK_INPUTS=1`` still checks cu_seqlens and max_seqlen before each call,
with a sync. While ``torch.compile`` traces, the word is not read; compiled code's bad values are
raised by the next eager call or by :func:`check_bad_inputs`. Ring attention's entry points do
not read it either: an error raised on one rank alone would leave the others waiting in the ring.
"""

from __future__ import annotations

import ctypes
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


def describe(word: int) -> str:
    """The message for a recorded word (code, index, value as csrc/common/bad_input.h packs
    them)."""
    code, index = word >> 56, (word >> 32) & 0xFFFFFF
    value = ctypes.c_int32(word & 0xFFFFFFFF).value
    name, index_kind, rule = _CODES.get(
        code, (f"an argument (code {code})", "index", "it is out of range"))
    return (f"flash_attn: {name} was out of range in an earlier CUDA call: {index_kind} {index} "
            f"has value {value}; {rule}. That call's result is wrong (the kernels clamped the "
            f"value to stay within the tensors); this error is raised by the next call into "
            f"flash_attn or by flash_attn.check_bad_inputs().")


def _word(index: int) -> ctypes.c_uint64:
    word = _WORDS.get(index)
    if word is None:
        from .ops import load_extension

        word = _WORDS[index] = ctypes.c_uint64.from_address(
            load_extension().bad_input_word_address(index))
    return word


def raise_pending(device: torch.device) -> None:
    """Raise the bad input recorded on ``device`` (CUDA) since the last check, if any, and
    clear it. No sync: a kernel still running may record one later. Free when the extension is
    not loaded yet (no kernel has run)."""
    from . import ops

    if device.type != "cuda" or ops._EXT is None or torch.compiler.is_compiling():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    word = _word(index)
    value = word.value
    if value:
        word.value = 0
        raise ValueError(describe(value))


def check_bad_inputs(device: Optional[Union[torch.device, str, int]] = None) -> None:
    """Wait for ``device``'s work (default: the current CUDA device) and raise a ValueError if a
    kernel of this package recorded an out-of-range device-valued input (cu_seqlens, seqused_k /
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table, or a too-small max_seqlen) since
    the last check. Without this call, the next call into flash_attn raises it."""
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    torch.cuda.synchronize(dev)
    raise_pending(dev)
