"""Context parallelism: ring attention over ``torch.distributed``, forward and backward.

Each rank of a process group holds a shard of the sequence of q, k and v. The K/V shards go
round the ring (rank r sends to r + 1 and receives from r - 1) with point-to-point operations
(``batch_isend_irecv``: NCCL on GPUs, gloo on CPU); each rank attends its queries to every
K/V shard in turn and merges the partial outputs with their log-sum-exp. The backward sends
K/V round the ring again, together with the dK/dV accumulators, so that each accumulator ends
at the rank that owns its K/V shard. The accumulators travel in float32 (float64 for float64
inputs) and make their last hop, to the owner, in the inputs' dtype.

The transfer of the next K/V shard is issued before the current shard's attention runs and
waited for after it, so they overlap: with NCCL the transfers run on NCCL's own stream and
``wait()`` makes the compute stream wait for them; with gloo they run on gloo's threads.
NCCL's transfer kernel needs SMs of its own: while a transfer is in flight the SM90 forward,
whose persistent grid otherwise holds every SM, is launched with ``_SM_MARGIN`` SMs left free.
With ``FLASH_ATTN_RING_TRANSPORT=copy_engine`` (CUDA, the ranks on one host) the transfers go
by the GPUs' copy engines into symmetric memory instead, and take no SM
(:class:`_CopyEngineRing`).

Sharding (``zigzag``):

* ``zigzag=True`` (the default): the sequence is split into 2N chunks and rank r holds chunks
  r and 2N-1-r, concatenated in that order. With a causal mask every rank then does the same
  amount of work. :func:`zigzag_shard` / :func:`zigzag_unshard` convert a full batch.
* ``zigzag=False``: contiguous shards, rank r holds rows ``[r * S, (r + 1) * S)``.

The varlen form (:func:`ring_flash_attn_varlen_func`) shards every packed sequence on its own
in the same way (:func:`zigzag_shard_varlen` / :func:`zigzag_unshard_varlen`); internally it is
the batched code on a batch of one whose rows are cut into sequences.

The learnable sink (``s_aux`` / ``learnable_sink``) joins every row's softmax once, after the
merge; in the backward the kernels need only the merged lse (which includes it), and the
sink's gradient is summed over the ranks.

Masks (causal, sliding window) are in global positions. Each (query chunk, key chunk) pair is
cut down to the rows and columns that see at least one key, and the kernel is called on that
sub-block with the window re-expressed in the kernel's bottom-right alignment (or with no mask
when the sub-block is fully visible, and not at all when nothing is visible). ALiBi's bias is
in global positions too: each call gets its sub-block's ``alibi_offset`` (the kernels move the
bias by it, not the mask), and sub-blocks are joined into one call only where they are
neighbours in the sequence as well.

Device paths: CUDA calls the kernels through :func:`flash_attn.ops.flash_attn_fwd` /
:func:`flash_attn.ops.flash_attn_bwd`; the CUDA backward kernel reads the ``out`` and
``softmax_lse`` it is handed, which here are the merged (global) ones, as ring attention needs.
CPU runs plain PyTorch with the same semantics, in float64 for float64 inputs: the CPU
reference op rounds softmax_lse to float32 and its backward recomputes a block-local softmax
(it ignores ``out`` / ``softmax_lse``), neither of which suits merging blocks.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import _fp8, ops, reference
from . import _validation as V
from ._validation import _check_alibi, _check_sink
from .dropout import at_positions, dropout_factor, new_rng_state
from .flash_attn_interface import _forward

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "zigzag_shard",
           "zigzag_unshard", "zigzag_shard_varlen", "zigzag_unshard_varlen"]

# Tags keep the K/V and dK/dV messages apart on gloo (NCCL ignores tags; there, both sides
# issue the messages in the same order, which is what matches them).
_TAG_KV = 0
_TAG_DKV = 1

# (start within its sequence, start among the shard's rows, length) of one run of a shard's rows.
Segment = Tuple[int, int, int]


# --------------------------------------------------------------------------------------------
# sharding helpers
# --------------------------------------------------------------------------------------------


def _group_size_rank(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("flash_attn: a process group was given but torch.distributed is "
                               "not initialized")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def zigzag_shard(x: Tensor, dim: int = 1, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """This rank's zigzag shard of the full sequence ``x`` (no communication).

    The sequence (``x.shape[dim]``) is split into 2N chunks (N = the group's size); rank r gets
    chunks r and 2N-1-r, concatenated along ``dim``.

    Arguments:
        x: the full tensor, the same on every rank, e.g. (batch, seqlen, nheads, headdim).
        dim: the sequence dim.
        group: the process group (default: the world; a group of one when torch.distributed
            is not initialized).
    Return:
        (..., seqlen / N, ...), contiguous.
    """
    n, r = _group_size_rank(group)
    seqlen = x.shape[dim]
    if seqlen % (2 * n) != 0:
        raise ValueError(
            f"zigzag_shard: the sequence length ({seqlen}, dim {dim}) must be divisible by "
            f"2 * world size = {2 * n}")
    chunks = x.chunk(2 * n, dim=dim)
    return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim=dim).contiguous()


def zigzag_unshard(x: Tensor, dim: int = 1,
                   group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The full sequence from every rank's zigzag shard (an ``all_gather``, not
    differentiable): the inverse of :func:`zigzag_shard`.

    Arguments:
        x: this rank's shard, e.g. (batch, seqlen / N, nheads, headdim); the same shape on
            every rank, with an even length along ``dim``.
        dim: the sequence dim.
        group: the process group.
    Return:
        (..., seqlen, ...) on every rank.
    """
    n, _ = _group_size_rank(group)
    if x.shape[dim] % 2 != 0:
        raise ValueError(f"zigzag_unshard: a zigzag shard has two equal chunks, but its length "
                         f"along dim {dim} is {x.shape[dim]} (odd)")
    if n == 1:
        return x.contiguous()
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks: List[Optional[Tensor]] = [None] * (2 * n)
    for r, p in enumerate(parts):
        chunks[r], chunks[2 * n - 1 - r] = p.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _segments(rank: int, world: int, seqlens_local: List[int],
              zigzag: bool) -> List[List[Segment]]:
    """The runs of rows that ``rank``'s shard holds, per sequence (global starts are positions
    within the sequence). ``seqlens_local``: each sequence's shard length (one entry for the
    batched layout, whose sequences all have the same length; the varlen layout packs them
    along the rows)."""
    out, local = [], 0
    for n in seqlens_local:
        if zigzag:
            half = n // 2
            out.append([(rank * half, local, half),
                        ((2 * world - 1 - rank) * half, local + half, half)])
        else:
            out.append([(rank * n, local, n)])
        local += n
    return out


# --------------------------------------------------------------------------------------------
# per-block masks
# --------------------------------------------------------------------------------------------


class _Block:
    """The visible sub-block of one (query segment, key segment) pair and the kernel's mask.

    ``rows`` / ``cols`` are local slices of the query / key shard; ``causal``,
    ``window_left``, ``window_right`` are the kernel's arguments for that sub-block (bottom-right
    aligned, -1 unbounded). ``q0`` / ``k0`` are the global positions of its first row and first
    column; ``seq`` the sequence it belongs to."""

    __slots__ = ("rows", "cols", "causal", "window_left", "window_right", "q0", "k0", "seq")

    def __init__(self, rows: slice, cols: slice, causal: bool, window_left: int,
                 window_right: int, q0: int = 0, k0: int = 0, seq: int = 0):
        self.rows, self.cols = rows, cols
        self.causal, self.window_left, self.window_right = causal, window_left, window_right
        self.q0, self.k0, self.seq = q0, k0, seq

    @property
    def pos(self) -> int:
        """ALiBi's distance at local (0, 0): the first row's position minus the first column's."""
        return self.q0 - self.k0

    def alibi_offset(self) -> int:
        """The kernels' ``alibi_offset`` for this sub-block: their distance
        ``i + (ncols - nrows) + offset - j`` is then the global one, ``pos + i - j``."""
        nrows = self.rows.stop - self.rows.start
        ncols = self.cols.stop - self.cols.start
        return self.pos - (ncols - nrows)


def _block(qseg: Segment, kseg: Segment, left: float, right: float, seq: int = 0,
           align: int = 1) -> Optional[_Block]:
    """The sub-block of ``qseg`` x ``kseg`` where a query at global position p keeps the keys
    at positions ``[p - left, p + right]`` (``left`` / ``right`` may be ``math.inf``), or None
    when it keeps none; ``seq``: the sequence both segments belong to. ``align``: its first row
    and first column are moved back to global positions that are multiples of it (within the
    segments, whose starts must be such multiples), as dropout's 16 x 16 blocks need; moving
    the top-left corner leaves the bottom-right aligned mask's window as it was, and the rows
    and columns so added keep nothing.

    In the pair's local coordinates (i: query row, j: key column) a key is kept when
    ``lo <= j - i <= hi``, with ``lo = d - left``, ``hi = d + right`` and ``d`` the query
    segment's global start minus the key segment's. Rows with a kept key are
    ``[max(0, -hi), min(Sq - 1, Sk - 1 - lo)]``, columns ``[max(0, lo), min(Sk - 1, Sq - 1 + hi)]``.
    The kernel keeps ``j - i`` in ``[o - window_left, o + window_right]`` with
    ``o = cols - rows`` (bottom-right alignment), hence the window below. For the equal-length
    segments used here the band always contains the sub-block's bottom-right corner, so both
    window sides come out >= 0 (checked)."""
    q0, ql0, sq = qseg
    k0, kl0, sk = kseg
    d = q0 - k0
    lo, hi = d - left, d + right
    r0, r1 = max(0, -hi), min(sq - 1, sk - 1 - lo)
    c0, c1 = max(0, lo), min(sk - 1, sq - 1 + hi)
    if r0 > r1 or c0 > c1:
        return None
    r0, r1, c0, c1 = int(r0), int(r1), int(c0), int(c1)
    assert q0 % align == 0 and k0 % align == 0, (qseg, kseg, align)
    r0, c0 = r0 - r0 % align, c0 - c0 % align
    nrows, ncols = r1 - r0 + 1, c1 - c0 + 1
    # The band in the sub-block's coordinates.
    lo, hi = lo + r0 - c0, hi + r0 - c0
    rows, cols = slice(ql0 + r0, ql0 + r1 + 1), slice(kl0 + c0, kl0 + c1 + 1)
    if lo <= -(nrows - 1) and hi >= ncols - 1:
        return _Block(rows, cols, False, -1, -1, q0 + r0, k0 + c0, seq)
    o = ncols - nrows
    wl = -1 if math.isinf(lo) else int(o - lo)
    wr = -1 if math.isinf(hi) else int(hi - o)
    assert (wl >= 0 or math.isinf(lo)) and (wr >= 0 or math.isinf(hi)), (qseg, kseg, lo, hi)
    # The kernels take a causal mask as causal=True with window_right 0.
    return _Block(rows, cols, wl == -1 and wr == 0, wl, wr, q0 + r0, k0 + c0, seq)


def _blocks(qsegs: List[List[Segment]], ksegs: List[List[Segment]], left: float,
            right: float, positional: bool = False, align: int = 1) -> List[_Block]:
    """The visible sub-blocks between the segments of each sequence (sequences never see each
    other). ``positional``: the kernels see global positions (ALiBi, dropout), see
    :func:`_coalesce`; ``align`` as in :func:`_block`."""
    out = []
    for seq, (qseq, kseq) in enumerate(zip(qsegs, ksegs)):
        blocks = [b for qs in qseq for ks in kseq
                  if (b := _block(qs, ks, left, right, seq, align)) is not None]
        out += _coalesce(blocks, positional)
    return out


def _unmasked(b: _Block) -> bool:
    return not b.causal and b.window_left == -1 and b.window_right == -1


def _coalesce(blocks: List[_Block], positional: bool = False) -> List[_Block]:
    """Joins neighbouring sub-blocks into one kernel call where the joined block's mask is exact:
    fewer, larger calls and fewer merges (zigzag: 2 calls per step instead of up to 4).
    ``positional`` (ALiBi, whose bias is one offset per call, and dropout, whose mask is drawn
    at the call's global positions): only blocks that are neighbours in global positions too,
    so that the joined block's positions are its first block's.

    * Same rows, adjacent columns, the left block fully visible and the right one unbounded on
      the left (no mask, causal, or window_left -1): the right block's mask, bottom-right
      aligned, leaves the left block fully visible. Row i keeps the joined columns up to its
      last key in the right block; a row that keeps a key there reaches past the left block,
      and one that keeps none (``_block`` trims such rows, but ``align`` adds some back) keeps
      the left block's last column in the sequence, which with ``positional`` is the column
      just before the right block's first: its right bound sits at the join.
    * Same columns, adjacent rows, both fully visible: no mask."""
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j:
                    continue
                width = a.cols.stop - a.cols.start
                height = a.rows.stop - a.rows.start
                if (a.rows == b.rows and a.cols.stop == b.cols.start and _unmasked(a)
                        and b.window_left == -1
                        and (not positional or b.pos == a.pos - width)):
                    joined = _Block(a.rows, slice(a.cols.start, b.cols.stop), b.causal, -1,
                                    b.window_right, a.q0, a.k0, a.seq)
                elif (a.cols == b.cols and a.rows.stop == b.rows.start and _unmasked(a)
                      and _unmasked(b) and (not positional or b.pos == a.pos + height)):
                    joined = _Block(slice(a.rows.start, b.rows.stop), a.cols, False, -1, -1,
                                    a.q0, a.k0, a.seq)
                else:
                    continue
                blocks = [x for n, x in enumerate(blocks) if n not in (i, j)] + [joined]
                changed = True
                break
            if changed:
                break
    return blocks


# --------------------------------------------------------------------------------------------
# per-block kernels
# --------------------------------------------------------------------------------------------


# SMs the SM90 forward leaves to NCCL's transfer kernel while one is in flight. Measured on
# 4 x H100 (128k tokens, d128, bf16, two runs): with none, a ring step's kernel and K/V exchange
# together took 17.2-17.4 ms against 12.2-12.3 ms for the kernel and 1.0 ms for the exchange
# alone, as the persistent grid and NCCL's kernel waited for each other's SMs; with 8 SMs
# left, 13.5-13.6 ms (the kernel alone 13.2-13.5). Forward per-GPU throughput against one GPU
# rose from 0.67-0.75 to 0.73-0.86; 16 SMs measured the same or lower, 32 lower.
_SM_MARGIN = 8


class _Alibi:
    """ALiBi's slopes under sharding: float32 (nheads,) for every sequence, or one row per
    sequence (batched: (batch, nheads), which the kernels take as is; varlen: (nseqs, nheads),
    the row of the block's sequence)."""

    __slots__ = ("slopes", "per_sequence")

    def __init__(self, slopes: Tensor, per_sequence: bool):
        self.slopes, self.per_sequence = slopes, per_sequence

    def of(self, blk: _Block) -> Tensor:
        return self.slopes[blk.seq] if self.per_sequence else self.slopes


class _Dropout:
    """Dropout under sharding: the call's probability and generator state (seed, offset), drawn
    once per call (the same on every rank when their generators agree, e.g. after
    ``torch.manual_seed``). Each block's kernel call draws the mask at the block's global
    positions (:func:`flash_attn.dropout.at_positions`), so that the sequence's mask is the one
    a single call on the whole sequence would draw."""

    __slots__ = ("p", "rng_state", "states")

    def __init__(self, p: float, rng_state: Tensor):
        self.p, self.rng_state = p, rng_state
        self.states: Dict[Tuple[int, int, int], Tensor] = {}

    def state(self, blk: _Block) -> Tensor:
        """The block's positioned state, made once per call (the backward reuses the forward's)."""
        key = (blk.seq, blk.q0, blk.k0)
        if key not in self.states:
            self.states[key] = at_positions(self.rng_state, *key)
        return self.states[key]

    def factor(self, blk: _Block, batch: int, nheads: int, rows: int, cols: int,
               dtype: torch.dtype) -> Tensor:
        """The CPU path's mask factor (batch, nheads, rows, cols) of the block."""
        return dropout_factor(self.state(blk), self.p, 0, batch, nheads, rows, cols, dtype,
                              self.rng_state.device)


def _placement(blk: _Block, alibi: Optional[_Alibi],
               dropout: Optional[_Dropout]) -> Dict[str, object]:
    """The kernels' keyword arguments that place a block in its sequence: ALiBi's slopes and
    offset, dropout's probability and positioned state (both CUDA ops take them by name)."""
    kw: Dict[str, object] = {"alibi_slopes": None if alibi is None else alibi.of(blk),
                             "alibi_offset": blk.alibi_offset()}
    if dropout is not None:
        kw.update(dropout_p=dropout.p, rng_state=dropout.state(blk))
    return kw


def _block_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, blk: _Block,
               softcap: float, sm_margin: int, alibi: Optional[_Alibi],
               dropout: Optional[_Dropout]) -> Tuple[Tensor, Tensor]:
    """(out, lse) of q's rows against one K/V block, lse (batch, nheads, rows) with +inf on
    rows that keep no key. CUDA: the kernel (out in q's dtype, lse float32), leaving
    ``sm_margin`` SMs free; CPU: the compute dtype (float64 for float64 inputs) for both.
    ALiBi's bias is that of the block's global positions (``alibi_offset``), and so is
    dropout's mask (lse is the softmax's, before dropout, which makes the merge exact)."""
    if q.is_cuda:
        return ops.flash_attn_fwd(q, k, v, None, None, None, q.shape[1], k.shape[1], scale,
                                  blk.causal, blk.window_left, blk.window_right, softcap,
                                  sm_margin=sm_margin, **_placement(blk, alibi, dropout))
    cdt = reference._compute_dtype(q, k, v)
    factor = None if dropout is None else dropout.factor(blk, q.shape[0], q.shape[2],
                                                         q.shape[1], k.shape[1], cdt)
    return reference._forward_dense(q.to(cdt), k.to(cdt), v.to(cdt), scale, blk.causal,
                                    blk.window_left, blk.window_right, softcap, None,
                                    alibi=None if alibi is None else alibi.of(blk),
                                    drop=factor, alibi_offset=blk.alibi_offset())


def _block_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               scale: float, blk: _Block, softcap: float, deterministic: bool,
               alibi: Optional[_Alibi],
               dropout: Optional[_Dropout]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one K/V block given the merged ``out`` and ``lse`` of q's rows: the
    probabilities are ``exp(s - lse)`` with the global lse and the softmax term uses
    ``rowsum(dout * out)`` with the global out, as in the kernels' backward. dk/dv are summed
    over each GQA group. ALiBi and dropout as in :func:`_block_fwd`."""
    if q.is_cuda:
        # The row slice of lse is strided; the kernel reads it as a contiguous array.
        return ops.flash_attn_bwd(dout, q, k, v, out, lse.contiguous(), None, None, q.shape[1],
                                  k.shape[1], scale, blk.causal, blk.window_left,
                                  blk.window_right, softcap, deterministic,
                                  **_placement(blk, alibi, dropout))
    cdt = reference._compute_dtype(q, k, v, dout)
    qc, kc, vc, doc = q.to(cdt), k.to(cdt), v.to(cdt), dout.to(cdt)
    h, hk = q.shape[2], k.shape[2]
    ke, ve = reference._expand_kv_heads(kc, h), reference._expand_kv_heads(vc, h)
    s, t = reference._scores(qc, ke, scale, softcap)
    if alibi is not None:  # a constant of the score: t (the softcap's tanh) is unchanged
        s = s + reference._alibi_bias(alibi.of(blk), q.shape[1], k.shape[1], None, s.dtype,
                                      blk.alibi_offset())
    keep = reference.keep_mask(q.shape[1], k.shape[1], blk.causal, blk.window_left,
                               blk.window_right, device=q.device)
    # lse is +inf on rows without any kept key anywhere: exp gives 0 there.
    p = torch.exp(s - lse.to(cdt)[..., None]).masked_fill(~keep, 0.0)
    factor = None if dropout is None else dropout.factor(blk, q.shape[0], h, q.shape[1],
                                                         k.shape[1], cdt)
    dv = torch.einsum("bhqk,bqhd->bkhd", p if factor is None else p * factor, doc)
    dp = torch.einsum("bqhd,bkhd->bhqk", doc, ve)
    if factor is not None:
        dp = dp * factor  # the gradient reaching p through the dropped, scaled probabilities
    delta = (doc * out.to(cdt)).sum(-1).transpose(1, 2)[..., None]  # (b, h, q, 1)
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = ds * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qc)
    return dq, reference._reduce_kv_heads(dk, hk), reference._reduce_kv_heads(dv, hk)


# --------------------------------------------------------------------------------------------
# communication
# --------------------------------------------------------------------------------------------


class _Ring:
    """Sends to the next rank and receives from the previous one, asynchronously, by
    ``batch_isend_irecv`` (NCCL's kernels on GPUs, gloo's threads on CPU)."""

    def __init__(self, group: Optional[dist.ProcessGroup], world: int, rank: int):
        self.group = group
        self.world, self.rank = world, rank
        self.next = self._global((rank + 1) % world)
        self.prev = self._global((rank - 1) % world)

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def margin(self, sending: bool) -> int:
        """SMs the forward leaves free while a transfer is in flight: NCCL's kernel needs them."""
        return _SM_MARGIN if sending else 0

    def reserve(self, tag: int, nbytes: int) -> None:
        """Room for messages of ``nbytes`` on channel ``tag`` (collective; nothing to do here)."""

    def exchange(self, x: Tensor, tag: int) -> Tuple[object, Tensor]:
        """Start sending ``x`` to the next rank and receiving a tensor like it from the previous
        one; returns (handle, receive buffer). ``x`` must not change until the handle is waited
        for; the buffer holds the message once it is, until the handle is released."""
        buf = torch.empty_like(x)
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, self.next, self.group, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.group, tag),
        ])
        return reqs, buf

    def wait(self, handle: object) -> None:
        """Make the current stream wait for the exchange (and for ``x``'s send)."""
        for r in handle:
            r.wait()

    def release(self, handle: object) -> None:
        """The exchange's receive buffer is no longer read, nor sent on (call after the
        exchange that sends it on, and after the kernels that read it, have been issued)."""


class _CopyEngineRing(_Ring):
    """The ring over NVLink by the GPUs' copy engines, for CUDA tensors on one host.

    Each rank writes its message straight into the next rank's receive slot: symmetric memory
    (torch.distributed._symmetric_memory) maps the next rank's slots into this rank's address
    space, and torch's copy of a contiguous tensor is a cudaMemcpyAsync, which the copy engines
    run. Streams order the copies with 32-bit words written and waited for by stream memory
    operations (the extension's ``stream_value32`` op). Neither takes an SM: NCCL's transfer
    kernel needs SMs, which the SM90 forward's persistent grid holds (a step with both took 17.4
    ms against 12.3 for the kernel alone; leaving 8 SMs to NCCL costs the kernel about 9%), and
    in the backward a transfer kernel queued behind an attention kernel's CTAs started only at
    that kernel's tail (4 x H100, 2026-11-27).

    Two slots per channel (K/V, dK/dV). Exchange number t of a channel goes to slot t % 2 once
    the next rank has released exchange t - 2 (it writes t - 2 into this rank's ``freed``
    word), and then writes t into the next rank's ``arrived`` word, for which the receiver's
    stream waits. Every rank issues the same exchanges in the same order, so t agrees between
    ranks; the words keep counting from call to call."""

    _WORDS = 8  # arrived[channel][slot], then freed[channel][slot]
    _ALIGN = 256

    def __init__(self, group: Optional[dist.ProcessGroup], world: int, rank: int,
                 device: torch.device):
        super().__init__(group, world, rank)
        self.pg = group or dist.group.WORLD  # the process group this ring's memory is bound to
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.capacity = [0, 0]  # bytes per slot, per channel
        self.count = [0, 0]     # exchanges issued per channel
        self.mem: Optional[Tensor] = None
        self.next_mem: Optional[Tensor] = None
        self.prev_mem: Optional[Tensor] = None
        self.handle = None

    def margin(self, sending: bool) -> int:
        return 0

    def _words(self, mem: Tensor) -> Tensor:
        return mem[:self._WORDS * 4].view(torch.int32)

    def _arrived(self, mem: Tensor, channel: int, slot: int) -> Tensor:
        return self._words(mem)[2 * channel + slot:][:1]

    def _freed(self, mem: Tensor, channel: int, slot: int) -> Tensor:
        return self._words(mem)[4 + 2 * channel + slot:][:1]

    @staticmethod
    def _channel(tag: int) -> int:
        return 0 if tag == _TAG_KV else 1

    def _slot(self, mem: Tensor, channel: int, slot: int, like: Tensor) -> Tensor:
        off = self._ALIGN + 2 * self.capacity[0] * channel + self.capacity[channel] * slot
        nbytes = like.numel() * like.element_size()
        return mem[off:off + nbytes].view(like.dtype).view(like.shape)

    def reserve(self, tag: int, nbytes: int) -> None:
        channel = self._channel(tag)
        if nbytes <= self.capacity[channel]:
            return
        # No multicast objects: the slots are only copied to, and some machines forbid them.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        # Every rank gets here at the same exchange (the shards' shapes agree), so the
        # reallocation is collective; nothing may still write into the old slots.
        barrier = functools.partial(dist.barrier, group=self.group,
                                    device_ids=[self.device.index])
        torch.cuda.synchronize(self.device)
        barrier()
        if symm_mem.get_backend(self.device) != "CUDA":
            # The driver's own peer mappings (cuMem); NVSHMEM or NCCL windows would need setup
            # of their own. Raises if another backend has already allocated.
            symm_mem.set_backend("CUDA")
        self.mem = self.next_mem = self.prev_mem = self.handle = None
        capacity = list(self.capacity)
        capacity[channel] = -(-nbytes // self._ALIGN) * self._ALIGN
        total = self._ALIGN + 2 * sum(capacity)
        mem = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        self._words(mem).zero_()
        handle = symm_mem.rendezvous(mem, self.pg)
        self.next_mem = handle.get_remote_tensor((self.rank + 1) % self.world, (total,),
                                                 torch.uint8)
        self.prev_mem = handle.get_remote_tensor((self.rank - 1) % self.world, (total,),
                                                 torch.uint8)
        self.mem, self.handle, self.capacity, self.count = mem, handle, capacity, [0, 0]
        torch.cuda.synchronize(self.device)
        barrier()

    def exchange(self, x: Tensor, tag: int) -> Tuple[object, Tensor]:
        channel = self._channel(tag)
        self.count[channel] += 1
        t = self.count[channel]
        slot = t % 2
        value32 = ops.load_extension().stream_value32
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if t > 2:
                value32(self._freed(self.mem, channel, slot), t - 2, True)
            self._slot(self.next_mem, channel, slot, x).copy_(x)
            value32(self._arrived(self.next_mem, channel, slot), t, False)
        x.record_stream(self.stream)
        return (channel, t), self._slot(self.mem, channel, slot, x)

    def wait(self, handle: object) -> None:
        channel, t = handle
        with torch.cuda.device(self.device):
            ops.load_extension().stream_value32(self._arrived(self.mem, channel, t % 2), t, True)

    def release(self, handle: object) -> None:
        channel, t = handle
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            ops.load_extension().stream_value32(self._freed(self.prev_mem, channel, t % 2), t,
                                                False)


# One copy-engine ring per (process group, device): its words keep counting across calls. A
# group destroyed and created again is another object, whose ring starts afresh.
_COPY_RINGS: Dict[Tuple[str, int], _CopyEngineRing] = {}
# Overrides FLASH_ATTN_RING_TRANSPORT when set (the tests and benchmark_ring.py's --transport).
_TRANSPORT: Optional[str] = None
_TRANSPORTS = ("nccl", "copy_engine")


def _transport() -> str:
    """"nccl" (the default: any process group) or "copy_engine" (CUDA, the ranks on one host;
    measured faster on 4 x H100, and opt-in because it needs symmetric memory)."""
    name = _TRANSPORT or os.environ.get("FLASH_ATTN_RING_TRANSPORT", "nccl")
    if name not in _TRANSPORTS:
        raise ValueError(f"FLASH_ATTN_RING_TRANSPORT={name!r}: expected one of {_TRANSPORTS}")
    return name


def _make_ring(group: Optional[dist.ProcessGroup], world: int, rank: int,
               device: torch.device) -> _Ring:
    transport = _transport()
    if device.type != "cuda" or transport != "copy_engine":
        return _Ring(group, world, rank)
    pg = group or dist.group.WORLD
    key = (pg.group_name, device.index)
    if key not in _COPY_RINGS or _COPY_RINGS[key].pg is not pg:
        _COPY_RINGS[key] = _CopyEngineRing(group, world, rank, device)
    return _COPY_RINGS[key]


# --------------------------------------------------------------------------------------------
# forward / backward
# --------------------------------------------------------------------------------------------


def _merge(acc_out: Tensor, acc_lse: Tensor, rows: slice, out: Tensor, lse: Tensor,
           fresh: bool) -> None:
    """Merge a partial (out, lse) of ``rows`` into the accumulators, in place (two passes over
    the rows of ``acc_out``). ``fresh``: no earlier partial touched these rows, so this one is
    copied. Rows that keep no key have lse -inf in the accumulator (+inf from the kernels)."""
    lse = lse.to(acc_lse.dtype)
    lse = torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)
    acc = acc_out[:, rows]
    if fresh:
        acc.copy_(out)
        acc_lse[:, :, rows] = lse
        return
    new, w_old, w_new = _lse_join(acc_lse[:, :, rows], lse)
    acc.mul_(w_old.transpose(1, 2)[..., None])
    acc.addcmul_(out, w_new.transpose(1, 2)[..., None])
    acc_lse[:, :, rows] = new


def _lse_join(old: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(new, w_old, w_new): new = logaddexp(old, lse) and the weights exp(old - new),
    exp(lse - new) of the two parts, 0 where both are -inf (rows that keep nothing)."""
    new = torch.logaddexp(old, lse)
    empty = new == float("-inf")
    safe = torch.where(empty, torch.zeros_like(new), new)
    w_old = torch.where(empty, torch.zeros_like(new), torch.exp(old - safe))
    w_new = torch.where(empty, torch.zeros_like(new), torch.exp(lse - safe))
    return new, w_old, w_new


def _ring_blocks(qsegs: List[List[Segment]], owner: int, ring: _Ring, seqlens: List[int],
                 zigzag: bool, left: float, right: float, alibi: Optional[_Alibi],
                 dropout: Optional[_Dropout]) -> List[_Block]:
    """The kernel calls of this rank's queries against ``owner``'s K/V shard: at global
    positions where ALiBi or dropout needs them, on dropout's 16-row grid."""
    return _blocks(qsegs, _segments(owner, ring.world, seqlens, zigzag), left, right,
                   alibi is not None or dropout is not None, 16 if dropout is not None else 1)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: _Ring, seqlens: List[int],
                  zigzag: bool, scale: float, left: float, right: float,
                  softcap: float, sink: Optional[Tensor], alibi: Optional[_Alibi],
                  dropout: Optional[_Dropout]) -> Tuple[Tensor, Tensor]:
    b, s, h, d = q.shape
    cdt = reference._compute_dtype(q, k, v)
    acc_out = torch.zeros(b, s, h, d, dtype=cdt, device=q.device)
    acc_lse = torch.full((b, h, s), float("-inf"), dtype=cdt, device=q.device)
    qsegs = _segments(ring.rank, ring.world, seqlens, zigzag)
    kv = torch.stack([k, v])
    ring.reserve(_TAG_KV, kv.numel() * kv.element_size())
    held = None  # the handle of the exchange that brought kv
    touched = torch.zeros(s, dtype=torch.bool)  # rows some partial has reached (host side)
    for step in range(ring.world):
        sending = step < ring.world - 1
        if sending:
            reqs, kv_next = ring.exchange(kv, _TAG_KV)
        owner = (ring.rank - step) % ring.world
        for blk in _ring_blocks(qsegs, owner, ring, seqlens, zigzag, left, right, alibi,
                                dropout):
            o, lse = _block_fwd(q[:, blk.rows], kv[0][:, blk.cols], kv[1][:, blk.cols], scale,
                                blk, softcap, ring.margin(sending), alibi, dropout)
            fresh = not bool(touched[blk.rows].any())
            _merge(acc_out, acc_lse, blk.rows, o, lse, fresh)
            touched[blk.rows] = True
        if sending:
            ring.wait(reqs)
        if held is not None:
            ring.release(held)
        if sending:
            kv, held = kv_next, reqs
    if sink is not None:
        acc_lse = _join_sink(acc_out, acc_lse, sink)
    # The kernels' convention for rows that keep no key (and no sink): out 0 (already), lse +inf.
    acc_lse = torch.where(acc_lse == float("-inf"), torch.full_like(acc_lse, float("inf")),
                          acc_lse)
    return acc_out.to(q.dtype), acc_lse.to(torch.float32 if q.is_cuda else cdt)


def _join_sink(acc_out: Tensor, acc_lse: Tensor, sink: Tensor) -> Tensor:
    """The learnable sink's logit sink[h] joins every row's softmax denominator once, after the
    merge over every K/V shard: the rows of ``acc_out`` are scaled by exp(lse - lse'), in place,
    and lse' = logaddexp(lse, sink[h]) is returned. Rows with no key get lse' = sink[h] and keep
    out = 0; a sink of -inf changes nothing."""
    new, w_old, _ = _lse_join(acc_lse, sink.to(acc_lse.dtype).view(1, -1, 1))
    acc_out.mul_(w_old.transpose(1, 2)[..., None])
    return new


def _sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor,
               group: Optional[dist.ProcessGroup]) -> Tensor:
    """The sink's gradient from this rank's rows (:func:`flash_attn.ops.sink_grad`), summed over
    the group's ranks (all_reduce), so that every rank returns the whole sequence's gradient.
    dout, out: (batch, rows, nheads, headdim); lse (batch, nheads, rows) including the sink."""
    grad = ops.sink_grad(dout, out, lse, sink, False)
    dist.all_reduce(grad, group=group)
    return grad


def _zero_rows(acc: Tensor, rows: Tensor) -> None:
    """acc[:, i] = 0 where the host bool tensor ``rows`` is True, run by run: slices, so that
    neither a copy of the mask to the device nor a masked index waits for the device."""
    edges = torch.diff(rows.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    stops = torch.nonzero(edges == -1).flatten().tolist()
    for a, b in zip(starts, stops):
        acc[:, a:b].zero_()


def _accumulate(pairs: List[Tuple[Tensor, Tensor]], rows: slice, touched: Tensor) -> None:
    """acc[:, rows] += g for each (acc, g) of ``pairs``, accumulators that start uninitialised
    and share ``touched`` (host side, a bool per row of dim 1: reached by an earlier call, then
    updated). Rows not reached before are written rather than added to, which spares a pass
    that zeroes the accumulator and a read of those zeros; rows that no call reaches are
    zeroed at the end (:func:`_zero_rows` of ``~touched``)."""
    seen = touched[rows].clone()
    touched[rows] = True
    for acc, g in pairs:
        view = acc[:, rows]
        if not bool(seen.any()):
            view.copy_(g)
            continue
        _zero_rows(view, ~seen)
        view.add_(g)


def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   ring: _Ring, seqlens: List[int], zigzag: bool, scale: float, left: float,
                   right: float, softcap: float, deterministic: bool,
                   alibi: Optional[_Alibi],
                   dropout: Optional[_Dropout]) -> Tuple[Tensor, Tensor, Tensor]:
    cdt = reference._compute_dtype(q, k, v, dout)
    dq = torch.empty(q.shape, dtype=cdt, device=q.device)
    dq_touched = torch.zeros(q.shape[1], dtype=torch.bool)
    qsegs = _segments(ring.rank, ring.world, seqlens, zigzag)
    kv = torch.stack([k, v])
    ring.reserve(_TAG_KV, kv.numel() * kv.element_size())
    ring.reserve(_TAG_DKV, kv.numel() * torch.empty((), dtype=cdt).element_size())
    kv_held = None  # the handle of the exchange that brought kv
    dkv_reqs: object = None
    dkv_in: Optional[Tensor] = None
    for step in range(ring.world):
        if step < ring.world - 1:
            kv_reqs, kv_next = ring.exchange(kv, _TAG_KV)
        owner = (ring.rank - step) % ring.world
        grads: List[Tuple[slice, Tensor, Tensor]] = []
        for blk in _ring_blocks(qsegs, owner, ring, seqlens, zigzag, left, right, alibi,
                                dropout):
            g_q, g_k, g_v = _block_bwd(dout[:, blk.rows], q[:, blk.rows], kv[0][:, blk.cols],
                                       kv[1][:, blk.cols], out[:, blk.rows],
                                       lse[:, :, blk.rows], scale, blk, softcap, deterministic,
                                       alibi, dropout)
            _accumulate([(dq, g_q)], blk.rows, dq_touched)
            grads.append((blk.cols, g_k, g_v))
        # The accumulator of this K/V block arrives from the previous rank (which had the block
        # one step earlier) while this step's kernels run; it is waited for only after they
        # have been issued, and this step's dK/dV are added into it in place. At step 0 the
        # block is this rank's own and its accumulator starts here.
        if dkv_in is None:
            part = torch.empty((2,) + tuple(k.shape), dtype=cdt, device=q.device)
            cols_touched = torch.zeros(k.shape[1], dtype=torch.bool)
            for cols, g_k, g_v in grads:
                _accumulate([(part[0], g_k), (part[1], g_v)], cols, cols_touched)
            _zero_rows(part[0], ~cols_touched)
            _zero_rows(part[1], ~cols_touched)
        else:
            ring.wait(dkv_reqs)
            part = dkv_in
            for cols, g_k, g_v in grads:
                part[0][:, cols] += g_k
                part[1][:, cols] += g_v
        if step == ring.world - 1:
            # The last hop takes each accumulator to its block's owner, which only converts it
            # to the inputs' dtype: converted here instead, the same values cross in half the
            # bytes (for 16-bit inputs), and this hop is the one no kernel runs beside.
            part = part.to(k.dtype)
        part_held = dkv_reqs
        dkv_reqs, dkv_in = ring.exchange(part, _TAG_DKV)
        if part_held is not None:
            ring.release(part_held)
        if step < ring.world - 1:
            ring.wait(kv_reqs)
        if kv_held is not None:
            ring.release(kv_held)
        if step < ring.world - 1:
            kv, kv_held = kv_next, kv_reqs
    # After the last step each accumulator takes one more hop, to the owner of its block.
    ring.wait(dkv_reqs)
    _zero_rows(dq, ~dq_touched)
    dq = dq.to(q.dtype)
    # Copies: dkv_in is a receive buffer, released below.
    dk, dv = dkv_in[0].to(k.dtype, copy=True), dkv_in[1].to(v.dtype, copy=True)
    ring.release(dkv_reqs)
    return dq, dk, dv


class _RingFlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], ring: _Ring,
                seqlens: List[int], zigzag: bool, scale: float, left: float, right: float,
                softcap: float, deterministic: bool, alibi: Optional[_Alibi],
                dropout_p: float) -> Tuple[Tensor, Tensor]:
        # One generator state per call, drawn as flash_attn_func draws it.
        dropout = _Dropout(dropout_p, new_rng_state(q.device)) if dropout_p > 0.0 else None
        if any(ctx.needs_input_grad[:3]):
            # The dK/dV channel's room now rather than in the backward, where every rank would
            # stop for a collective reallocation.
            cdt = reference._compute_dtype(q, k, v)
            ring.reserve(_TAG_DKV, 2 * k.numel() * torch.empty((), dtype=cdt).element_size())
        out, lse = _ring_forward(q, k, v, ring, seqlens, zigzag, scale, left, right, softcap,
                                 sink, alibi, dropout)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (ring, seqlens, zigzag, scale, left, right, softcap, deterministic, alibi,
                    dropout)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
        q, k, v, out, lse, sink = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        # The kernels' backward needs nothing more for the sink: the lse it is handed includes it.
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = _sink_grad(dout, out, lse, sink, ctx.args[0].group)
        return (dq, dk, dv, dsink) + (None,) * 10


# --------------------------------------------------------------------------------------------
# validation and the public function
# --------------------------------------------------------------------------------------------


def _local_error(q: Tensor, k: Tensor, v: Tensor, seqlens: List[int],
                 zigzag: bool) -> Optional[str]:
    """What is wrong with this rank's shards on their own, or None. q, k, v are 4-D here (the
    varlen layout as a batch of one)."""
    if k.shape != v.shape:
        return f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        return (f"q and k/v must have the same batch, shard length and head dim (the shards "
                f"hold the same positions), got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        return (f"the number of query heads ({q.shape[2]}) must be a multiple of the number of "
                f"K/V heads ({k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}"
    if zigzag and any(n % 2 for n in seqlens):
        return (f"with zigzag=True a shard holds two equal chunks of each sequence, so its "
                f"lengths must be even, got {seqlens} (each sequence length must be divisible "
                f"by 2 * world size)")
    if q.is_cuda and q.shape[3] % 8 != 0:
        return f"on CUDA the head dim must be a multiple of 8, got {q.shape[3]}"
    return None


def _backend_error(device: torch.device, backend: str) -> Optional[str]:
    """Whether tensors on ``device`` can go through a group with ``backend`` (gloo: CPU,
    NCCL: CUDA; a mixed backend such as "cpu:gloo,cuda:nccl" names its devices)."""
    backend = str(backend).lower()
    if ":" in backend:
        devices = {part.split(":")[0] for part in backend.split(",")}
    else:
        devices = {"gloo": {"cpu"}, "nccl": {"cuda"}}.get(backend, {device.type})
    if device.type not in devices:
        return (f"tensors on {device} cannot go through the group's {backend!r} backend "
                f"(gloo: CPU tensors, NCCL: CUDA tensors)")
    return None


# Per process group: a gloo group over the same ranks for the shape check (see _host_group).
_HOST_GROUPS: Dict[str, Tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _serves_cpu(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg``'s collectives take CPU tensors (gloo, or a "cpu:gloo,cuda:nccl" mix)."""
    return _backend_error(torch.device("cpu"), dist.get_backend(pg)) is None


def _host_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """A group whose collectives take CPU tensors: ``group`` itself where its backend serves
    CPU tensors, else a gloo group over its ranks, made once (only its ranks take part). Why: an
    NCCL all_gather of the shapes, read back by ``tolist()``, waits for everything queued on the
    GPU and leaves it idle until the ring's first launch (a trace on 4 x H100, 128k: the first
    kernel 1.6 ms after the all_gather began); on the host the check overlaps the GPU's queued
    work."""
    pg = group or dist.group.WORLD
    if _serves_cpu(pg):
        return pg
    key = pg.group_name
    if key not in _HOST_GROUPS or _HOST_GROUPS[key][0] is not pg:
        side = dist.new_group(dist.get_process_group_ranks(pg), backend="gloo",
                              use_local_synchronization=True)
        _HOST_GROUPS[key] = (pg, side)
    return _HOST_GROUPS[key][1]


def _check_shapes(fn: str, q: Tensor, k: Tensor, cu_seqlens: Optional[Tensor],
                  local: Optional[str], group: Optional[dist.ProcessGroup], world: int,
                  rank: int) -> None:
    """One all_gather of every rank's shapes (and whether its own checks passed), and for varlen
    a second one of cu_seqlens, so that every rank raises the same error instead of some of them
    waiting forever in the ring. Both on the host (:func:`_host_group`)."""
    info = [0 if local is None else 1]
    if local is None:
        info += list(q.shape) + [k.shape[2], 0 if cu_seqlens is None else cu_seqlens.numel()]
    else:
        info += [0] * 6
    host = _host_group(group)
    mine = torch.tensor(info, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=host)
    every_l = [t.tolist() for t in every]
    if local is not None:
        raise ValueError(f"{fn}: {local}")
    bad = [r for r, t in enumerate(every_l) if t[0]]
    if bad:
        raise ValueError(f"{fn}: rank(s) {bad} of the group rejected their input (see their "
                         f"error)")
    if any(t != every_l[0] for t in every_l):
        shapes = {r: f"q {tuple(t[1:5])}, nheads_k {t[5]}" for r, t in enumerate(every_l)}
        raise ValueError(f"{fn}: the shards must have the same shapes on every rank (equal "
                         f"sequence lengths), got {shapes} (this is rank {rank})")
    if cu_seqlens is None:
        return
    mine = cu_seqlens.to(device="cpu", dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=host)
    if any(not torch.equal(t, every[0]) for t in every):
        raise ValueError(f"{fn}: cu_seqlens must be the same on every rank (each sequence "
                         f"sharded evenly), got {[t.tolist() for t in every]}")


def _unsupported(fn: str, qkv: Tuple[Tensor, Tensor, Tensor], dropout_p: float,
                 return_attn_probs: bool, window_size, softcap: float) -> None:
    if any(_fp8.is_fp8(x) for x in qkv):
        # The partial outputs would be merged and returned in the inputs' dtype, and the
        # descales have no argument here.
        raise NotImplementedError(f"{fn}: FP8 (float8_e4m3fn) inputs are not implemented under "
                                  f"sharding; pass bf16/fp16 shards")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1), got {dropout_p}")
    if return_attn_probs:
        raise NotImplementedError(f"{fn}: return_attn_probs is not implemented under sharding "
                                  f"(use return_softmax_lse for the log-sum-exp)")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"{fn}: window_size must be a pair of ints >= -1, got {window_size!r}")
    if softcap < 0:
        raise ValueError(f"{fn}: softcap must be >= 0, got {softcap}")


def _ring_attention(fn: str, q: Tensor, k: Tensor, v: Tensor, seqlens: List[int],
                    cu_seqlens: Optional[Tensor], local: Optional[str],
                    group: Optional[dist.ProcessGroup], world: int, rank: int, causal: bool,
                    window_size, softcap: float, softmax_scale: Optional[float], zigzag: bool,
                    deterministic: bool, sink: Optional[Tensor], alibi: Optional[_Alibi],
                    dropout_p: float) -> Tuple[Tensor, Tensor]:
    """The checks that involve the group, then the ring, on 4-D q, k, v."""
    backend_err = _backend_error(q.device, dist.get_backend(group))
    if backend_err is not None:
        # Raised before any communication: the shape check below would itself fail or hang.
        raise ValueError(f"{fn}: {backend_err}")
    if local is None:
        local = _local_error(q, k, v, seqlens, zigzag)
    _check_shapes(fn, q, k, cu_seqlens, local, group, world, rank)
    if dropout_p > 0.0:
        # After the shape check, so that every rank has the same lengths and raises alike.
        _check_dropout_grid(fn, seqlens, zigzag, world)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    left = math.inf if window_size[0] < 0 else window_size[0]
    right = 0 if causal else (math.inf if window_size[1] < 0 else window_size[1])
    q, k, v = (x.contiguous() for x in (q, k, v))
    ring = _make_ring(group, world, rank, q.device)
    return _RingFlashAttnFunc.apply(q, k, v, sink, ring, seqlens, zigzag, scale, left, right,
                                    float(softcap), deterministic, alibi, float(dropout_p))


def _check_dropout_grid(fn: str, seqlens: List[int], zigzag: bool, world: int) -> None:
    """Dropout's mask is drawn in 16 x 16 blocks of global positions, and each kernel call
    draws whole blocks from its first row and column: every shard chunk must start on a
    multiple of 16."""
    chunks = [n // 2 if zigzag else n for n in seqlens]
    bad = [c for c in chunks if c % 16]
    if bad:
        what = "each of the 2N zigzag chunks" if zigzag else "each rank's shard"
        raise NotImplementedError(
            f"{fn}: dropout_p > 0 needs {what} of every sequence to be a multiple of 16 rows "
            f"long (the dropout mask is drawn in 16 x 16 blocks of global positions), got "
            f"chunks of {sorted(set(bad))} rows on {world} ranks")


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: Optional[float] = None,
    zigzag: bool = True,
    dropout_p: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_softmax_lse: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a sequence sharded across the ranks of ``group`` (context parallelism).

    Every rank calls this with its shard; the result is this rank's rows of attention over the
    full sequence, and the gradients of q, k, v are this rank's rows of the full gradients.
    Masks are in global positions (the sequence's order before sharding).

    Arguments:
        q: (batch, seqlen_local, nheads, headdim), this rank's shard of the queries.
        k, v: (batch, seqlen_local, nheads_k, headdim), the same rows of the keys / values;
            nheads a multiple of nheads_k (GQA / MQA).
        group: the process group (default: the world). A group of one, or torch.distributed
            not initialized, runs :func:`flash_attn.flash_attn_func` on the shard.
        causal: causal mask over global positions.
        window_size: (left, right), sliding window over global positions, -1 unbounded.
        softcap: > 0 applies ``softcap * tanh(s / softcap)`` to the scores.
        softmax_scale: default ``1 / sqrt(headdim)``.
        zigzag: True: rank r of N holds chunks r and 2N-1-r of the sequence split into 2N
            (:func:`zigzag_shard`); False: rank r holds rows ``[r * S, (r + 1) * S)``.
        dropout_p: dropout probability; the mask is the one :func:`flash_attn.flash_attn_func`
            draws for the whole sequence when every rank's generator is in the same state
            (``torch.manual_seed``). Each zigzag chunk (each shard without zigzag) must be a
            multiple of 16 rows (NotImplementedError otherwise). On CUDA it runs the SM80
            kernels, as dropout does on one GPU.
        return_attn_probs: not implemented under sharding (True raises NotImplementedError).
        alibi_slopes: (nheads,) or (batch, nheads) float32, optional, the same on every rank:
            the bias ``-slope * |i - j|`` over global positions i, j of the sequence.
        deterministic: handed to the CUDA backward kernel (the ring's own order is fixed).
        return_softmax_lse: also return this rank's rows of the log-sum-exp.
        s_aux: (nheads,) float32 or q's dtype, optional: the learnable attention sink of
            gpt-oss, the same on every rank; its logit s_aux[h] joins the softmax denominator of
            every row of query head h once (the partial results are merged first). Its gradient
            is that of the whole sequence on every rank (an all_reduce in the backward).
        learnable_sink: another name for s_aux (pass one of them).
    Return:
        out: (batch, seqlen_local, nheads, headdim).
        softmax_lse (only with return_softmax_lse): (batch, nheads, seqlen_local), natural log,
            +inf on rows that keep no key (with a sink: the sink's logit); float32, except
            float64 for float64 CPU inputs on more than one rank.

    Before the ring starts, the call checks its inputs and does one small ``all_gather`` of every
    rank's shard shape, so that shards of different lengths (or one rank's bad input) give
    every rank a ValueError rather than a hang. The group's backend must match the device (gloo:
    CPU, NCCL: CUDA).
    """
    fn = "ring_flash_attn_func"
    _unsupported(fn, (q, k, v), dropout_p, return_attn_probs, window_size, softcap)
    world, rank = _group_size_rank(group)
    if world == 1:
        # flash_attn_func's path, without its return_attn_probs (which would materialize the
        # probabilities) to get the lse.
        a = V.validate_qkv(fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                           causal=causal, window_size=tuple(window_size), softcap=softcap,
                           alibi_slopes=alibi_slopes, deterministic=deterministic,
                           s_aux=s_aux, learnable_sink=learnable_sink)
        out, lse, _ = _forward(q, k, v, a, None, None, None, a.seqlen_q, a.seqlen_k,
                               deterministic)
        return (out, lse) if return_softmax_lse else out
    local = None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        local = (f"q, k, v must be 4-D (batch, seqlen_local, nheads, headdim), got shapes "
                 f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    sink, sink_err = _ring_sink(fn, s_aux, learnable_sink, q, local)
    alibi, alibi_err = _ring_alibi(fn, alibi_slopes, q, q.shape[0], False, local)
    out, lse = _ring_attention(fn, q, k, v, [q.shape[1]] if local is None else [], None,
                               local or sink_err or alibi_err, group, world, rank, causal,
                               window_size, softcap, softmax_scale, zigzag, deterministic,
                               sink, alibi, dropout_p)
    return (out, lse) if return_softmax_lse else out


def _ring_sink(fn: str, s_aux: Optional[Tensor], learnable_sink: Optional[Tensor], q: Tensor,
               local: Optional[str]) -> Tuple[Optional[Tensor], Optional[str]]:
    """The validated sink, or the error that every rank then raises (the group's shape check
    gathers it, so that no rank waits for one that stopped). q is this rank's q, 4-D unless
    ``local`` says otherwise."""
    if local is not None or (s_aux is None and learnable_sink is None):
        return None, None
    try:
        return _check_sink(fn, s_aux, learnable_sink, q, q.shape[2]), None
    except (TypeError, ValueError) as e:
        return None, str(e).removeprefix(f"{fn}: ")


def _ring_alibi(fn: str, alibi_slopes: Optional[Tensor], q: Tensor, batch: int,
                per_sequence: bool,
                local: Optional[str]) -> Tuple[Optional[_Alibi], Optional[str]]:
    """The validated ALiBi slopes ((nheads,) or (batch, nheads); for varlen ``batch`` counts
    the sequences and a row per sequence is ``per_sequence``), or the error that every rank then
    raises (as :func:`_ring_sink`)."""
    if local is not None or alibi_slopes is None:
        return None, None
    try:
        slopes = _check_alibi(fn, alibi_slopes, q, batch, q.shape[-2])
    except (TypeError, ValueError) as e:
        return None, str(e).removeprefix(f"{fn}: ")
    return _Alibi(slopes.contiguous(), per_sequence and slopes.dim() == 2), None


def _varlen_local_error(q: Tensor, k: Tensor, v: Tensor,
                        cu_seqlens: Tensor) -> Optional[str]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return (f"q, k, v must be 3-D (total_local, nheads, headdim), got shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if (not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1
            or cu_seqlens.dtype != torch.int32):
        return "cu_seqlens must be a 1-D int32 tensor (batch + 1,)"
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != q.shape[0]:
        return (f"cu_seqlens must start at 0, not decrease and end at total_local = "
                f"{q.shape[0]}, got {cu}")
    return None


def ring_flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: Optional[float] = None,
    zigzag: bool = True,
    dropout_p: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_softmax_lse: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`ring_flash_attn_func` for sequences packed along the rows: every sequence of the
    batch is sharded across the group on its own (zigzag or contiguous, as ``zigzag`` says), and
    each rank packs its shards of all the sequences (:func:`zigzag_shard_varlen`).

    Arguments:
        q: (total_local, nheads, headdim), this rank's shards of every sequence, packed.
        k, v: (total_local, nheads_k, headdim), the same rows.
        cu_seqlens: (batch + 1,) int32, the boundaries of the shards in q, k, v (sequence b's
            shard is rows ``[cu_seqlens[b], cu_seqlens[b + 1])``), the same on every rank:
            sequence b is ``N * (cu_seqlens[b + 1] - cu_seqlens[b])`` long.
        max_seqlen: the longest shard, for the single-device path of a group of one (the ring
            reads the lengths from cu_seqlens).
        alibi_slopes: (nheads,) or (batch, nheads) float32, optional: ALiBi over each
            sequence's global positions, a row per sequence for the 2-D form.
        Other arguments: as in :func:`ring_flash_attn_func`.
    Return:
        out: (total_local, nheads, headdim).
        softmax_lse (only with return_softmax_lse): (nheads, total_local).

    On top of the checks of :func:`ring_flash_attn_func`, cu_seqlens is all-gathered once to
    check that it is the same on every rank.
    """
    fn = "ring_flash_attn_varlen_func"
    _unsupported(fn, (q, k, v), dropout_p, return_attn_probs, window_size, softcap)
    world, rank = _group_size_rank(group)
    if world == 1:
        a = V.validate_varlen_qkv(
            fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout_p,
            softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
            softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
            s_aux=s_aux, learnable_sink=learnable_sink)
        out, lse, _ = _forward(q, k, v, a, cu_seqlens, cu_seqlens, None, max_seqlen, max_seqlen,
                               deterministic)
        return (out, lse) if return_softmax_lse else out
    local = _varlen_local_error(q, k, v, cu_seqlens)
    seqlens: List[int] = []
    if local is None:
        cu = cu_seqlens.tolist()
        seqlens = [b - a for a, b in zip(cu, cu[1:])]
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        cu_check: Optional[Tensor] = cu_seqlens
    else:
        cu_check = None
    sink, sink_err = _ring_sink(fn, s_aux, learnable_sink, q, local)
    alibi, alibi_err = _ring_alibi(fn, alibi_slopes, q, len(seqlens), True, local)
    out, lse = _ring_attention(fn, q, k, v, seqlens, cu_check, local or sink_err or alibi_err,
                               group, world, rank, causal, window_size, softcap, softmax_scale,
                               zigzag, deterministic, sink, alibi, dropout_p)
    out, lse = out[0], lse[0]
    return (out, lse) if return_softmax_lse else out


def zigzag_shard_varlen(x: Tensor, cu_seqlens: Tensor,
                        group: Optional[dist.ProcessGroup] = None) -> Tuple[Tensor, Tensor]:
    """This rank's zigzag shards of packed sequences (no communication): each sequence is
    sharded as by :func:`zigzag_shard`, and the shards are packed in the same order.

    Arguments:
        x: (total, ...), the full packed tensor, the same on every rank.
        cu_seqlens: (batch + 1,) int32 boundaries of the sequences in x; every sequence's
            length divisible by 2N.
        group: the process group.
    Return:
        x_local: (total / N, ...); cu_seqlens_local: (batch + 1,) int32, cu_seqlens / N (the
        same on every rank).
    """
    n, _ = _group_size_rank(group)
    cu = cu_seqlens.tolist()
    bad = [b - a for a, b in zip(cu, cu[1:]) if (b - a) % (2 * n)]
    if bad:
        raise ValueError(f"zigzag_shard_varlen: every sequence length must be divisible by "
                         f"2 * world size = {2 * n}, got lengths {bad} among {cu}")
    parts = [zigzag_shard(x[a:b], 0, group) for a, b in zip(cu, cu[1:])]
    x_local = torch.cat(parts, dim=0) if parts else x[:0]
    return x_local, torch.div(cu_seqlens, n, rounding_mode="floor").to(torch.int32)


def zigzag_unshard_varlen(x: Tensor, cu_seqlens: Tensor,
                          group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The packed full sequences from every rank's zigzag shards (an ``all_gather``, not
    differentiable): the inverse of :func:`zigzag_shard_varlen`.

    Arguments:
        x: (total_local, ...), this rank's packed shards.
        cu_seqlens: (batch + 1,) int32, the shards' boundaries in x (the same on every rank).
        group: the process group.
    Return:
        (total_local * N, ...) on every rank.
    """
    n, _ = _group_size_rank(group)
    cu = cu_seqlens.tolist()
    if n == 1:
        return x.contiguous()
    every = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(every, x.contiguous(), group=group)
    out = []
    for a, b in zip(cu, cu[1:]):
        half = (b - a) // 2
        chunks: List[Optional[Tensor]] = [None] * (2 * n)
        for r, p in enumerate(every):
            chunks[r], chunks[2 * n - 1 - r] = p[a:a + half], p[a + half:b]
        out += chunks
    return torch.cat(out, dim=0) if out else x[:0]
