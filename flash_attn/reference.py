"""Pure-PyTorch reference attention with exactly the semantics of docs/INTERNALS.md.

This module is what the CPU path of :mod:`flash_attn.ops` runs, and what the GPU tests compare
the kernels against. It is written for clarity, not speed: it materializes the full
``(batch, nheads, seqlen_q, seqlen_k)`` score matrix.

Semantics (shared with the CUDA kernels):

* ``s = (q . k) * softmax_scale``; with ``softcap > 0``: ``s = softcap * tanh(s / softcap)``.
* Masks are aligned bottom-right: for query row ``i`` and key column ``j`` of one sequence, with
  ``shift = seqlen_k - seqlen_q``, the window ``(left, right)`` keeps
  ``i + shift - left <= j <= i + shift + right`` (a negative bound is unbounded), and
  ``causal=True`` means ``right = 0``. ``j < seqlen_k`` always.
* ``seqused_k[b]`` (optional) limits batch ``b`` to its first ``seqused_k[b]`` keys; the mask's
  ``seqlen_k`` is then ``seqused_k[b]``.
* ``alibi_slopes`` (optional, ``(nheads,)`` or ``(batch, nheads)``): the bias
  ``-slope * |i + shift + alibi_offset - j|`` (``shift`` as for the masks; ``alibi_offset``, 0
  by default, places a sub-block of a longer sequence, as ring attention calls it) is added to
  ``s`` of query head ``h`` (after the softcap), with ``slope = alibi_slopes[h]`` or
  ``alibi_slopes[b, h]``.
* Query head ``h`` reads key/value head ``h // (nheads // nheads_k)`` (GQA / MQA). v's head
  dim may differ from q's and k's (MLA); the output has v's, ``softmax_scale`` defaults to
  ``1 / sqrt`` of q's.
* ``sink`` (optional, ``(nheads,)``, the learnable sink of gpt-oss): the logit ``sink[h]``
  joins the softmax denominator of every row of query head ``h`` without a value vector:
  ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink[h]))`` over the kept ``k``, and the
  log-sum-exp includes it. ``-inf`` is no sink.
* A row with no kept column has output 0 and zero gradients, and log-sum-exp ``+inf``, or
  ``sink[h]`` with a sink (its softmax is the sink alone, which carries no value).
* ``dropout_p > 0`` with ``rng_state`` (flash_attn/dropout.py): after the softmax, each
  probability is dropped (0) or scaled by ``1 / (1 - dropout_p)`` as the mask of
  :func:`flash_attn.dropout.dropout_factor` says; the log-sum-exp is that of the softmax.

Everything is computed in float32 (float64 if any input is float64). ``out`` (and ``dq``,
``dk``, ``dv``) come back in the input dtype, ``softmax_lse`` always in float32 (as the kernels
return it). The forward is differentiable through ordinary torch ops, with no NaN gradients on
fully masked rows; :func:`attention_backward_ref` computes the same gradients explicitly (the
form the kernels use) so that it can run where autograd is not available (inside a custom op).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .dropout import dropout_factor

__all__ = [
    "attention_forward_ref",
    "attention_backward_ref",
    "attention_probs_ref",
    "keep_mask",
    "kvcache_update_ref",
    "unpage",
    "unpage_varlen",
    "paged_key_counts",
    "rotary_ref",
]


def _compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _normalize_window(causal: bool, window_left: int, window_right: int) -> Tuple[int, int]:
    left = -1 if window_left is None or window_left < 0 else int(window_left)
    right = -1 if window_right is None or window_right < 0 else int(window_right)
    if causal:
        right = 0
    return left, right


def keep_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    seqused_k: Optional[Tensor] = None,
    device: Optional[torch.device] = None,
) -> Tensor:
    """Boolean mask of kept (query, key) pairs, ``True`` = attended.

    Returns shape ``(seqlen_q, seqlen_k)``, or ``(batch, 1, seqlen_q, seqlen_k)`` when
    ``seqused_k (batch,)`` is given (then the effective ``seqlen_k`` of batch ``b``, used both for
    the bottom-right alignment and for the ``j < seqlen_k`` bound, is ``seqused_k[b]``).
    """
    left, right = _normalize_window(causal, window_left, window_right)
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    if seqused_k is not None:
        sk = seqused_k.to(device=device, dtype=torch.long).view(-1, 1, 1, 1)
        i = i.view(1, 1, seqlen_q, 1)
        j = j.view(1, 1, 1, seqlen_k)
    else:
        sk = seqlen_k
    diag = i + (sk - seqlen_q)  # the key column aligned with query row i
    keep = j < sk
    if left >= 0:
        keep = keep & (j >= diag - left)
    if right >= 0:
        keep = keep & (j <= diag + right)
    return keep


def _expand_kv_heads(x: Tensor, nheads: int) -> Tensor:
    """(b, s, nheads_k, d) -> (b, s, nheads, d): query head h reads kv head h // group."""
    nheads_k = x.shape[2]
    if nheads_k == nheads:
        return x
    return x.repeat_interleave(nheads // nheads_k, dim=2)


def _reduce_kv_heads(dx: Tensor, nheads_k: int) -> Tensor:
    """(b, s, nheads, d) -> (b, s, nheads_k, d): sum the gradients of each GQA group."""
    b, s, h, d = dx.shape
    if h == nheads_k:
        return dx
    return dx.reshape(b, s, nheads_k, h // nheads_k, d).sum(dim=3)


def _scores(q: Tensor, k: Tensor, softmax_scale: float, softcap: float):
    """q (b, sq, h, d), k (b, sk, h, d), compute dtype -> (s, tanh(s_raw/cap) or None), each
    (b, h, sq, sk)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _alibi_bias(slopes: Tensor, seqlen_q: int, seqlen_k: int, seqused_k: Optional[Tensor],
                dtype: torch.dtype, offset: int = 0) -> Tensor:
    """ALiBi's bias for slopes (h,) or (b, h), broadcastable to (b, h, sq, sk):
    -slope * |i + sk - sq + offset - j|, with sk the sequence's keys (seqused_k[b] when
    given)."""
    device = slopes.device
    i = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    sk = seqlen_k if seqused_k is None else seqused_k.to(device).long().view(-1, 1, 1, 1)
    per_head = slopes.to(dtype).view(-1, slopes.shape[-1], 1, 1)
    return -per_head * (i + sk - seqlen_q + offset - j).abs().to(dtype)


def _sequence_slopes(alibi_slopes: Optional[Tensor], b: int) -> Optional[Tensor]:
    """The slopes of varlen sequence b: (nheads,) as given, row b of (batch, nheads)."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[b:b + 1]


def _masked_softmax(s: Tensor, keep: Tensor, sink: Optional[Tensor] = None):
    """Softmax over the kept entries of the last dim without producing NaNs (values or grads),
    with the sink logits (broadcastable to s without its last dim, e.g. (1, h, 1)) as one more
    column of the denominator when given.

    Returns (p, lse), p without the sink's column: p is 0 where not kept, and rows with nothing
    kept get p = 0 and lse = +inf, or lse = sink with a sink.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
    # The row max is for numerical stability only; softmax is invariant to it, so detaching it
    # keeps the gradient exact while avoiding gradients through -inf / max.
    if s.shape[-1] == 0:  # no keys at all
        m = s.new_full(s.shape[:-1] + (1,), float("-inf"))
    else:
        m = torch.where(keep, s, neg_inf).amax(dim=-1, keepdim=True).detach()
    if sink is not None:
        sink = sink.unsqueeze(-1)
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    shifted = torch.where(keep, s - m, torch.zeros_like(s))
    e = torch.where(keep, torch.exp(shifted), torch.zeros_like(s))
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        # m >= sink unless sink is -inf, whose term (and its gradient) is then exactly 0.
        denom = denom + torch.exp(sink - m)
    has_any = denom > 0
    safe_denom = torch.where(has_any, denom, torch.ones_like(denom))
    p = e / safe_denom
    lse = torch.where(
        has_any, m + torch.log(safe_denom), torch.full_like(denom, float("inf"))
    ).squeeze(-1)
    return p, lse


def _check_scale(softmax_scale: Optional[float], headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    return float(softmax_scale)


def _sink_logits(sink: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """sink (h,) as (1, h, 1) in dtype: broadcastable to a (b, h, sq) row statistic."""
    return None if sink is None else sink.to(dtype).view(1, -1, 1)


def _forward_dense(q, k, v, softmax_scale, causal, window_left, window_right, softcap, seqused_k,
                   alibi=None, sink=None, drop=None, alibi_offset=0):
    """All inputs in the compute dtype, q (b, sq, h, d), k/v (b, sk, hk, d); alibi (h,),
    (b, h) or None, alibi_offset as in the module docstring; sink (h,) or None; drop:
    dropout's factor (b, h, sq, sk) or None.

    Returns out (b, sq, h, d), lse (b, h, sq), both in the compute dtype."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    ke = _expand_kv_heads(k, h)
    ve = _expand_kv_heads(v, h)
    s, _ = _scores(q, ke, softmax_scale, softcap)
    if alibi is not None:
        s = s + _alibi_bias(alibi, sq, sk, seqused_k, s.dtype, alibi_offset)
    keep = keep_mask(sq, sk, causal, window_left, window_right, seqused_k, device=q.device)
    p, lse = _masked_softmax(s, keep, _sink_logits(sink, s.dtype))
    if seqused_k is not None:
        # Rows past seqused_k are never read (an unused cache slot may hold NaN; 0 * NaN = NaN).
        used = torch.arange(sk, device=q.device)[None, :] < seqused_k.to(q.device)[:, None].long()
        ve = ve.masked_fill(~used[:, :, None, None], 0)
    out = torch.einsum("bhqk,bkhd->bqhd", p if drop is None else p * drop, ve)
    return out, lse


def _backward_dense(
    dout, q, k, v, softmax_scale, causal, window_left, window_right, softcap, seqused_k,
    alibi=None, sink=None, drop=None, alibi_offset=0,
):
    """Explicit gradients of _forward_dense's out w.r.t. q, k, v (all in the compute dtype).
    The sink only changes p (its column has no value, so the formulas are otherwise those
    without it)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    ke = _expand_kv_heads(k, h)
    ve = _expand_kv_heads(v, h)
    s, t = _scores(q, ke, softmax_scale, softcap)
    if alibi is not None:  # a constant of the score: t (the softcap's tanh) is unchanged
        s = s + _alibi_bias(alibi, sq, sk, seqused_k, s.dtype, alibi_offset)
    keep = keep_mask(sq, sk, causal, window_left, window_right, seqused_k, device=q.device)
    p, _ = _masked_softmax(s, keep, _sink_logits(sink, s.dtype))
    dv = torch.einsum("bhqk,bqhd->bkhd", p if drop is None else p * drop, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, ve)
    if drop is not None:
        dp = dp * drop  # the gradient reaching p through the dropped, scaled probabilities
    delta = (p * dp).sum(dim=-1, keepdim=True)  # == rowsum(dout * out)
    ds = p * (dp - delta)  # gradient w.r.t. the (capped) score; 0 where not kept
    if t is not None:
        ds = ds * (1.0 - t * t)  # d/dx [c * tanh(x / c)] = 1 - tanh^2
    ds = ds * softmax_scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q)
    return dq, _reduce_kv_heads(dk, hk), _reduce_kv_heads(dv, hk)


def _dropout(dropout_p: float, rng_state: Optional[Tensor], nheads: int, dtype: torch.dtype,
             device):
    """drop(entry0, entries, seqlen_q, seqlen_k): dropout's factor for those batch entries (or
    the varlen sequence entry0), or None without dropout."""
    if dropout_p == 0.0:
        return lambda *args: None
    if rng_state is None:
        raise ValueError("flash_attn.reference: dropout_p > 0 needs its rng_state")

    def drop(entry0: int, entries: int, seqlen_q: int, seqlen_k: int) -> Tensor:
        return dropout_factor(rng_state, dropout_p, entry0, entries, nheads, seqlen_q,
                              seqlen_k, dtype, device)

    return drop


def _empty_rows_lse(like: Tensor, nheads: int, rows: int, sink: Optional[Tensor]) -> Tensor:
    """(nheads, rows) log-sum-exp of rows that attend to no key: +inf, or sink[h] with a sink
    (-inf there is no sink: +inf)."""
    if sink is None:
        return like.new_full((nheads, rows), float("inf"))
    s = sink.to(like.dtype)
    s = torch.where(s == float("-inf"), torch.full_like(s, float("inf")), s)
    return s[:, None].expand(nheads, rows)


def _seq_bounds(cu_seqlens: Tensor) -> List[int]:
    return [int(x) for x in cu_seqlens.tolist()]


def attention_forward_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
    alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Reference forward.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), or (total_q, nheads, headdim) with cu_seqlens_q.
        k, v: (batch, seqlen_k, nheads_k, headdim), or (total_k, nheads_k, headdim); v's
            head dim may differ from q's and k's.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 (varlen), or both None.
        seqused_k: (batch,) int32 or None: batch b only uses its first seqused_k[b] keys.
        max_seqlen_q, max_seqlen_k: ignored (the reference reads the lengths from cu_seqlens).
        softmax_scale: default 1 / sqrt(headdim).
        causal, window_left, window_right, softcap, alibi_slopes, alibi_offset: see the module
            docstring.
        sink: (nheads,) or None: the learnable sink's logits (module docstring).
        dropout_p, rng_state: dropout (module docstring); rng_state (2,) or (5,) int64 when
            dropout_p > 0 (flash_attn/dropout.py).
    Return:
        out: q's shape with v's head dim, q's dtype, contiguous.
        softmax_lse: float32, (batch, nheads, seqlen_q), or
            (nheads, total_q) for varlen, the sink included; +inf for rows with no kept key
            (sink[h] with a sink, also on varlen rows past cu_seqlens_q[-1]).
    """
    del max_seqlen_q, max_seqlen_k
    cdt = _compute_dtype(q, k, v, sink)
    lse_dtype = torch.float32
    scale = _check_scale(softmax_scale, q.shape[-1])
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    drop = _dropout(dropout_p, rng_state, q.shape[-2], cdt, q.device)
    if cu_seqlens_q is None:
        out, lse = _forward_dense(
            qc, kc, vc, scale, causal, window_left, window_right, softcap, seqused_k,
            alibi_slopes, sink, drop(0, q.shape[0], q.shape[1], k.shape[1]), alibi_offset,
        )
        return out.to(q.dtype).contiguous(), lse.to(lse_dtype).contiguous()

    total_q, h, d = q.shape
    bq, bk = _seq_bounds(cu_seqlens_q), _seq_bounds(cu_seqlens_k)
    used = seqused_k.tolist() if seqused_k is not None else None
    out_parts, lse_parts = [], []
    covered = 0
    for b in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[b], bq[b + 1], bk[b], bk[b + 1]
        if used is not None:
            k1 = k0 + min(int(used[b]), k1 - k0)
        o, l = _forward_dense(
            qc[q0:q1].unsqueeze(0), kc[k0:k1].unsqueeze(0), vc[k0:k1].unsqueeze(0),
            scale, causal, window_left, window_right, softcap, None,
            _sequence_slopes(alibi_slopes, b), sink, drop(b, 1, q1 - q0, k1 - k0), alibi_offset,
        )
        out_parts.append(o[0])
        lse_parts.append(l[0])
        covered = q1
    # Rows past cu_seqlens_q[-1] (if any) belong to no sequence: they attend to no key (output
    # 0, lse +inf, or the sink's logit).
    dv = v.shape[-1]
    if covered < total_q:
        out_parts.append(qc.new_zeros(total_q - covered, h, dv))
        lse_parts.append(_empty_rows_lse(qc, h, total_q - covered, sink))
    out = torch.cat(out_parts, dim=0) if out_parts else qc.new_zeros(total_q, h, dv)
    lse = torch.cat(lse_parts, dim=1) if lse_parts else _empty_rows_lse(qc, h, total_q, sink)
    return out.to(q.dtype).contiguous(), lse.to(lse_dtype).contiguous()


def attention_backward_ref(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Optional[Tensor] = None,
    softmax_lse: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    *,
    seqused_k: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
    alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference backward: (dq, dk, dv) in the dtypes of (q, k, v), contiguous.

    The gradients are the exact gradients of :func:`attention_forward_ref`'s ``out``, recomputed
    from ``q, k, v`` in float32 (float64 for float64 inputs). ``out`` and ``softmax_lse`` are
    accepted for signature parity with ``flash_attn_cuda.bwd`` but are not used (recomputing
    them in high precision makes this a better reference than trusting a low-precision
    forward). ``dk``/``dv`` are summed over each GQA group. Rows with no kept key contribute
    nothing. ``sink`` (nheads,) is the forward's learnable sink (it changes the
    probabilities); its own gradient is :func:`flash_attn.ops.sink_grad`, from out, dout and
    softmax_lse. ``dropout_p`` and ``rng_state`` replay the forward's dropout mask;
    ``alibi_offset`` is the forward's.
    """
    del out, softmax_lse, max_seqlen_q, max_seqlen_k
    cdt = _compute_dtype(q, k, v, dout, sink)
    scale = _check_scale(softmax_scale, q.shape[-1])
    qc, kc, vc, doc = q.to(cdt), k.to(cdt), v.to(cdt), dout.to(cdt)
    drop = _dropout(dropout_p, rng_state, q.shape[-2], cdt, q.device)
    if cu_seqlens_q is None:
        dq, dk, dv = _backward_dense(
            doc, qc, kc, vc, scale, causal, window_left, window_right, softcap, seqused_k,
            alibi_slopes, sink, drop(0, q.shape[0], q.shape[1], k.shape[1]), alibi_offset,
        )
    else:
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        bq, bk = _seq_bounds(cu_seqlens_q), _seq_bounds(cu_seqlens_k)
        used = seqused_k.tolist() if seqused_k is not None else None
        for b in range(len(bq) - 1):
            q0, q1, k0, k1 = bq[b], bq[b + 1], bk[b], bk[b + 1]
            if used is not None:
                k1 = k0 + min(int(used[b]), k1 - k0)
            g = _backward_dense(
                doc[q0:q1].unsqueeze(0), qc[q0:q1].unsqueeze(0), kc[k0:k1].unsqueeze(0),
                vc[k0:k1].unsqueeze(0), scale, causal, window_left, window_right, softcap, None,
                _sequence_slopes(alibi_slopes, b), sink, drop(b, 1, q1 - q0, k1 - k0),
                alibi_offset,
            )
            dq[q0:q1] = g[0][0]
            dk[k0:k1] = g[1][0]
            dv[k0:k1] = g[2][0]
    return (
        dq.to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype).contiguous(),
    )


def attention_probs_ref(
    q: Tensor,
    k: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
) -> Tensor:
    """The attention probabilities ``exp(s - softmax_lse)`` on kept entries, 0 elsewhere. With
    dropout, the entries the mask drops are negated (FlashAttention-2's convention), the others
    left unscaled.

    Used by ``return_attn_probs=True`` (testing only). Computed in float32 (float64 for float64
    inputs) and returned in that dtype, without gradients.

    Return:
        (batch, nheads, seqlen_q, seqlen_k); for varlen (batch, nheads, max_seqlen_q,
        max_seqlen_k), zero-padded past each sequence's lengths.
    """
    cdt = _compute_dtype(q, k)
    scale = _check_scale(softmax_scale, q.shape[-1])
    with torch.no_grad():
        qc, kc = q.to(cdt), k.to(cdt)
        lse = softmax_lse.to(cdt)

        drop = _dropout(dropout_p, rng_state, q.shape[-2], cdt, q.device)

        def dense(qb, kb, lseb, alibi, entry0):
            h = qb.shape[2]
            s, _ = _scores(qb, _expand_kv_heads(kb, h), scale, softcap)
            if alibi is not None:
                s = s + _alibi_bias(alibi, qb.shape[1], kb.shape[1], None, s.dtype)
            keep = keep_mask(qb.shape[1], kb.shape[1], causal, window_left, window_right,
                             device=qb.device)
            # exp(s - (+inf)) = 0 on rows with nothing kept; where() also drops masked entries.
            p = torch.where(keep, torch.exp(s - lseb.unsqueeze(-1)), torch.zeros_like(s))
            factor = drop(entry0, qb.shape[0], qb.shape[1], kb.shape[1])
            return p if factor is None else torch.where(factor > 0, p, -p)

        if cu_seqlens_q is None:
            return dense(qc, kc, lse, alibi_slopes, 0)
        bq, bk = _seq_bounds(cu_seqlens_q), _seq_bounds(cu_seqlens_k)
        batch = len(bq) - 1
        lens_q = [bq[i + 1] - bq[i] for i in range(batch)]
        lens_k = [bk[i + 1] - bk[i] for i in range(batch)]
        mq = max(lens_q, default=0) if max_seqlen_q is None else int(max_seqlen_q)
        mk = max(lens_k, default=0) if max_seqlen_k is None else int(max_seqlen_k)
        if any(n > mq for n in lens_q) or any(n > mk for n in lens_k):
            raise ValueError(
                f"attention_probs_ref: max_seqlen_q={mq} / max_seqlen_k={mk} are smaller than "
                f"the longest sequence in cu_seqlens_q ({max(lens_q)}) / cu_seqlens_k "
                f"({max(lens_k)})"
            )
        h = q.shape[1]
        probs = qc.new_zeros(batch, h, mq, mk)
        for b in range(batch):
            p = dense(
                qc[bq[b]:bq[b + 1]].unsqueeze(0),
                kc[bk[b]:bk[b + 1]].unsqueeze(0),
                lse[:, bq[b]:bq[b + 1]].unsqueeze(0),
                _sequence_slopes(alibi_slopes, b), b,
            )
            probs[b, :, : lens_q[b], : lens_k[b]] = p[0]
        return probs


# --------------------------------------------------------------------------------------------
# Rotary embedding, and flash_attn_with_kvcache's cache update
# --------------------------------------------------------------------------------------------


def rotary_ref(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool,
               conjugate: bool = False) -> Tensor:
    """Rotary embedding of the first rotary_dim = 2 * cos.shape[1] dims of x, the one
    implementation behind flash_attn_with_kvcache's rotary, flash_attn.layers.rotary and
    flash_attn.ops.triton.rotary.

    Arguments:
        x: (..., nheads, headdim), headdim >= rotary_dim.
        cos, sin: (seqlen_ro, rotary_dim / 2).
        pos: (...), integer, the position of each row of x (x's shape without the last two
            dims, or broadcastable to it). A position outside [0, seqlen_ro) leaves its row
            unrotated (cos = 1, sin = 0), as FlashAttention-2's rotary kernel does.
        interleaved: rotate the pairs (0, 1), (2, 3), ... (GPT-J) instead of (i, i +
            rotary_dim / 2) (GPT-NeoX).
        conjugate: rotate by -sin (the inverse rotation, which is also the backward).
    Return:
        out: (..., nheads, rotary_dim) in x's dtype, computed in float32 (float64 for float64
            x). The dims of x past rotary_dim are not part of it.
    """
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    seqlen_ro, half = cos.shape
    rd = 2 * half
    inside = (pos >= 0) & (pos < seqlen_ro)
    idx = pos.clamp(0, max(seqlen_ro - 1, 0))
    # An empty table still has to be indexable; every position is then outside it.
    cos_t = cos.to(cdt) if seqlen_ro > 0 else cos.new_ones(1, half, dtype=cdt)
    sin_t = sin.to(cdt) if seqlen_ro > 0 else sin.new_zeros(1, half, dtype=cdt)
    c = torch.where(inside[..., None], cos_t[idx], 1.0).unsqueeze(-2)  # (..., 1, rd / 2)
    s = torch.where(inside[..., None], sin_t[idx], 0.0).unsqueeze(-2)
    if conjugate:
        s = -s
    xr = x[..., :rd].to(cdt)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return rot.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """x (batch, seqlen, nheads, headdim) with its first rotary_dim dims rotated at positions
    pos (batch, seqlen), clamped to the table as the cache-update kernel clamps them."""
    rot = rotary_ref(x, cos, sin, pos.clamp(0, cos.shape[0] - 1), interleaved)
    return torch.cat((rot, x[..., rot.shape[-1]:]), dim=-1)


def unpage(x: Tensor, block_table: Tensor) -> Tensor:
    """A paged K or V (num_pages, page_size, nheads_k, headdim) as the contiguous
    (batch, max_num_blocks_per_seq * page_size, nheads_k, headdim) its block_table (batch,
    max_num_blocks_per_seq) describes; page indices are clamped into the pages."""
    pages = block_table.long().clamp(0, x.shape[0] - 1)
    return x[pages].flatten(1, 2)


def unpad_left(k: Tensor, v: Tensor, seqused_k: Tensor,
               leftpad_k: Tensor) -> Tuple[Tensor, Tensor]:
    """A left-padded batched K/V (batch, seqlen_k, nheads_k, headdim) as the kernels read it:
    sequence b's keys are the seqused_k[b] rows from row leftpad_k[b] (seqused_k clamped into
    [0, seqlen_k], leftpad_k into [0, seqlen_k - seqused_k[b]]). Returns (k, v) with those
    rows moved to the front of each entry; seqused_k then counts them."""
    seqlen_k = k.shape[1]
    if seqlen_k == 0:
        return k, v
    used = seqused_k.long().clamp(0, seqlen_k)
    first = torch.minimum(leftpad_k.long().clamp(min=0), seqlen_k - used)
    rows = (first[:, None] + torch.arange(seqlen_k, device=k.device)).clamp(max=seqlen_k - 1)
    batch = torch.arange(k.shape[0], device=k.device)[:, None]
    return k[batch, rows], v[batch, rows]


def paged_key_counts(cu_seqlens_k: Tensor, capacity: int, max_seqlen_k: int) -> Tensor:
    """The keys of each sequence of a paged varlen call, as the kernels count them from any
    cu_seqlens_k: offsets clamped into [0, total] (total = batch * capacity, capped below
    2^31) and nondecreasing, each count at most min(max_seqlen_k, capacity), where capacity
    is the table's width times the page size."""
    cu = cu_seqlens_k.long()
    total = min((cu.shape[0] - 1) * capacity, 2**31 - 1)
    k0 = cu[:-1].clamp(0, total)
    k1 = torch.maximum(cu[1:], k0).clamp(max=total)
    return (k1 - k0).clamp(max=min(max_seqlen_k, capacity))


def unpage_varlen(x: Tensor, block_table: Tensor, lens: Tensor) -> Tensor:
    """A paged K or V (num_pages, page_size, nheads_k, headdim) as varlen
    (sum(lens), nheads_k, headdim): sequence b's lens[b] keys are the first rows of its
    pages."""
    full = unpage(x, block_table)
    return torch.cat([full[b, :n] for b, n in enumerate(lens.tolist())] + [full[:0, 0]])


def kvcache_update_ref(
    k_cache: Tensor,
    v_cache: Tensor,
    q_rot: Optional[Tensor],
    q: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    seqlen_offset: int,
    cache_batch_idx: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    rotary_interleaved: bool,
    q_rows_advance: bool,
    block_table: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
) -> Tensor:
    """The cache update of ``flash_attn_with_kvcache``, in place; returns ``seqused_k``.

    Arguments:
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), written in place.
        q_rot: (batch, seqlen_q, nheads, headdim), written with q rotated; given exactly when
            rotary_cos / rotary_sin are.
        q: (batch, seqlen_q, nheads, headdim).
        k, v: (batch, seqlen_new, nheads_k, headdim) or None. Row j of batch b goes to row
            first[b] + j of cache entry cache_batch_idx[b] (clamped; b without it), k rotated
            at that position first; rows outside the cache are dropped.
        cache_seqlens: int32 (batch,) first[b], or None: first[b] = seqlen_offset.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2); positions are clamped to the
            tables. q row j is rotated at first[b] + j with q_rows_advance, else at first[b].
        block_table: paged caches (num_pages, page_size, nheads_k, headdim): row r of batch b
            is row r % page_size of page block_table[b, r // page_size] (clamped); the caches'
            length is then max_num_blocks_per_seq * page_size.
        cache_leftpad: int32 (batch,) or None: the first cache row of each sequence's keys,
            clamped into [0, end[b]].
    Return:
        seqused_k: int32 (batch,), the keys of each sequence: end[b] - cache_leftpad[b], with
            end[b] = min(max(first[b] + seqlen_new, 0), seqlen_cache).
    """
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("flash_attn: block_table and cache_batch_idx cannot be used together")
    batch, seqlen_q = q.shape[0], q.shape[1]
    page_size = k_cache.shape[1]
    seqlen_cache = page_size if block_table is None else block_table.shape[1] * page_size
    seqlen_new = 0 if k is None else k.shape[1]
    if seqlen_new > seqlen_cache:
        raise ValueError(f"flash_attn: k has {seqlen_new} rows, more than the cache's "
                         f"{seqlen_cache}")
    first = (torch.full((batch,), seqlen_offset, dtype=torch.long, device=q.device)
             if cache_seqlens is None else cache_seqlens.long())
    if rotary_cos is not None:
        assert q_rot is not None and k is not None
        steps = torch.arange(seqlen_q, device=q.device) * int(q_rows_advance)
        q_rot.copy_(_rotate(q, rotary_cos, rotary_sin, first[:, None] + steps,
                            rotary_interleaved))
        pos = first[:, None] + torch.arange(seqlen_new, device=q.device)
        k = _rotate(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
    if k is not None and batch > 0:
        # Rows past the cache's end wrap around onto rows that keep their values (seqlen_new
        # <= seqlen_cache keeps them distinct from the written ones): no index is out of range.
        pos = first[:, None] + torch.arange(seqlen_new, device=q.device)
        rows = torch.remainder(pos, seqlen_cache)
        inside = (rows == pos)[..., None, None]
        if block_table is not None:
            seqs = block_table.long().gather(1, rows // page_size).clamp(0, k_cache.shape[0] - 1)
            rows = rows % page_size
        elif cache_batch_idx is None:
            seqs = torch.arange(batch, device=q.device)[:, None].expand_as(rows)
        else:
            seqs = cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1)[:, None].expand_as(rows)
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache[seqs, rows] = torch.where(inside, new, cache[seqs, rows])
    end = (first + seqlen_new).clamp(0, seqlen_cache)
    if cache_leftpad is not None:
        end = end - torch.minimum(cache_leftpad.long().clamp(min=0), end)
    return end.to(torch.int32)
