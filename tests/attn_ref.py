"""Independent attention reference and shared helpers for the GPU tests.

Written from the semantics in docs/INTERNALS.md, on purpose without importing anything from
``flash_attn`` (``flash_attn/reference.py`` is the package's own CPU path; the kernels are
checked against this file instead, so a shared misreading of the contract cannot hide).

``attention_ref`` has two modes, chosen by ``compute_dtype``:

* ``torch.float32`` / ``torch.float64``: the "exact" reference. Inputs are upcast, everything is
  computed in ``compute_dtype`` and ``out`` comes back in ``compute_dtype`` (so errors are measured
  against the high-precision value, not against a rounded copy of it).
* ``torch.float16`` / ``torch.bfloat16`` (normally ``q.dtype``): "PyTorch in low precision", the
  baseline the accuracy rule scales by. The two matmuls run in the low dtype as a PyTorch model
  would (``q`` is scaled in the low dtype first, S = QK^T is rounded to the low dtype by the matmul),
  the softmax runs in float32, P is cast to the low dtype before ``P @ V``; ``out`` is in the low
  dtype.

Semantics: ``s = (q . k) * scale``, ``softcap > 0`` gives ``s = softcap * tanh(s / softcap)``;
masks are aligned bottom-right (``shift = seqlen_k - seqlen_q``; ``window_size = (left, right)``
keeps ``i + shift - left <= j <= i + shift + right``, negative = unbounded, ``causal`` forces
``right = 0``); query head ``h`` reads kv head ``h // (nheads // nheads_k)``; a row with no kept
key has ``out = 0``, ``lse = +inf`` and zero gradients (never NaN). ``lse`` is float32, or float64
when ``compute_dtype`` is float64: shape ``(batch, nheads, seqlen_q)``, or ``(nheads, total_q)``
with ``cu_seqlens``.
"""

from __future__ import annotations

import math
import os
import re
from typing import Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor

LOW_DTYPES = (torch.float16, torch.bfloat16)
HIGH_DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def keep_mask_ref(seqlen_q: int, seqlen_k: int, causal: bool, window_size, device) -> Tensor:
    """(seqlen_q, seqlen_k) bool, True where query row i may attend key column j."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    shift = seqlen_k - seqlen_q
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + shift + right
    if left >= 0:
        keep &= j >= i + shift - left
    return keep


def _attention_dense(q, k, v, scale, causal, window_size, softcap, compute_dtype, alibi=None,
                     sink=None, drop=None, alibi_offset=0):
    """q (b, sq, h, d), k/v (b, sk, hk, dv) -> out (b, sq, h, dv), lse (b, h, sq); alibi: ALiBi
    slopes (h,) or (b, h), or None; sink: a learnable sink's logits (h,) (one more softmax
    column per row, without a value), or None; drop: a dropout factor (b, h, sq, sk) applied
    to the probabilities, or None."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    assert h % hk == 0, (h, hk)
    low = compute_dtype in LOW_DTYPES
    acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)

    if sk == 0:
        # Nothing to attend to: out = 0 (still connected to q so autograd gives zeros), lse = +inf
        # (with a sink: its logit, or +inf where that is -inf).
        out = (q * 0).sum(-1, keepdim=True).expand(b, sq, h, v.shape[-1])
        lse = torch.full((b, h, sq), math.inf, dtype=acc_dtype, device=q.device)
        if sink is not None:
            s = sink.to(acc_dtype).view(1, h, 1).expand(b, h, sq)
            lse = torch.where(s == -math.inf, lse, s)
        return out, lse

    if low:
        # As PyTorch in low precision: scale q in the low dtype, matmul rounds S to the low dtype.
        s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k).to(acc_dtype)
    else:
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        dist = (torch.arange(sq, device=q.device)[:, None] + (sk - sq + alibi_offset)
                - torch.arange(sk, device=q.device)[None, :]).abs().to(acc_dtype)
        s = s - alibi.to(acc_dtype).expand(b, h)[:, :, None, None] * dist

    keep = keep_mask_ref(sq, sk, causal, window_size, q.device)  # (sq, sk)
    s = s.masked_fill(~keep, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # masked entries: exp(-inf) = 0, gradient 0
    l = p.sum(dim=-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    lse = torch.where(empty, torch.full_like(l, math.inf), torch.log(l_safe) + m).squeeze(-1)
    probs = p / l_safe
    if sink is not None:
        probs = probs[..., :-1]
    if drop is not None:
        probs = probs * drop.to(probs.dtype)
    if low:
        probs = probs.to(compute_dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: Optional[float] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    alibi_slopes: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
    drop: Optional[Tensor] = None,
    alibi_offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Reference attention. Batched: q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d),
    lse (b, h, sq). Varlen (cu_seqlens_q and cu_seqlens_k given): q (total_q, h, d),
    k/v (total_k, hk, d) -> out (total_q, h, d), lse (h, total_q). Differentiable.
    alibi_slopes (h,) or (batch, h): the score of query i and key j gets
    -slope * |i + sk - sq + alibi_offset - j| (after the softcap; the offset moves the bias, not
    the mask). sink (h,): a learnable sink's logits, one
    more softmax column of each row of head h, without a value (lse includes it). drop
    (batched only): dropout's factor (b, h, sq, sk) on the probabilities. v's head dim may
    differ from q's."""
    assert compute_dtype in LOW_DTYPES + HIGH_DTYPES, compute_dtype
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    window_size = (int(window_size[0]), int(window_size[1]))
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _attention_dense(q, k, v, scale, causal, window_size, softcap, compute_dtype,
                                alibi_slopes, sink, drop, alibi_offset)
    assert drop is None, "attention_ref: drop is for batched calls"
    assert cu_seqlens_q is not None and cu_seqlens_k is not None
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    assert len(cq) == len(ck)
    outs, lses = [], []
    for bi in range(len(cq) - 1):
        qs = q[cq[bi]:cq[bi + 1]].unsqueeze(0)
        ks = k[ck[bi]:ck[bi + 1]].unsqueeze(0)
        vs = v[ck[bi]:ck[bi + 1]].unsqueeze(0)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[bi:bi + 1]
        o, lse = _attention_dense(qs, ks, vs, scale, causal, window_size, softcap, compute_dtype,
                                  slopes, sink, None, alibi_offset)
        outs.append(o.squeeze(0))
        lses.append(lse.squeeze(0))
    if not outs:  # batch 0
        lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        return q[:0].to(compute_dtype), torch.empty(q.shape[1], 0, dtype=lse_dtype, device=q.device)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


# ---------------------------------------------------------------------------------------------
# Helpers shared by the GPU tests
# ---------------------------------------------------------------------------------------------

REF_DTYPE = torch.float64  # the "exact" reference: cheap on an H100 at these sizes, no TF32 risk


def kernel_paths() -> list:
    """Kernel paths the GPU tests run on. On compute capability 9.0 both: "sm90" (the default
    dispatch) and "sm80" (FLASH_ATTN_FORCE_SM80=1); elsewhere "sm80". FLASH_ATTN_TEST_PATHS
    (e.g. "sm90") narrows the list."""
    paths = ["sm80"]
    try:
        if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
            paths = ["sm90", "sm80"]
    except Exception:
        pass
    wanted = os.environ.get("FLASH_ATTN_TEST_PATHS")
    if wanted:
        paths = [p for p in paths if p in {w.strip() for w in wanted.split(",")}]
    return paths


def arg_re(name: str) -> str:
    """Regex matching the argument name as a whole word (so 'q' does not match 'seqlen_q')."""
    return r"(?<![\w])" + re.escape(name) + r"(?![\w])"


def poison_cuda_allocator(large_bytes: int = 256 << 20, small_blocks: int = 48) -> None:
    """Fill the CUDA caching allocator's free blocks with NaN bytes (0xFF is NaN in fp16, bf16
    and fp32) and return them to the cache, so that outputs a kernel forgets to write (e.g. rows
    with no kept key, or a tile tail) read back as NaN instead of as lucky zeros. The public API
    (FlashAttention-2's) takes no preallocated outputs, so this is how outputs get poisoned."""
    big = torch.empty(large_bytes, dtype=torch.uint8, device="cuda").fill_(0xFF)
    small = [torch.empty(1 << 19, dtype=torch.uint8, device="cuda").fill_(0xFF)
             for _ in range(small_blocks)]
    del big, small


def max_abs_err(a: Tensor, b: Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.to(b.dtype) - b).abs().max().item()


def assert_finite(name: str, x: Tensor) -> None:
    if x.numel() and not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise AssertionError(f"{name}: {bad} of {x.numel()} entries are NaN/inf")


def assert_accuracy(name: str, ours: Tensor, ref: Tensor, pt: Tensor, mult: float,
                    atol_rel: float = 1e-5) -> None:
    """The accuracy rule: max|ours - ref| <= mult * max|pt - ref| + atol, where ``ref`` is the
    high-precision reference, ``pt`` the same computation in the low dtype, and
    atol = atol_rel * max(1, max|ref|) absorbs fp32 accumulation-order noise where the low
    precision baseline happens to be exact (e.g. seqlen_k = 1, or rows whose gradient is 0)."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert_finite(name, ours)
    err = max_abs_err(ours, ref)
    pt_err = max_abs_err(pt, ref)
    scale = max_abs_err(ref, torch.zeros_like(ref)) if ref.numel() else 0.0
    atol = atol_rel * max(1.0, scale)
    assert err <= mult * pt_err + atol, (
        f"{name}: max|ours - ref| = {err:.3e} > {mult} * max|pt - ref| ({pt_err:.3e}) + "
        f"{atol:.1e} (max|ref| = {scale:.3e})"
    )


def assert_lse(name: str, lse: Tensor, lse_ref: Tensor, rtol: float = 1e-4) -> None:
    """Finite reference entries: |lse - ref| <= rtol * max(1, max|ref|); +inf entries: +inf."""
    assert lse.shape == lse_ref.shape, f"{name}: shape {tuple(lse.shape)} != {tuple(lse_ref.shape)}"
    assert lse.dtype == torch.float32, f"{name}: dtype {lse.dtype}, expected torch.float32"
    lse = lse.to(lse_ref.dtype)
    inf_ref = torch.isinf(lse_ref)
    assert not torch.isnan(lse).any(), f"{name}: NaN in softmax_lse"
    if inf_ref.any():
        got = lse[inf_ref]
        assert (got == math.inf).all(), (
            f"{name}: {int((got != math.inf).sum())} rows with no kept key have lse != +inf "
            f"(e.g. {got[got != math.inf][:4].tolist()})"
        )
    fin = ~inf_ref
    if fin.any():
        assert torch.isfinite(lse[fin]).all(), f"{name}: non-finite lse where the reference is finite"
        err = (lse[fin] - lse_ref[fin]).abs().max().item()
        tol = rtol * max(1.0, lse_ref[fin].abs().max().item())
        assert err <= tol, f"{name}: max|lse - ref| = {err:.3e} > {tol:.1e}"


GRAD_MULT = (3, 3, 2)  # accuracy-rule multipliers for dq, dk, dv (out uses 2)


def rand(*shape, dtype, requires_grad=True, device="cuda"):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def check_seqused_k(q: Tensor, k: Tensor, v: Tensor, used: Sequence[int], causal: bool,
                    check_lse: bool) -> None:
    """A KV cache filled to ``used[i]`` keys in sequence i (the internal op's seqused_k): the
    rows past it are set to NaN in k and v (in place) and must not reach the output, which is
    checked per sequence against the reference on its used keys (and the LSE if ``check_lse``).
    q: (batch, seqlen_q, nheads, d); k, v: (batch, seqlen_k, nheads_k, d)."""
    for i, n in enumerate(used):
        k[i, n:] = float("nan")
        v[i, n:] = float("nan")
    seqused = torch.tensor(list(used), dtype=torch.int32, device=q.device)
    d = q.shape[-1]
    out, lse = torch.ops.flash_attn._fwd(q, k, v, None, None, seqused, q.shape[1], k.shape[1],
                                         d ** -0.5, causal, -1, 0 if causal else -1, 0.0)
    for i, n in enumerate(used):
        qi, ki, vi = q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]
        ref, lse_ref = attention_ref(qi, ki, vi, causal=causal, compute_dtype=REF_DTYPE)
        pt, _ = attention_ref(qi, ki, vi, causal=causal, compute_dtype=q.dtype)
        assert_accuracy(f"out[{i}]", out[i:i + 1], ref, pt, 2)
        if check_lse:
            assert_lse(f"softmax_lse[{i}]", lse[i:i + 1], lse_ref)


def plain_qkv(q, k, v):
    return q, k, v


def compare_to_ref(out, grads, leaves, to_qkv, ref_kwargs, dout, tag=""):
    """Check a kernel's ``out`` and its gradients ``grads`` (w.r.t. ``leaves``, for ``dout``)
    against the float64 reference and the low-precision baseline. ``to_qkv(*tensors)`` maps the
    leaves to the (q, k, v) views the reference takes; applied to gradients of the leaves it gives
    (dq, dk, dv). ``grads=None`` checks the forward only."""
    dtype = leaves[0].dtype
    need_grad = grads is not None
    ref_leaves = [x.detach().to(REF_DTYPE).requires_grad_(need_grad) for x in leaves]
    out_ref, _ = attention_ref(*to_qkv(*ref_leaves), compute_dtype=REF_DTYPE, **ref_kwargs)
    pt_leaves = [x.detach().clone().requires_grad_(need_grad) for x in leaves]
    out_pt, _ = attention_ref(*to_qkv(*pt_leaves), compute_dtype=dtype, **ref_kwargs)
    assert_accuracy(f"out{tag}", out, out_ref, out_pt, 2)
    if not need_grad:
        return
    grads_ref = torch.autograd.grad(out_ref, ref_leaves, dout.to(REF_DTYPE))
    grads_pt = torch.autograd.grad(out_pt, pt_leaves, dout)
    for g, leaf in zip(grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, (g.dtype, g.shape, leaf.shape)
    views = zip(("dq", "dk", "dv"), GRAD_MULT, to_qkv(*grads), to_qkv(*grads_ref),
                to_qkv(*grads_pt))
    for name, mult, g, g_ref, g_pt in views:
        assert_accuracy(f"{name}{tag}", g, g_ref, g_pt, mult)


def assert_backward_repeatable(out: Tensor, leaves, runs: int) -> None:
    """`runs` backward passes of `out` (one random dout) give bitwise equal gradients of the
    three leaves (q, k, v): deterministic=True's promise."""
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    for _ in range(runs - 1):
        again = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        for name, a, b in zip("qkv", first, again):
            assert torch.equal(a, b), f"d{name} differs between runs"


def check_fwd_bwd(ours_fn, leaves, to_qkv, ref_kwargs):
    """Run ``ours_fn(*leaves) -> out`` (the kernel), backprop a random ``dout`` to every leaf and
    compare out, dq, dk, dv with the references (see compare_to_ref). Returns (out, grads)."""
    out = ours_fn(*leaves)
    assert isinstance(out, torch.Tensor), f"expected a Tensor, got {type(out).__name__}"
    q_view = to_qkv(*leaves)[0]
    assert out.dtype == q_view.dtype and out.device == q_view.device, (out.dtype, out.device)
    assert tuple(out.shape) == tuple(q_view.shape), (tuple(out.shape), tuple(q_view.shape))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    compare_to_ref(out, grads, leaves, to_qkv, ref_kwargs, dout)
    return out, grads


# Autouse fixtures: a test module opts in with
#     from attn_ref import kernel_path, poisoned_allocator  # noqa: F401


@pytest.fixture(autouse=True, params=kernel_paths())
def kernel_path(request, monkeypatch):
    """Runs every test on each kernel path (the id says which); the binding reads
    FLASH_ATTN_FORCE_SM80 at every call."""
    if request.param == "sm80":
        monkeypatch.setenv("FLASH_ATTN_FORCE_SM80", "1")
    else:
        monkeypatch.delenv("FLASH_ATTN_FORCE_SM80", raising=False)
    return request.param


@pytest.fixture(autouse=True)
def poisoned_allocator():
    if torch.cuda.is_available():
        poison_cuda_allocator()
    yield
