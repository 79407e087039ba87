"""The public FlashAttention-2 style functions.

All seven functions validate their arguments (:mod:`flash_attn._validation`), then call
:func:`flash_attn.ops.flash_attn_fwd`: under ``torch.compile`` the custom op
``torch.ops.flash_attn._fwd``, whose autograd formula calls ``torch.ops.flash_attn._bwd``; in
eager mode the same kernels and backward formula without the custom op's dispatch overhead.
CUDA tensors run the compiled kernels (``flash_attn._C``); CPU tensors run the PyTorch reference
(:mod:`flash_attn.reference`), with the same semantics.

Notes common to all functions:

* Inputs whose last dim is not contiguous (``stride(-1) != 1``) are copied with
  ``.contiguous()``; other strides are passed through (the packed variants pass views of the
  packed tensor, without a copy).
* Head dims that are not a multiple of 8 are zero-padded to the next multiple of 8 before the op
  (a copy) and the output is sliced back; ``softmax_scale`` defaults to ``1 / sqrt(headdim)``
  of the original head dim. Gradients flow back through the padding and the slicing. On CUDA a
  v head dim other than q's (MLA) is padded the same way to the wider of the two, since the
  kernels take one head dim (with a paged cache, the padded copy is of the whole cache).
* ``dropout_p > 0`` draws the mask of ``flash_attn/dropout.py`` from the generator of q's device
  (on CUDA in the SM80 kernels, forward and backward, on every GPU).
* A learnable sink (``s_aux`` or ``learnable_sink``, two names for one argument, after
  FlashAttention-2's arguments) works on every path, forward and backward: the CPU reference
  has it in its softmax, the CUDA forward kernels join it to each finished row, and the
  backward kernels need nothing more than the LSE that includes it.
* FP8: every function takes ``float8_e4m3fn`` q, k, v (``flash_attn_with_kvcache``: q, the
  caches and the new k, v) with FlashAttention-3's ``q_descale``, ``k_descale``,
  ``v_descale`` (last), forward only, with a bfloat16 output: on CUDA the SM90 kernels
  (H100-class GPUs), on CPU the reference on the dequantized inputs (:mod:`flash_attn._fp8`
  says what each path takes).
"""

from __future__ import annotations

from typing import Optional, SupportsIndex, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _fp8
from . import _validation as V
from . import ops, reference
from .dropout import new_rng_state

# max_seqlen and other integer arguments: a Python int, a numpy integer or a 0-dim integer
# tensor, as FlashAttention-2 (and transformers' packed-sequence path) pass them.
IntLike = SupportsIndex
# The output, or (out, softmax_lse[, S_dmask]) with return_attn_probs / return_softmax_lse.
AttnResult = Union[Tensor, Tuple[Tensor, ...]]


__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


def _maybe_contiguous(x: Tensor) -> Tensor:
    return x.contiguous() if x.stride(-1) != 1 else x


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: V.AttnArgs,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    deterministic: bool,
    kv_batch_idx: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None,
):
    """(out, softmax_lse, rng_state) of the forward op, on inputs made kernel-ready: a last dim
    with stride 1, a head dim zero-padded to a multiple of 8 (the output sliced back).
    rng_state: the dropout mask's generator state (flash_attn/dropout.py), drawn here from
    the generator of q's device when dropout_p > 0, else None.

    A v head dim other than q's and k's (MLA) runs on the CUDA kernels, which take one head dim,
    with the narrower side zero-padded to the wider: zero columns of q and k add nothing to the
    scores, zero columns of v give output columns that are sliced off, and the gradients flow
    back through the padding. It costs the padded GEMM work and a copy of the padded tensors;
    kernels with two head dims would not.

    FP8 inputs (float8_e4m3fn, a.q_descale / k_descale / v_descale) go to the op as they are
    (out comes back in bfloat16), their head dim padded to a multiple of 16."""
    q, k, v = _maybe_contiguous(q), _maybe_contiguous(k), _maybe_contiguous(v)
    hd = v.shape[-1]  # the output's head dim (v's: it may differ from q's and k's)
    # A multiple of 8, as the kernels need (16 for FP8: 16 bytes either way).
    fp8 = a.dtype in _fp8.FP8_DTYPES
    width_qk = _fp8.kernel_headdim(a.dtype, a.headdim)
    width_v = _fp8.kernel_headdim(a.dtype, hd)
    if q.device.type != "cpu" and width_qk != width_v:
        width_qk = width_v = max(width_qk, width_v)
    pad = _fp8.pad_headdim if fp8 else _pad_headdim
    if width_qk != a.headdim:
        q, k = pad(q, width_qk - a.headdim), pad(k, width_qk - a.headdim)
    pad_v = width_v - hd
    if pad_v:
        v = pad(v, pad_v)
    rng_state = new_rng_state(q.device) if a.dropout_p > 0.0 else None
    out, lse = ops.flash_attn_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        a.softmax_scale, a.causal, a.window_left, a.window_right, a.softcap, deterministic,
        kv_batch_idx, block_table, leftpad_k, a.alibi_slopes, a.sink, a.dropout_p, rng_state,
        0, a.q_descale, a.k_descale, a.v_descale,  # sm_margin 0, then FP8's descales
    )
    return (out[..., :hd] if pad_v else out), lse, rng_state


def _pad_headdim(x: Tensor, n: int) -> Tensor:
    return F.pad(x, [0, n])


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: V.AttnArgs,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    deterministic: bool,
    return_attn_probs: bool,
    block_table: Optional[Tensor] = None,
):
    out, lse, rng_state = _forward(q, k, v, a, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q,
                                   max_seqlen_k, deterministic, block_table=block_table)
    if not return_attn_probs:
        return out
    if a.dtype in _fp8.FP8_DTYPES:  # the CPU reference's: of the dequantized q and k
        q = _fp8.dequantize(q, a.q_descale, cu_seqlens_q)
        k = _fp8.dequantize(k, a.k_descale, cu_seqlens_k)
    probs = reference.attention_probs_ref(
        q.detach(), k.detach(), lse.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, a.softmax_scale, a.causal, a.window_left, a.window_right, a.softcap,
        a.alibi_slopes, a.dropout_p, rng_state,
    )
    return out, lse, probs


_RETURN_DOC = """
    Return:
        out: {out_shape}.
        softmax_lse [optional, if return_attn_probs=True]: {lse_shape}, float32. The
            logsumexp of each row of the matrix QK^T * scaling (e.g., log of the softmax
            normalization factor), the sink's logit included when there is one; +inf for rows
            that attend to no key (with a sink: the sink's logit).
        S_dmask [optional, if return_attn_probs=True]: {probs_shape}. The attention
            probabilities softmax(QK^T * scaling + ALiBi bias) with the masks applied (0 where
            masked; a learnable sink's column left out; with dropout, the dropped entries
            negated, as FlashAttention-2 encodes them),
            materialized in PyTorch from q, k and softmax_lse, in float32 (float64 for float64
            inputs), without gradients. This is for testing only: it costs O(seqlen_q *
            seqlen_k) memory and is not what the kernel computes internally.
"""

_BATCHED_RETURN = _RETURN_DOC.format(
    out_shape="(batch_size, seqlen, nheads, headdim_v)",
    lse_shape="(batch_size, nheads, seqlen)",
    probs_shape="(batch_size, nheads, seqlen_q, seqlen_k)",
)
_VARLEN_RETURN = _RETURN_DOC.format(
    out_shape="(total, nheads, headdim_v)",
    lse_shape="(nheads, total_q_seqlen)",
    probs_shape="(batch_size, nheads, max_seqlen_q, max_seqlen_k),\n            zero "
    "beyond each sequence's lengths",
)

_SCORE_ARGS_DOC = """
        softmax_scale: float. The scaling of QK^T before applying softmax.
            Default to 1 / sqrt(headdim).
        causal: bool. Whether to apply causal attention mask (e.g., for auto-regressive
            modeling).
        window_size: (left, right). If not (-1, -1), implements sliding window local
            attention.
        softcap: float. Anything > 0 activates softcapping attention.
        alibi_slopes: (nheads,) or (batch_size, nheads), fp32. A bias of
            (-alibi_slope * |i + seqlen_k - seqlen_q - j|) is added to the attention score of
            query i and key j (after the softcap). On the Hopper path the forward then runs
            the SM80 kernels (the Hopper kernels take no bias)."""

_SINK_ARGS_DOC = """
        s_aux [optional]: (nheads,), float32 or q's dtype (converted to float32). A learnable
            attention sink, as in gpt-oss: for query head h, the logit s_aux[h] joins the
            softmax denominator of every row without a value vector, i.e. the probability of
            key j is exp(S_ij) / (sum_l exp(S_il) + exp(s_aux[h])) over the kept keys l, with
            S the scaled, softcapped, biased scores. softmax_lse includes it; -inf means no
            sink. The output is differentiable in it (its gradient reaches the tensor
            given).
        learnable_sink [optional]: (nheads,). Another name for s_aux (the name of
            FlashAttention-4; s_aux is vLLM's FlashAttention-3's); passing both raises
            ValueError."""

# FlashAttention-2's contract for max_seqlen, and what breaking it does here.
_MAX_SEQLEN_DOC = """
            As in FlashAttention-2, max_seqlen_q and max_seqlen_k are trusted: on CUDA a
            sequence longer than them is cut to its first max_seqlen_q queries and max_seqlen_k
            keys (a causal diagonal then aligned to the cut lengths; query rows past the cut
            get output 0 and lse +inf). The kernels record it, and the next call into
            flash_attn (or flash_attn.check_bad_inputs()) raises a ValueError for it;
            FLASH_ATTN_CHECK_INPUTS=1 checks before the launch, at one device sync per call.
            The CPU reference reads the lengths from cu_seqlens alone."""

_COMMON_ARGS_DOC = """
        dropout_p: float. Dropout probability, applied to the attention probabilities (kept
            ones scaled by 1 / (1 - dropout_p)); 0.0 during evaluation. The mask of
            flash_attn/dropout.py, seeded from the generator of q's device, so
            torch.manual_seed reproduces it (on CUDA the SM80 kernels draw it, also on
            H100).""" + _SCORE_ARGS_DOC + """
        deterministic: bool. Whether to use the deterministic implementation of the backward
            pass: dq's partial sums are added in a fixed order, so repeated runs give bitwise
            equal gradients. Both CUDA kernel families implement it (the key tiles add their
            parts of dq one at a time); the CPU reference is always deterministic.
        return_attn_probs: bool. Whether to return the attention probabilities. This option
            is for testing only: the probabilities are recomputed in PyTorch (see below)."""
_COMMON_ARGS_DOC_SINK = _COMMON_ARGS_DOC + _SINK_ARGS_DOC

_FP8_ARGS_DOC = """
        q_descale, k_descale, v_descale [optional]: (batch_size, nheads_k), float32, on q's
            device, for q, k, v in torch.float8_e4m3fn (all three; FlashAttention-3's names
            and shapes; batch_size is the number of sequences, len(cu_seqlens_q) - 1 for
            varlen). The call computes the attention of the dequantized inputs
            x.float() * descale: scores (q * q_descale) . (k * k_descale) * softmax_scale,
            output softmax . (v * v_descale), where query head h of sequence b uses entry
            [b, h // (nheads // nheads_k)] (its key/value head's); None means 1. The output is
            bfloat16 (softmax_lse float32). On CUDA the SM90 kernels run it (H100-class GPUs
            only; others raise NotImplementedError): batched and varlen, causal, window,
            softcap, MQA/GQA, the learnable sink, a paged K/V (block_table) in pages of a
            multiple of 8 rows; alibi_slopes, dropout_p > 0, return_attn_probs=True, a v
            head dim other than q's and other page sizes raise NotImplementedError there (CPU
            tensors run all of them on the reference, in float32). A backward through an FP8
            call raises NotImplementedError on both devices."""

_MASK_DOC = """
    If causal=True, the causal mask is aligned to the bottom right corner of the attention
    matrix. For example, if seqlen_q = 2 and seqlen_k = 5, the causal mask (1 = keep,
    0 = masked out) is:
        1 1 1 1 0
        1 1 1 1 1
    If seqlen_q = 5 and seqlen_k = 2, the causal mask is:
        0 0
        0 0
        0 0
        1 0
        1 1
    If a row of the mask is all zero, the output for that row is zero (and its logsumexp is
    +inf, or the sink's logit with a learnable sink).

    If window_size != (-1, -1), implements sliding window local attention. Query at position
    i will only attend to keys between
    [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]]
    inclusive.

    Inputs may be strided views (no copy); only a last dim with stride != 1 is copied
    (.contiguous()). Head dims that are not a multiple of 8 are zero-padded (a copy) and the
    output is sliced back. CPU tensors run the PyTorch reference implementation."""

_GQA_DOC = """
    Supports multi-query and grouped-query attention (MQA/GQA) by passing in KV with fewer
    heads than Q. Note that the number of heads in Q must be divisible by the number of heads
    in KV. For example, if Q has 6 heads and K, V have 2 heads, heads 0, 1, 2 of Q will
    attend to head 0 of K, V, and heads 3, 4, 5 of Q will attend to head 1 of K, V."""


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> AttnResult:
    fn = "flash_attn_qkvpacked_func"
    a = V.validate_qkvpacked(
        fn, qkv, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux,
        learnable_sink=learnable_sink, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale,
    )
    q, k, v = qkv.unbind(dim=2)
    return _attention(q, k, v, a, None, None, a.seqlen_q, a.seqlen_k, deterministic,
                      return_attn_probs)


flash_attn_qkvpacked_func.__doc__ = (
    """dropout_p should be set to 0.0 during evaluation.
    If Q, K, V are already stacked into 1 tensor, this function will be faster than
    calling flash_attn_func on Q, K, V since the backward pass avoids explicit concatenation
    of the gradients of Q, K, V. (Here q, k, v are views of qkv, without a copy; the gradient
    reaches qkv.)
    For multi-query and grouped-query attention (MQA/GQA), please see
    flash_attn_kvpacked_func and flash_attn_func.
"""
    + _MASK_DOC
    + """

    Arguments:
        qkv: (batch_size, seqlen, 3, nheads, headdim)"""
    + _COMMON_ARGS_DOC_SINK
    + _FP8_ARGS_DOC
    + _BATCHED_RETURN
)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> AttnResult:
    fn = "flash_attn_kvpacked_func"
    a = V.validate_kvpacked(
        fn, q, kv, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux,
        learnable_sink=learnable_sink, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale,
    )
    k, v = kv.unbind(dim=2)
    return _attention(q, k, v, a, None, None, a.seqlen_q, a.seqlen_k, deterministic,
                      return_attn_probs)


flash_attn_kvpacked_func.__doc__ = (
    """dropout_p should be set to 0.0 during evaluation.
    If K, V are already stacked into 1 tensor, this function will be faster than
    calling flash_attn_func on Q, K, V since the backward pass avoids explicit concatenation
    of the gradients of K, V. (Here k, v are views of kv; the gradient reaches kv.)
"""
    + _GQA_DOC
    + "\n"
    + _MASK_DOC
    + """

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim)"""
    + _COMMON_ARGS_DOC_SINK
    + _FP8_ARGS_DOC
    + _BATCHED_RETURN
)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> AttnResult:
    fn = "flash_attn_func"
    a = V.validate_qkv(
        fn, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux,
        learnable_sink=learnable_sink, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale,
    )
    return _attention(q, k, v, a, None, None, a.seqlen_q, a.seqlen_k, deterministic,
                      return_attn_probs)


flash_attn_func.__doc__ = (
    """dropout_p should be set to 0.0 during evaluation.
"""
    + _GQA_DOC
    + "\n"
    + _MASK_DOC
    + """

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim_v). headdim_v may differ from headdim
            (MLA, e.g. 192 / 128); on CUDA the narrower side is zero-padded to the wider head
            dim, whose kernels run."""
    + _COMMON_ARGS_DOC_SINK
    + _FP8_ARGS_DOC
    + _BATCHED_RETURN
)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: IntLike,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> AttnResult:
    fn = "flash_attn_varlen_qkvpacked_func"
    a = V.validate_varlen_qkvpacked(
        fn, qkv, cu_seqlens, max_seqlen, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux,
        learnable_sink=learnable_sink, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale,
    )
    q, k, v = qkv.unbind(dim=1)
    return _attention(q, k, v, a, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                      deterministic, return_attn_probs)


flash_attn_varlen_qkvpacked_func.__doc__ = (
    """dropout_p should be set to 0.0 during evaluation.
    If Q, K, V are already stacked into 1 tensor, this function will be faster than
    calling flash_attn_varlen_func on Q, K, V since the backward pass avoids explicit
    concatenation of the gradients of Q, K, V. (Here q, k, v are views of qkv; the gradient
    reaches qkv.)
    For multi-query and grouped-query attention (MQA/GQA), please see
    flash_attn_varlen_kvpacked_func and flash_attn_varlen_func.
"""
    + _MASK_DOC
    + """
    The masks are applied per sequence (seqlen_q = seqlen_k = that sequence's length).

    Arguments:
        qkv: (total, 3, nheads, headdim), where total = total number of tokens in the batch.
        cu_seqlens: (batch_size + 1,), dtype torch.int32. The cumulative sequence lengths
            of the sequences in the batch, used to index into qkv.
        max_seqlen: int. Maximum sequence length in the batch (max_seqlen_q and max_seqlen_k
            below)."""
    + _MAX_SEQLEN_DOC
    + _COMMON_ARGS_DOC_SINK
    + _FP8_ARGS_DOC
    + _VARLEN_RETURN
)


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: IntLike,
    max_seqlen_k: IntLike,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> AttnResult:
    fn = "flash_attn_varlen_kvpacked_func"
    a = V.validate_varlen_kvpacked(
        fn, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux,
        learnable_sink=learnable_sink, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale,
    )
    k, v = kv.unbind(dim=1)
    return _attention(q, k, v, a, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      deterministic, return_attn_probs)


flash_attn_varlen_kvpacked_func.__doc__ = (
    """dropout_p should be set to 0.0 during evaluation.
    If K, V are already stacked into 1 tensor, this function will be faster than
    calling flash_attn_varlen_func on Q, K, V since the backward pass avoids explicit
    concatenation of the gradients of K, V. (Here k, v are views of kv; the gradient
    reaches kv.)
"""
    + _GQA_DOC
    + "\n"
    + _MASK_DOC
    + """
    The masks are applied per sequence, with that sequence's seqlen_q and seqlen_k.

    Arguments:
        q: (total_q, nheads, headdim), where total_q = total number of query tokens in the
            batch.
        kv: (total_k, 2, nheads_k, headdim), where total_k = total number of key tokens in
            the batch.
        cu_seqlens_q: (batch_size + 1,), dtype torch.int32. The cumulative sequence lengths
            of the sequences in the batch, used to index into q.
        cu_seqlens_k: (batch_size + 1,), dtype torch.int32. The cumulative sequence lengths
            of the sequences in the batch, used to index into kv.
        max_seqlen_q: int. Maximum query sequence length in the batch.
        max_seqlen_k: int. Maximum key sequence length in the batch."""
    + _MAX_SEQLEN_DOC
    + _COMMON_ARGS_DOC_SINK
    + _FP8_ARGS_DOC
    + _VARLEN_RETURN
)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: IntLike,
    max_seqlen_k: IntLike,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> AttnResult:
    fn = "flash_attn_varlen_func"
    a = V.validate_varlen_qkv(
        fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, return_attn_probs=return_attn_probs,
        block_table=block_table, s_aux=s_aux, learnable_sink=learnable_sink,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
    )
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return _attention(q, k, v, a, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      deterministic, return_attn_probs, block_table)


flash_attn_varlen_func.__doc__ = (
    """dropout_p should be set to 0.0 during evaluation.
"""
    + _GQA_DOC
    + "\n"
    + _MASK_DOC
    + """
    The masks are applied per sequence, with that sequence's seqlen_q and seqlen_k.

    Arguments:
        q: (total_q, nheads, headdim), where total_q = total number of query tokens in the
            batch.
        k: (total_k, nheads_k, headdim), where total_k = total number of key tokens in the
            batch; or (num_blocks, page_block_size, nheads_k, headdim) if there's a
            block_table (i.e. paged KV cache).
        v: (total_k, nheads_k, headdim_v), where total_k = total number of key tokens in the
            batch; or (num_blocks, page_block_size, nheads_k, headdim_v) if there's a
            block_table. headdim_v may differ from headdim (as in flash_attn_func).
        cu_seqlens_q: (batch_size + 1,), dtype torch.int32. The cumulative sequence lengths
            of the sequences in the batch, used to index into q.
        cu_seqlens_k: (batch_size + 1,), dtype torch.int32. The cumulative sequence lengths
            of the sequences in the batch, used to index into kv (with a block_table: the
            key lengths, each at most max_num_blocks_per_seq * page_block_size).
        max_seqlen_q: int. Maximum query sequence length in the batch.
        max_seqlen_k: int. Maximum key sequence length in the batch."""
    + _MAX_SEQLEN_DOC
    + _COMMON_ARGS_DOC
    + """
        block_table [optional]: (batch_size, max_num_blocks_per_seq), dtype torch.int32. Key
            row r of sequence b is row r % page_block_size of page block_table[b, r //
            page_block_size] of k and v; page_block_size as in flash_attn_with_kvcache (any
            size >= 1). Forward only (a backward raises
            NotImplementedError), without return_attn_probs."""
    + _SINK_ARGS_DOC
    + _FP8_ARGS_DOC
    + _VARLEN_RETURN
)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    s_aux: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> AttnResult:
    fn = "flash_attn_with_kvcache"
    c = V.validate_kvcache(
        fn, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
        rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, s_aux, learnable_sink,
        q_descale, k_descale, v_descale,
    )
    a = c.attn
    first = c.cache_seqlens
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    seqused_k = None
    if cache_batch_idx is not None:
        cache_batch_idx = cache_batch_idx.contiguous()
    if cache_leftpad is not None:
        cache_leftpad = cache_leftpad.contiguous()
    if first is not None or cache_leftpad is not None:
        # One kernel: the new rows written, q rotated, the key counts (from the pad on).
        q_rot = torch.empty_like(q) if c.rotary_dim else None
        local = a.causal or a.window_left >= 0 or a.window_right >= 0
        lengths = first.contiguous() if isinstance(first, Tensor) else None
        offset = a.seqlen_k if first is None else (first if isinstance(first, int) else 0)
        # Not differentiable (a backward with cache_seqlens or cache_leftpad raises).
        with torch.no_grad():
            seqused_k = ops.kvcache_update(
                k_cache, v_cache, q_rot, q, k, v, lengths, offset, cache_batch_idx, rotary_cos,
                rotary_sin, c.rotary_interleaved, local, block_table, cache_leftpad,
            )
        q = q if q_rot is None else q_rot
    # With cache_batch_idx the kernels read entry cache_batch_idx[b] in place (kv_batch_idx),
    # and a paged cache's pages through its block table.
    if block_table is not None:
        keys, values, kv_batch_idx = k_cache, v_cache, None
    elif cache_batch_idx is None:
        keys, values, kv_batch_idx = k_cache[:a.batch], v_cache[:a.batch], None
    else:
        keys, values, kv_batch_idx = k_cache, v_cache, cache_batch_idx
    out, lse, _ = _forward(q, keys, values, a, None, None, seqused_k, a.seqlen_q, a.seqlen_k,
                           False, kv_batch_idx, block_table, cache_leftpad)
    return (out, lse) if c.return_softmax_lse else out


flash_attn_with_kvcache.__doc__ = """
    If k and v are not None, k_cache and v_cache will be updated *inplace* with the new values
    from k and v. This is useful for incremental decoding: you can pass in the cached keys and
    values from the previous step, and update them with the new keys and values from the
    current step, and do attention with the updated cache, all in one call.

    Also apply rotary embedding if rotary_cos and rotary_sin are passed in. The key k will be
    rotated by rotary_cos and rotary_sin at indices cache_seqlens, cache_seqlens + 1, etc. If
    causal or local (i.e., window_size != (-1, -1)), the query q will be rotated by rotary_cos
    and rotary_sin at indices cache_seqlens, cache_seqlens + 1, etc. If not causal and not
    local, the query q will be rotated by rotary_cos and rotary_sin at indices cache_seqlens
    only (i.e. we consider all tokens in q to be at position cache_seqlens). The rotation is
    computed in float32, on CUDA by one kernel that also writes the new rows into the cache,
    before the attention runs.

    The attention of batch entry b reads the first cache_seqlens[b] + seqlen_new rows of its
    cache entry (after the update), from row cache_leftpad[b] on if cache_leftpad is given;
    the causal mask and the window are aligned bottom-right to the rows read.
""" + _GQA_DOC + """

    The cache is read in place, with or without cache_batch_idx or block_table. This is an
    inference API: a backward pass through it raises NotImplementedError whenever
    cache_seqlens, cache_leftpad or block_table is given (the backward kernels take none).
    Sequences that share cache rows (a repeated cache_batch_idx, or pages in several rows of
    block_table) and append k/v there leave those rows holding any one of their values.

    Arguments:
        q: (batch_size, seqlen, nheads, headdim)
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), batch_size_cache >=
            batch_size without cache_batch_idx; or (num_blocks, page_block_size, nheads_k,
            headdim) if there's a block_table (i.e. paged KV cache), page_block_size >= 1.
        v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) or (num_blocks,
            page_block_size, nheads_k, headdim) if there's a block_table.
        k [optional]: (batch_size, seqlen_new, nheads_k, headdim). If not None, we concatenate
            k with k_cache, starting at the indices specified by cache_seqlens.
        v [optional]: (batch_size, seqlen_new, nheads_k, headdim). Similar to k.
        rotary_cos [optional]: (seqlen_ro, rotary_dim / 2), q's dtype or float32; rotary_dim
            <= headdim. A position past seqlen_ro is refused on CPU and on CUDA with
            FLASH_ATTN_CHECK_INPUTS=1; otherwise it reads the last row (never out of range).
        rotary_sin [optional]: (seqlen_ro, rotary_dim / 2). Similar to rotary_cos. Both
            need k and v (as in FlashAttention-2; without them a ValueError).
        cache_seqlens: int, or (batch_size,), dtype torch.int32. The sequence lengths of the
            KV cache; required with k and v. None (without k and v): every row of the cache.
            Lengths past seqlen_cache - seqlen_new never write or read outside the cache: the
            rows that would land past its end are dropped (checked and refused on CPU, and on
            CUDA with FLASH_ATTN_CHECK_INPUTS=1; without it the kernels record the value and
            the next call raises it, see flash_attn.check_bad_inputs).
        cache_batch_idx: (batch_size,), dtype torch.int32. The indices used to index into the
            KV cache. If None, we assume that the batch indices are [0, 1, 2, ..., batch_size -
            1]; out-of-range entries are clamped and raised by the next call. If the indices
            are not distinct, and k and v are provided, the values updated
            in the cache might come from any of the duplicate indices.
        cache_leftpad [optional]: (batch_size,), dtype torch.int32. The index that the KV
            cache starts: sequence b's keys are its cache rows [cache_leftpad[b],
            cache_seqlens[b] + seqlen_new). If None, assume 0. New rows are still written at
            cache_seqlens, and rotary positions are cache rows (as in FlashAttention-2). Works
            with block_table too (row cache_leftpad[b] of the sequence's pages). Values outside
            [0, cache_seqlens] are refused on CPU and on CUDA with FLASH_ATTN_CHECK_INPUTS=1;
            otherwise clamped, and raised by the next call (flash_attn.check_bad_inputs).
        block_table [optional]: (batch_size, max_num_blocks_per_seq), dtype torch.int32. Row
            r of sequence b is row r % page_block_size of page block_table[b, r //
            page_block_size]; the cache's length is max_num_blocks_per_seq * page_block_size.
            Not with cache_batch_idx. Pages of any size >= 1 are read in place: on the Hopper
            kernels where the page is a multiple of 8 rows and cache_leftpad is not given
            (fastest where it holds whole key blocks: 128 rows for headdim <= 128, 96 to 192,
            80 to 256), else on the SM80 kernels, which gather a key block row by
            row.""" + _SCORE_ARGS_DOC + """
        rotary_interleaved: bool. Only applicable if rotary_cos and rotary_sin are passed in.
            If True, rotary embedding will combine dimensions 0 & 1, 2 & 3, etc. If False,
            rotary embedding will combine dimensions 0 & rotary_dim / 2, 1 & rotary_dim / 2 +
            1 (i.e. GPT-NeoX style).
        num_splits: int. Must be 0: the kernels choose how many pieces to split the keys into
            (FLASH_ATTN_SPLIT=0 turns the split off); other values raise NotImplementedError.
        return_softmax_lse: bool. Whether to return the logsumexp of the attention scores.""" \
    + _SINK_ARGS_DOC + """
        q_descale, k_descale, v_descale [optional]: (batch_size, nheads_k), float32, for q,
            k_cache, v_cache (and k, v) in torch.float8_e4m3fn, as in flash_attn_func: row
            [b] scales sequence b's keys and values whichever cache entry or pages it reads,
            the new rows included, which are written into the caches as they are (quantized
            by the caller for sequence b's k_descale / v_descale row; sequences that share
            cache rows with different descale rows read them at different scales). The
            output is bfloat16. On CUDA: with cache_seqlens, cache_batch_idx, cache_leftpad
            and pages of a multiple of 8 rows (GQA packed and the keys split over SMs as for
            bfloat16); other page sizes and cache_leftpad with block_table raise
            NotImplementedError there (CPU tensors run them on the reference), rotary_cos /
            rotary_sin on both devices (the rotated rows would be requantized).

    Return:
        out: (batch_size, seqlen, nheads, headdim).
        softmax_lse [optional, if return_softmax_lse=True]: (batch_size, nheads, seqlen),
            float32. The logsumexp of each row of the matrix QK^T * scaling (e.g., log of the
            softmax normalization factor), the sink's logit included when there is one; +inf
            for rows that attend to no key (with a sink: the sink's logit).
"""
