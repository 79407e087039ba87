"""Argument validation for every public entry point (the only place users' mistakes become errors).

Every function in :mod:`flash_attn.flash_attn_interface` calls one of the ``validate_*``
functions below before anything is launched. Errors name the function, the argument, what was
given and what is expected:

* ``TypeError``: an argument of the wrong Python / tensor type (including dtypes).
* ``ValueError``: a well-typed argument with a bad value or shape.
* ``NotImplementedError``: a valid combination this package does not implement (FP8 inputs
  with what their kernels lack, :mod:`flash_attn._fp8`; a forced split count,
  return_attn_probs with a block_table).

Checks that need the *values* of ``cu_seqlens`` (start at 0, nondecreasing, last entry equals the
number of rows, ``max_seqlen`` not smaller than the longest sequence) would force a device sync on
CUDA, so there they only run when the environment variable ``FLASH_ATTN_CHECK_INPUTS=1`` is set;
without it the kernels record out-of-range values, which the next call raises
(``flash_attn/_bad_input.py``).
On CPU they always run (no sync cost). They are skipped while ``torch.compile`` traces (they are
data dependent).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _fp8
from ._bad_input import raise_pending

MAX_HEADDIM_CUDA = 256
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Dtypes of an FP8 call (q, k, v all of it), on both devices, where the entry point takes the
# descales (flash_attn/_fp8.py).
FP8_DTYPES = _fp8.FP8_DTYPES
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "meta")

__all__ = [
    "AttnArgs",
    "validate_qkv",
    "validate_qkvpacked",
    "validate_kvpacked",
    "validate_varlen_qkv",
    "validate_varlen_qkvpacked",
    "validate_varlen_kvpacked",
    "KVCacheArgs",
    "validate_kvcache",
    "check_inputs_enabled",
]


class AttnArgs(NamedTuple):
    """Normalized description of one validated call (immutable).

    For varlen calls ``seqlen_q``/``seqlen_k`` are ``max_seqlen_q``/``max_seqlen_k`` and
    ``total_q``/``total_k`` the numbers of rows; for batched calls ``total_*`` are ``None``,
    as is ``total_k`` for a paged varlen call (its keys live in pages).
    ``window_left``/``window_right`` are normalized: -1 means unbounded, and ``causal`` forces
    ``window_right = 0`` (docs/INTERNALS.md). A NamedTuple rather than a frozen dataclass: it
    is built on every call, several times faster.
    """

    varlen: bool
    batch: int
    seqlen_q: int
    seqlen_k: int
    total_q: Optional[int]
    total_k: Optional[int]
    nheads: int
    nheads_k: int
    headdim: int
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    device_type: str
    dtype: torch.dtype
    alibi_slopes: Optional[Tensor] = None  # float32 (nheads,) or (batch, nheads)
    sink: Optional[Tensor] = None  # learnable sink: float32 (float64 on CPU) (nheads,)
    dropout_p: float = 0.0  # the mask: flash_attn/dropout.py
    # An FP8 call's descales (flash_attn/_fp8.py): float32 (batch, nheads_k), contiguous, or
    # None (1); always None for other calls.
    q_descale: Optional[Tensor] = None
    k_descale: Optional[Tensor] = None
    v_descale: Optional[Tensor] = None


def check_inputs_enabled() -> bool:
    """Whether the sync-requiring value checks run on CUDA (``FLASH_ATTN_CHECK_INPUTS=1``)."""
    return os.environ.get("FLASH_ATTN_CHECK_INPUTS", "0").strip().lower() in ("1", "true", "yes")


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - very old torch
        return False


# The exact-type tests first: they answer the usual int / float arguments at a fraction of the
# cost of the ABC isinstance checks.


def _is_int(x) -> bool:
    return type(x) is int or (
        isinstance(x, (numbers.Integral, torch.SymInt)) and not isinstance(x, bool)
    )


def _as_int(x) -> Optional[Union[int, torch.SymInt]]:
    """x as a Python int if it is an integer scalar, else None.

    Accepts what FlashAttention-2's binding accepts (anything with ``__index__``): int, numpy
    integers, ``torch.SymInt``, and 0-dim integer tensors. A 0-dim tensor is read with
    ``.item()``, one device sync when it lives on the GPU (transformers' packed-sequence path
    passes ``max_seqlen`` that way); a Python int costs nothing extra. bool is refused, as are
    floats and tensors of other shapes or dtypes.
    """
    if type(x) is int:
        return x
    if isinstance(x, bool):
        return None
    if isinstance(x, torch.SymInt):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if (
        isinstance(x, Tensor)
        and x.dim() == 0
        and not x.dtype.is_floating_point
        and not x.dtype.is_complex
        and x.dtype != torch.bool
    ):
        return x.item()
    return None


def _is_real(x) -> bool:
    t = type(x)
    return t is float or t is int or (
        isinstance(x, (numbers.Real, torch.SymFloat, torch.SymInt)) and not isinstance(x, bool)
    )


def _isfinite(x) -> bool:
    # Like math.isfinite, but also traceable for torch.compile's symbolic floats.
    return x == x and abs(x) != math.inf


def _dtype_hint(name: str) -> str:
    return f"cast with {name}.half() or {name}.bfloat16()"


# --------------------------------------------------------------------------------------------
# Tensor checks
# --------------------------------------------------------------------------------------------


def _check_tensor(fn: str, name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")


# The checks below take the device and its type from the caller, which reads them once
# (``Tensor.device.type`` costs as much as several of the checks).


def _check_device_type(fn: str, name: str, device: torch.device, device_type: str) -> None:
    if device_type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"{fn}: {name} is on device {device}, but only CUDA tensors (kernels) and CPU "
            f"tensors (PyTorch reference) are supported; move it with {name}.cuda()"
        )


def _fp8_not_here(fn: str, name: str, dtype: torch.dtype) -> NotImplementedError:
    return NotImplementedError(
        f"{fn}: FP8 ({dtype}) inputs are not implemented here ({name}); flash_attn_func, "
        f"flash_attn_varlen_func and their packed variants take them, with the descales"
    )


def _check_float_dtype(fn: str, name: str, x: Tensor, device_type: str,
                       fp8: bool = False) -> None:
    """x's dtype is one the device's kernels take; `fp8`: the entry point takes FP8 inputs
    (float8_e4m3fn, with the descales), else they raise NotImplementedError."""
    dtype = x.dtype
    if dtype in (CUDA_DTYPES if device_type == "cuda" else CPU_DTYPES):
        return
    if dtype in FP8_DTYPES:
        if fp8:
            return
        raise _fp8_not_here(fn, name, dtype)
    if device_type == "cuda":
        raise TypeError(
            f"{fn}: {name} must be float16 or bfloat16 on CUDA, got {dtype}; "
            f"{_dtype_hint(name)}"
        )
    raise TypeError(
        f"{fn}: {name} must be a floating point tensor (float16, bfloat16, float32 or "
        f"float64 on CPU), got {dtype}"
    )


def _check_same_device(fn: str, ref_name: str, ref: Tensor, name: str, x: Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(
            f"{fn}: {name} must be on the same device as {ref_name} ({ref.device}), "
            f"got {x.device}"
        )


def _check_same_dtype(fn: str, ref_name: str, ref: Tensor, name: str, x: Tensor,
                      fp8: bool = False) -> None:
    """x has ref's dtype. Where one of them is FP8: an FP8 call needs all of q, k and v in
    it (`fp8`: the entry point takes FP8 inputs, else NotImplementedError)."""
    if x.dtype != ref.dtype:
        if ref.dtype in FP8_DTYPES or x.dtype in FP8_DTYPES:
            if not fp8:
                raise _fp8_not_here(fn, name if x.dtype in FP8_DTYPES else ref_name,
                                    x.dtype if x.dtype in FP8_DTYPES else ref.dtype)
            raise TypeError(
                f"{fn}: q, k and v must all be float8_e4m3fn for an FP8 call, got {ref_name} "
                f"of dtype {ref.dtype} and {name} of dtype {x.dtype}"
            )
        raise TypeError(
            f"{fn}: {name} must have the same dtype as {ref_name} ({ref.dtype}), got {x.dtype}"
        )


def _check_rank(fn: str, name: str, x: Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(
            f"{fn}: {name} must be a {rank}-D tensor of shape {layout}, got {x.dim()}-D "
            f"tensor of shape {tuple(x.shape)}"
        )


def _check_headdim_v(fn: str, nv: str, headdim_v: int, device_type: str) -> None:
    """v's head dim where it may differ from q's and k's (MLA): any on CPU (the reference); on
    CUDA up to the kernels' largest head dim (the interface pads q/k and v to one width)."""
    if headdim_v <= 0:
        raise ValueError(f"{fn}: headdim_v (last dim of {nv}) must be > 0, got {headdim_v}")
    if device_type == "cuda" and headdim_v > MAX_HEADDIM_CUDA:
        raise ValueError(
            f"{fn}: headdim_v (last dim of {nv}) must be <= {MAX_HEADDIM_CUDA} on CUDA, got "
            f"{headdim_v}"
        )


def _check_qkv_tensors(fn, names, q, k, v, varlen: bool, same_batch: bool = True,
                       paged: bool = False, headdim_v_differs: bool = False,
                       fp8: bool = False):
    """Type / device / dtype / rank / shape checks shared by the batched and varlen paths
    (`same_batch` False: k and v may hold more sequences than q, as a KV cache does; `paged`:
    varlen q with k and v in pages (num_blocks, page_block_size, nheads_k, headdim);
    `headdim_v_differs`: v's last dim may differ from q's and k's, as in MLA; `fp8`: q, k, v
    may be float8_e4m3fn, all three, else FP8 raises NotImplementedError).

    Returns (nheads, nheads_k, headdim, device_type)."""
    nq, nk, nv = names
    _check_tensor(fn, nq, q)
    _check_tensor(fn, nk, k)
    _check_tensor(fn, nv, v)
    device, k_device, v_device = q.device, k.device, v.device
    device_type = device.type
    _check_device_type(fn, nq, device, device_type)
    raise_pending(device)  # a bad device-valued input that an earlier call's kernels recorded
    # On q's device k and v pass the device type check; only the others need their own type.
    k_elsewhere, v_elsewhere = k_device != device, v_device != device
    if k_elsewhere:
        _check_device_type(fn, nk, k_device, k_device.type)
    if v_elsewhere:
        _check_device_type(fn, nv, v_device, v_device.type)
    if k_elsewhere:
        _check_same_device(fn, nq, q, nk, k)
    if v_elsewhere:
        _check_same_device(fn, nq, q, nv, v)
    _check_float_dtype(fn, nq, q, device_type, fp8)
    _check_same_dtype(fn, nq, q, nk, k, fp8)
    _check_same_dtype(fn, nq, q, nv, v, fp8)
    if varlen and paged:
        _check_rank(fn, nq, q, 3, "(total_q, nheads, headdim)")
        _check_rank(fn, nk, k, 4, "(num_blocks, page_block_size, nheads_k, headdim)")
        _check_rank(fn, nv, v, 4, "(num_blocks, page_block_size, nheads_k, headdim)")
    elif varlen:
        _check_rank(fn, nq, q, 3, "(total_q, nheads, headdim)")
        _check_rank(fn, nk, k, 3, "(total_k, nheads_k, headdim)")
        _check_rank(fn, nv, v, 3, "(total_k, nheads_k, headdim)")
    else:
        _check_rank(fn, nq, q, 4, "(batch, seqlen_q, nheads, headdim)")
        _check_rank(fn, nk, k, 4, "(batch, seqlen_k, nheads_k, headdim)")
        _check_rank(fn, nv, v, 4, "(batch, seqlen_k, nheads_k, headdim)")
    q_shape, k_shape = q.shape, k.shape
    if headdim_v_differs and k_shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{fn}: {nk} and {nv} must have the same shape but for the last dim (headdim, "
            f"headdim_v), got {nk} {tuple(k.shape)} and {nv} {tuple(v.shape)}"
        )
    if not headdim_v_differs and k_shape != v.shape:
        raise ValueError(
            f"{fn}: {nk} and {nv} must have the same shape, got {nk} {tuple(k.shape)} and "
            f"{nv} {tuple(v.shape)}"
        )
    if not varlen and same_batch and k_shape[0] != q_shape[0]:
        raise ValueError(
            f"{fn}: {nq} and {nk} must have the same batch size, got {nq} {tuple(q.shape)} "
            f"(batch {q.shape[0]}) and {nk} {tuple(k.shape)} (batch {k.shape[0]})"
        )
    headdim = q_shape[-1]
    if k_shape[-1] != headdim:
        raise ValueError(
            f"{fn}: {nq} and {nk} must have the same headdim (last dim), got {nq} "
            f"{tuple(q.shape)} and {nk} {tuple(k.shape)}"
        )
    if headdim <= 0:
        raise ValueError(f"{fn}: headdim (last dim of {nq}) must be > 0, got {headdim}")
    if device_type == "cuda" and headdim > MAX_HEADDIM_CUDA:
        raise ValueError(
            f"{fn}: headdim (last dim of {nq}) must be <= {MAX_HEADDIM_CUDA} on CUDA, got "
            f"{headdim}"
        )
    _check_headdim_v(fn, nv, v.shape[-1], device_type)
    nheads, nheads_k = q_shape[-2], k_shape[-2]
    if nheads_k <= 0 or nheads <= 0:
        raise ValueError(
            f"{fn}: number of heads must be > 0, got nheads={nheads} ({nq}) and "
            f"nheads_k={nheads_k} ({nk})"
        )
    if nheads % nheads_k != 0:
        raise ValueError(
            f"{fn}: the number of query heads ({nheads}, {nq}.shape[-2]) must be divisible by "
            f"the number of key/value heads ({nheads_k}, {nk}.shape[-2])"
        )
    return nheads, nheads_k, headdim, device_type


# --------------------------------------------------------------------------------------------
# Scalar option checks
# --------------------------------------------------------------------------------------------


def _check_options(
    fn: str,
    device_type: str,
    headdim: int,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    deterministic,
    return_attn_probs,
):
    """Returns (softmax_scale, causal, window_left, window_right, softcap, dropout_p),
    normalized."""
    if not _is_real(dropout_p):
        raise TypeError(f"{fn}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{fn}: dropout_p must be in [0, 1), got {dropout_p!r}")

    if softmax_scale is None:
        scale = 1.0 / math.sqrt(headdim)
    else:
        if not _is_real(softmax_scale):
            raise TypeError(
                f"{fn}: softmax_scale must be a float or None, got {softmax_scale!r}"
            )
        scale = float(softmax_scale)
        if not (_isfinite(scale) and scale > 0.0):
            raise ValueError(
                f"{fn}: softmax_scale must be a finite number > 0 (or None for "
                f"1/sqrt(headdim)), got {softmax_scale!r}"
            )

    if type(causal) is not bool:  # bool has no subclasses: same as isinstance, cheaper
        raise TypeError(f"{fn}: causal must be a bool, got {causal!r}")

    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        left, right = _as_int(window_size[0]), _as_int(window_size[1])
    else:
        left = right = None
    if left is None or right is None:
        raise TypeError(
            f"{fn}: window_size must be a pair of ints (left, right), -1 meaning unbounded, "
            f"got {window_size!r}"
        )
    if left < -1 or right < -1:
        raise ValueError(
            f"{fn}: window_size entries must be >= -1 (-1 means unbounded), got {window_size!r}"
        )
    if causal:
        right = 0

    if not _is_real(softcap):
        raise TypeError(f"{fn}: softcap must be a float >= 0 (0 disables it), got {softcap!r}")
    cap = float(softcap)
    if not (_isfinite(cap) and cap >= 0.0):
        raise ValueError(
            f"{fn}: softcap must be a finite number >= 0 (0 disables it), got {softcap!r}"
        )

    if type(deterministic) is not bool:
        raise TypeError(f"{fn}: deterministic must be a bool, got {deterministic!r}")

    if type(return_attn_probs) is not bool:
        raise TypeError(f"{fn}: return_attn_probs must be a bool, got {return_attn_probs!r}")

    return scale, causal, left, right, cap, p


# --------------------------------------------------------------------------------------------
# cu_seqlens / max_seqlen
# --------------------------------------------------------------------------------------------


def _check_cu_seqlens(fn: str, name: str, cu: Tensor, q_name: str, q: Tensor) -> None:
    _check_tensor(fn, name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(
            f"{fn}: {name} must be an int32 tensor of shape (batch + 1,), got {cu.dtype}; "
            f"convert with {name}.to(torch.int32)"
        )
    if cu.dim() != 1:
        raise ValueError(
            f"{fn}: {name} must be 1-D of shape (batch + 1,), got shape {tuple(cu.shape)}"
        )
    if cu.shape[0] < 1:
        raise ValueError(
            f"{fn}: {name} must have batch + 1 >= 1 entries (starting with 0), got shape "
            f"{tuple(cu.shape)}"
        )
    if not cu.is_contiguous():
        raise ValueError(
            f"{fn}: {name} must be contiguous (the kernels index it directly), got strides "
            f"{cu.stride()}; pass {name}.contiguous()"
        )
    _check_same_device(fn, q_name, q, name, cu)


def _check_max_seqlen(fn: str, name: str, x) -> int:
    n = _as_int(x)
    if n is None:
        got = (f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
               if isinstance(x, Tensor) else repr(x))
        raise TypeError(
            f"{fn}: {name} must be an int (a Python or numpy integer, or a 0-dim integer "
            f"tensor), got {got}"
        )
    if n < 0:
        raise ValueError(f"{fn}: {name} must be >= 0, got {n}")
    return n


def _check_cu_seqlens_values(
    fn: str,
    name: str,
    cu: Tensor,
    total: int,
    rows_name: str,
    total_name: str,
    max_name: str,
    max_seqlen: int,
) -> None:
    vals = cu.tolist()  # Python ints (cu is int32)
    if vals[0] != 0:
        raise ValueError(f"{fn}: {name} must start at 0, got {name}[0] = {vals[0]}")
    longest = 0
    for i in range(1, len(vals)):
        n = vals[i] - vals[i - 1]
        if n < 0:
            raise ValueError(
                f"{fn}: {name} must be nondecreasing, but {name}[{i}] = {vals[i]} < "
                f"{name}[{i - 1}] = {vals[i - 1]}"
            )
        if n > longest:
            longest = n
    if vals[-1] != total:
        raise ValueError(
            f"{fn}: {name}[-1] must equal the number of rows of {rows_name} ({total_name}) "
            f"({total}), got {vals[-1]}"
        )
    if longest > max_seqlen:
        raise ValueError(
            f"{fn}: {max_name} must be >= the longest sequence in {name} ({longest}), got "
            f"{max_seqlen}"
        )


def _check_alibi(fn: str, alibi_slopes, q: Tensor, batch: int, nheads: int) -> Optional[Tensor]:
    """alibi_slopes: None, or float32 (nheads,) or (batch, nheads) on q's device. Returns it
    with a contiguous last dim."""
    if alibi_slopes is None:
        return None
    _check_tensor(fn, "alibi_slopes", alibi_slopes)
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(
            f"{fn}: alibi_slopes must be a float32 tensor of shape (nheads,) or (batch, "
            f"nheads), got {alibi_slopes.dtype}; convert with alibi_slopes.float()"
        )
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"{fn}: alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = "
            f"({batch}, {nheads}), got {tuple(alibi_slopes.shape)}"
        )
    _check_same_device(fn, "q", q, "alibi_slopes", alibi_slopes)
    return alibi_slopes if alibi_slopes.stride(-1) == 1 else alibi_slopes.contiguous()


def _check_sink(fn: str, s_aux, learnable_sink, q: Tensor, nheads: int) -> Optional[Tensor]:
    """The learnable sink, given as s_aux or learnable_sink (two names for one argument):
    None, or (nheads,) of float32 or q's dtype (with FP8 q also bfloat16 or float16) on q's
    device. Returns it contiguous in float32, or float64 when it is float64 (with float64 q on
    CPU: the reference then stays float64, which gradcheck needs). Its values are not checked:
    -inf means no sink."""
    if s_aux is not None and learnable_sink is not None:
        raise ValueError(
            f"{fn}: s_aux and learnable_sink are two names for the learnable sink; pass one of "
            f"them, not both"
        )
    if s_aux is None and learnable_sink is None:
        return None
    name, sink = ("s_aux", s_aux) if s_aux is not None else ("learnable_sink", learnable_sink)
    _check_tensor(fn, name, sink)
    if (sink.dtype != torch.float32 and sink.dtype != q.dtype
            and not (q.dtype in FP8_DTYPES and sink.dtype in CUDA_DTYPES)):
        raise TypeError(
            f"{fn}: {name} must be a float32 tensor (or of q's dtype, {q.dtype}) of shape "
            f"(nheads,), got {sink.dtype}; convert with {name}.float()"
        )
    if sink.dim() != 1 or sink.shape[0] != nheads:
        raise ValueError(
            f"{fn}: {name} must have shape (nheads,) = ({nheads},) (one logit per query head), "
            f"got {tuple(sink.shape)}"
        )
    _check_same_device(fn, "q", q, name, sink)
    if sink.dtype != torch.float32 and sink.dtype != torch.float64:
        sink = sink.float()  # differentiable: the gradient reaches the tensor given
    return sink.contiguous()


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def validate_qkv(
    fn: str,
    q: object,
    k: object,
    v: object,
    dropout_p: object = 0.0,
    softmax_scale: object = None,
    causal: object = False,
    window_size: object = (-1, -1),
    softcap: object = 0.0,
    alibi_slopes: object = None,
    deterministic: object = False,
    return_attn_probs: object = False,
    s_aux: object = None,
    learnable_sink: object = None,
    q_descale: object = None,
    k_descale: object = None,
    v_descale: object = None,
    names: Sequence[str] = ("q", "k", "v"),
) -> AttnArgs:
    """Validate a batched call: q (b, sq, h, d), k/v (b, sk, hk, d), the sink (h,); FP8 q, k, v
    with the descales (b, hk) (flash_attn/_fp8.py)."""
    nheads, nheads_k, headdim, device_type = _check_qkv_tensors(fn, names, q, k, v,
                                                                varlen=False,
                                                                headdim_v_differs=True,
                                                                fp8=True)
    scale, causal, left, right, cap, drop = _check_options(
        fn, device_type, headdim, dropout_p, softmax_scale, causal, window_size, softcap,
        deterministic, return_attn_probs,
    )
    batch = q.shape[0]
    descales = _fp8.check_call(fn, q, device_type, batch, nheads_k, headdim, v.shape[-1],
                               q_descale, k_descale, v_descale, drop, alibi_slopes,
                               return_attn_probs, 0)
    return AttnArgs(
        varlen=False, batch=batch, seqlen_q=q.shape[1], seqlen_k=k.shape[1],
        total_q=None, total_k=None, nheads=nheads, nheads_k=nheads_k, headdim=headdim,
        softmax_scale=scale, causal=causal, window_left=left, window_right=right,
        softcap=cap, device_type=device_type, dtype=q.dtype,
        alibi_slopes=_check_alibi(fn, alibi_slopes, q, batch, nheads),
        sink=_check_sink(fn, s_aux, learnable_sink, q, nheads), dropout_p=drop,
        q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
    )


def _check_packed(fn: str, name: str, x, rank: int, layout: str, pack_dim: int, n: int):
    _check_tensor(fn, name, x)
    device = x.device
    device_type = device.type
    _check_device_type(fn, name, device, device_type)
    _check_float_dtype(fn, name, x, device_type, fp8=True)  # the packed entry points take FP8
    _check_rank(fn, name, x, rank, layout)
    if x.shape[pack_dim] != n:
        raise ValueError(
            f"{fn}: {name} must have shape {layout} (size {n} at dim {pack_dim}), got "
            f"{tuple(x.shape)}"
        )


def validate_qkvpacked(fn: str, qkv: object, **options: object) -> AttnArgs:
    """qkv (batch, seqlen, 3, nheads, headdim)."""
    _check_packed(fn, "qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)", 2, 3)
    return validate_qkv(
        fn, *qkv.unbind(2), names=("qkv", "qkv", "qkv"), **options,
    )


def validate_kvpacked(fn: str, q: object, kv: object, **options: object) -> AttnArgs:
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    _check_tensor(fn, "q", q)
    _check_packed(fn, "kv", kv, 5, "(batch, seqlen_k, 2, nheads_k, headdim)", 2, 2)
    return validate_qkv(
        fn, q, *kv.unbind(2), names=("q", "kv", "kv"), **options,
    )


def validate_varlen_qkv(
    fn: str,
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    dropout_p: object = 0.0,
    softmax_scale: object = None,
    causal: object = False,
    window_size: object = (-1, -1),
    softcap: object = 0.0,
    alibi_slopes: object = None,
    deterministic: object = False,
    return_attn_probs: object = False,
    block_table: object = None,
    s_aux: object = None,
    learnable_sink: object = None,
    q_descale: object = None,
    k_descale: object = None,
    v_descale: object = None,
    names: Sequence[str] = ("q", "k", "v"),
    cu_names: Sequence[str] = ("cu_seqlens_q", "cu_seqlens_k"),
    max_names: Sequence[str] = ("max_seqlen_q", "max_seqlen_k"),
) -> AttnArgs:
    """Validate a varlen call: q (total_q, h, d), k/v (total_k, hk, d), cu_seqlens (b + 1,),
    the sink (h,); with block_table (b, max_num_blocks_per_seq), k/v (num_blocks,
    page_block_size, hk, d); FP8 q, k, v with the descales (b, hk) (flash_attn/_fp8.py)."""
    paged = block_table is not None
    nheads, nheads_k, headdim, device_type = _check_qkv_tensors(fn, names, q, k, v,
                                                                varlen=True, paged=paged,
                                                                headdim_v_differs=True,
                                                                fp8=True)
    nq, nk = names[0], names[1]
    cq, ck = cu_names
    _check_cu_seqlens(fn, cq, cu_seqlens_q, nq, q)
    _check_cu_seqlens(fn, ck, cu_seqlens_k, nq, q)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"{fn}: {cq} and {ck} must have the same length (batch + 1), got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    mq = _check_max_seqlen(fn, max_names[0], max_seqlen_q)
    mk = _check_max_seqlen(fn, max_names[1], max_seqlen_k)
    batch = cu_seqlens_q.shape[0] - 1
    if paged:
        capacity = _check_block_table(fn, block_table, q, batch, nk, k)
        if return_attn_probs:
            raise NotImplementedError(
                f"{fn}: return_attn_probs=True with block_table is not implemented; pass "
                f"return_attn_probs=False"
            )
    scale, causal, left, right, cap, drop = _check_options(
        fn, device_type, headdim, dropout_p, softmax_scale, causal, window_size, softcap,
        deterministic, return_attn_probs,
    )
    descales = _fp8.check_call(fn, q, device_type, batch, nheads_k, headdim, v.shape[-1],
                               q_descale, k_descale, v_descale, drop, alibi_slopes,
                               return_attn_probs, k.shape[1] if paged else 0)
    check_values = device_type == "cpu" or (device_type == "cuda" and check_inputs_enabled())
    if check_values and not _is_compiling():
        _check_cu_seqlens_values(fn, cq, cu_seqlens_q, q.shape[0], nq, "total_q", max_names[0],
                                 mq)
        if paged:
            # The keys are the pages': cu_seqlens_k ends wherever its lengths sum to, and
            # no sequence is longer than its row of the table holds.
            total_k = int(cu_seqlens_k[-1])
            _check_cu_seqlens_values(fn, ck, cu_seqlens_k, total_k, nk, "total_k",
                                     max_names[1], mk)
            lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
            for b, n in enumerate(lens):
                if n > capacity:
                    raise ValueError(
                        f"{fn}: sequence {b} has {n} keys ({ck}[{b + 1}] - {ck}[{b}]), more "
                        f"than its row of block_table holds ({capacity} = "
                        f"max_num_blocks_per_seq * page_block_size)"
                    )
            _check_index_values(fn, "block_table", block_table, k.shape[0],
                                 f"[0, num_blocks) = [0, {k.shape[0]})")
        else:
            _check_cu_seqlens_values(fn, ck, cu_seqlens_k, k.shape[0], nk, "total_k",
                                     max_names[1], mk)
    return AttnArgs(
        varlen=True, batch=batch, seqlen_q=mq, seqlen_k=mk,
        total_q=q.shape[0], total_k=None if paged else k.shape[0], nheads=nheads,
        nheads_k=nheads_k,
        headdim=headdim, softmax_scale=scale, causal=causal, window_left=left,
        window_right=right, softcap=cap, device_type=device_type, dtype=q.dtype,
        alibi_slopes=_check_alibi(fn, alibi_slopes, q, batch, nheads),
        sink=_check_sink(fn, s_aux, learnable_sink, q, nheads), dropout_p=drop,
        q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
    )


def validate_varlen_qkvpacked(fn: str, qkv: object, cu_seqlens: object, max_seqlen: object,
                              **options: object) -> AttnArgs:
    """qkv (total, 3, nheads, headdim), cu_seqlens (batch + 1,)."""
    _check_packed(fn, "qkv", qkv, 4, "(total, 3, nheads, headdim)", 1, 3)
    return validate_varlen_qkv(
        fn, *qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        names=("qkv", "qkv", "qkv"), cu_names=("cu_seqlens", "cu_seqlens"),
        max_names=("max_seqlen", "max_seqlen"), **options,
    )


def validate_varlen_kvpacked(
    fn: str,
    q: object,
    kv: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    **options: object,
) -> AttnArgs:
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    _check_tensor(fn, "q", q)
    _check_packed(fn, "kv", kv, 4, "(total_k, 2, nheads_k, headdim)", 1, 2)
    return validate_varlen_qkv(
        fn, q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        names=("q", "kv", "kv"), **options,
    )


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# --------------------------------------------------------------------------------------------


class KVCacheArgs(NamedTuple):
    """A validated ``flash_attn_with_kvcache`` call: the attention's AttnArgs (``seqlen_k`` is
    the cache's length) and what the cache update and the rotary embedding need."""

    attn: AttnArgs
    seqlen_new: int  # rows of k / v appended (0 without them)
    # An int (validated), an int32 (batch,) tensor on q's device, or None (the whole cache).
    cache_seqlens: Union[int, Tensor, None]
    rotary_dim: int  # 0 without rotary_cos / rotary_sin
    rotary_interleaved: bool
    return_softmax_lse: bool


def _check_cache_index(fn: str, name: str, x, q: Tensor, batch: int) -> None:
    _check_tensor(fn, name, x)
    if x.dtype != torch.int32:
        raise TypeError(
            f"{fn}: {name} must be an int32 tensor of shape (batch,), got {x.dtype}; convert "
            f"with {name}.to(torch.int32)"
        )
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(
            f"{fn}: {name} must have shape (batch,) = ({batch},), got {tuple(x.shape)}"
        )
    _check_same_device(fn, "q", q, name, x)


def _check_block_table(fn: str, block_table, q: Tensor, batch: int, k_name: str, k) -> int:
    """block_table int32 (batch, max_num_blocks_per_seq >= 1) on q's device over a paged k
    (num_blocks >= 1, page_block_size >= 1, nheads_k, headdim). Returns the keys a sequence
    can hold: the table's width times the page."""
    _check_tensor(fn, "block_table", block_table)
    _check_same_device(fn, "q", q, "block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(
            f"{fn}: block_table must be an int32 tensor of shape (batch, "
            f"max_num_blocks_per_seq), got {block_table.dtype}; convert with "
            f"block_table.to(torch.int32)"
        )
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(
            f"{fn}: block_table must have shape (batch, max_num_blocks_per_seq) = ({batch}, "
            f">= 1), got {tuple(block_table.shape)}"
        )
    page = k.shape[1]
    if page < 1 or k.shape[0] < 1:
        raise ValueError(
            f"{fn}: a paged {k_name} must have shape (num_blocks >= 1, page_block_size >= 1, "
            f"nheads_k, headdim), got {tuple(k.shape)}"
        )
    return block_table.shape[1] * page


def _check_index_values(fn: str, name: str, x: Tensor, end: int, interval: str) -> None:
    """Every entry of the 1-D or 2-D int tensor x in [0, end), `interval` naming that range in
    the error (a device sync on CUDA)."""
    for i, n in enumerate(x.reshape(-1).tolist()):
        if not 0 <= n < end:
            at = str(i) if x.dim() == 1 else ", ".join(map(str, divmod(i, x.shape[1])))
            raise ValueError(f"{fn}: {name} must be in {interval}, got {name}[{at}] = {n}")


def validate_kvcache(
    fn: str,
    q: object,
    k_cache: object,
    v_cache: object,
    k: object = None,
    v: object = None,
    rotary_cos: object = None,
    rotary_sin: object = None,
    cache_seqlens: object = None,
    cache_batch_idx: object = None,
    cache_leftpad: object = None,
    block_table: object = None,
    softmax_scale: object = None,
    causal: object = False,
    window_size: object = (-1, -1),
    softcap: object = 0.0,
    rotary_interleaved: object = True,
    alibi_slopes: object = None,
    num_splits: object = 0,
    return_softmax_lse: object = False,
    s_aux: object = None,
    learnable_sink: object = None,
    q_descale: object = None,
    k_descale: object = None,
    v_descale: object = None,
) -> KVCacheArgs:
    """q (b, sq, h, d); k_cache / v_cache (b_cache, s_cache, hk, d) with b_cache >= b, or paged
    (num_blocks, page_block_size, hk, d) with block_table (b, max_num_blocks_per_seq); k / v
    (b, s_new, hk, d) or None; cache_seqlens int or int32 (b,); rotary_cos / rotary_sin
    (seqlen_ro, rotary_dim / 2); the sink (h,); FP8 q, caches and k / v with the descales
    (b, hk) (flash_attn/_fp8.py). Returns the normalized call."""
    splits = _as_int(num_splits)
    if splits is None:
        raise TypeError(f"{fn}: num_splits must be an int >= 0, got {num_splits!r}")
    num_splits = splits
    if num_splits < 0:
        raise ValueError(f"{fn}: num_splits must be >= 0, got {num_splits}")
    if num_splits != 0:
        raise NotImplementedError(
            f"{fn}: num_splits={num_splits} is not implemented: the kernels choose how to split "
            f"the keys themselves; pass num_splits=0 (FLASH_ATTN_SPLIT=0 turns splitting off)"
        )
    nheads, nheads_k, headdim, device_type = _check_qkv_tensors(
        fn, ("q", "k_cache", "v_cache"), q, k_cache, v_cache, varlen=False, same_batch=False,
        fp8=True,
    )
    batch, seqlen_cache = q.shape[0], k_cache.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError(
                f"{fn}: cache_batch_idx cannot be used with block_table (the block table "
                f"already names each sequence's pages); pass cache_batch_idx=None"
            )
        seqlen_cache = _check_block_table(fn, block_table, q, batch, "k_cache", k_cache)
    # With cache_batch_idx any entry may serve any batch, and pages any sequence: one is enough.
    need = batch if cache_batch_idx is None and block_table is None else min(batch, 1)
    if k_cache.shape[0] < need:
        raise ValueError(
            f"{fn}: k_cache must hold at least {need} sequences (dim 0: batch = {batch}"
            f"{'' if cache_batch_idx is None else ' with cache_batch_idx'}), got "
            f"{tuple(k_cache.shape)}"
        )
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v must be given together (or both None)")
    seqlen_new = 0
    if k is not None:
        _check_qkv_tensors(fn, ("q", "k", "v"), q, k, v, varlen=False, fp8=True)
        if k.shape[2] != nheads_k:
            raise ValueError(
                f"{fn}: k must have nheads_k = {nheads_k} heads (as k_cache), got "
                f"{tuple(k.shape)}"
            )
        seqlen_new = k.shape[1]
        # Written in place: no element of a cache may be another's.
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
                raise ValueError(
                    f"{fn}: {name} is written in place but has an expanded (stride 0) dim, "
                    f"strides {tuple(x.stride())}; pass a cache that owns its memory"
                )
        if k_cache is v_cache:  # other overlaps: the CUDA binding's check
            raise ValueError(f"{fn}: k_cache and v_cache are the same tensor; pass two caches")
        if seqlen_new > seqlen_cache:
            raise ValueError(
                f"{fn}: k has {seqlen_new} new rows but the cache holds only {seqlen_cache} "
                f"({'k_cache.shape[1]' if block_table is None else 'the block table'})"
            )
        if cache_seqlens is None:
            raise ValueError(
                f"{fn}: cache_seqlens is needed with k and v (the rows where they are written)"
            )
    descales = _fp8.check_call(fn, q, device_type, batch, nheads_k, headdim, headdim,
                               q_descale, k_descale, v_descale, 0.0, alibi_slopes, False,
                               0 if block_table is None else k_cache.shape[1],
                               cache_leftpad is not None,
                               rotary_cos is not None or rotary_sin is not None)
    lens_interval = f"[0, seqlen_cache - seqlen_new] = [0, {seqlen_cache - seqlen_new}]"
    if cache_seqlens is not None:
        if _is_int(cache_seqlens):
            n = int(cache_seqlens)
            if not 0 <= n <= seqlen_cache - seqlen_new:
                raise ValueError(f"{fn}: cache_seqlens must be in {lens_interval}, got {n}")
            cache_seqlens = n
        else:
            _check_cache_index(fn, "cache_seqlens", cache_seqlens, q, batch)
    if cache_batch_idx is not None:
        _check_cache_index(fn, "cache_batch_idx", cache_batch_idx, q, batch)
    if cache_leftpad is not None:
        _check_cache_index(fn, "cache_leftpad", cache_leftpad, q, batch)
    rotary_dim = 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{fn}: rotary_cos and rotary_sin must be given together (or both None)")
    if rotary_cos is not None:
        if k is None:  # as FlashAttention-2: the rotation's positions are those of new rows
            raise ValueError(
                f"{fn}: rotary_cos and rotary_sin need the new k and v to append (rotary "
                f"embedding is applied to q and k at the rows written to the cache)"
            )
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _check_tensor(fn, name, x)
            _check_same_device(fn, "q", q, name, x)
            _check_rank(fn, name, x, 2, "(seqlen_ro, rotary_dim / 2)")
            if x.dtype not in (q.dtype, torch.float32):
                raise TypeError(
                    f"{fn}: {name} must have q's dtype ({q.dtype}) or float32, got {x.dtype}"
                )
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(
                f"{fn}: rotary_cos and rotary_sin must have the same shape, got "
                f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}"
            )
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_cos.shape[0] < 1 or not 0 < rotary_dim <= headdim:
            raise ValueError(
                f"{fn}: rotary_cos must have shape (seqlen_ro >= 1, rotary_dim / 2) with "
                f"0 < rotary_dim <= headdim = {headdim}, got {tuple(rotary_cos.shape)}"
            )
        if type(rotary_interleaved) is not bool:
            raise TypeError(
                f"{fn}: rotary_interleaved must be a bool, got {rotary_interleaved!r}"
            )
    if type(return_softmax_lse) is not bool:
        raise TypeError(f"{fn}: return_softmax_lse must be a bool, got {return_softmax_lse!r}")
    scale, causal, left, right, cap, _ = _check_options(
        fn, device_type, headdim, 0.0, softmax_scale, causal, window_size, softcap,
        False, False,
    )
    check_values = device_type == "cpu" or (device_type == "cuda" and check_inputs_enabled())
    if check_values and not _is_compiling():
        if isinstance(cache_seqlens, Tensor):
            _check_index_values(fn, "cache_seqlens", cache_seqlens,
                                seqlen_cache - seqlen_new + 1, lens_interval)
        if rotary_dim:
            # The last position rotated: the cache's length (plus the new rows or q's rows).
            start = (max(cache_seqlens.tolist(), default=0) if isinstance(cache_seqlens, Tensor)
                     else cache_seqlens)
            local = causal or left >= 0 or right >= 0
            last = start + max(seqlen_new, q.shape[1] if local else 1) - 1
            if last >= rotary_cos.shape[0]:
                raise ValueError(
                    f"{fn}: rotary_cos and rotary_sin have {rotary_cos.shape[0]} positions "
                    f"(seqlen_ro), but position {last} is rotated; pass tables of at least "
                    f"{last + 1} rows"
                )
        if cache_leftpad is not None:
            ends = (cache_seqlens.tolist() if isinstance(cache_seqlens, Tensor)
                    else [seqlen_cache if cache_seqlens is None else cache_seqlens] * batch)
            for b, (first, end) in enumerate(zip(cache_leftpad.tolist(), ends)):
                if not 0 <= first <= end:
                    raise ValueError(
                        f"{fn}: cache_leftpad must be in [0, cache_seqlens] (a sequence's "
                        f"first cache row, before its end), got cache_leftpad[{b}] = {first} "
                        f"with a cache length of {end}"
                    )
        if cache_batch_idx is not None:
            _check_index_values(fn, "cache_batch_idx", cache_batch_idx, k_cache.shape[0],
                                f"[0, batch_cache) = [0, {k_cache.shape[0]})")
        if block_table is not None:
            _check_index_values(fn, "block_table", block_table, k_cache.shape[0],
                                f"[0, num_blocks) = [0, {k_cache.shape[0]})")
    attn = AttnArgs(
        varlen=False, batch=batch, seqlen_q=q.shape[1], seqlen_k=seqlen_cache, total_q=None,
        total_k=None, nheads=nheads, nheads_k=nheads_k, headdim=headdim, softmax_scale=scale,
        causal=causal, window_left=left, window_right=right, softcap=cap,
        device_type=device_type, dtype=q.dtype,
        alibi_slopes=_check_alibi(fn, alibi_slopes, q, batch, nheads),
        sink=_check_sink(fn, s_aux, learnable_sink, q, nheads),
        q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
    )
    return KVCacheArgs(attn, seqlen_new, cache_seqlens, rotary_dim, bool(rotary_interleaved),
                       return_softmax_lse)
