"""The attention-dropout mask: which scores are kept, defined once for the CUDA kernels and the
reference path.

Status: the CPU reference path (flash_attn.reference) and the SM80 CUDA kernels
(csrc/common/dropout.h, which every GPU runs under dropout) apply it; the SM90 kernels do not
draw it yet. A call's generator state is an int64 tensor ``rng_state = (seed, offset)``
(:func:`new_rng_state`), which the backward and ``return_attn_probs`` replay. A state of five,
``(seed, offset, entry0, row0, col0)`` (:func:`at_positions`), places the call's scores inside
a larger attention: its batch entry (varlen sequence) ``b``, query row ``i`` and key column
``j`` take the numbers of ``b + entry0``, ``i + row0`` and ``j + col0``, with ``row0`` and
``col0`` multiples of 16 so that the call's 16 x 16 blocks are the larger one's. Ring attention
(flash_attn.ring_attention) calls the kernels on blocks of a sharded sequence this way and
draws the mask of the whole sequence.

Definition. For query row ``i`` and key column ``j`` of a sequence (positions within the
sequence, varlen too), query head ``h`` of batch entry (or varlen sequence) ``b``, with
``nheads`` query heads and a generator state ``(seed, offset)``:

* the 16 x 16 block of the element, ``I = i // 16``, ``J = j // 16``, and its place in it,
  ``r = i % 16``, ``c = j % 16``;
* ``lane = (r % 8) * 4 + (c % 8) // 2`` and ``half = (c // 8) * 4 + (r // 8) * 2 + c % 2``;
* ``words = Philox4x32-10(counter=(32 * J + lane, I, b * nheads + h, offset mod 2^32),
  key=(seed mod 2^32, seed >> 32))``, and the element's 16-bit random number is half
  ``half % 2`` (low first) of ``words[half // 2]``;
* the element is kept when that number is below ``round((1 - p) * 65536)``; kept
  probabilities are scaled by ``1 / (1 - p)``.

Why this shape: ``lane`` and ``half`` are the lane and the register of the element in the
accumulator fragments of both kernel families (``mma.sync`` m16n8 on SM80, WGMMA on SM90: in
each 16 x 8 atom lane ``4g + t`` holds rows ``g, g + 8`` and columns ``2t, 2t + 1``), so a
forward thread computes exactly one Philox call per 16 x 16 block and uses all 8 of its
numbers. 16 bits make the kept fraction exact to 2^-16. For SM90 kernels drawing it (not built
yet): the SM90 backward holds the transposed scores (keys as rows), so its threads would compute
the same calls for the transposed block and move the numbers to the transposed fragment
(``movmatrix.trans``); and a thread's calls line up with its fragment only where a warp's 16
rows start at a multiple of 16, which the SM90 forward's end-aligned band tiles and GQA-packed
rows do not, so those would be turned off under dropout.

Reproducibility: ``torch.manual_seed`` reproduces a call's mask within one execution mode;
under ``torch.compile`` with inductor, ``torch.randint`` draws from inductor's own generator
stream, so a compiled call and an eager one with the same seed draw different masks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key increments (Weyl sequence)
_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: Tensor) -> Tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit halves of a * b for a 32-bit constant and int64 tensors holding 32-bit
    values, without leaving int64: b is multiplied by a's two 16-bit halves."""
    ah, al = a >> 16, a & 0xFFFF
    t1 = al * b  # < 2^48
    t2 = ah * b  # < 2^48, weight 2^16
    mid = ((t2 & 0xFFFF) << 16) + t1  # < 2^49
    hi = (t2 >> 16) + (mid >> 32)
    return hi & _MASK32, mid & _MASK32


def philox4x32_10(counter: Tensor, key: Tuple[int, int]) -> Tensor:
    """Philox4x32 with 10 rounds (Salmon et al., SC 2011) on int64 tensors of 32-bit values.
    counter: (..., 4); key: two 32-bit ints. Returns (..., 4)."""
    c0, c1, c2, c3 = (counter[..., i] & _MASK32 for i in range(4))
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for rnd in range(10):
        if rnd:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo32(_M0, c0)
        hi1, lo1 = _mulhilo32(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack([c0, c1, c2, c3], dim=-1)


def _lane_and_half(r: Tensor, c: Tensor) -> Tuple[Tensor, Tensor]:
    """The lane and the number (0-7) of the element at (r, c) of its 16 x 16 block."""
    return (r % 8) * 4 + (c % 8) // 2, (c // 8) * 4 + (r // 8) * 2 + c % 2


def dropout_random16(seed: int, offset: int, bh: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """The 16-bit random numbers of the module's definition, int64 in [0, 65536), for the
    broadcast of ``bh`` (b * nheads + h), ``rows`` (query rows i) and ``cols`` (key columns j)."""
    bh, rows, cols = torch.broadcast_tensors(bh.long(), rows.long(), cols.long())
    lane, half = _lane_and_half(rows % 16, cols % 16)
    counter = torch.stack(
        [32 * (cols // 16) + lane, rows // 16, bh, torch.full_like(bh, offset & _MASK32)], dim=-1)
    words = philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    word = torch.gather(words, -1, (half // 2).unsqueeze(-1)).squeeze(-1)
    return (word >> (16 * (half % 2))) & 0xFFFF


def keep_threshold(dropout_p: float) -> int:
    """Kept when the 16-bit number is below this: round((1 - p) * 65536)."""
    return min(65536, max(0, round((1.0 - dropout_p) * 65536)))


def new_rng_state(device: Optional[torch.device | str] = None) -> Tensor:
    """A call's (seed, offset), int64 (2,) on ``device`` (default the CPU), drawn from that
    device's default generator: ``torch.manual_seed`` reproduces it. On CUDA the draw is a kernel
    that writes device memory, which the attention kernels read: no host sync, and a captured
    CUDA graph draws fresh values on every replay (torch's graph-safe generator state)."""
    return torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=device)


def at_positions(rng_state: Tensor, entry0: int, row0: int, col0: int) -> Tensor:
    """The five-element state (module docstring) of a call whose batch entry 0, query row 0 and
    key column 0 are ``entry0``, ``row0`` and ``col0`` of the attention that ``rng_state`` (a
    two-element state) draws the mask of; on rng_state's device. The positions are filled in on
    the device (no copy from the host, which would wait for the device's queue)."""
    if row0 < 0 or col0 < 0 or entry0 < 0 or row0 % 16 or col0 % 16:
        raise ValueError(f"flash_attn: dropout positions must be >= 0 with row0 and col0 "
                         f"multiples of 16, got entry0={entry0}, row0={row0}, col0={col0}")
    state = rng_state.new_empty(5)
    state[:2].copy_(rng_state.reshape(2))
    for i, x in enumerate((entry0, row0, col0)):
        state[2 + i].fill_(x)
    return state


def _unpack(rng_state: Tensor) -> Tuple[int, int, int, int, int]:
    """(seed, offset, entry0, row0, col0) of a two- or five-element state."""
    vals = [int(x) for x in rng_state.tolist()]
    if len(vals) == 2:
        return vals[0], vals[1], 0, 0, 0
    if len(vals) != 5 or min(vals[2:]) < 0 or vals[3] % 16 or vals[4] % 16:
        raise ValueError("flash_attn: rng_state must be (seed, offset) or (seed, offset, entry0, "
                         f"row0, col0) with row0 and col0 multiples of 16, got {vals}")
    return vals[0], vals[1], vals[2], vals[3], vals[4]


def _block_random16(seed: int, offset: int, bh: Tensor, row_blocks: int,
                    col_blocks: int, row_block0: int = 0, col_block0: int = 0) -> Tensor:
    """The numbers of whole 16 x 16 blocks, one Philox call per (block, lane) as the kernels
    compute them: (len(bh), 16 * row_blocks, 16 * col_blocks), from block (row_block0,
    col_block0) on."""
    dev = bh.device
    # (16, 16): each element's lane and its number there
    lane, half = _lane_and_half(torch.arange(16, device=dev).view(-1, 1),
                                torch.arange(16, device=dev).view(1, -1))
    counter = torch.stack(torch.broadcast_tensors(
        32 * torch.arange(col_block0, col_block0 + col_blocks, device=dev).view(1, 1, -1, 1)
        + torch.arange(32, device=dev).view(1, 1, 1, -1),
        torch.arange(row_block0, row_block0 + row_blocks, device=dev).view(1, -1, 1, 1),
        bh.long().view(-1, 1, 1, 1),
        torch.tensor(offset & _MASK32, device=dev)), dim=-1)  # (bh, I, J, lane, 4)
    words = philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    halves = torch.stack([words & 0xFFFF, words >> 16], dim=-1).flatten(-2)  # (.., lane, 8)
    block = halves[:, :, :, lane, half]  # (bh, I, J, 16, 16)
    return block.permute(0, 1, 3, 2, 4).reshape(bh.numel(), 16 * row_blocks, 16 * col_blocks)


def dropout_factor(rng_state: Tensor, dropout_p: float, entry0: int, entries: int, nheads: int,
                   seqlen_q: int, seqlen_k: int, dtype: torch.dtype,
                   device: Optional[torch.device] = None) -> Tensor:
    """(entries, nheads, seqlen_q, seqlen_k): 1 / (1 - p) where the score is kept, 0 where it is
    dropped, for the batch entries (varlen sequences) entry0 .. entry0 + entries - 1 (of the
    call; a five-element rng_state moves them, and the rows and columns, as it says)."""
    seed, offset, entry_shift, row0, col0 = _unpack(rng_state)
    entry0 += entry_shift
    bh = torch.arange(entry0 * nheads, (entry0 + entries) * nheads, device=device)
    numbers = _block_random16(seed, offset, bh, -(-seqlen_q // 16), -(-seqlen_k // 16),
                              row0 // 16, col0 // 16)
    keep = numbers[:, :seqlen_q, :seqlen_k] < keep_threshold(dropout_p)
    return keep.view(entries, nheads, seqlen_q, seqlen_k).to(dtype) / (1.0 - dropout_p)


def dropout_keep_mask(seed: int, offset: int, batch: int, nheads: int, seqlen_q: int,
                      seqlen_k: int, dropout_p: float,
                      device: Optional[torch.device] = None) -> Tensor:
    """The keep mask of one call, bool (batch, nheads, seqlen_q, seqlen_k): True where the
    score is kept (for varlen, sequence b's block [:, :, :len_q(b), :len_k(b)] of entry b)."""
    bh = torch.arange(batch * nheads, device=device).view(batch, nheads, 1, 1)
    rows = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    cols = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    return dropout_random16(seed, offset, bh, rows, cols) < keep_threshold(dropout_p)
