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


def dequantize(fn: str, q, k, v, q_descale, k_descale, v_descale,
               cu_seqlens_q: Optional[Tensor] = None,
               cu_seqlens_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """float32 q, k, v = x.float() * descale, for FP8 q, k, v (checked here: all e4m3, on the
    CPU, descales float32 (batch, nheads_k)). Batched: (b, s, h, d); varlen: (total, h, d) with
    each token's sequence read from cu_seqlens. The result carries no gradient to the FP8
    inputs."""
    names = ("q", "k", "v")
    for name, x in zip(names, (q, k, v)):
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
    varlen = cu_seqlens_q is not None
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads_k <= 0 or nheads % nheads_k != 0:
        raise ValueError(f"{fn}: nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    batch = (cu_seqlens_q.numel() - 1) if varlen else q.shape[0]
    group = nheads // nheads_k

    def apply(x: Tensor, d: Tensor, cu: Optional[Tensor]) -> Tensor:
        per_head = d.repeat_interleave(group, dim=1) if x.shape[-2] == nheads else d
        xf = x.detach().float()
        if not varlen:
            return xf * per_head[:, None, :, None]
        lengths = (cu[1:] - cu[:-1]).long()
        rows = torch.repeat_interleave(per_head, lengths, dim=0)
        if rows.shape[0] < xf.shape[0]:  # tokens past cu[-1]: no sequence, scale 1
            rows = torch.cat([rows, rows.new_ones(xf.shape[0] - rows.shape[0], rows.shape[1])])
        return xf * rows[:, :, None]

    qd = _descale(fn, "q_descale", q_descale, batch, nheads_k, q.device)
    kd = _descale(fn, "k_descale", k_descale, batch, nheads_k, q.device)
    vd = _descale(fn, "v_descale", v_descale, batch, nheads_k, q.device)
    return apply(q, qd, cu_seqlens_q), apply(k, kd, cu_seqlens_k), apply(v, vd, cu_seqlens_k)


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


def finish(out: Tensor, inputs_require_grad: bool) -> Tensor:
    """The FP8 call's bf16 output; with inputs that require grad, a backward through it
    raises NotImplementedError."""
    out = out.to(torch.bfloat16)
    if inputs_require_grad and torch.is_grad_enabled():
        out = _NoBackward.apply(out.requires_grad_())
    return out
