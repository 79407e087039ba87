"""FP8 (float8_e4m3fn) forward on the SM90 kernels: out (bfloat16) and lse
(float32) against a float64 attention of the dequantized inputs ``x.double() * descale``, with
random descales in [0.5, 2] per (sequence, kv head); batched and varlen, full / causal / sliding
window, GQA and MQA, head dims 64, 128, 256 and padded ones (80: the kernel's tier 96; 72: the
interface pads to 80), seqlens that are not multiples of 128 with seqlen_q != seqlen_k, softcap,
the learnable sink, flash_attn_with_kvcache on e4m3 caches (cache_seqlens, cache_batch_idx,
NaN bytes past each sequence). Skipped without an sm90 GPU or where the build has no e4m3
kernel of the tier (build_info's kernels with dtype "e4m3").

Bound (``Ref.bound``, per output element of row r, column d; float64, from the reference's own
probabilities, every quantity over the row's kept keys j):

    |O - O_ref| <= 2^-4 * A + S + (n_pv + 1) * 2^-12 * A + eps_s * T + 2^-8 * |O_ref|

* P rounding (the dominant term). The kernel rounds P_j = exp(s_j - m) to e4m3 before
  O += P V, while the normaliser l sums the unrounded P. e4m3 keeps 3 mantissa bits: a normal
  value (>= 2^-6) rounds to nearest with relative error <= 2^-4; below 2^-6 (subnormals,
  spacing 2^-9) the absolute error is <= 2^-10, and at most P_j itself (values under 2^-10
  round to 0). Its running max m never exceeds the row's final max M' (m may lag it, or be
  offset by up to 8 in log2 units so that P <= 256 < 448, e4m3's largest value: no
  saturation), so a P_j of the kernel's units counts exp(m - M') <= 1 times in the final
  units, where the normaliser is Z = sum_j exp(s_j - M') (+ exp(sink - M')) >= 1. Since l
  is unrounded, O - O_ref = sum_j dP_j V_j / l exactly, hence
  ``A = sum_j pi_j |V_jd|`` (pi the reference's probabilities) times 2^-4, plus
  ``S = sum_j min(exp(s_j - M'), 2^-10) |V_jd| / Z`` for the subnormal part (the weakest form,
  offset 0; with the kernel's offset it is smaller).
* Accumulation. Hopper's FP8 WGMMA accumulates in about 13 mantissa bits (FP22, SageAttention2),
  so each 32-deep k-step may lose 2^-13 of the sum of the magnitudes it adds: for S = QK^T at
  most (d/32 + 1) * 2^-13 * scale * sum_d |q_d k_jd| per score (eps_s is twice that per unit
  of ``a_j = scale * sum_d |q_d k_jd|``), and for P V (n_pv = ceil(keys / 32) k-steps) the
  third term, both with a factor 2 of margin. A score error ds_j moves O by
  sum_j pi_j (ds_j - ds_mean) (V_jd - O_d) to first order (softmax's derivative; the centring on
  O_d is free since the weights sum to 0), so ``T = sum_j pi_j (a_j + a_mean) |V_jd - O_ref_d|``
  (near 0 for one-hot attention, where a bound without the centring would not be). A softcap
  only shrinks score errors (tanh' <= 1). The descales enter in float32 (2^-24: negligible).
* The bfloat16 output: rounding with relative error <= 2^-8 (7 explicit mantissa bits), of
  |O| <= |O_ref| + the rest (the 1.5 below covers the difference).

Asserted: |O - O_ref| <= 1.5 * bound + 1e-3 everywhere (NaN from a poisoned, unwritten output
fails it). The bound is a worst case, loose for spread-out attention (errors of random sign
cancel), so a second rule has teeth there: the repository's accuracy rule (tests/attn_ref.py)
with a PyTorch baseline that does what the kernel's arithmetic does, P = 256 * exp(s - M)
rounded to e4m3 (exact float64 elsewhere, unrounded normaliser, output rounded to bf16):
max|O - O_ref| <= 3 * max|O_pt - O_ref| + 2^-8 * max(1, max|O_ref|) (one more bf16
rounding of the largest element).

Key order: the kernel permutes keys within each 32-key group to match the FP8 register layout
(V is read transposed), so a bug there mixes values of keys of one group, invisible with
near-uniform attention. test_sharp_attention makes each query attend (almost) only to one
key: q_r = 2 * k_target(r) with softmax_scale 1, values of very different sizes per key, so
O_r ~= v_target and the bound is tight (P of the target is the row's max, which rounds to
itself; the others are below e^-19 of it, and the centred score term vanishes), and a key or
mask mix-up is an O(|V|) error. It also aims queries at keys just inside the mask's edges
and, for the masked ones, just outside (a leak of a masked key then dominates the row).
test_matches_bf16_kernel compares with the bf16 kernel on the dequantized inputs cast to bf16,
within the sum of both bounds (the bf16 one: inputs and P rounded with relative error 2^-8,
scores off by 2^-7 * a_j, the output's rounding).

The rules were tried (on an H100, before the kernel existed) on an emulated kernel: online
softmax per 128 keys with P rounded to e4m3 (offset 8, and a lazily rescaled max with P <= 1),
and FP22-like accumulation (truncated to 13 mantissa bits per 32-deep k-step): its error stayed
under 0.43 of 1.5 * bound + 1e-3, 0.35 of the accuracy rule and 0.15 of the lse tolerance over
head dims 64-256, seqlens to 1000 x 4000, random and sharp inputs; planted bugs (V rows swapped
within 32-key groups, the q_descale of another head) failed every case.

softmax_lse is computed from the unrounded fp32 scores: |lse - lse_ref| <= 1e-2 + 1.5 * eps_s *
a_mean (the accumulation's score error, averaged by the softmax), +inf where no key is kept
(the sink's logit with a sink).
"""

import math
import os
import sys
from typing import NamedTuple, Optional

import pytest
import torch
from torch import Tensor

from flash_attn import _validation as V
from flash_attn import (
    flash_attn_func,
    flash_attn_interface as interface,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    ops,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import keep_mask_ref, poison_cuda_allocator  # noqa: E402

E4M3 = torch.float8_e4m3fn
U_E4M3 = 2.0 ** -4  # e4m3's unit roundoff (3 mantissa bits)
SUB_E4M3 = 2.0 ** -10  # its largest absolute rounding error below 2^-6 (subnormal spacing 2^-9)
FP22 = 2.0 ** -13  # relative loss per FP8 WGMMA k-step of 32 (13-bit accumulator mantissa)
U_BF16 = 2.0 ** -8  # bfloat16's unit roundoff (7 explicit mantissa bits)


@pytest.fixture(autouse=True)
def sm90_dispatch_poisoned_allocator(monkeypatch):
    """FP8 runs on the SM90 kernels only: the default dispatch (FLASH_ATTN_FORCE_SM80 unset);
    the allocator's free memory poisoned with NaN (tests/attn_ref.py), so that an output the
    kernel forgets to write fails the checks."""
    monkeypatch.delenv("FLASH_ATTN_FORCE_SM80", raising=False)
    if torch.cuda.is_available():
        poison_cuda_allocator()
    yield


# ---------------------------------------------------------------------------------------------
# What this GPU and build run
# ---------------------------------------------------------------------------------------------

_BUILT = None


def _built() -> set:
    """(kind, arch, dtype, headdim) of the registered kernels; empty without the extension."""
    global _BUILT
    if _BUILT is None:
        try:
            kernels = ops.load_extension().build_info()["kernels"]
        except Exception:
            kernels = []
        _BUILT = {(k["kind"], k["arch"], k["dtype"], k["headdim"]) for k in kernels}
    return _BUILT


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def need_fp8(*headdims: int, bf16: bool = False) -> None:
    """Skip unless the GPU is sm90 and the build has the e4m3 forward kernel (and, with
    ``bf16``, the bf16 one) of each head dim's tier (the interface pads FP8 head dims to a
    multiple of 16)."""
    if not _is_sm90():
        pytest.skip("FP8 runs on the SM90 kernels: needs a compute capability 9.0 GPU")
    for d in headdims:
        tier = ops._tier(d + -d % 16)
        if ("fwd", 90, "e4m3", tier) not in _built():
            pytest.skip(f"no e4m3 forward kernel for head dim {d} (tier {tier}) in this build")
        if bf16 and ("fwd", 90, "bf16", tier) not in _built():
            pytest.skip(f"no SM90 bf16 forward kernel for head dim {d} (tier {tier})")


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def rand_fp8(*shape: int, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(E4M3)


def rand_descale(batch: int, nheads_k: int) -> Tensor:
    return torch.empty(batch, nheads_k, device="cuda").uniform_(0.5, 2.0)


def spread_values(*shape: int) -> Tensor:
    """e4m3 values whose size differs a lot from key to key (each key's row scaled by a factor
    in [1, 16]; the largest stay far below e4m3's 448)."""
    size = torch.empty(*shape[:-1], 1, device="cuda").uniform_(1.0, 16.0)
    return (torch.randn(*shape, device="cuda") * size).to(E4M3)


def cu_seqlens(lens) -> Tensor:
    return torch.tensor([0] + list(lens), device="cuda").cumsum(0).to(torch.int32)


MASKS = {  # name: (causal, window_size)
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "window": (False, (64, 0)),
    "window_lr": (False, (37, 20)),
}


# ---------------------------------------------------------------------------------------------
# Reference and bound (float64)
# ---------------------------------------------------------------------------------------------


class Ref(NamedTuple):
    out: Tensor  # (b, sq, h, dv) batched, (total_q, h, dv) varlen
    lse: Tensor  # (b, h, sq), (h, total_q)
    bound: Tensor  # like out: the FP8 kernel's error bound (module docstring)
    bound_bf16: Tensor  # like out: the bf16 kernel's on the dequantized inputs cast to bf16
    pt: Tensor  # like out: the PyTorch baseline (P rounded to e4m3, out to bf16)
    lse_tol: Tensor  # like lse


def _per_head(descale: Optional[Tensor], batch: int, heads: int, group: int) -> Tensor:
    """(batch, heads) float64 factors of a (batch, nheads_k) descale (None: 1)."""
    if descale is None:
        return torch.ones(batch, heads, dtype=torch.float64, device="cuda")
    return descale.double().repeat_interleave(group, dim=1)


def _centered(w: Tensor, vt: Tensor, out: Tensor) -> Tensor:
    """sum_j w[..., i, j] * |vt[..., j, :] - out[..., i, :]|, in row chunks (bounded memory)."""
    b, h, sq, sk = w.shape
    res = torch.zeros_like(out)
    rows = max(1, (1 << 25) // max(1, b * h * sk * vt.shape[-1]))
    for i in range(0, sq, rows):
        diff = (vt[:, :, None] - out[:, :, i:i + rows, None]).abs()  # (b, h, c, sk, d)
        res[:, :, i:i + rows] = torch.einsum("bhck,bhckd->bhcd", w[:, :, i:i + rows], diff)
    return res


def reference_dense(q, k, v, qd, kd, vd, *, scale, causal=False, window=(-1, -1),
                    softcap=0.0, sink=None) -> Ref:
    """Batched: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv) in e4m3, descales
    (b, hk) float32 or None."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qf = q.double() * _per_head(qd, b, h, g)[:, None, :, None]
    kf = (k.double() * _per_head(kd, b, hk, 1)[:, None, :, None]).repeat_interleave(g, 2)
    vf = (v.double() * _per_head(vd, b, hk, 1)[:, None, :, None]).repeat_interleave(g, 2)
    vt = vf.transpose(1, 2)  # (b, h, sk, dv)
    raw = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    mag = torch.einsum("bqhd,bkhd->bhqk", qf.abs(), kf.abs()) * scale  # a_j
    s = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    keep = keep_mask_ref(sq, sk, causal, window, q.device)
    s = s.masked_fill(~keep, -math.inf)
    mag = mag.masked_fill(~keep, 0.0)
    m_keys = s.amax(-1, keepdim=True) if sk else torch.full((b, h, sq, 1), -math.inf,
                                                             dtype=torch.float64, device="cuda")
    sink_l = None if sink is None else sink.double().view(1, h, 1, 1)
    m_all = m_keys if sink_l is None else torch.maximum(m_keys, sink_l)

    def finite(x):
        return torch.where(torch.isfinite(x), x, torch.zeros_like(x))

    def softmax_parts(m):
        e = torch.exp(s - finite(m))  # masked: 0
        z = e.sum(-1, keepdim=True)
        if sink_l is not None:
            z = z + torch.exp(sink_l - finite(m))
        return e, z

    e, z = softmax_parts(m_all)
    empty = z == 0
    z = torch.where(empty, torch.ones_like(z), z)
    pi = e / z
    out = pi @ vt
    lse = torch.where(empty, torch.full_like(z, math.inf), torch.log(z) + finite(m_all))
    a_mean = (pi * mag).sum(-1, keepdim=True)
    abs_v = vt.abs()
    big_a = pi @ abs_v
    sub = (e.clamp(max=SUB_E4M3) @ abs_v) / z
    eps_s = 2 * (d / 32 + 1) * FP22
    n_pv = math.ceil(sk / 32)
    centered = _centered(pi * (mag + a_mean), vt, out)
    bound = ((U_E4M3 + 2 * (n_pv + 1) * FP22) * big_a + sub + eps_s * centered
             + U_BF16 * out.abs())
    # bf16 kernel: P and the inputs rounded to bf16 (q and k: scores off by 2 * 2^-8 * a_j),
    # fp32 accumulation, the output rounded.
    bound_bf16 = 2 * U_BF16 * big_a + 2 * U_BF16 * centered + U_BF16 * out.abs()
    # The PyTorch baseline: P relative to the keys' max, times 256, rounded to e4m3.
    e_k, z_k = softmax_parts(m_keys)
    p8 = (256.0 * e_k).float().to(E4M3).double() / 256.0
    z_k = torch.where(z_k == 0, torch.ones_like(z_k), z_k)
    pt = ((p8 @ vt) / z_k).to(torch.bfloat16).double()
    lse_tol = 1e-2 + 1.5 * eps_s * a_mean
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (b, h, sq, .) -> (b, sq, h, .)
    return Ref(t(out), lse.squeeze(-1), t(bound), t(bound_bf16), t(pt),
               lse_tol.squeeze(-1))


def reference_varlen(q, k, v, cu_q, cu_k, qd, kd, vd, **kw) -> Ref:
    """Varlen: each sequence through reference_dense with its row of the descales."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    parts = []
    for i in range(len(cq) - 1):
        one = lambda x: None if x is None else x[i:i + 1]  # noqa: E731
        parts.append(reference_dense(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                                     v[None, ck[i]:ck[i + 1]], one(qd), one(kd), one(vd), **kw))
    return Ref(*(torch.cat([getattr(p, f)[0] for p in parts], dim=1 if f in ("lse", "lse_tol")
                           else 0) for f in Ref._fields))


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _where(mask: Tensor) -> str:
    idx = mask.nonzero()[0].tolist()
    return str(tuple(idx))


def check(out: Tensor, lse: Optional[Tensor], ref: Ref, tag: str = "") -> None:
    assert out.dtype == torch.bfloat16, f"{tag}: out dtype {out.dtype}, expected bfloat16"
    assert out.shape == ref.out.shape, f"{tag}: out shape {tuple(out.shape)} != {tuple(ref.out.shape)}"
    err = (out.double() - ref.out).abs()
    tol = 1.5 * ref.bound + 1e-3
    bad = ~(err <= tol)  # NaN fails
    if bad.any():
        at = bad.nonzero()[0]
        i = tuple(at.tolist())
        raise AssertionError(
            f"{tag}: {int(bad.sum())} of {err.numel()} out elements exceed 1.5 * bound + 1e-3, "
            f"e.g. at {i}: out {out[i].item():.5g}, ref {ref.out[i].item():.5g}, bound "
            f"{ref.bound[i].item():.3g} (max err {err.nan_to_num(math.inf).max().item():.3g})")
    if out.numel():
        pt_err = (ref.pt - ref.out).abs().max().item()
        atol = U_BF16 * max(1.0, ref.out.abs().max().item())  # one more bf16 rounding
        assert err.max().item() <= 3 * pt_err + atol, (
            f"{tag}: max|out - ref| = {err.max().item():.3e} > 3 * max|pt - ref| "
            f"({pt_err:.3e}) + {atol:.1e}")
    if lse is None:
        return
    assert lse.dtype == torch.float32, f"{tag}: lse dtype {lse.dtype}, expected float32"
    assert lse.shape == ref.lse.shape, f"{tag}: lse shape {tuple(lse.shape)} != {tuple(ref.lse.shape)}"
    inf = torch.isinf(ref.lse)
    lse = lse.double()
    assert (lse[inf] == math.inf).all(), f"{tag}: rows with no kept key need lse = +inf"
    lse_err = (lse - ref.lse).abs()
    bad = ~inf & ~(lse_err <= ref.lse_tol)
    assert not bad.any(), (
        f"{tag}: lse off at {_where(bad)} (|lse - ref| up to "
        f"{lse_err[~inf].nan_to_num(math.inf).max().item():.3e}, tolerance "
        f"{ref.lse_tol[bad].min().item():.3e})")


def fwd_batched(q, k, v, qd, kd, vd, **kw):
    """(out, lse): out of flash_attn_func, lse of the same call through the interface's own
    forward (validation, head-dim padding, the op), which the public function returns only
    with return_attn_probs, refused for FP8 on CUDA."""
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    out = flash_attn_func(q, k, v, **fp8, **kw)
    a = V.validate_qkv("fwd_batched", q, k, v, **fp8, **kw)
    _, lse, _ = interface._forward(q, k, v, a, None, None, None, a.seqlen_q, a.seqlen_k, False)
    return out, lse


def fwd_varlen(q, k, v, cu_q, cu_k, mq, mk, qd, kd, vd, **kw):
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **fp8, **kw)
    a = V.validate_varlen_qkv("fwd_varlen", q, k, v, cu_q, cu_k, mq, mk, **fp8, **kw)
    _, lse, _ = interface._forward(q, k, v, a, cu_q, cu_k, None, mq, mk, False)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Random inputs: batched, varlen, MQA, softcap and sink
# ---------------------------------------------------------------------------------------------

HEADDIMS = [64, 128, 256, 80, 72]  # 80: tier 96 (the kernel pads); 72: the interface pads to 80
SEQLENS = [(1, 77), (77, 77), (300, 1000), (1000, 300), (77, 1)]


@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"q{a}-k{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", HEADDIMS, ids=[f"d{d}" for d in HEADDIMS])
def test_batched(d, mask, sq, sk):
    need_fp8(d)
    torch.manual_seed(d * 7 + sq + sk)
    b, h, hk = 2, 4, 2  # GQA
    causal, window = MASKS[mask]
    q, k, v = rand_fp8(b, sq, h, d), rand_fp8(b, sk, hk, d), rand_fp8(b, sk, hk, d)
    qd, kd, vd = (rand_descale(b, hk) for _ in range(3))
    out, lse = fwd_batched(q, k, v, qd, kd, vd, causal=causal, window_size=window)
    ref = reference_dense(q, k, v, qd, kd, vd, scale=d ** -0.5, causal=causal, window=window)
    check(out, lse, ref, f"d={d} {mask} sq={sq} sk={sk}")


PACK_CASES = [(1, 1000), (5, 300), (77, 2000)]  # (seqlen_q, seqlen_k)


@pytest.mark.parametrize("sq,sk", PACK_CASES, ids=[f"q{a}-k{b}" for a, b in PACK_CASES])
@pytest.mark.parametrize("pack", ["1", "0"], ids=["packed", "unpacked"])
@pytest.mark.parametrize("layout", ["batched", "varlen"])
@pytest.mark.parametrize("d", [64, 128, 256, 80], ids=["d64", "d128", "d256", "d80"])
def test_gqa_packing(d, layout, pack, sq, sk, monkeypatch):
    """GQA 8:2 with the query heads of a KV head packed into one tile (FLASH_ATTN_PACK_GQA=1:
    Q gathered by cp.async, the head-dim padding zero-filled (d80: tier 96), the tile's
    descales those of its KV head, keys split over SMs where tiles are few) and unpacked (=0),
    causal: both meet the bound."""
    need_fp8(d)
    monkeypatch.setenv("FLASH_ATTN_PACK_GQA", pack)
    torch.manual_seed(d + sq + sk + len(layout))
    b, h, hk = 3, 8, 2
    qd, kd, vd = (rand_descale(b, hk) for _ in range(3))
    if layout == "batched":
        q, k, v = rand_fp8(b, sq, h, d), rand_fp8(b, sk, hk, d), spread_values(b, sk, hk, d)
        out, lse = fwd_batched(q, k, v, qd, kd, vd, causal=True)
        ref = reference_dense(q, k, v, qd, kd, vd, scale=d ** -0.5, causal=True)
    else:
        lq, lk = [sq, max(sq - 2, 1), sq + 3], [sk, sk // 2, sk + 17]
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        q, k = rand_fp8(sum(lq), h, d), rand_fp8(sum(lk), hk, d)
        v = spread_values(sum(lk), hk, d)
        out, lse = fwd_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), qd, kd, vd, causal=True)
        ref = reference_varlen(q, k, v, cu_q, cu_k, qd, kd, vd, scale=d ** -0.5, causal=True)
    check(out, lse, ref, f"pack={pack} {layout} d={d} sq={sq} sk={sk}")


@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("hk", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_varlen(d, hk, mask):
    need_fp8(d)
    torch.manual_seed(d + hk)
    h = 4
    lens_q, lens_k = [1, 77, 300, 0, 1000, 129], [77, 1, 1000, 5, 300, 129]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, v = rand_fp8(sum(lens_q), h, d), rand_fp8(sum(lens_k), hk, d), rand_fp8(sum(lens_k), hk, d)
    qd, kd, vd = (rand_descale(len(lens_q), hk) for _ in range(3))
    causal, window = MASKS[mask]
    out, lse = fwd_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), qd, kd, vd,
                          causal=causal, window_size=window)
    ref = reference_varlen(q, k, v, cu_q, cu_k, qd, kd, vd, scale=d ** -0.5, causal=causal,
                           window=window)
    check(out, lse, ref, f"varlen d={d} hk={hk} {mask}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mqa_batched(causal):
    need_fp8(128)
    torch.manual_seed(11)
    b, sq, sk, h, d = 3, 300, 1000, 8, 128
    q, k, v = rand_fp8(b, sq, h, d), rand_fp8(b, sk, 1, d), rand_fp8(b, sk, 1, d)
    qd, kd, vd = (rand_descale(b, 1) for _ in range(3))
    out, lse = fwd_batched(q, k, v, qd, kd, vd, causal=causal)
    check(out, lse, reference_dense(q, k, v, qd, kd, vd, scale=d ** -0.5, causal=causal),
          f"mqa causal={causal}")


@pytest.mark.parametrize("layout", ["batched", "varlen"])
@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_and_sink(causal, softcap, sink, layout):
    need_fp8(128)
    torch.manual_seed(int(causal) + 2 * int(sink) + 4 * int(softcap > 0))
    h, hk, d = 4, 2, 128
    # Scores large enough for the softcap to bend them; sink logits around the row maxima,
    # one of them -inf (no sink for that head).
    s_aux = None
    if sink:
        s_aux = torch.randn(h, device="cuda") * 2 + 3
        s_aux[1] = -math.inf
    kw = dict(causal=causal, softcap=softcap, s_aux=s_aux, softmax_scale=0.5)
    rk = dict(scale=0.5, causal=causal, softcap=softcap, sink=s_aux)
    if layout == "batched":
        b, sq, sk = 2, 1000, 300  # causal: the first 700 rows keep no key (the sink alone)
        q, k, v = rand_fp8(b, sq, h, d), rand_fp8(b, sk, hk, d), rand_fp8(b, sk, hk, d)
        qd, kd, vd = (rand_descale(b, hk) for _ in range(3))
        out, lse = fwd_batched(q, k, v, qd, kd, vd, **kw)
        ref = reference_dense(q, k, v, qd, kd, vd, **rk)
    else:
        lens_q, lens_k = [77, 1000, 3], [300, 77, 0]
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        q = rand_fp8(sum(lens_q), h, d)
        k, v = rand_fp8(sum(lens_k), hk, d), rand_fp8(sum(lens_k), hk, d)
        qd, kd, vd = (rand_descale(3, hk) for _ in range(3))
        out, lse = fwd_varlen(q, k, v, cu_q, cu_k, 1000, 300, qd, kd, vd, **kw)
        ref = reference_varlen(q, k, v, cu_q, cu_k, qd, kd, vd, **rk)
    check(out, lse, ref, f"{layout} causal={causal} softcap={softcap} sink={sink}")


def test_descale_none_expanded_and_partial():
    """None means 1; an expanded scalar descale (stride 0, as vLLM passes) and one descale
    alone work."""
    need_fp8(128)
    torch.manual_seed(12)
    b, sq, sk, h, hk, d = 2, 77, 300, 4, 2, 128
    q, k, v = rand_fp8(b, sq, h, d), rand_fp8(b, sk, hk, d), rand_fp8(b, sk, hk, d)
    for qd, kd, vd in ((None, None, None),
                       (torch.tensor(1.7, device="cuda").expand(b, hk), None, None),
                       (None, None, rand_descale(b, hk))):
        out, lse = fwd_batched(q, k, v, qd, kd, vd, causal=True)
        check(out, lse, reference_dense(q, k, v, qd, kd, vd, scale=d ** -0.5, causal=True),
              f"descales {[x is not None for x in (qd, kd, vd)]}")


def test_qkvpacked():
    """The packed variants pass strided e4m3 views (no copy) with the descales."""
    need_fp8(128)
    torch.manual_seed(13)
    b, s, h, d = 2, 300, 4, 128
    qkv = rand_fp8(b, s, 3, h, d)
    qd, kd, vd = (rand_descale(b, h) for _ in range(3))
    out = flash_attn_qkvpacked_func(qkv, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    q, k, v = qkv.unbind(2)
    check(out, None, reference_dense(q, k, v, qd, kd, vd, scale=d ** -0.5, causal=True),
          "qkvpacked")


def test_empty_inputs():
    """No keys or no queries: nothing launches; out bf16 zeros, lse +inf (the sink's logit)."""
    need_fp8(64)
    q, k = rand_fp8(1, 5, 2, 64), rand_fp8(1, 0, 2, 64)
    sink = torch.tensor([0.5, -math.inf], device="cuda")
    out, lse = fwd_batched(q, k, k, None, None, None, s_aux=sink)
    assert out.dtype == torch.bfloat16 and (out == 0).all()
    assert lse[0, 0].eq(0.5).all() and lse[0, 1].eq(math.inf).all()
    out = flash_attn_func(rand_fp8(1, 0, 2, 64), rand_fp8(1, 7, 2, 64), rand_fp8(1, 7, 2, 64))
    assert out.shape == (1, 0, 2, 64) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Sharp attention: key order and masks
# ---------------------------------------------------------------------------------------------


def _kept_range(sq: int, sk: int, causal: bool, window):
    """Per query row: the first and last kept key (lo > hi: none)."""
    left, right = window
    if causal:
        right = 0
    r = torch.arange(sq, device="cuda")
    diag = r + sk - sq
    lo = (diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(r)
    hi = (diag + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(r, sk - 1)
    return lo, hi


def _targets(sq: int, sk: int, h: int, causal: bool, window, aim: str) -> Tensor:
    """(sq, h) key index each query row of each head attends to; -1 where it has none.
    aim "kept": a random kept key; "edge": the first or last kept key (at random); "masked": a
    key just outside the kept range (the one after the last, or before the first), else -1."""
    lo, hi = _kept_range(sq, sk, causal, window)
    lo, hi = lo[:, None].expand(sq, h), hi[:, None].expand(sq, h)
    none = lo > hi
    coin = torch.rand(sq, h, device="cuda") < 0.5
    if aim == "kept":
        t = lo + (torch.rand(sq, h, device="cuda") * (hi - lo + 1).clamp(min=1)).long()
        t = torch.minimum(t, hi)
    elif aim == "edge":
        t = torch.where(coin, lo, hi)
    else:  # masked
        after, before = hi + 1, lo - 1
        ok_after = (after >= 0) & (after < sk)
        ok_before = (before >= 0) & (before < sk)
        t = torch.where(ok_after & (coin | ~ok_before), after, before)
        none = ~ok_after & ~ok_before
    return torch.where(none, torch.full_like(t, -1), t)


def _aim(q: Tensor, k: Tensor, targets: Tensor) -> Tensor:
    """q (sq, h, d) with row r of head h replaced by 2 * k[targets[r, h], kv head of h] (exact
    in e4m3) where targets >= 0. k (sk, hk, d)."""
    sq, h, d = q.shape
    g = h // k.shape[1]
    heads = torch.arange(h, device="cuda") // g
    # Indexing and selecting on the bytes (uint8 views): no e4m3 kernels needed for them.
    rows = k.view(torch.uint8)[targets.clamp(min=0), heads[None, :].expand(sq, h)]
    aimed = (rows.view(E4M3).float() * 2).to(E4M3)  # (sq, h, d), exact
    return torch.where((targets >= 0)[..., None], aimed.view(torch.uint8),
                       q.view(torch.uint8)).view(E4M3)


def cat_fp8(parts, dim: int = 0, stack: bool = False) -> Tensor:
    """torch.cat / torch.stack of e4m3 tensors, on their bytes."""
    join = torch.stack if stack else torch.cat
    return join([x.view(torch.uint8) for x in parts], dim).view(E4M3)


AIMS = [("kept", "full"), ("kept", "causal"), ("edge", "causal"), ("edge", "window"),
        ("edge", "window_lr"), ("masked", "causal"), ("masked", "window"),
        ("masked", "window_lr")]


@pytest.mark.parametrize("layout", ["batched", "varlen"])
@pytest.mark.parametrize("aim,mask", AIMS, ids=[f"{a}-{m}" for a, m in AIMS])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_sharp_attention(d, aim, mask, layout):
    """Each query attends (almost) only to one key: O ~= v_target, so a key order or mask
    error within a 32-key group (or anywhere) is an O(|V|) error against a tight bound."""
    need_fp8(d)
    torch.manual_seed(d + len(aim) * 3 + len(mask))
    h, hk = 4, 2
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, softmax_scale=1.0)
    rk = dict(scale=1.0, causal=causal, window=window)
    if layout == "batched":
        b, sq, sk = 2, 300, 1000
        k, v = rand_fp8(b, sk, hk, d), spread_values(b, sk, hk, d)
        q = cat_fp8([_aim(rand_fp8(sq, h, d), k[i], _targets(sq, sk, h, causal, window, aim))
                     for i in range(b)], stack=True)
        qd, kd, vd = (rand_descale(b, hk) for _ in range(3))
        out, lse = fwd_batched(q, k, v, qd, kd, vd, **kw)
        ref = reference_dense(q, k, v, qd, kd, vd, **rk)
    else:
        lens_q, lens_k = [77, 300, 1, 129], [300, 1000, 77, 129]
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        k, v = rand_fp8(sum(lens_k), hk, d), spread_values(sum(lens_k), hk, d)
        parts = []
        for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            ks = k[int(cu_k[i]):int(cu_k[i + 1])]
            parts.append(_aim(rand_fp8(nq, h, d), ks, _targets(nq, nk, h, causal, window, aim)))
        q = cat_fp8(parts)
        qd, kd, vd = (rand_descale(len(lens_q), hk) for _ in range(3))
        out, lse = fwd_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), qd, kd, vd, **kw)
        ref = reference_varlen(q, k, v, cu_q, cu_k, qd, kd, vd, **rk)
    check(out, lse, ref, f"sharp {layout} d={d} aim={aim} {mask}")


@pytest.mark.parametrize("inputs", ["random", "sharp"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_matches_bf16_kernel(d, causal, inputs):
    """The FP8 kernel against the bf16 kernel on the dequantized inputs cast to bf16, within
    the sum of their bounds (module docstring)."""
    need_fp8(d, bf16=True)
    torch.manual_seed(d + int(causal))
    b, sq, sk, h, hk = 2, 300, 1000, 4, 2
    k = rand_fp8(b, sk, hk, d)
    if inputs == "random":
        q, v, scale = rand_fp8(b, sq, h, d), rand_fp8(b, sk, hk, d), d ** -0.5
    else:
        v, scale = spread_values(b, sk, hk, d), 1.0
        q = cat_fp8([_aim(rand_fp8(sq, h, d), k[i],
                          _targets(sq, sk, h, causal, (-1, -1), "kept")) for i in range(b)],
                    stack=True)
    qd, kd, vd = (rand_descale(b, hk) for _ in range(3))
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, q_descale=qd,
                          k_descale=kd, v_descale=vd)
    g = h // hk
    deq = lambda x, ds, rep: (x.float() * ds.repeat_interleave(rep, 1)[:, None, :, None])  # noqa: E731
    out_bf16 = flash_attn_func(deq(q, qd, g).bfloat16(), deq(k, kd, 1).bfloat16(),
                               deq(v, vd, 1).bfloat16(), softmax_scale=scale, causal=causal)
    ref = reference_dense(q, k, v, qd, kd, vd, scale=scale, causal=causal)
    check(out, None, ref, f"{inputs} d={d} causal={causal}")
    diff = (out.double() - out_bf16.double()).abs()
    tol = 1.5 * (ref.bound + ref.bound_bf16) + 2e-3
    bad = ~(diff <= tol)
    assert not bad.any(), (
        f"fp8 vs bf16 kernel: {int(bad.sum())} elements differ by more than the two bounds, "
        f"e.g. at {_where(bad)} (max diff {diff.max().item():.3e})")


# ---------------------------------------------------------------------------------------------
# What FP8 does not do on CUDA
# ---------------------------------------------------------------------------------------------


def test_kvcache_whole_cache_indexed():
    """cache_seqlens None with cache_batch_idx: every row of entry cache_batch_idx[b] (the plain
    kernel, reading K/V through the batch index), descale row b."""
    need_fp8(128)
    torch.manual_seed(21)
    b, sq, sc, h, hk, d = 3, 7, 300, 4, 2, 128
    q = rand_fp8(b, sq, h, d)
    k_cache, v_cache = rand_fp8(5, sc, hk, d), spread_values(5, sc, hk, d)
    idx = torch.tensor([3, 0, 4], dtype=torch.int32, device="cuda")
    qd, kd, vd = (rand_descale(b, hk) for _ in range(3))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=idx, causal=True,
                                       return_softmax_lse=True, q_descale=qd, k_descale=kd,
                                       v_descale=vd)
    for i, e in enumerate(idx.tolist()):
        one = lambda x: x[i:i + 1]  # noqa: E731
        ref = reference_dense(one(q), k_cache[e:e + 1], v_cache[e:e + 1], one(qd), one(kd),
                              one(vd), scale=d ** -0.5, causal=True)
        check(out[i:i + 1], lse[i:i + 1], ref, f"whole cache, seq {i}")


def test_backward_raises():
    need_fp8(64)
    q, k, v = (rand_fp8(1, 8, 2, 64) for _ in range(3))
    out = flash_attn_func(q.requires_grad_(), k, v, k_descale=rand_descale(1, 2).requires_grad_())
    with pytest.raises(NotImplementedError, match="backward of an FP8"):
        out.float().sum().backward()


@pytest.mark.parametrize("what", ["alibi_slopes", "dropout_p", "return_attn_probs", "mla"])
def test_unsupported_options_raise(what):
    """Refused before any kernel (any GPU), naming what is missing."""
    q = rand_fp8(1, 8, 2, 64)
    v = rand_fp8(1, 8, 2, 32) if what == "mla" else q
    kw = {"alibi_slopes": dict(alibi_slopes=torch.ones(2, device="cuda")),
          "dropout_p": dict(dropout_p=0.1), "return_attn_probs": dict(return_attn_probs=True),
          "mla": {}}[what]
    with pytest.raises(NotImplementedError, match="CUDA FP8"):
        flash_attn_func(q, q, v, **kw)


def test_unsupported_pages_leftpad_and_rotary_raise():
    """Pages that are not a multiple of 8 rows and cache_leftpad with pages (the SM80 kernels'
    cases) are refused on CUDA, naming them; rotary tables on FP8 caches on any device."""
    q = rand_fp8(8, 2, 64)
    pages = rand_fp8(4, 12, 2, 64)
    cu = cu_seqlens([8])
    table = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="pages of 12 rows"):
        flash_attn_varlen_func(q, pages, pages, cu, cu, 8, 8, block_table=table)
    qb, cache = rand_fp8(1, 1, 2, 64), rand_fp8(1, 32, 2, 64)
    lens = torch.tensor([4], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="pages of 12 rows"):
        flash_attn_with_kvcache(qb, pages, pages, cache_seqlens=lens, block_table=table)
    pages16 = rand_fp8(4, 16, 2, 64)
    with pytest.raises(NotImplementedError, match="cache_leftpad together with block_table"):
        flash_attn_with_kvcache(qb, pages16, pages16, cache_seqlens=lens, block_table=table,
                                cache_leftpad=lens - 2)
    new = rand_fp8(1, 1, 2, 64)
    table_ro = torch.ones(64, 32, device="cuda")
    with pytest.raises(NotImplementedError, match="rotary"):
        flash_attn_with_kvcache(qb, cache, cache.clone(), new, new, rotary_cos=table_ro,
                                rotary_sin=table_ro, cache_seqlens=lens)


KV_CASES = [  # (seqlen_q, seqlen_new, seqlen_cache, mask)
    (1, 1, 1000, "causal"),  # decode
    (5, 5, 300, "causal"),
    (3, 0, 77, "full"),  # no append
    (16, 2, 520, "window"),
]
KV_LAYOUTS = ["direct", "batch_idx", "leftpad", "pages8", "pages16", "pages64", "pages256"]


class _Caches(NamedTuple):
    """A case's caches as the call takes them, and sequence i's logical rows (read back from
    them after the call)."""
    k: Tensor
    v: Tensor
    kw: dict  # cache_batch_idx / block_table / cache_leftpad
    rows: object  # rows(cache, i) -> (seqlen_cache, hk, d)
    first: list  # sequence i's first key row


def _bytes(x: Tensor) -> Tensor:
    return x.view(torch.uint8)


def _kv_layout(layout: str, k: Tensor, v: Tensor, lens: Tensor) -> _Caches:
    """k, v: (b, sc, hk, d) logical caches, one per sequence. direct: as they are; batch_idx:
    scattered into entries of a bigger cache, read through cache_batch_idx; leftpad: sequence
    i's keys from row first[i] (the rows before it NaN bytes); pagesN: pages of N rows (the
    cache rounded up to whole pages), shuffled, read through block_table. Gathers and scatters
    go through byte views. direct and leftpad hand k and v themselves to the call."""
    b, sc = k.shape[:2]
    if layout == "direct":
        return _Caches(k, v, {}, lambda c, i: c[i], [0] * b)
    if layout == "leftpad":
        first = [min(int(n), 3 * i) for i, n in enumerate(lens)]
        for i, f in enumerate(first):  # never read: NaN (0x7f)
            _bytes(k)[i, :f] = 0x7F
            _bytes(v)[i, :f] = 0x7F
        pad = torch.tensor(first, dtype=torch.int32, device="cuda")
        return _Caches(k, v, dict(cache_leftpad=pad), lambda c, i: c[i], first)
    if layout == "batch_idx":
        idx = torch.tensor([4, 0, 2][:b], dtype=torch.int32, device="cuda")
        big = []
        for x in (k, v):
            # Finite bytes (below 0x7e, e4m3's largest) in the entries no one reads.
            y = torch.randint(0, 0x7E, (5,) + tuple(x.shape[1:]), dtype=torch.uint8,
                              device="cuda")
            y[idx.long()] = _bytes(x)
            big.append(y.view(E4M3))
        return _Caches(big[0], big[1], dict(cache_batch_idx=idx),
                       lambda c, i: c[int(idx[i])], [0] * b)
    page = int(layout[len("pages"):])
    per_seq = -(-sc // page)
    table = torch.randperm(b * per_seq, device="cuda").view(b, per_seq).int()
    paged = []
    for x in (k, v):
        whole = torch.zeros((b, per_seq * page) + tuple(x.shape[2:]), dtype=torch.uint8,
                            device="cuda")
        whole[:, :sc] = _bytes(x)
        pages = torch.empty_like(whole).view((b * per_seq, page) + tuple(x.shape[2:]))
        pages[table.long().flatten()] = whole.view_as(pages)
        paged.append(pages.view(E4M3))
    return _Caches(paged[0], paged[1], dict(block_table=table),
                   lambda c, i: _bytes(c)[table[i].long()].flatten(0, 1)[:sc].view(E4M3),
                   [0] * b)


@pytest.mark.parametrize("sq,snew,sc,mask", KV_CASES,
                         ids=[f"q{a}-new{b}-c{c}-{m}" for a, b, c, m in KV_CASES])
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_kvcache(d, sq, snew, sc, mask, layout):
    """flash_attn_with_kvcache on e4m3 caches: the new rows are written as they are (bytes),
    the other rows untouched, and out / lse meet the bound against the float64 attention of
    sequence b's rows [first, cache_seqlens[b] + seqlen_new) of its cache, dequantized with row
    b of the descales, whether the cache is read directly, through cache_batch_idx, from a
    left pad or from shuffled pages. The rows past each sequence hold NaN bytes, which must
    not reach out (the last key block's V rows past the sequence are cleared). GQA 4:2."""
    need_fp8(d)
    torch.manual_seed(d + sq * 3 + sc + len(layout))
    b, h, hk = 3, 4, 2
    q = rand_fp8(b, sq, h, d)
    k_log, v_log = rand_fp8(b, sc, hk, d), spread_values(b, sc, hk, d)
    lens = torch.tensor([0, sc // 3, sc - snew], dtype=torch.int32, device="cuda")
    for i in range(b):  # NaN (0x7f) past what sequence i reads
        end = int(lens[i]) + snew
        k_log.view(torch.uint8)[i, end:] = 0x7F
        v_log.view(torch.uint8)[i, end:] = 0x7F
    c = _kv_layout(layout, k_log, v_log, lens)
    before_k, before_v = k_log.clone(), v_log.clone()  # direct, leftpad: the caches themselves
    k_new, v_new = (rand_fp8(b, snew, hk, d) for _ in range(2)) if snew else (None, None)
    qd, kd, vd = (rand_descale(b, hk) for _ in range(3))
    causal, window = MASKS[mask]
    out, lse = flash_attn_with_kvcache(
        q, c.k, c.v, k_new, v_new, cache_seqlens=lens, causal=causal, window_size=window,
        return_softmax_lse=True, q_descale=qd, k_descale=kd, v_descale=vd, **c.kw)
    scale = d ** -0.5
    for i in range(b):
        start, end = int(lens[i]), int(lens[i]) + snew
        for cache, before, new in ((c.k, before_k, k_new), (c.v, before_v, v_new)):
            got, was = c.rows(cache, i).view(torch.uint8), before[i].view(torch.uint8)
            if snew:
                assert torch.equal(got[start:end], new.view(torch.uint8)[i]), "new rows"
            assert torch.equal(got[:start], was[:start]) and torch.equal(got[end:], was[end:])
        one = lambda x: x[i:i + 1]  # noqa: E731
        keys = slice(c.first[i], end)
        ref = reference_dense(one(q), c.rows(c.k, i)[None, keys], c.rows(c.v, i)[None, keys],
                              one(qd), one(kd), one(vd), scale=scale, causal=causal,
                              window=window)
        check(out[i:i + 1], lse[i:i + 1], ref, f"kvcache {layout} d{d} seq {i}")


def test_other_gpus_and_force_sm80_raise(monkeypatch):
    """No SM80 FP8 kernels: a GPU other than sm90, or FLASH_ATTN_FORCE_SM80=1, raises."""
    if not _built():
        pytest.skip("flash_attn._C is not built")
    q = rand_fp8(1, 8, 2, 64)
    if not _is_sm90():
        with pytest.raises(NotImplementedError, match=r"H100-class \(sm90\)"):
            flash_attn_func(q, q, q)
        return
    monkeypatch.setenv("FLASH_ATTN_FORCE_SM80", "1")
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_FORCE_SM80"):
        flash_attn_func(q, q, q)
    # flash_attn_with_kvcache refuses before it appends: the cache keeps its bytes.
    cache = rand_fp8(1, 16, 2, 64)
    before = cache.clone()
    lens = torch.tensor([3], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_FORCE_SM80"):
        flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), q[:, :1], q[:, :1],
                                cache_seqlens=lens)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_compile_fullgraph():
    need_fp8(128)
    torch.manual_seed(14)
    q, k, v = rand_fp8(2, 77, 4, 128), rand_fp8(2, 300, 2, 128), rand_fp8(2, 300, 2, 128)
    qd, kd, vd = (rand_descale(2, 2) for _ in range(3))

    def f(q, k, v, qd, kd, vd):
        return flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    torch._dynamo.reset()
    out_c = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qd, kd, vd)
    assert out_c.dtype == torch.bfloat16
    assert torch.equal(out_c, f(q, k, v, qd, kd, vd))
