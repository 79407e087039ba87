"""``torch.library`` custom ops wrapping the attention kernels, and their eager fast path.

* ``torch.ops.flash_attn._fwd`` -> ``(out, softmax_lse)``
* ``torch.ops.flash_attn._bwd`` -> ``(dq, dk, dv)``
* ``torch.ops.flash_attn._kvcache_update`` -> ``seqused_k`` (writes the caches and ``q_rot``)

Device implementations: CUDA calls the extension's ops ``torch.ops.flash_attn_cuda.fwd``,
``bwd`` and ``kvcache_update`` (on PyTorch's stable C ABI, registered by importing
``flash_attn._C``, which is done lazily so that this module imports without it); CPU runs
:mod:`flash_attn.reference`. Every op has a fake
(meta) implementation, so it traces under ``torch.compile`` as a single opaque node, and
``_fwd`` has an autograd formula that calls ``_bwd``.

The entry points :func:`flash_attn_fwd` / :func:`flash_attn_bwd` call the custom ops while
``torch.compile`` traces (and whenever a mode, transform or tensor subclass could intercept the
op). In plain eager mode they call the same device implementations directly, skipping the
dispatcher round trip of the custom op (tens of microseconds per call): through
``_FlashAttnFunc``, a ``torch.autograd.Function`` sharing the op's context setup and backward
formula, when a gradient is needed, else with no autograd at all.

The signatures of ``_fwd`` / ``_bwd`` follow the extension's ``fwd`` / ``bwd``
(docs/INTERNALS.md), which take no preallocated outputs (the ops are functional,
``mutates_args=()``), with one difference: ``_fwd`` takes a ``deterministic`` flag (before
``kv_batch_idx``, ``block_table``, ``leftpad_k`` and ``alibi_slopes``) that the forward ignores
and that is handed to ``_bwd`` by the autograd formula. Both end with ``sink`` (the learnable
sink, float32 ``(nheads,)``): the CPU kernels implement it in the reference,
``flash_attn_cuda.fwd`` takes it (its kernels join it to each finished row; a call with no keys
launches nothing, and its rows attend to the sink alone), and the CUDA ``_bwd`` needs nothing of
it (its ``softmax_lse`` already includes the sink). ``_fwd``'s autograd formula returns the
sink's gradient, computed from ``out``, ``dout`` and ``softmax_lse`` (:func:`sink_grad`). After
the sink both take ``dropout_p`` and ``rng_state`` (int64 ``(2,)`` on q's device: the mask's
seed and offset, flash_attn/dropout.py; ``(5,)`` places the call in a larger attention),
which ``flash_attn_cuda.fwd`` and ``flash_attn_cuda.bwd`` take too: the CPU kernels and the
SM80 CUDA kernels apply the mask (the binding runs the SM80 kernels under dropout on every
GPU). ``_fwd`` ends with ``sm_margin``: SMs
the SM90 forward's persistent grid leaves free for work running beside it, such as ring
attention's NCCL transfers (a scheduling hint: the CPU and the SM80 kernels, whose grids do not
hold the GPU, have nothing to leave). ``_fwd`` then ends with ``q_descale``, ``k_descale`` and
``v_descale``, the descales of FP8 inputs (flash_attn/_fp8.py): float32 ``(batch, nheads_k)``,
contiguous, on q's device, or None (1). With q, k, v in ``float8_e4m3fn`` the CUDA kernel calls
``flash_attn_cuda.fwd`` with them as its last three arguments (the SM90 FP8 kernels; never
``fwd_plain``), the CPU kernel dequantizes (k's descale joined to q's, v's applied to the
output: constants of a sequence and key/value head) and runs the float32 reference, and both
return ``out`` in bfloat16; the autograd formula raises NotImplementedError (no FP8
backward). Both ops end with ``alibi_offset`` (int, 0 by default), which
``flash_attn_cuda.fwd`` / ``bwd`` take last too: ALiBi's distance becomes
``i + seqlen_k - seqlen_q + alibi_offset - j`` (the masks do not move), so that ring attention
can call the kernels on a sub-block of a longer sequence. ``_kvcache_update`` follows
``flash_attn_cuda.kvcache_update`` and mutates the caches and ``q_rot``.

Callers (``flash_attn_interface``) validate the arguments first and guarantee: q/k/v with a
stride-1 last dim, head dim a multiple of 8 on CUDA, 16 for FP8 (the interface zero-pads other
head dims), FP8 only batched or varlen without paged or indexed K/V,
``softmax_scale`` already resolved to a float, the window normalized
(``causal`` implies ``window_right == 0``), and the sink contiguous float32 (float64 beside
float64 CPU inputs).

Outputs are always freshly allocated contiguous tensors: ``out`` has q's shape (with v's head
dim) and dtype (bfloat16 for FP8 q),
``softmax_lse`` is float32 of shape ``(batch, nheads, seqlen_q)``, or ``(nheads, total_q)`` for
varlen (``cu_seqlens_q`` given); ``dq, dk, dv`` have the shapes and dtypes of q, k, v.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import _fp8, reference

__all__ = ["flash_attn_fwd", "flash_attn_bwd", "kvcache_update", "load_extension",
           "sink_grad"]

class _Extension:
    """The compiled extension as this package calls it: the kernels' ops, which importing
    ``flash_attn._C`` registers as ``torch.ops.<_C.op_namespace>.*`` (``flash_attn_cuda``; an
    A/B build has a namespace of its own), and ``_C``'s own functions (``build_info``, the
    bad-input words)."""

    def __init__(self, module: ModuleType) -> None:
        ops = getattr(torch.ops, module.op_namespace)
        # The overloads themselves: calling the packet resolves the overload on every call.
        self.fwd: Callable[..., Tuple[Tensor, Tensor]] = ops.fwd.default
        self.bwd: Callable[..., Tuple[Tensor, Tensor, Tensor]] = ops.bwd.default
        # The same without optional tensors or dropout, the scalars in one list: fewer
        # arguments, a cheaper call (csrc/flash_api.cpp, fwd_plain).
        self.fwd_plain: Callable[..., Tuple[Tensor, Tensor]] = ops.fwd_plain.default
        self.bwd_plain: Callable[..., Tuple[Tensor, Tensor, Tensor]] = ops.bwd_plain.default
        self.kvcache_update: Callable[..., Tensor] = ops.kvcache_update.default
        self.stream_value32: Callable[[Tensor, int, bool], None] = ops.stream_value32.default
        self.build_info: Callable[[], Dict[str, Any]] = module.build_info
        self.bad_input_word_address: Callable[[int], int] = module.bad_input_word_address
        self.take_bad_input: Callable[[int], int] = module.take_bad_input


_EXT: Optional[_Extension] = None


def load_extension() -> _Extension:
    """Import ``flash_attn._C`` (once), which registers the kernels' ops, or raise a
    RuntimeError saying why it is unavailable."""
    global _EXT
    if _EXT is None:
        try:
            from .. import _C  # noqa: F401  (the compiled extension)
        except Exception as e:  # ImportError, OSError (missing libs), undefined symbols ...
            raise RuntimeError(
                "flash_attn: the CUDA extension flash_attn._C is not available ("
                f"{type(e).__name__}: {e}). It was not built or does not load in this "
                "environment; run `python -m flash_attn` to see the build status, and rebuild "
                "with `pip install -e .` on a machine with CUDA. CPU tensors run the PyTorch "
                "reference and do not need it."
            ) from e
        _EXT = _Extension(_C)
    return _EXT


# Head-dim tiers the kernels are compiled for (csrc/common/tiers.h, kHeadDimTiers).
_HEADDIM_TIERS = (32, 64, 96, 128, 160, 192, 224, 256)
_BUILT_KERNELS = None
# Compute capability per CUDA device index; it cannot change while the process runs.
_CAPABILITY: Dict[int, Tuple[int, int]] = {}


def _capability(device: torch.device) -> Tuple[int, int]:
    """Compute capability of ``device``, cached per device index. A device without an index
    means the current device, which can change, so it is queried every time."""
    index = device.index
    if index is None:
        return torch.cuda.get_device_capability(device)
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = torch.cuda.get_device_capability(device)
    return cap


def _tier(headdim: int) -> Optional[int]:
    """The smallest compiled head-dim tier >= ``headdim``, or None above the largest."""
    for t in _HEADDIM_TIERS:
        if headdim <= t:
            return t
    return None


def require_kernel(kind: str, dtype: torch.dtype, headdim: int, device: torch.device) -> None:
    """Raise NotImplementedError naming the build flags when this build has no kernel for the
    call. Mirrors the binding's dispatch (SM90 kernels on compute capability 9.0 unless
    FLASH_ATTN_FORCE_SM80=1, else SM80). The binding raises the same error; every entry point
    calls this first so that the error comes before any output is allocated.

    FP8 (torch.float8_e4m3fn, build_info's dtype "e4m3") has SM90 forward kernels only: on
    another GPU, or with FLASH_ATTN_FORCE_SM80=1, it raises NotImplementedError saying so.

    Arguments:
        kind: "fwd" or "bwd".
        dtype: torch.float16, torch.bfloat16 or torch.float8_e4m3fn.
        headdim: the head dim handed to the kernel (a multiple of 8, of 16 for FP8, at most
            256).
        device: the CUDA device of the call.
    """
    global _BUILT_KERNELS
    if _BUILT_KERNELS is None:
        _BUILT_KERNELS = {(k["kind"], k["arch"], k["dtype"], k["headdim"])
                          for k in load_extension().build_info()["kernels"]}
    tier = _tier(headdim)
    fp8 = dtype in _fp8.FP8_DTYPES
    dt = "e4m3" if fp8 else "fp16" if dtype == torch.float16 else "bf16"
    if fp8:
        _require_sm90_for_fp8(device)  # e4m3 has no SM80 kernels
    elif (kind, 80, dt, tier) in _BUILT_KERNELS:
        return
    # Only without an SM80 kernel do the capability and FLASH_ATTN_FORCE_SM80 matter; the
    # variable is read at every call, as the binding does.
    if ((kind, 90, dt, tier) in _BUILT_KERNELS and _capability(device) == (9, 0)
            and os.environ.get("FLASH_ATTN_FORCE_SM80", "") != "1"):
        return
    raise NotImplementedError(
        f"flash_attn: no {'forward' if kind == 'fwd' else 'backward'} kernel was built for {dt} "
        f"head dim {headdim} (tier {tier}). Rebuild with FLASH_ATTN_HEADDIMS including {tier}, "
        f"FLASH_ATTN_DTYPES including {dt}"
        + (" and sm_90 among the targets" if fp8 else "")
        + (" and FLASH_ATTN_DISABLE_BACKWARD unset" if kind == "bwd" else "")
        + "; `python -m flash_attn` lists what was built.")


def _require_sm90_for_fp8(device: torch.device) -> None:
    """FP8 (e4m3) runs on the SM90 kernels only: a compute capability 9.0 GPU, and not under
    FLASH_ATTN_FORCE_SM80=1."""
    cap = _capability(device)
    if cap != (9, 0):
        raise NotImplementedError(
            f"flash_attn: FP8 (float8_e4m3fn) attention needs an H100-class (sm90) GPU: only "
            f"the SM90 kernels take it, and {device} has compute capability "
            f"{cap[0]}.{cap[1]}; pass bf16/fp16 inputs on this GPU"
        )
    if os.environ.get("FLASH_ATTN_FORCE_SM80", "") == "1":
        raise NotImplementedError(
            "flash_attn: FP8 (float8_e4m3fn) attention runs on the SM90 kernels only, and "
            "FLASH_ATTN_FORCE_SM80=1 selects the SM80 kernels; unset it for FP8 inputs"
        )


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])  # (nheads, total_q)
    return (q.shape[0], q.shape[2], q.shape[1])  # (batch, nheads, seqlen_q)


# Tensor types the device implementations may be handed directly (Parameter only disables
# __torch_function__); any other subclass goes through the custom op.
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def _direct_call_ok(q: Tensor, *tensors: Optional[Tensor]) -> bool:
    """Whether calling the device implementation for q's device directly does what calling the
    custom op would: q on CPU or CUDA (meta tensors take the op's fake implementation), plain
    tensors, and no torch-function or dispatch mode (FakeTensorMode, make_fx, selective
    checkpointing, ...) nor functorch transform (vmap, grad, ...) that would see the op.
    The caller checks ``torch.compiler.is_compiling()`` first."""
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return False
    if type(q) not in _PLAIN_TENSOR_TYPES or not (q.is_cuda or q.is_cpu):
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN_TENSOR_TYPES:
            return False
    return True


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_attn::_fwd", mutates_args=())
def _fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool = False,
    kv_batch_idx: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
    sm_margin: int = 0,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    raise NotImplementedError(
        f"flash_attn::_fwd has no implementation for device {q.device} (CUDA and CPU only)"
    )


@_fwd_op.register_kernel("cpu")
def _fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, causal, window_left, window_right, softcap, deterministic=False,
             kv_batch_idx=None, block_table=None, leftpad_k=None, alibi_slopes=None, sink=None,
             dropout_p=0.0, rng_state=None, sm_margin=0, q_descale=None, k_descale=None,
             v_descale=None, alibi_offset=0):
    if q.dtype in _fp8.FP8_DTYPES:
        # The reference of an FP8 call: the float32 attention of the dequantized inputs, rounded
        # to bfloat16. k's descale joins q's and v's scales the output (both are constants of a
        # sequence and key/value head), so K and V are read as stored, through any batch index,
        # pages or left pad, and sequence b keeps its descales whichever rows it reads.
        q = _fp8.dequantize(q, _fp8.scores_descale(q_descale, k_descale), cu_seqlens_q)
        out, lse = _fwd_cpu(
            q, k.float(), v.float(), cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
            deterministic, kv_batch_idx, block_table, leftpad_k, alibi_slopes, sink, dropout_p,
            rng_state, sm_margin)
        return _fp8.dequantize(out, v_descale, cu_seqlens_q).to(_fp8.OUT_DTYPE), lse
    if kv_batch_idx is not None:
        idx = _kv_entries(kv_batch_idx, k)
        k, v = k[idx], v[idx]
    if block_table is not None and cu_seqlens_k is None:
        k, v = reference.unpage(k, block_table), reference.unpage(v, block_table)
    if leftpad_k is not None:
        if seqused_k is None or cu_seqlens_k is not None:
            raise ValueError("flash_attn: leftpad_k is for batched K/V with seqused_k (the keys "
                             "from the pad on)")
        k, v = reference.unpad_left(k, v, seqused_k, leftpad_k)
    if block_table is not None and cu_seqlens_k is not None:
        # Sequence b's keys are its pages' first rows, as many as the kernels count; packed
        # back to back, the reference reads them through cu_seqlens_k rebuilt from the counts.
        lens = reference.paged_key_counts(cu_seqlens_k, block_table.shape[1] * k.shape[1],
                                          max_seqlen_k)
        k, v = (reference.unpage_varlen(x, block_table, lens) for x in (k, v))
        cu_seqlens_k = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    return reference.attention_forward_ref(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, sink,
        dropout_p, rng_state, alibi_offset=alibi_offset,
    )


def _kv_entries(kv_batch_idx: Tensor, k: Tensor) -> Tensor:
    """The K/V entry of each query batch, kv_batch_idx clamped into K's batch (as the kernels
    read them), as int64 indices."""
    return kv_batch_idx.long().clamp(0, k.shape[0] - 1)


def _out_shape(q: Tensor, v: Tensor) -> Tuple[int, ...]:
    """out has q's shape with v's head dim (which may differ from q's)."""
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def _out_dtype(q: Tensor) -> torch.dtype:
    """q's dtype; bfloat16 for FP8 q (flash_attn/_fp8.py)."""
    return _fp8.OUT_DTYPE if q.dtype in _fp8.FP8_DTYPES else q.dtype


def _empty_forward(q: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
                   sink: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    # Nothing to launch: no query rows, or no keys at all (every row then has no kept key, and
    # its softmax is the sink alone: lse = the sink's logit, +inf where it is -inf or absent).
    out = torch.zeros(_out_shape(q, v), dtype=_out_dtype(q), device=q.device)
    lse = torch.full(_lse_shape(q, cu_seqlens_q), float("inf"), dtype=torch.float32,
                     device=q.device)
    if sink is not None:
        alone = torch.where(sink == float("-inf"), float("inf"), sink.float())
        lse.copy_(alone.view(-1, 1) if cu_seqlens_q is not None else alone.view(1, -1, 1))
    return out, lse


@_fwd_op.register_kernel("cuda")
def _fwd_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, deterministic=False,
              kv_batch_idx=None, block_table=None, leftpad_k=None, alibi_slopes=None,
              sink=None, dropout_p=0.0, rng_state=None, sm_margin=0, q_descale=None,
              k_descale=None, v_descale=None, alibi_offset=0):
    if (q.numel() == 0 or k.numel() == 0
            or (block_table is not None and block_table.numel() == 0)):
        return _empty_forward(q, v, cu_seqlens_q, sink)
    require_kernel("fwd", q.dtype, q.shape[-1], q.device)
    ext = load_extension()
    if q.dtype in _fp8.FP8_DTYPES:
        # The SM90 FP8 kernels, through fwd (fwd_plain takes no descales): out in bfloat16.
        out, lse = ext.fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, window_right, softcap, kv_batch_idx,
            block_table, leftpad_k, alibi_slopes, sink, dropout_p, rng_state, sm_margin,
            q_descale, k_descale, v_descale,
        )
        return out, lse
    # A tuple, which the eager autograd.Function (_FlashAttnFunc) takes as two tensor outputs.
    if (cu_seqlens_q is None and cu_seqlens_k is None and seqused_k is None
            and kv_batch_idx is None and block_table is None and leftpad_k is None
            and alibi_slopes is None and sink is None and dropout_p == 0.0
            and rng_state is None):
        out, lse = ext.fwd_plain(q, k, v, [
            float(max_seqlen_q), float(max_seqlen_k), softmax_scale, float(causal),
            float(window_left), float(window_right), softcap, float(sm_margin)])
    else:
        out, lse = ext.fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, window_right, softcap, kv_batch_idx,
            block_table, leftpad_k, alibi_slopes, sink, dropout_p, rng_state, sm_margin,
            alibi_offset=alibi_offset,
        )
    return out, lse


@_fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, deterministic=False,
              kv_batch_idx=None, block_table=None, leftpad_k=None, alibi_slopes=None,
              sink=None, dropout_p=0.0, rng_state=None, sm_margin=0, q_descale=None,
              k_descale=None, v_descale=None, alibi_offset=0):
    # contiguous, like the real implementations; bfloat16 for FP8 q
    out = q.new_empty(_out_shape(q, v), dtype=_out_dtype(q))
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return out, lse


def _fwd_impl(*args: Any) -> Tuple[Tensor, Tensor]:
    """The custom op's kernel for q's device (CPU or CUDA), called without the dispatcher."""
    return _fwd_cuda(*args) if args[0].is_cuda else _fwd_cpu(*args)


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_attn::_bwd", mutates_args=())
def _bwd_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    alibi_slopes: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
    alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    raise NotImplementedError(
        f"flash_attn::_bwd has no implementation for device {q.device} (CUDA and CPU only)"
    )


@_bwd_op.register_kernel("cpu")
def _bwd_cpu(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
             deterministic, alibi_slopes=None, sink=None, dropout_p=0.0, rng_state=None,
             alibi_offset=0):
    # The reference is deterministic whatever `deterministic` says.
    return reference.attention_backward_ref(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
        alibi_slopes=alibi_slopes, sink=sink, dropout_p=dropout_p, rng_state=rng_state,
        alibi_offset=alibi_offset,
    )


@_bwd_op.register_kernel("cuda")
def _bwd_cuda(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
              deterministic, alibi_slopes=None, sink=None, dropout_p=0.0, rng_state=None,
              alibi_offset=0):
    # The sink needs nothing here: softmax_lse includes it, and P = exp(S - lse) is then the
    # probability of each key with the sink in the denominator.
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    require_kernel("bwd", q.dtype, q.shape[-1], q.device)
    ext = load_extension()
    if (cu_seqlens_q is None and cu_seqlens_k is None and alibi_slopes is None
            and dropout_p == 0.0 and rng_state is None):
        return ext.bwd_plain(dout, q, k, v, out, softmax_lse, [
            float(max_seqlen_q), float(max_seqlen_k), softmax_scale, float(causal),
            float(window_left), float(window_right), softcap, float(deterministic)])
    dq, dk, dv = ext.bwd(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
        deterministic, alibi_slopes, dropout_p, rng_state, alibi_offset,
    )
    return dq, dk, dv


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
              deterministic, alibi_slopes=None, sink=None, dropout_p=0.0, rng_state=None,
              alibi_offset=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def flash_attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    alibi_slopes: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
    alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`flash_attn_fwd`: ``(dq, dk, dv)``, not differentiable (the sink's
    gradient is :func:`sink_grad`).

    Calls ``torch.ops.flash_attn._bwd`` while tracing, under grad mode (a backward with
    ``create_graph=True``: differentiating through the op then raises autograd's error, as the
    op has no autograd formula), or when :func:`_direct_call_ok` says no; else the op's kernel
    for q's device directly.
    """
    args = (dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
            deterministic, alibi_slopes, sink, dropout_p, rng_state, alibi_offset)
    if (torch.compiler.is_compiling() or torch.is_grad_enabled()
            or not _direct_call_ok(q, dout, k, v, out, softmax_lse, cu_seqlens_q,
                                   cu_seqlens_k, alibi_slopes, sink, rng_state)):
        return _bwd_op(*args)
    return _bwd_cuda(*args) if q.is_cuda else _bwd_cpu(*args)


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
     softmax_scale, causal, window_left, window_right, softcap, deterministic,
     kv_batch_idx, block_table, leftpad_k, alibi_slopes, sink, dropout_p, rng_state,
     _sm_margin, _q_descale, _k_descale, _v_descale, alibi_offset) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    # An FP8 forward has no backward (_backward raises): nothing to save.
    ctx.fp8 = q.dtype in _fp8.FP8_DTYPES
    if ctx.fp8:
        return
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, kv_batch_idx,
                          alibi_slopes, sink, rng_state)
    ctx.dropout_p = dropout_p
    ctx.has_seqused_k = seqused_k is not None
    ctx.paged = block_table is not None
    ctx.left_padded = leftpad_k is not None
    ctx.max_seqlen_q = max_seqlen_q
    ctx.max_seqlen_k = max_seqlen_k
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.window_left = window_left
    ctx.window_right = window_right
    ctx.softcap = softcap
    ctx.deterministic = deterministic
    ctx.alibi_offset = alibi_offset


def _backward(ctx, dout, dlse):
    # dlse is ignored: softmax_lse is marked non-differentiable.
    if ctx.fp8:
        raise NotImplementedError(_fp8.NO_BACKWARD)
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, kv_batch_idx,
     alibi_slopes, sink, rng_state) = ctx.saved_tensors
    if ctx.left_padded:
        raise NotImplementedError(
            "flash_attn: the backward pass does not support a left-padded K/V (cache_leftpad; "
            "forward only)"
        )
    if ctx.has_seqused_k:
        raise NotImplementedError(
            "flash_attn: the backward pass does not support seqused_k (forward only, see "
            "docs/INTERNALS.md)"
        )
    if ctx.paged:
        raise NotImplementedError(
            "flash_attn: the backward pass does not support a paged K/V (block_table; forward "
            "only)"
        )
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    needs = ctx.needs_input_grad
    dq = dk = dv = dsink = None
    if needs[0] or needs[1] or needs[2]:
        idx = None if kv_batch_idx is None else _kv_entries(kv_batch_idx, k)
        keys, values = (k, v) if idx is None else (k[idx], v[idx])
        dq, dk, dv = flash_attn_bwd(
            dout, q, keys, values, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q,
            ctx.max_seqlen_k, ctx.softmax_scale, ctx.causal, ctx.window_left,
            ctx.window_right, ctx.softcap, ctx.deterministic, alibi_slopes, sink,
            ctx.dropout_p, rng_state, ctx.alibi_offset,
        )
        if idx is not None:  # entries read by several query batches sum their gradients
            dk = torch.zeros_like(k).index_add_(0, idx, dk)
            dv = torch.zeros_like(v).index_add_(0, idx, dv)
    if sink is not None and needs[18]:
        dsink = sink_grad(dout, out, lse, sink, cu_seqlens_q is not None)
    return (dq, dk, dv) + (None,) * 15 + (dsink, None, None, None, None, None, None, None)


def sink_grad(dout: Tensor, out: Tensor, softmax_lse: Tensor, sink: Tensor,
              varlen: bool) -> Tensor:
    """The learnable sink's gradient, in the sink's dtype:
    ``dsink[h] = -sum over rows r of head h of exp(sink[h] - lse[r]) * D[r]``, with
    ``D[r] = rowsum(dout * out)`` over the head dim and lse including the sink (the sink's
    probability times D, as for any score of the softmax; it has no value vector). Rows with no
    kept key have out = 0, so D = 0; a -inf sink gets 0. Plain torch ops on any device: the
    attention kernels' dq, dk, dv need nothing new for the sink, only a sink-including lse.

    Arguments:
        dout, out: (batch, seqlen_q, nheads, headdim), or (total_q, nheads, headdim) (varlen).
        softmax_lse: float32 (batch, nheads, seqlen_q), or (nheads, total_q) (varlen).
        sink: (nheads,).
    """
    cdt = torch.float64 if torch.float64 in (out.dtype, sink.dtype) else torch.float32
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)  # (batch, seqlen_q, nheads) or (total, nheads)
    if varlen:
        delta = delta.transpose(0, 1).unsqueeze(0)  # (1, nheads, total_q)
    else:
        delta = delta.transpose(1, 2)  # (batch, nheads, seqlen_q)
    p_sink = torch.exp(sink.to(cdt)[None, :, None] - softmax_lse.to(cdt).reshape(delta.shape))
    return -(p_sink * delta).sum(dim=(0, 2)).to(sink.dtype)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _FlashAttnFunc(torch.autograd.Function):
    """The eager autograd node of the forward: the op's kernel for q's device, with the op's
    context setup and backward formula. ``forward`` takes ``ctx`` itself rather than defining
    a ``setup_context`` staticmethod: with one, ``Function.apply`` binds the arguments with
    ``inspect.signature`` on every call."""

    @staticmethod
    def forward(ctx, *inputs: Any) -> Tuple[Tensor, Tensor]:
        output = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_backward)


def flash_attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool = False,
    kv_batch_idx: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
    sm_margin: int = 0,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Attention forward: ``(out, softmax_lse)``, differentiable in q, k, v and the sink
    (softmax_lse is not differentiable). FP8 q, k, v (float8_e4m3fn, with the descales) give
    a bfloat16 ``out`` and no backward: where one of q, k, v, the sink or a descale requires
    grad, a backward through ``out`` raises NotImplementedError.

    While ``torch.compile`` traces, or when :func:`_direct_call_ok` says no, this is the custom op
    ``torch.ops.flash_attn._fwd``, which traces as one node. In eager mode it calls the op's
    kernel for q's device directly: through ``_FlashAttnFunc`` when grad mode is on and q, k, v
    or the sink requires grad (the gradient reaches only those), else without autograd. Both
    ways run the same kernels and the same backward formula.
    """
    if sm_margin < 0:
        raise ValueError(f"flash_attn: sm_margin must be >= 0, got {sm_margin}")
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, window_right, softcap, deterministic,
            kv_batch_idx, block_table, leftpad_k, alibi_slopes, sink, dropout_p, rng_state,
            sm_margin, q_descale, k_descale, v_descale, alibi_offset)
    if torch.compiler.is_compiling() or not _direct_call_ok(q, k, v, cu_seqlens_q,
                                                             cu_seqlens_k, seqused_k,
                                                             kv_batch_idx, block_table,
                                                             leftpad_k, alibi_slopes, sink,
                                                             rng_state, q_descale, k_descale,
                                                             v_descale):
        return _fwd_op(*args)
    if torch.is_grad_enabled() and _requires_grad(q, k, v, sink, q_descale, k_descale,
                                                  v_descale):
        return _FlashAttnFunc.apply(*args)
    return _fwd_impl(*args)


def _requires_grad(*tensors: Optional[Tensor]) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache's cache update
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_attn::_kvcache_update",
                         mutates_args=("k_cache", "v_cache", "q_rot"))
def _kvcache_update_op(
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
    raise NotImplementedError(
        f"flash_attn::_kvcache_update has no implementation for device {q.device} (CUDA and "
        f"CPU only)"
    )


# The kernels spell out the trailing defaults: a traced call leaves them out.
@_kvcache_update_op.register_kernel("cpu")
def _kvcache_update_cpu(k_cache, v_cache, q_rot, q, k, v, cache_seqlens, seqlen_offset,
                        cache_batch_idx, rotary_cos, rotary_sin, rotary_interleaved,
                        q_rows_advance, block_table=None, cache_leftpad=None) -> Tensor:
    return reference.kvcache_update_ref(
        k_cache, v_cache, q_rot, q, k, v, cache_seqlens, seqlen_offset, cache_batch_idx,
        rotary_cos, rotary_sin, rotary_interleaved, q_rows_advance, block_table,
        cache_leftpad)


@_kvcache_update_op.register_kernel("cuda")
def _kvcache_update_cuda(k_cache, v_cache, q_rot, q, k, v, cache_seqlens, seqlen_offset,
                         cache_batch_idx, rotary_cos, rotary_sin, rotary_interleaved,
                         q_rows_advance, block_table=None, cache_leftpad=None) -> Tensor:
    # The attention after the update needs a forward kernel (FP8: an sm90 GPU): refused before
    # the caches are written, not after.
    require_kernel("fwd", q.dtype, _fp8.kernel_headdim(q.dtype, q.shape[-1]), q.device)
    return load_extension().kvcache_update(
        k_cache, v_cache, q_rot, q, k, v, cache_seqlens, seqlen_offset, cache_batch_idx,
        rotary_cos, rotary_sin, rotary_interleaved, q_rows_advance, block_table,
        cache_leftpad)


@_kvcache_update_op.register_fake
def _kvcache_update_fake(k_cache, v_cache, q_rot, q, *args):
    return q.new_empty((q.shape[0],), dtype=torch.int32)


def kvcache_update(
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
    """flash_attn_with_kvcache's cache update (:func:`flash_attn.reference.kvcache_update_ref`
    states it): k/v written into the caches in place (k rotated), q rotated into q_rot, and
    ``seqused_k`` returned; on CUDA one kernel launch. The custom op
    ``torch.ops.flash_attn._kvcache_update`` while tracing or when :func:`_direct_call_ok` says
    no, else its kernel for q's device directly. Not differentiable."""
    args = (k_cache, v_cache, q_rot, q, k, v, cache_seqlens, seqlen_offset, cache_batch_idx,
            rotary_cos, rotary_sin, rotary_interleaved, q_rows_advance, block_table,
            cache_leftpad)
    if torch.compiler.is_compiling() or not _direct_call_ok(
            q, k_cache, v_cache, q_rot, k, v, cache_seqlens, cache_batch_idx, rotary_cos,
            rotary_sin, block_table, cache_leftpad):
        return _kvcache_update_op(*args)
    return _kvcache_update_cuda(*args) if q.is_cuda else _kvcache_update_cpu(*args)
