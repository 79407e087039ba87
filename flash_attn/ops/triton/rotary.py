"""FlashAttention-2's low-level rotary function, ``flash_attn.ops.triton.rotary.apply_rotary``.

FlashAttention-2 implements it as a Triton kernel; here it is plain PyTorch (no Triton is
needed): the positions of the rows are computed here and the rotation is
:func:`flash_attn.reference.rotary_ref`, the same code that rotates q and k in
``flash_attn_with_kvcache``. Every device runs it, CUDA included: the CUDA path currently runs
this PyTorch code (a CUDA kernel of ours is planned). The math is done in float32 (float64 for
float64 inputs) and the result is cast back to x's dtype.

:mod:`flash_attn.layers.rotary` builds the autograd-aware functions and ``RotaryEmbedding`` on
:func:`apply_rotary`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ...reference import rotary_ref

__all__ = ["apply_rotary"]


def _check_tables(cos: Tensor, sin: Tensor, headdim: int) -> int:
    """Raise ValueError unless cos / sin are matching (seqlen_ro, rotary_dim / 2) tables with
    rotary_dim <= headdim; return rotary_dim."""
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"rotary: cos and sin must both be (seqlen_ro, rotary_dim / 2), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > headdim:
        raise ValueError(f"rotary: rotary_dim = 2 * cos.shape[1] = {rotary_dim} must be <= "
                         f"headdim = {headdim}")
    return rotary_dim


def _check_offsets(seqlen_offsets: Union[int, Tensor], batch: int, seqlen: Optional[int],
                   seqlen_ro: int) -> None:
    """FlashAttention-2's checks of seqlen_offsets against the batch and the tables; seqlen is
    the longest sequence, or None where it is unknown without a device sync."""
    if seqlen is not None and seqlen > seqlen_ro:
        raise ValueError(f"rotary: the sequences are {seqlen} long, longer than the cos / sin "
                         f"tables ({seqlen_ro} rows)")
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32,
                                                                            torch.int64):
            raise ValueError(f"rotary: a tensor seqlen_offsets must be int32 or int64 of shape "
                             f"(batch,) = ({batch},), got {seqlen_offsets.dtype} of shape "
                             f"{tuple(seqlen_offsets.shape)}")
    elif seqlen is not None and seqlen_offsets + seqlen > seqlen_ro:
        raise ValueError(f"rotary: seqlen_offsets + seqlen = {seqlen_offsets} + {seqlen} exceeds "
                         f"the cos / sin tables ({seqlen_ro} rows)")


def _varlen_positions(cu_seqlens: Tensor, total: int, seqlen_offsets: Union[int, Tensor],
                      device: torch.device) -> Tensor:
    """(total,) long: row t of sequence b (cu_seqlens[b] <= t < cu_seqlens[b + 1]) is at position
    t - cu_seqlens[b] + offset[b]; rows outside every sequence get -1, which leaves them
    unrotated. Computed on the device, without reading cu_seqlens back to the host."""
    batch = cu_seqlens.shape[0] - 1
    rows = torch.arange(total, device=device)
    if batch <= 0:
        return torch.full_like(rows, -1)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=batch - 1)
    pos = rows - cu[seq]
    pos = pos + (seqlen_offsets.to(device=device, dtype=torch.long)[seq]
                 if isinstance(seqlen_offsets, Tensor) else seqlen_offsets)
    inside = (rows >= cu[0]) & (rows < cu[-1])
    return torch.where(inside, pos, -1)


def apply_rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> Tensor:
    """Rotate the first rotary_dim dims of each head of x by the angle of its row's position.

    Arguments:
        x: (batch, seqlen, nheads, headdim) if cu_seqlens is None,
            else (total_seqlen, nheads, headdim).
        cos, sin: (seqlen_ro, rotary_dim / 2), rotary_dim <= headdim. A position p uses row p;
            positions outside [0, seqlen_ro) (possible with a tensor seqlen_offsets) are left
            unrotated, as FlashAttention-2's kernel leaves them.
        seqlen_offsets: int, or int32 / int64 tensor (batch,): the position of the first row of
            each sequence (the tokens already in a KV cache, when decoding).
        cu_seqlens: (batch + 1,) int32 or None. With it, row t of sequence b
            (cu_seqlens[b] <= t < cu_seqlens[b + 1]) is at position t - cu_seqlens[b] +
            offset[b]: positions restart for each sequence. Rows outside every sequence are
            not rotated.
        max_seqlen: int, the longest sequence of a varlen x (FlashAttention-2 requires it with
            cu_seqlens; here it is optional and only used to check the tables' length).
        interleaved: rotate the pairs of dims (0, 1), (2, 3), ... (GPT-J style) instead of
            (i, i + rotary_dim / 2) (GPT-NeoX style).
        inplace: write the result into x (dims past rotary_dim are untouched) and return x.
        conjugate: rotate by -sin, the inverse rotation (the backward of the rotation).
    Return:
        out: same shape and dtype as x: x's first rotary_dim dims rotated, the rest copied.
            Differentiable with respect to x through ordinary torch ops.
    """
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"rotary: x must be (batch, seqlen, nheads, headdim) without "
                             f"cu_seqlens, got {x.dim()}-D")
        batch, seqlen = x.shape[0], x.shape[1]
    else:
        if x.dim() != 3 or cu_seqlens.dim() != 1:
            raise ValueError(f"rotary: with cu_seqlens (batch + 1,), x must be (total_seqlen, "
                             f"nheads, headdim), got x {x.dim()}-D and cu_seqlens "
                             f"{cu_seqlens.dim()}-D")
        batch, seqlen = cu_seqlens.shape[0] - 1, max_seqlen
    rotary_dim = _check_tables(cos, sin, x.shape[-1])
    _check_offsets(seqlen_offsets, batch, seqlen, cos.shape[0])

    if cu_seqlens is None:
        pos = torch.arange(seqlen, device=x.device)
        if isinstance(seqlen_offsets, Tensor):
            pos = pos + seqlen_offsets.to(device=x.device, dtype=torch.long)[:, None]
        else:
            pos = (pos + seqlen_offsets)[None, :]  # broadcast over the batch
    else:
        pos = _varlen_positions(cu_seqlens, x.shape[0], seqlen_offsets, x.device)
    rot = rotary_ref(x, cos, sin, pos, interleaved, conjugate)
    if inplace:
        x[..., :rotary_dim].copy_(rot)
        return x
    if rotary_dim == x.shape[-1]:
        return rot
    return torch.cat((rot, x[..., rotary_dim:]), dim=-1)
