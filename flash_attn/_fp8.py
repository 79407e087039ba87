"""FP8 (e4m3) inputs: the rules of an FP8 call, and the CPU reference's
dequantization.

q, k and v in ``torch.float8_e4m3fn`` (all three), with optional ``q_descale``, ``k_descale``,
``v_descale`` (FlashAttention-3's names), each float32 of shape ``(batch, nheads_k)`` on q's
device (batch: the number of sequences, ``cu_seqlens_q.numel() - 1`` for varlen; query head h
of sequence b uses the entry of its key/value head ``h // (nheads // nheads_k)``; None means
1), give attention of the dequantized inputs ``x.float() * descale``: scores
``(q * q_descale) . (k * k_descale) * softmax_scale``, output ``softmax . (v * v_descale)``,
returned in **bfloat16** (softmax_lse float32 as in any call).

Where it runs (the custom op ``flash_attn::_fwd`` takes the descales as its last three
arguments, so every path, torch.compile's included, sees the same FP8 call):

* CUDA: the SM90 (H100-class, compute capability 9.0) forward kernels take the e4m3 tensors
  and the descales as they are (``flash_attn_cuda.fwd``'s trailing ``q_descale``,
  ``k_descale``, ``v_descale``): batched and varlen, causal, sliding window, softcap, GQA/MQA,
  a learnable sink, a paged K/V (block_table) in pages of a multiple of 8 rows, and
  ``flash_attn_with_kvcache`` on e4m3 caches (the new rows appended as they are,
  ``cache_seqlens``, ``cache_batch_idx``, ``cache_leftpad`` without pages). Other GPUs have no
  FP8 kernels (NotImplementedError), nor do alibi_slopes, dropout_p > 0,
  return_attn_probs=True, a v head dim other than q's (MLA), pages of other sizes or
  ``cache_leftpad`` with pages on CUDA (those run on the SM80 kernels in bf16/fp16). Head dims
  are zero-padded to a multiple of 16 (16 bytes of e4m3, the TMA's alignment).
* CPU: the reference runs every option of a float32 call on the dequantized inputs (paged and
  indexed K/V included: a sequence keeps its own descales whichever cache rows it reads), then
  rounds the output to bfloat16.
* Neither: rotary embedding in ``flash_attn_with_kvcache`` (it would rotate and requantize
  e4m3 rows), and any backward (a backward through an FP8 output raises
  NotImplementedError, whichever input required grad: q, k, v, a descale or the sink).

The checks (:func:`check_call`) run inside :mod:`flash_attn._validation`, the one place where
every entry point's arguments are checked.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
FP8_DTYPES = (E4M3,)
OUT_DTYPE = torch.bfloat16  # the output dtype of an FP8 call
HEADDIM_ALIGN = 16  # the CUDA kernels' head-dim multiple for e4m3 (16 bytes, as 8 for bf16)

NO_BACKWARD = ("flash_attn: the backward of an FP8 (float8_e4m3fn) forward is not "
               "implemented; run the forward in bf16/fp16 to train")


def kernel_headdim(dtype: torch.dtype, d: int) -> int:
    """d rounded up to the CUDA kernels' head-dim multiple: 16 bytes of a row, 16 values of
    e4m3 (HEADDIM_ALIGN) or 8 of fp16/bf16."""
    align = HEADDIM_ALIGN if dtype in FP8_DTYPES else 8
    return d + -d % align


def is_fp8(x: object) -> bool:
    return isinstance(x, Tensor) and x.dtype in FP8_DTYPES


def _descale(fn: str, name: str, d: object, batch: int, nheads_k: int,
             device: torch.device) -> Optional[Tensor]:
    """A descale as the op takes it: None (1), or float32 (batch, nheads_k) on q's device,
    made contiguous (an expanded scalar scale, as vLLM passes, is copied)."""
    if d is None:
        return None
    if not isinstance(d, Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor or None, got {type(d).__name__}")
    if d.dtype != torch.float32 or tuple(d.shape) != (batch, nheads_k) or d.device != device:
        raise ValueError(
            f"{fn}: {name} must be a float32 tensor of shape (batch, nheads_k) = "
            f"({batch}, {nheads_k}) on q's device, got {d.dtype} {tuple(d.shape)} on {d.device}"
        )
    return d.contiguous()


def check_no_descale(fn: str, q_descale: object, k_descale: object, v_descale: object) -> None:
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise ValueError(
            f"{fn}: q_descale, k_descale and v_descale are for float8_e4m3fn inputs; q is not"
        )


def check_call(fn: str, q: Tensor, device_type: str, batch: int, nheads_k: int, headdim: int,
               headdim_v: int, q_descale: object, k_descale: object, v_descale: object,
               dropout_p: float, alibi_slopes: Optional[Tensor], return_attn_probs: bool,
               page_size: int, leftpad: bool = False, rotary: bool = False
               ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The FP8 rules of a validated attention call (q, k, v, shapes and options already
    checked, q, k and v of one dtype): the descales as the op takes them, None for a call
    that is not FP8 (which must pass none). Raises NotImplementedError for what no path
    implements with FP8 inputs (see the module docstring). `page_size`: rows per page of a
    paged K/V (block_table), 0 without one; `leftpad`: cache_leftpad; `rotary`:
    flash_attn_with_kvcache's rotary tables."""
    if q.dtype not in FP8_DTYPES:
        check_no_descale(fn, q_descale, k_descale, v_descale)
        return None, None, None
    if rotary:
        raise NotImplementedError(
            f"{fn}: rotary embedding with FP8 (float8_e4m3fn) caches is not implemented (the "
            f"rotated rows would be requantized); rotate k and q before the call, or pass "
            f"bf16/fp16 inputs"
        )
    if device_type == "cuda":
        missing = [what for what, given in (
            ("alibi_slopes", alibi_slopes is not None),
            ("dropout_p > 0", dropout_p > 0.0),
            ("return_attn_probs=True", return_attn_probs),
            (f"a v head dim other than q's ({headdim_v} != {headdim}, MLA)",
             headdim_v != headdim),
            (f"pages of {page_size} rows (a multiple of 8 runs)",
             page_size > 0 and page_size % 8 != 0),
            ("cache_leftpad together with block_table", page_size > 0 and leftpad),
        ) if given]
        if missing:
            raise NotImplementedError(
                f"{fn}: the CUDA FP8 (float8_e4m3fn) kernels do not implement "
                f"{' or '.join(missing)}; pass bf16/fp16 inputs for it (CPU tensors run it on "
                f"the reference)"
            )
    return (_descale(fn, "q_descale", q_descale, batch, nheads_k, q.device),
            _descale(fn, "k_descale", k_descale, batch, nheads_k, q.device),
            _descale(fn, "v_descale", v_descale, batch, nheads_k, q.device))


def scores_descale(q_descale: Optional[Tensor], k_descale: Optional[Tensor]
                   ) -> Optional[Tensor]:
    """q_descale * k_descale (None where both are None): each is a constant of a (sequence,
    key/value head), so the scores (q * q_descale) . (k * k_descale) equal
    (q * q_descale * k_descale) . k, and k may be read as it is stored."""
    if q_descale is None or k_descale is None:
        return q_descale if k_descale is None else k_descale
    return q_descale * k_descale


def dequantize(x: Tensor, descale: Optional[Tensor],
               cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """``x.float() * descale`` for an FP8 q, k or v: batched ``(batch, seqlen, heads, d)``, or
    varlen ``(total, heads, d)`` with each row's sequence read from ``cu_seqlens`` (whose last
    entry is at most ``total``; rows past it keep a descale of 1). ``descale`` (float32
    ``(batch, nheads_k)``, None: 1) is repeated over the query heads of each key/value head
    when x has more heads than it has columns."""
    x = x.detach().float()
    if descale is None:
        return x
    d = descale.detach()
    group = x.shape[-2] // d.shape[1]
    if group != 1:
        d = d.repeat_interleave(group, dim=1)
    if cu_seqlens is None:
        return x * d[:, None, :, None]
    rows = torch.repeat_interleave(d, (cu_seqlens[1:] - cu_seqlens[:-1]).long(), dim=0)
    # Rows past the last sequence (which the reference leaves alone) keep a descale of 1.
    rows = torch.cat([rows, rows.new_ones(x.shape[0] - rows.shape[0], rows.shape[1])])
    return x * rows[:, :, None]


def pad_headdim(x: Tensor, n: int) -> Tensor:
    """x with n zero columns appended to its last dim (bytes 0 are +0.0 in e4m3); padded
    through a uint8 view, which every device copies. FP8 has no backward: the copy is a new
    leaf that requires grad where x does, so that a backward still reaches the op's formula
    and raises NotImplementedError there."""
    padded = torch.nn.functional.pad(x.detach().view(torch.uint8), [0, n]).view(x.dtype)
    return padded.requires_grad_(x.requires_grad)
