"""Rotary position embeddings with FlashAttention-2's API (``flash_attn.layers.rotary``):
:func:`apply_rotary_emb`, :func:`apply_rotary_emb_qkv_`, :func:`apply_rotary_emb_kv_` and the
:class:`RotaryEmbedding` module (with its xPos variant, ``scale_base``).

One PyTorch implementation runs on every device (:func:`flash_attn.ops.triton.rotary.apply_rotary`,
float32 math, results cast back to the input dtype); the CUDA path currently runs the same
PyTorch code (a CUDA kernel of ours is planned). The functions are ``torch.autograd.Function``
subclasses whose backward is the rotation by -sin (a rotation's inverse is its transpose).

Conventions, as in FlashAttention-2: cos / sin are (seqlen_ro, rotary_dim / 2) tables, row p
holding cos / sin of p * inv_freq; only the first rotary_dim dims of each head rotate, the rest
pass through; non-interleaved (GPT-NeoX) pairs dim i with dim i + rotary_dim / 2, interleaved
(GPT-J) pairs dims 2i and 2i + 1.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..ops.triton.rotary import apply_rotary

__all__ = [
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_torch",
    "rotate_half",
]


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """The partner of each dim with its sign for a rotation by +90 degrees: (x0, x1) ->
    (-x1, x0) for the pairs (first half, second half), or (even, odd) dims if interleaved.

    Arguments:
        x: (..., rotary_dim).
    Return:
        out: (..., rotary_dim).
    """
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x1, x0), dim=-1).flatten(-2)
    x0, x1 = x.chunk(2, dim=-1)
    return torch.cat((-x1, x0), dim=-1)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor,
                           interleaved: bool = False) -> Tensor:
    """Rotary embedding written as x * cos + rotate_half(x) * sin in x's dtype, positions
    0, 1, ... (FlashAttention-2 keeps it as the reference its tests compare against).

    Arguments:
        x: (batch, seqlen, nheads, headdim).
        cos, sin: (seqlen, rotary_dim / 2) or (batch, seqlen, rotary_dim / 2).
    Return:
        out: (batch, seqlen, nheads, headdim).
    """
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary: rotary_dim = {rotary_dim} must be <= headdim = {x.shape[-1]}")
    # Each table entry serves both dims of its pair: repeated per pair (interleaved) or per
    # half; the head axis is inserted before the last dim.
    if interleaved:
        cos, sin = (t.repeat_interleave(2, dim=-1).unsqueeze(-2) for t in (cos, sin))
    else:
        cos, sin = (torch.cat((t, t), dim=-1).unsqueeze(-2) for t in (cos, sin))
    xr = x[..., :rotary_dim]
    return torch.cat((xr * cos + rotate_half(xr, interleaved) * sin, x[..., rotary_dim:]), dim=-1)


def _save_offsets(ctx, seqlen_offsets: Union[int, Tensor], *tensors: Optional[Tensor]) -> None:
    """Save the tables (and a tensor seqlen_offsets) for backward; an int offset is kept on ctx
    because save_for_backward takes tensors only."""
    if isinstance(seqlen_offsets, Tensor):
        ctx.save_for_backward(*tensors, seqlen_offsets)
        ctx.seqlen_offsets = None
    else:
        ctx.save_for_backward(*tensors)
        ctx.seqlen_offsets = seqlen_offsets


def _load_offsets(ctx):
    """(saved tensors, seqlen_offsets) as _save_offsets stored them."""
    saved = ctx.saved_tensors
    if ctx.seqlen_offsets is None:
        return saved[:-1], saved[-1]
    return saved, ctx.seqlen_offsets


class ApplyRotaryEmb(torch.autograd.Function):
    """:func:`apply_rotary_emb` with the backward dx = rotation of dout by -sin."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                inplace: bool = False, seqlen_offsets: Union[int, Tensor] = 0,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None) -> Tensor:
        out = apply_rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, interleaved=interleaved, inplace=inplace)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cu_seqlens)
        ctx.interleaved = interleaved
        ctx.max_seqlen = max_seqlen
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        (cos, sin, cu_seqlens), seqlen_offsets = _load_offsets(ctx)
        # Out of place even for an in-place forward: dout may be shared with other consumers.
        dx = apply_rotary(dout, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                          max_seqlen=ctx.max_seqlen, interleaved=ctx.interleaved,
                          conjugate=True)
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tensor:
    """
    Arguments:
        x: (batch_size, seqlen, nheads, headdim) if cu_seqlens is None,
            else (total_seqlen, nheads, headdim).
        cos, sin: (seqlen_rotary, rotary_dim / 2), rotary_dim <= headdim.
        interleaved: if True, rotate pairs of even and odd dimensions (GPT-J style) instead of
            the 1st half and the 2nd half (GPT-NeoX style).
        inplace: if True, write the result into x and return x.
        seqlen_offsets: int, or int32 / int64 tensor (batch_size,): each sequence's positions
            start at this value (the tokens already in a KV cache, when decoding).
        cu_seqlens: (batch + 1,) int32 or None: with it, each sequence's positions restart at
            0 (plus its offset).
        max_seqlen: int, the longest sequence when cu_seqlens is given.
    Return:
        out: (batch_size, seqlen, nheads, headdim) if cu_seqlens is None,
            else (total_seqlen, nheads, headdim): the first rotary_dim dims of each head
            rotated, the rest of headdim unchanged.
    """
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens,
                                max_seqlen)


# FlashAttention-2 keeps this older name.
apply_rotary_emb_func = apply_rotary_emb


def _qk_heads(qkv: Tensor, num_heads_q: Optional[int]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Views (q, k, qk) into packed qkv, (batch, seqlen, 3, nheads, headdim) or
    (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim); qk covers the q and k heads as
    one (batch, seqlen, nheads_q + nheads_k, headdim) view where the strides allow it (one
    rotation instead of two when q and k share tables), else None."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"rotary: 5-D qkv must be (batch, seqlen, 3, nheads, headdim), got "
                             f"{tuple(qkv.shape)}")
        nheads = qkv.shape[3]
        qk = (qkv[:, :, :2].flatten(2, 3) if qkv.stride(2) == nheads * qkv.stride(3) else None)
        return qkv[:, :, 0], qkv[:, :, 1], qk
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError(f"rotary: qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, "
                         f"seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q "
                         f"given; got {tuple(qkv.shape)} and num_heads_q={num_heads_q}")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q <= 0 or qkv.shape[2] != num_heads_q + 2 * num_heads_k:
        raise ValueError(f"rotary: qkv has {qkv.shape[2]} heads, not num_heads_q + 2 * "
                         f"num_heads_k with num_heads_q={num_heads_q}")
    end_k = num_heads_q + num_heads_k
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:end_k], qkv[:, :, :end_k]


def _rotate_qkv_(qkv: Tensor, cos: Tensor, sin: Tensor, cos_k: Optional[Tensor],
                 sin_k: Optional[Tensor], interleaved: bool, seqlen_offsets: Union[int, Tensor],
                 num_heads_q: Optional[int], conjugate: bool) -> None:
    """Rotate q (by cos, sin) and k (by cos_k, sin_k, default cos, sin) of qkv in place."""
    q, k, qk = _qk_heads(qkv, num_heads_q)
    rotate = dict(seqlen_offsets=seqlen_offsets, interleaved=interleaved, inplace=True,
                  conjugate=conjugate)
    if cos_k is None and sin_k is None and qk is not None:
        apply_rotary(qk, cos, sin, **rotate)
        return
    apply_rotary(q, cos, sin, **rotate)
    apply_rotary(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, **rotate)


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    """:func:`apply_rotary_emb_qkv_`: rotates q and k of packed qkv in place."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, cos_k: Optional[Tensor] = None,
                sin_k: Optional[Tensor] = None, interleaved: bool = False,
                seqlen_offsets: Union[int, Tensor] = 0,
                num_heads_q: Optional[int] = None) -> Tensor:
        _rotate_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q,
                     conjugate=False)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cos_k, sin_k)
        ctx.interleaved = interleaved
        ctx.num_heads_q = num_heads_q
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv: Tensor):
        (cos, sin, cos_k, sin_k), seqlen_offsets = _load_offsets(ctx)
        # A copy, so that a gradient shared with other consumers is not modified; dv passes
        # through unchanged.
        dqkv = dqkv.clone()
        _rotate_qkv_(dqkv, cos, sin, cos_k, sin_k, ctx.interleaved, seqlen_offsets,
                     ctx.num_heads_q, conjugate=True)
        return dqkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos_k: Optional[Tensor] = None,
    sin_k: Optional[Tensor] = None,
    interleaved: bool = False,
    seqlen_offsets: Union[int, Tensor] = 0,
    num_heads_q: Optional[int] = None,
) -> Tensor:
    """
    Arguments:
        qkv: (batch_size, seqlen, 3, nheads, headdim), or
            (batch_size, seqlen, num_heads_q + 2 * num_heads_k, headdim) (MQA / GQA), in which
            case num_heads_q must be given.
        cos, sin: (seqlen, rotary_dim / 2), the tables for q.
        cos_k, sin_k: (seqlen, rotary_dim / 2) or None: the tables for k (default cos, sin).
        interleaved: if True, rotate pairs of even and odd dimensions (GPT-J style) instead of
            the 1st half and the 2nd half (GPT-NeoX style).
        seqlen_offsets: int, or int32 / int64 tensor (batch_size,): each sequence's positions
            start at this value (the tokens already in a KV cache, when decoding).
        num_heads_q: int, the number of q heads of a 4-D qkv.
    Return:
        qkv: the input, with the first rotary_dim dims of q and k rotated *in place*; v is
            unchanged.
    """
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets,
                                    num_heads_q)


class ApplyRotaryEmbKV_(torch.autograd.Function):
    """:func:`apply_rotary_emb_kv_`: rotates k of packed kv in place."""

    @staticmethod
    def forward(ctx, kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                seqlen_offsets: Union[int, Tensor] = 0) -> Tensor:
        if kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError(f"rotary: kv must be (batch, seqlen, 2, nheads, headdim), got "
                             f"{tuple(kv.shape)}")
        apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets,
                     interleaved=interleaved, inplace=True)
        _save_offsets(ctx, seqlen_offsets, cos, sin)
        ctx.interleaved = interleaved
        ctx.mark_dirty(kv)
        return kv

    @staticmethod
    def backward(ctx, dkv: Tensor):
        (cos, sin), seqlen_offsets = _load_offsets(ctx)
        dkv = dkv.clone()  # a gradient shared with other consumers stays unmodified
        apply_rotary(dkv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets,
                     interleaved=ctx.interleaved, inplace=True, conjugate=True)
        return dkv, None, None, None, None


def apply_rotary_emb_kv_(
    kv: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    seqlen_offsets: Union[int, Tensor] = 0,
) -> Tensor:
    """
    Arguments:
        kv: (batch_size, seqlen, 2, nheads, headdim).
        cos, sin: (seqlen, rotary_dim / 2).
        interleaved: if True, rotate pairs of even and odd dimensions (GPT-J style) instead of
            the 1st half and the 2nd half (GPT-NeoX style).
        seqlen_offsets: int, or int32 / int64 tensor (batch_size,): each sequence's positions
            start at this value (the tokens already in a KV cache, when decoding).
    Return:
        kv: the input, with the first rotary_dim dims of k rotated *in place*; v is unchanged.
    """
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embeddings (RoFormer, Su et al., https://arxiv.org/abs/2104.09864)
    applied in place to packed qkv, or to q and packed kv.

    Position p of a sequence rotates the pair of dims (i, i + dim / 2) (or (2i, 2i + 1) if
    interleaved) by the angle p * inv_freq[i], inv_freq[i] = base ** (-2i / dim). Heads wider
    than dim keep their remaining dims unchanged.

    With scale_base (xPos, Sun et al., https://arxiv.org/abs/2212.10554; 512 is a common
    value), q at position p is also multiplied by scale ** ((p - L // 2) / scale_base) and k
    divided by it, with scale[i] = (2i + 0.4 * dim) / (1.4 * dim) and L the length of the
    cached tables, so that q . k decays with the distance between them.

    The cos / sin tables are cached in the input's dtype and device, for as many positions as
    the longest call so far needed.
    """

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        interleaved: bool = False,
        scale_base: Optional[float] = None,
        device: Optional[torch.device] = None,
    ):
        """
        Arguments:
            dim: rotary_dim, the number of rotated dims of each head (even, <= headdim).
            base: the base of the rotation frequencies.
            interleaved: if True, rotate pairs of even and odd dimensions (GPT-J style) instead
                of the 1st half and the 2nd half (GPT-NeoX style).
            scale_base: None, or the xPos scale base.
            device: where the inv_freq and scale buffers are created.
        """
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        # Buffers follow .to() / .cuda() but are not part of the state dict: they are a
        # function of the constructor's arguments.
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = self._compute_scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached: Optional[Tensor] = None
        self._sin_cached: Optional[Tensor] = None
        self._cos_k_cached: Optional[Tensor] = None
        self._sin_k_cached: Optional[Tensor] = None

    def _compute_inv_freq(self, device: Optional[torch.device] = None) -> Tensor:
        """(dim / 2,) float32: base ** (-2i / dim)."""
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / (self.base ** exponents)

    def _compute_scale(self, device: Optional[torch.device] = None) -> Tensor:
        """(dim / 2,) float32: xPos's per-frequency decay base (2i + 0.4 * dim) / (1.4 * dim)."""
        return ((torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
                 + 0.4 * self.dim) / (1.4 * self.dim))

    def _update_cos_sin_cache(self, seqlen: int, device: Optional[torch.device] = None,
                              dtype: Optional[torch.dtype] = None) -> None:
        """Recompute the tables for seqlen positions when they are shorter, on another device
        or dtype, or inference tensors while training (autograd cannot save those)."""
        if not (seqlen > self._seq_len_cached
                or self._cos_cached is None
                or self._cos_cached.device != device
                or self._cos_cached.dtype != dtype
                or (self.training and self._cos_cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # Angles in float32 whatever the module's dtype: positions times frequencies in bf16
        # would be off by whole radians at long positions. The buffers are recomputed if a
        # .half() / .bfloat16() call has rounded them.
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:
            inv_freq = self._compute_inv_freq(device)
        # torch.outer, not einsum: autocast would run einsum in half precision.
        freqs = torch.outer(t, inv_freq.to(device))
        if self.scale is None:
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)
            return
        scale = self.scale
        if scale.dtype != torch.float32:
            scale = self._compute_scale(device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=device)
                 - seqlen // 2) / self.scale_base
        # (seqlen, dim / 2), in float32: a rounded base raised to large powers drifts fast.
        decay = scale.to(device) ** power[:, None]
        self._cos_cached = (torch.cos(freqs) * decay).to(dtype)
        self._sin_cached = (torch.sin(freqs) * decay).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / decay).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / decay).to(dtype)

    def forward(
        self,
        qkv: Tensor,
        kv: Optional[Tensor] = None,
        seqlen_offset: Union[int, Tensor] = 0,
        max_seqlen: Optional[int] = None,
        num_heads_q: Optional[int] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """
        Arguments:
            qkv: (batch, seqlen, 3, nheads, headdim) or
                (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) (MQA / GQA, with
                num_heads_q given) if kv is None, else q: (batch, seqlen, nheads, headdim).
            kv: (batch, seqlen, 2, nheads_k, headdim) or None.
            seqlen_offset: int, or int32 / int64 tensor (batch,): each sequence's positions
                start at this value (the tokens already in a KV cache, when decoding). With a
                tensor, pass max_seqlen so that the tables cover every position.
            max_seqlen: int or None: make the tables cover max_seqlen positions (otherwise
                seqlen + seqlen_offset for an int offset).
            num_heads_q: int, the number of q heads of a 4-D qkv.
        Return:
            qkv with q and k rotated *in place* if kv is None, else (q, kv) with q and k
            rotated in place.
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif not isinstance(seqlen_offset, Tensor):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device,
                                       dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("RotaryEmbedding: with a tensor seqlen_offset, pass max_seqlen "
                             "(the tables have not been computed yet)")
        scaled = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv, self._cos_cached, self._sin_cached,
                self._cos_k_cached if scaled else None, self._sin_k_cached if scaled else None,
                interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                num_heads_q=num_heads_q,
            )
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached,
                             interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if scaled else self._cos_cached,
                                  self._sin_k_cached if scaled else self._sin_cached,
                                  interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv
