"""FP8 (e4m3) inputs of ``flash_attn_func`` / ``flash_attn_varlen_func`` (issue 30 item 3).

q, k and v in ``torch.float8_e4m3fn``, with optional ``q_descale``, ``k_descale``,
``v_descale`` of shape ``(batch, nheads_k)`` (FlashAttention-3's names: query head h of
sequence b uses the entry of its key/value head), give a bfloat16 output: attention of the
dequantized inputs ``x.float() * descale``. The CPU reference implements it by dequantizing and
running the float32 path; the CUDA kernels do not take FP8 yet (NotImplementedError). There is
no FP8 backward: a backward through an FP8 forward raises NotImplementedError.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

FP8_DTYPES = (torch.float8_e4m3fn,)


def is_fp8(x) -> bool:
    return isinstance(x, Tensor) and x.dtype in FP8_DTYPES


def _descale(fn: str, name: str, d: Optional[Tensor], batch: int, nheads_k: int,
             device) -> Tensor:
    if d is None:
        return torch.ones(batch, nheads_k, dtype=torch.float32, device=device)
    if not isinstance(d, Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor or None, got {type(d).__name__}")
    if d.dtype != torch.float32 or tuple(d.shape) != (batch, nheads_k) or d.device != device:
        raise ValueError(
            f"{fn}: {name} must be a float32 tensor of shape (batch, nheads_k) = "
            f"({batch}, {nheads_k}) on q's device, got {d.dtype} {tuple(d.shape)} on {d.device}"
        )
    return d


def check_inputs(fn: str, q, k, v) -> None:
    """An FP8 call's q, k, v: all float8_e4m3fn, on the CPU (the reference)."""
    for name, x in zip(("q", "k", "v"), (q, k, v)):
        if not is_fp8(x):
            raise TypeError(
                f"{fn}: q, k and v must all be float8_e4m3fn for an FP8 call, got {name} of "
                f"dtype {getattr(x, 'dtype', type(x).__name__)}"
            )
    if q.device.type != "cpu":
        raise NotImplementedError(
            f"{fn}: FP8 (float8_e4m3fn) inputs are not implemented by the CUDA kernels yet; "
            f"the CPU reference implements them: pass CPU tensors, or bf16/fp16 inputs"
        )


def apply_descales(fn: str, q: Tensor, k: Tensor, v: Tensor, q_descale, k_descale, v_descale,
                   cu_seqlens_q: Optional[Tensor] = None,
                   cu_seqlens_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """x * descale for the float32 q, k, v of an FP8 call, already validated as attention
    inputs (batched (b, s, h, d), or varlen (total, h, d) with each token's sequence read from
    cu_seqlens). The descales (float32 (batch, nheads_k), None: 1) carry no gradient."""
    varlen = cu_seqlens_q is not None
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    batch = (cu_seqlens_q.numel() - 1) if varlen else q.shape[0]
    group = nheads // nheads_k

    def apply(x: Tensor, d: Tensor, cu: Optional[Tensor]) -> Tensor:
        per_head = d.repeat_interleave(group, dim=1) if x.shape[-2] == nheads else d
        if not varlen:
            return x * per_head[:, None, :, None]
        rows = torch.repeat_interleave(per_head, (cu[1:] - cu[:-1]).long(), dim=0)
        return x * rows[:, :, None]

    qd = _descale(fn, "q_descale", q_descale, batch, nheads_k, q.device).detach()
    kd = _descale(fn, "k_descale", k_descale, batch, nheads_k, q.device).detach()
    vd = _descale(fn, "v_descale", v_descale, batch, nheads_k, q.device).detach()
    return apply(q, qd, cu_seqlens_q), apply(k, kd, cu_seqlens_k), apply(v, vd, cu_seqlens_k)


def as_float32(fn: str, q, k, v, s_aux, learnable_sink):
    """An FP8 call's q, k, v (checked: check_inputs) and learnable sink as float32 tensors
    without gradient (the call has no backward), for the validation and the computation that
    any float32 call has; the descales come after the validation (apply_descales)."""
    check_inputs(fn, q, k, v)
    q, k, v = (x.detach().float() for x in (q, k, v))

    def sink32(sink):  # q's dtype is float32 now: a bf16 sink would no longer match it
        return sink.detach().float() if isinstance(sink, Tensor) else sink

    return q, k, v, sink32(s_aux), sink32(learnable_sink)


def check_no_descale(fn: str, q_descale, k_descale, v_descale) -> None:
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise ValueError(
            f"{fn}: q_descale, k_descale and v_descale are for float8_e4m3fn inputs; q is not"
        )


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        raise NotImplementedError(
            "flash_attn: the backward of an FP8 (float8_e4m3fn) forward is not implemented; "
            "run the forward in bf16/fp16 to train"
        )


def needs_grad(*tensors) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def any_fp8(q, k, v) -> bool:
    return is_fp8(q) or is_fp8(k) or is_fp8(v)


def prepare(fn: str, q, k, v, q_descale, k_descale, v_descale, s_aux, learnable_sink):
    """The start of an entry point that takes FP8 inputs: (fp8, grad, q, k, v, s_aux,
    learnable_sink). An FP8 call's tensors come back as float32 (as_float32), `grad` saying
    whether one of its inputs requires grad (for finish); any other call must pass no
    descale."""
    if not any_fp8(q, k, v):
        check_no_descale(fn, q_descale, k_descale, v_descale)
        return False, False, q, k, v, s_aux, learnable_sink
    grad = needs_grad(q, k, v, q_descale, k_descale, v_descale, s_aux, learnable_sink)
    return (True, grad) + as_float32(fn, q, k, v, s_aux, learnable_sink)


def finish(res, inputs_require_grad: bool):
    """The FP8 call's result with its output in bf16 (res: out, or (out, lse, probs) with
    return_attn_probs); where an input (q, k, v, a descale, the sink) requires grad, a backward
    through the output raises NotImplementedError."""
    rest = tuple(res[1:]) if isinstance(res, tuple) else None
    out = (res[0] if rest is not None else res).to(torch.bfloat16)
    if inputs_require_grad and torch.is_grad_enabled():
        out = _NoBackward.apply(out.requires_grad_())
    return out if rest is None else (out,) + rest
