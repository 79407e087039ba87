"""flash_attn_with_kvcache on CPU (the PyTorch path) against an independent float64
implementation from the FlashAttention-2 semantics (the cache update and the rotary embedding
written here, the masked attention test_cpu_api.explicit_attention's): the new k/v are written
in place into the cache at rows [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of entry
cache_batch_idx[b] (k rotated first when rotary_cos/sin are given), and q attends to the first
cache_seqlens[b] + seqlen_new keys of that entry (from row cache_leftpad[b] on), masks aligned
bottom-right to the keys attended.

Inputs are float64 on a 1/8 grid and cos/sin tables on a 1/16 grid, so a rotation (two products
and a sum) is exact in float32 as well: the comparisons stay tight (1e-10) whatever precision the
implementation rotates in.
"""

import inspect
import itertools
import math
import os
import re
import sys

import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_with_kvcache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cpu_api import explicit_attention  # noqa: E402  (the float64 masked attention)

FN = "flash_attn_with_kvcache"
F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def arg_re(name: str) -> str:
    """Regex matching the argument name as a whole word (so 'k' does not match 'k_cache')."""
    return r"(?<![\w])" + re.escape(name) + r"(?![\w])"


def grid_rand(*shape, dtype=F64):
    """Standard normal values rounded to a 1/8 grid."""
    return (torch.randn(*shape, dtype=F64) * 8).round().div(8).to(dtype)


def grid_cos_sin(seqlen_ro, rotary_dim, dtype=F64):
    """Arbitrary (not unit-norm) cos/sin tables on a 1/16 grid in [-1, 1], each
    (seqlen_ro, rotary_dim / 2): a swapped table or a wrong sign shows."""
    cos = (torch.rand(seqlen_ro, rotary_dim // 2, dtype=F64) * 32 - 16).round().div(16)
    sin = (torch.rand(seqlen_ro, rotary_dim // 2, dtype=F64) * 32 - 16).round().div(16)
    return cos.to(dtype), sin.to(dtype)


def angle_cos_sin(seqlen_ro, rotary_dim, dtype=F64, base=10000.0):
    """The usual rotary tables: angle = position * base^(-2i / rotary_dim)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)
    ang = torch.arange(seqlen_ro, dtype=F64)[:, None] * inv_freq[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def seqlens(*lens):
    return torch.tensor(lens, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Independent reference
# ---------------------------------------------------------------------------------------------


def rotary_ref(x, cos, sin, pos, interleaved):
    """x (n, heads, d): row t rotated at position pos[t] (first 2 * cos.shape[1] dims), float64.
    Interleaved pairs (x[2i], x[2i+1]), otherwise (x[i], x[i + rotary_dim / 2]); each pair
    (x0, x1) -> (x0 cos_i - x1 sin_i, x0 sin_i + x1 cos_i)."""
    x = x.double()
    half = cos.shape[1]
    c, s = cos.double()[pos], sin.double()[pos]  # (n, half)
    out = x.clone()
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        x0, x1 = x[:, :, a], x[:, :, b]
        ci, si = c[:, i, None], s[:, i, None]
        out[:, :, a] = x0 * ci - x1 * si
        out[:, :, b] = x0 * si + x1 * ci
    return out


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                rotary_interleaved=True, alibi_slopes=None):
    """Returns (out, lse, k_cache_after, v_cache_after), all float64; inputs are not modified.
    Keys of batch b: explicit concatenation of the old cache rows [cache_leftpad[b]:
    cache_seqlens[b]] with the (rotated) new k; explicit masked softmax per sequence."""
    b, sq, h, d = q.shape
    sc, hk = k_cache.shape[1], k_cache.shape[2]
    sn = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        lens = [sc] * b
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * b
    else:
        lens = [int(x) for x in cache_seqlens.tolist()]
    idx = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
    pad = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    q_rows_shifted = causal or tuple(window_size) != (-1, -1)
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    out = torch.zeros(b, sq, h, d, dtype=F64)
    lse = torch.full((b, h, sq), math.inf, dtype=F64)
    for bi in range(b):
        c, e = lens[bi], idx[bi]
        qb = q[bi].double()
        kn = torch.zeros(0, hk, d, dtype=F64)
        vn = torch.zeros(0, hk, d, dtype=F64)
        if k is not None:
            kn, vn = k[bi].double(), v[bi].double()
            if rotary_cos is not None:
                kn = rotary_ref(kn, rotary_cos, rotary_sin, c + torch.arange(sn),
                                rotary_interleaved)
                qpos = c + torch.arange(sq) if q_rows_shifted else torch.full((sq,), c)
                qb = rotary_ref(qb, rotary_cos, rotary_sin, qpos, rotary_interleaved)
            kc[e, c:c + sn] = kn
            vc[e, c:c + sn] = vn
        keys = torch.cat([k_cache[e, pad[bi]:c].double(), kn])
        vals = torch.cat([v_cache[e, pad[bi]:c].double(), vn])
        if keys.shape[0] == 0:
            continue
        slopes = None
        if alibi_slopes is not None:  # (nheads,) or row bi of (batch, nheads)
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[bi:bi + 1]
        o, m, _ = explicit_attention(qb[None], keys[None], vals[None], scale, False, left, right,
                                     softcap, slopes)
        out[bi], lse[bi] = o[0], m[0]
    return out, lse, kc, vc


def check_call(q, k_cache, v_cache, out_tol=TOL, lse_tol=1e-5, cache_tol=None, **kw):
    """Calls flash_attn_with_kvcache(..., return_softmax_lse=True) and checks out, softmax_lse and
    the in-place cache update against kvcache_ref (computed first, on the caches as given).
    cache_tol None: the caches must equal the reference exactly. Returns (out, lse, out_ref,
    lse_ref)."""
    out_ref, lse_ref, kc_ref, vc_ref = kvcache_ref(q, k_cache, v_cache, **kw)
    res = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    assert isinstance(res, tuple) and len(res) == 2, type(res)
    out, lse = res
    b, sq, h, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    torch.testing.assert_close(out.double(), out_ref, **out_tol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=lse_tol, rtol=lse_tol)
    for name, got, want in (("k_cache", k_cache, kc_ref), ("v_cache", v_cache, vc_ref)):
        if cache_tol is None:
            assert torch.equal(got, want.to(got.dtype)), f"{name} differs from the reference"
        else:
            torch.testing.assert_close(got.double(), want, atol=cache_tol, rtol=cache_tol)
    return out, lse, out_ref, lse_ref


def make(b=2, sq=1, sn=1, sc=16, h=4, hk=2, d=16, batch_cache=None, dtype=F64):
    """q, k_cache, v_cache, k, v (k, v None when sn is 0)."""
    q = grid_rand(b, sq, h, d, dtype=dtype)
    k_cache = grid_rand(batch_cache or b, sc, hk, d, dtype=dtype)
    v_cache = grid_rand(batch_cache or b, sc, hk, d, dtype=dtype)
    if sn == 0:
        return q, k_cache, v_cache, None, None
    return q, k_cache, v_cache, grid_rand(b, sn, hk, d, dtype=dtype), grid_rand(b, sn, hk, d,
                                                                               dtype=dtype)


# ---------------------------------------------------------------------------------------------
# API surface
# ---------------------------------------------------------------------------------------------


def test_exported_with_flash_attention_2_signature():
    """Exported from flash_attn, with FlashAttention-2's parameter names, order and defaults,
    then the learnable sink's two names (ours) and FlashAttention-3's FP8 descales."""
    assert flash_attn.flash_attn_with_kvcache is flash_attn_with_kvcache
    empty = inspect.Parameter.empty
    expected = [
        ("q", empty), ("k_cache", empty), ("v_cache", empty), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False), ("s_aux", None),
        ("learnable_sink", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
    ]
    params = inspect.signature(flash_attn_with_kvcache).parameters.values()
    assert [(p.name, p.default) for p in params] == expected


def test_return_softmax_lse():
    """False returns the output tensor alone; True returns (out, softmax_lse) with lse
    (batch, nheads, seqlen_q) float32, the logsumexp of the scaled scores; same output."""
    torch.manual_seed(1)
    q, k_cache, v_cache, k, v = make(b=3, sq=2, sn=2, h=4, hk=2)
    cs = seqlens(0, 5, 14)
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    out_plain = flash_attn_with_kvcache(q, kc1, vc1, k, v, cache_seqlens=cs, causal=True)
    assert isinstance(out_plain, torch.Tensor)
    assert out_plain.shape == q.shape and out_plain.dtype == q.dtype
    out, lse, out_ref, lse_ref = check_call(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cs,
                                            causal=True)
    assert torch.equal(out, out_plain)
    assert torch.equal(kc1, k_cache) and torch.equal(vc1, v_cache)
    assert lse.shape == (3, 4, 2) and torch.isfinite(lse).all()


# ---------------------------------------------------------------------------------------------
# Appending new keys / values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlens_kind", ["tensor", "int"])
@pytest.mark.parametrize("sq,sn", [(1, 1), (3, 3), (2, 5), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_append(causal, sq, sn, seqlens_kind):
    """New k/v appended at cache_seqlens (one per sequence, or an int for all), q attends to the
    cached rows plus the new ones; the caches are updated in place."""
    torch.manual_seed(2)
    sc = 16
    q, k_cache, v_cache, k, v = make(b=3, sq=sq, sn=sn, sc=sc)
    cs = seqlens(0, 5, sc - sn) if seqlens_kind == "tensor" else 4
    check_call(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cs, causal=causal)


def test_cache_updated_in_place_at_the_right_rows_only():
    """Rows [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of entry b hold k[b] / v[b]
    afterwards (same tensor objects); every other row is unchanged; q, k, v are not modified."""
    torch.manual_seed(3)
    sc, sn = 12, 3
    q, k_cache, v_cache, k, v = make(b=3, sq=2, sn=sn, sc=sc)
    cs = seqlens(0, 4, sc - sn)
    kc0, vc0, q0, k0, v0, cs0 = (t.clone() for t in (k_cache, v_cache, q, k, v, cs))
    kc_ptr, vc_ptr = k_cache.data_ptr(), v_cache.data_ptr()
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cs, causal=True)
    assert k_cache.data_ptr() == kc_ptr and v_cache.data_ptr() == vc_ptr
    for b, c in enumerate(cs.tolist()):
        rows = torch.zeros(sc, dtype=torch.bool)
        rows[c:c + sn] = True
        assert torch.equal(k_cache[b, rows], k[b]) and torch.equal(v_cache[b, rows], v[b])
        assert torch.equal(k_cache[b, ~rows], kc0[b, ~rows]), f"k_cache[{b}] changed elsewhere"
        assert torch.equal(v_cache[b, ~rows], vc0[b, ~rows]), f"v_cache[{b}] changed elsewhere"
    for name, t, t0 in (("q", q, q0), ("k", k, k0), ("v", v, v0), ("cache_seqlens", cs, cs0)):
        assert torch.equal(t, t0), f"{name} was modified"


def test_cache_update_then_same_call_on_cache_alone():
    """After appending, the same attention is obtained from the updated cache alone
    (no k/v, cache_seqlens advanced by seqlen_new)."""
    torch.manual_seed(4)
    q, k_cache, v_cache, k, v = make(b=2, sq=3, sn=3, sc=16)
    cs = seqlens(2, 9)
    out1, lse1 = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cs,
                                         causal=True, return_softmax_lse=True)
    out2, lse2 = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cs + 3,
                                         causal=True, return_softmax_lse=True)
    torch.testing.assert_close(out1, out2, **TOL)
    torch.testing.assert_close(lse1, lse2, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    """Other CPU dtypes: output in q's dtype close to the float64 reference, the cache update
    exact (the grid values are exactly representable)."""
    torch.manual_seed(5)
    q, k_cache, v_cache, k, v = make(b=2, sq=2, sn=2, sc=16, dtype=dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    check_call(q, k_cache, v_cache, out_tol=dict(atol=tol, rtol=tol), lse_tol=1e-4,
               k=k, v=v, cache_seqlens=seqlens(3, 11), causal=True)


# ---------------------------------------------------------------------------------------------
# Attending to the cache only (no k/v)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlens_kind", ["tensor", "int", "none"])
@pytest.mark.parametrize("causal", [False, True])
def test_no_new_kv(causal, seqlens_kind):
    """Without k/v, q attends to the first cache_seqlens keys (0 keys: output 0, lse +inf), or
    to the whole cache when cache_seqlens is None; the caches are not written."""
    torch.manual_seed(6)
    sc = 8
    q, k_cache, v_cache, _, _ = make(b=3, sq=2, sn=0, sc=sc)
    cs = {"tensor": seqlens(3, 7, 0), "int": 5, "none": None}[seqlens_kind]
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    out, lse, _, _ = check_call(q, k_cache, v_cache, cache_seqlens=cs, causal=causal)
    assert torch.equal(k_cache, kc0) and torch.equal(v_cache, vc0)
    if seqlens_kind == "tensor":
        assert torch.all(out[2] == 0) and torch.all(torch.isposinf(lse[2]))
    if seqlens_kind == "none":
        out_f, lse_f, _ = flash_attn_func(q, k_cache, v_cache, causal=causal,
                                          return_attn_probs=True)
        torch.testing.assert_close(out, out_f, **TOL)
        torch.testing.assert_close(lse, lse_f, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_rows_without_keys_no_new_kv(causal):
    """Fewer keys than queries: with causal (bottom-right aligned) the first rows see no key and
    give output 0 and lse +inf; a sequence with cache_seqlens 0 has no key at all."""
    torch.manual_seed(7)
    q, k_cache, v_cache, _, _ = make(b=3, sq=3, sn=0, sc=8)
    out, lse, _, _ = check_call(q, k_cache, v_cache, cache_seqlens=seqlens(1, 0, 6),
                                causal=causal)
    empty = torch.zeros(3, 3, dtype=torch.bool)  # (batch, row)
    empty[1] = True
    if causal:
        empty[0, :2] = True  # L = 1, seqlen_q = 3: row i sees keys j <= i - 2
    for b in range(3):
        for i in range(3):
            if empty[b, i]:
                assert torch.all(out[b, i] == 0) and torch.all(torch.isposinf(lse[b, :, i]))
            else:
                assert torch.all(torch.isfinite(lse[b, :, i]))


def test_rows_without_keys_with_append():
    """seqlen_new < seqlen_q on an empty cache entry: with causal the first seqlen_q - L rows see
    no key (output 0, lse +inf); the other sequence is unaffected."""
    torch.manual_seed(8)
    q, k_cache, v_cache, k, v = make(b=2, sq=4, sn=2, sc=16)
    out, lse, _, _ = check_call(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens(0, 5),
                                causal=True)
    assert torch.all(out[0, :2] == 0) and torch.all(torch.isposinf(lse[0, :, :2]))
    assert torch.all(torch.isfinite(lse[0, :, 2:])) and torch.all(torch.isfinite(lse[1]))


# ---------------------------------------------------------------------------------------------
# GQA, masks, softcap, scale
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [2, 1])
def test_gqa(hk, causal):
    """4 query heads over 2 or 1 KV heads: query head h reads KV head h // (4 // hk)."""
    torch.manual_seed(9)
    q, k_cache, v_cache, k, v = make(b=3, sq=3, sn=3, sc=16, h=4, hk=hk, d=32)
    check_call(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens(0, 7, 13), causal=causal)


@pytest.mark.parametrize(
    "causal,window,softcap,scale",
    [
        (False, (2, 1), 0.0, None),
        (True, (3, -1), 0.0, None),
        (False, (0, 0), 0.7, None),
        (False, (-1, 2), 0.0, 0.3),
        (True, (-1, -1), 0.5, 0.3),
        (True, (1, 5), 1.5, None),  # causal overrides the right bound
    ],
)
def test_window_softcap_scale(causal, window, softcap, scale):
    """Sliding windows aligned bottom-right to cache_seqlens + seqlen_new, softcap and a custom
    softmax_scale, with appended keys."""
    torch.manual_seed(10)
    q, k_cache, v_cache, k, v = make(b=3, sq=3, sn=3, sc=16)
    check_call(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens(0, 6, 13), causal=causal,
               window_size=window, softcap=softcap, softmax_scale=scale)


def test_window_no_new_kv():
    """A window over the cache alone (no k/v)."""
    torch.manual_seed(11)
    q, k_cache, v_cache, _, _ = make(b=2, sq=2, sn=0, sc=16)
    check_call(q, k_cache, v_cache, cache_seqlens=seqlens(9, 16), window_size=(3, 0))


# ---------------------------------------------------------------------------------------------
# Rotary embeddings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["noncausal", "causal", "window"])
@pytest.mark.parametrize("d,rotary_dim", [(32, 16), (16, 16)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary(interleaved, d, rotary_dim, mode):
    """k rotated at positions cache_seqlens[b] + j before it is written (dims past rotary_dim
    untouched); q row j at cache_seqlens[b] + j with causal or a window, else every row at
    cache_seqlens[b]. Interleaved (GPT-J) and half-split (GPT-NeoX) pairs."""
    torch.manual_seed(12)
    sc = 16
    q, k_cache, v_cache, k, v = make(b=2, sq=3, sn=3, sc=sc, h=4, hk=2, d=d)
    cos, sin = grid_cos_sin(sc, rotary_dim)
    causal = mode == "causal"
    window = (4, 1) if mode == "window" else (-1, -1)
    q0, k0, v0, cos0, sin0 = (t.clone() for t in (q, k, v, cos, sin))
    check_call(q, k_cache, v_cache, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
               cache_seqlens=seqlens(2, 13), causal=causal, window_size=window,
               rotary_interleaved=interleaved)
    for name, t, t0 in (("q", q, q0), ("k", k, k0), ("v", v, v0), ("rotary_cos", cos, cos0),
                        ("rotary_sin", sin, sin0)):
        assert torch.equal(t, t0), f"{name} was modified"


def test_rotary_q_positions_depend_on_causal():
    """Sanity of the reference itself: with seqlen_q > 1 the non-causal (all rows at
    cache_seqlens) and causal (row j at cache_seqlens + j) q positions give different outputs for
    the same visible keys (a window covering everything), and the function follows each."""
    torch.manual_seed(13)
    sc = 16
    q, k_cache, v_cache, k, v = make(b=2, sq=3, sn=3, sc=sc)
    cos, sin = grid_cos_sin(sc, 16)
    kw = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens(4, 10))
    out_plain, _, _, _ = check_call(q, k_cache.clone(), v_cache.clone(), **kw)
    out_win, _, _, _ = check_call(q, k_cache.clone(), v_cache.clone(), window_size=(100, 100),
                                  **kw)
    assert not torch.allclose(out_plain[:, 1:], out_win[:, 1:])
    torch.testing.assert_close(out_plain[:, 0], out_win[:, 0], **TOL)


def test_rotary_float32_tables_and_default_interleaved():
    """cos/sin in float32 with float64 q (allowed); rotary_interleaved defaults to True."""
    torch.manual_seed(14)
    sc = 16
    q, k_cache, v_cache, k, v = make(b=2, sq=2, sn=2, sc=sc, d=32)
    cos, sin = grid_cos_sin(sc, 16, dtype=torch.float32)
    check_call(q, k_cache, v_cache, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
               cache_seqlens=seqlens(0, 14), causal=True)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_real_angles(interleaved):
    """The usual cos/sin of position * frequency on unrounded inputs, with GQA 4:1. The rotation
    may be computed in float32, so compared at 1e-5."""
    torch.manual_seed(15)
    sc, d = 32, 32
    q = torch.randn(3, 2, 4, d, dtype=F64)
    k_cache, v_cache = torch.randn(3, sc, 1, d, dtype=F64), torch.randn(3, sc, 1, d, dtype=F64)
    k, v = torch.randn(3, 2, 1, d, dtype=F64), torch.randn(3, 2, 1, d, dtype=F64)
    cos, sin = angle_cos_sin(sc, d)
    check_call(q, k_cache, v_cache, out_tol=dict(atol=1e-5, rtol=1e-5), cache_tol=1e-5,
               k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens(0, 11, 30),
               causal=True, rotary_interleaved=interleaved)


# ---------------------------------------------------------------------------------------------
# cache_batch_idx
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary", [False, True])
def test_cache_batch_idx(rotary):
    """Batch b reads and writes cache entry cache_batch_idx[b] of a larger cache (with
    cache_seqlens[b] indexed by the batch, not by the entry); other entries stay untouched."""
    torch.manual_seed(16)
    sc, sn = 16, 2
    q, k_cache, v_cache, k, v = make(b=2, sq=2, sn=sn, sc=sc, batch_cache=4)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    cs = seqlens(5, 9)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    kw = dict(k=k, v=v, cache_seqlens=cs, cache_batch_idx=idx, causal=True)
    if rotary:
        cos, sin = grid_cos_sin(sc, 16)
        kw.update(rotary_cos=cos, rotary_sin=sin)
    check_call(q, k_cache, v_cache, **kw)
    for e in (0, 2):
        assert torch.equal(k_cache[e], kc0[e]) and torch.equal(v_cache[e], vc0[e]), e
    for b, (e, c) in enumerate(zip(idx.tolist(), cs.tolist())):
        assert torch.equal(v_cache[e, c:c + sn], v[b])
        assert torch.equal(v_cache[e, :c], vc0[e, :c]) and torch.equal(v_cache[e, c + sn:],
                                                                        vc0[e, c + sn:])
        if not rotary:
            assert torch.equal(k_cache[e, c:c + sn], k[b])


def test_cache_batch_idx_without_new_kv():
    """cache_batch_idx selects the entries read when no k/v is given."""
    torch.manual_seed(17)
    q, k_cache, v_cache, _, _ = make(b=3, sq=1, sn=0, sc=8, batch_cache=5)
    check_call(q, k_cache, v_cache, cache_seqlens=seqlens(8, 2, 5),
               cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32))


def test_cache_batch_idx_fewer_entries_than_batches():
    """Several batches may read one entry: 3 batches over a 2-entry cache."""
    torch.manual_seed(18)
    q, k_cache, v_cache, _, _ = make(b=3, sq=2, sn=0, sc=8, batch_cache=2)
    check_call(q, k_cache, v_cache, cache_seqlens=seqlens(8, 3, 6), causal=True,
               cache_batch_idx=torch.tensor([1, 1, 0], dtype=torch.int32))


def test_cache_batch_idx_backward():
    """Without cache_seqlens the call is differentiable; the gradient of an entry read by
    several batches is the sum of theirs (autograd through an explicit gather)."""
    torch.manual_seed(19)
    q, k_cache, v_cache, _, _ = make(b=3, sq=3, sn=0, sc=5, batch_cache=3)
    idx = torch.tensor([2, 0, 2], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k_cache, v_cache)]
    out = flash_attn_with_kvcache(*leaves, cache_batch_idx=idx, causal=True)
    dout = grid_rand(*out.shape)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k_cache, v_cache)]
    sel = idx.long()
    out_ref = flash_attn_func(ref_leaves[0], ref_leaves[1][sel], ref_leaves[2][sel],
                              causal=True)
    grads_ref = torch.autograd.grad(out_ref, ref_leaves, dout)
    torch.testing.assert_close(out, out_ref, **TOL)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **TOL)
    assert grads[1][1].abs().sum() == 0  # entry 1 is read by no batch


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("mode", ["noncausal", "causal", "window"])
@pytest.mark.parametrize("sq,sn", [(1, 1), (3, 2), (2, 0)])
def test_cache_leftpad(sq, sn, mode, rotary):
    """Sequence b's keys start at cache row cache_leftpad[b]: the masks align to the rows
    from there to cache_seqlens[b] + seqlen_new, the new rows are written at cache_seqlens[b]
    and rotated at cache-row positions (FlashAttention-2's semantics). A pad equal to the
    length leaves only the new keys (or none)."""
    if rotary and sn == 0:
        pytest.skip("rotary needs new k/v")
    torch.manual_seed(30)
    sc = 16
    q, k_cache, v_cache, k, v = make(b=4, sq=sq, sn=sn, sc=sc, batch_cache=5)
    kw = dict(k=k, v=v, cache_seqlens=seqlens(7, 3, 12, 5), cache_leftpad=seqlens(2, 0, 9, 5),
              causal=mode == "causal", window_size=(3, 1) if mode == "window" else (-1, -1))
    if rotary:
        cos, sin = grid_cos_sin(sc + sq, 16)
        kw.update(rotary_cos=cos, rotary_sin=sin)
    check_call(q, k_cache, v_cache, **kw)


def test_cache_leftpad_with_cache_batch_idx_and_no_seqlens():
    """cache_leftpad is per query batch and composes with cache_batch_idx; without
    cache_seqlens the keys run from the pad to the end of the cache."""
    torch.manual_seed(31)
    q, k_cache, v_cache, _, _ = make(b=3, sq=2, sn=0, sc=8, batch_cache=2)
    check_call(q, k_cache, v_cache, cache_batch_idx=torch.tensor([1, 1, 0], dtype=torch.int32),
               cache_leftpad=seqlens(0, 5, 3), causal=True)
    check_call(q, k_cache, v_cache, cache_seqlens=seqlens(8, 6, 4), cache_leftpad=seqlens(1, 6, 0),
               cache_batch_idx=torch.tensor([0, 1, 0], dtype=torch.int32))


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_with_cache(per_batch):
    """ALiBi aligned to each sequence's keys: from cache_leftpad to cache_seqlens plus the new
    rows (rotated), slopes (nheads,) or (batch, nheads)."""
    torch.manual_seed(32)
    q, k_cache, v_cache, k, v = make(b=3, sq=3, sn=2, sc=16, h=4, hk=2)
    cos, sin = grid_cos_sin(20, 16)
    slopes = torch.rand(3, 4) if per_batch else torch.rand(4)
    check_call(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens(9, 0, 14),
               cache_leftpad=seqlens(4, 0, 1), causal=True, rotary_cos=cos, rotary_sin=sin,
               alibi_slopes=slopes.float(), lse_tol=1e-4)


def test_cache_leftpad_backward_raises():
    """A left-padded call is forward only: its backward names cache_leftpad."""
    q, k_cache, v_cache, _, _ = make(b=2, sq=2, sn=0, sc=8)
    q.requires_grad_()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_leftpad=seqlens(1, 2))
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        out.sum().backward()


def to_pages(cache, page, perm):
    """A contiguous cache (b, s, hk, d) as pages (num_blocks, page, hk, d) in the order perm
    (sequence b's block i is page perm[b * s / page + i]; num_blocks = len(perm) may exceed
    the blocks used) and its block table (b, s / page)."""
    b, s = cache.shape[:2]
    blocks = cache.reshape(b * s // page, page, *cache.shape[2:])
    pages = grid_rand(len(perm), page, *cache.shape[2:], dtype=cache.dtype)
    table = torch.tensor(perm[:b * s // page], dtype=torch.int32).reshape(b, s // page)
    pages[table.reshape(-1).long()] = blocks
    return pages, table


@pytest.mark.parametrize("page", [64, 1, 3, 16, 48])
@pytest.mark.parametrize("sq,sn,rotary", [(1, 1, False), (1, 1, True), (3, 0, False),
                                          (5, 70, False), (5, 70, True)])
def test_paged_cache(sq, sn, rotary, page):
    """A paged cache (block_table; pages in shuffled order, one page unused) gives the results
    of the same cache held contiguously, and the append writes the same rows into the pages
    (across page boundaries with sn = 70). Pages of any size on the CPU reference (3 divides no
    key block, 16 is vLLM's), as on CUDA."""
    torch.manual_seed(20 + page)
    b, sc = 2, 192
    q, k_cache, v_cache, k, v = make(b=b, sq=sq, sn=sn, sc=sc)
    perm = torch.randperm(b * sc // page + 1).tolist()
    k_pages, table = to_pages(k_cache, page, perm)
    v_pages, _ = to_pages(v_cache, page, perm)
    kw = dict(k=k, v=v, cache_seqlens=seqlens(30, 100), causal=True)
    if rotary:
        cos, sin = grid_cos_sin(sc, 16)
        kw.update(rotary_cos=cos, rotary_sin=sin)
    out_ref, lse_ref, _, _ = check_call(q, k_cache, v_cache, **kw)
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table,
                                       return_softmax_lse=True, **kw)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    flat = table.reshape(-1).long()
    torch.testing.assert_close(k_pages[flat].reshape(k_cache.shape), k_cache, atol=0, rtol=0)
    torch.testing.assert_close(v_pages[flat].reshape(v_cache.shape), v_cache, atol=0, rtol=0)


@pytest.mark.parametrize("page", [1, 4, 16, 64])
@pytest.mark.parametrize("sn", [0, 3])
def test_cache_leftpad_with_block_table(page, sn):
    """cache_leftpad together with a paged cache: sequence b's keys are its rows from
    cache_leftpad[b] to cache_seqlens[b] (plus the appended ones), read through its pages, as
    with the same cache held contiguously."""
    torch.manual_seed(40 + page + sn)
    b, sc = 3, 128
    q, k_cache, v_cache, k, v = make(b=b, sq=2, sn=sn, sc=sc)
    perm = torch.randperm(b * sc // page + 1).tolist()
    k_pages, table = to_pages(k_cache, page, perm)
    v_pages, _ = to_pages(v_cache, page, perm)
    kw = dict(k=k, v=v, cache_seqlens=seqlens(40, 7, 100), cache_leftpad=seqlens(5, 7, 61),
              causal=True)
    out_ref, lse_ref, _, _ = check_call(q, k_cache, v_cache, **kw)
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table,
                                       return_softmax_lse=True, **kw)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)


def test_cuda_takes_any_page_size():
    """A CUDA paged cache may have pages of any size >= 1 (the SM80 kernels gather a key block
    row by row); the check reads only k's shape and device, so a stand-in for a CUDA k
    suffices."""
    from flash_attn import _validation as V

    class PagedCudaK:
        shape = (3, 16, 2, 16)
        device = torch.device("cuda", 0)

    table = torch.zeros(2, 5, dtype=torch.int32)
    assert V._check_block_table(FN, table, torch.zeros(2, 1, 4, 16), 2, "k_cache",
                                PagedCudaK()) == 5 * 16


def varlen_paged(lens, page, hk, d, spare=1):
    """Varlen k and v (sum(lens), hk, d), their cu_seqlens_k, and the same keys in shuffled
    pages (rows past a sequence's keys and `spare` unused pages NaN) with their block table
    (len(lens), max pages per sequence)."""
    k, v = grid_rand(sum(lens), hk, d), grid_rand(sum(lens), hk, d)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    width = max(1, max(-(-n // page) for n in lens))
    table = torch.randperm(len(lens) * width + spare)[:len(lens) * width].reshape(len(lens),
                                                                                 width)
    paged = []
    for x in (k, v):
        pages = torch.full((len(lens) * width + spare, page, hk, d), float("nan"), dtype=F64)
        for b, n in enumerate(lens):
            rows = x[int(cu[b]):int(cu[b + 1])]
            for i in range(0, n, page):
                pages[table[b, i // page], :min(page, n - i)] = rows[i:i + page]
        paged.append(pages)
    return k, v, cu, paged[0], paged[1], table.to(torch.int32)


@pytest.mark.parametrize("page", [64, 1, 16, 48])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged(causal, page):
    """flash_attn_varlen_func with block_table (keys in shuffled pages of `page` rows, any size
    on the CPU reference) gives the results of the same keys held as varlen tensors; a sequence
    may hold no key."""
    torch.manual_seed(21 + page)
    lens_q, lens_k, h, hk, d = [5, 1, 70, 3], [130, 0, 70, 64], 4, 2, 16
    q = grid_rand(sum(lens_q), h, d)
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    k, v, cu_k, k_pages, v_pages, table = varlen_paged(lens_k, page, hk, d)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out = flash_attn.flash_attn_varlen_func(q, k, v, *args, causal=causal)
    out_p = flash_attn.flash_attn_varlen_func(q, k_pages, v_pages, *args, causal=causal,
                                              block_table=table)
    torch.testing.assert_close(out_p, out, **TOL)


def test_varlen_paged_errors():
    """A sequence longer than its table row, return_attn_probs, and a backward pass are
    refused with named errors."""
    torch.manual_seed(22)
    q = grid_rand(4, 2, 16)
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    _, _, cu_k, pages, _, table = varlen_paged([64, 10], 64, 2, 16)
    with pytest.raises(ValueError, match=r"block_table"):
        flash_attn.flash_attn_varlen_func(q, pages, pages.clone(), cu_q,
                                          torch.tensor([0, 65, 75], dtype=torch.int32), 2, 65,
                                          block_table=table)
    with pytest.raises(NotImplementedError, match=arg_re("return_attn_probs")):
        flash_attn.flash_attn_varlen_func(q, pages, pages.clone(), cu_q, cu_k, 2, 64,
                                          block_table=table, return_attn_probs=True)
    qg = q.clone().requires_grad_()
    out = flash_attn.flash_attn_varlen_func(qg, pages, pages.clone(), cu_q, cu_k, 2, 64,
                                            block_table=table)
    with pytest.raises(NotImplementedError, match=r"block_table"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _err_args(**over):
    """Valid arguments (batch 2, seqlen_cache 8, seqlen_new 1, nheads 4, nheads_k 2, d 16)
    with some replaced."""
    b, sc, h, hk, d = 2, 8, 4, 2, 16
    args = dict(q=grid_rand(b, 1, h, d), k_cache=grid_rand(b, sc, hk, d),
                v_cache=grid_rand(b, sc, hk, d), k=grid_rand(b, 1, hk, d),
                v=grid_rand(b, 1, hk, d), cache_seqlens=seqlens(2, 5))
    args.update(over)
    return args


_K_OR_CACHE_OR_SEQLEN = r"seqlen|k_cache|" + arg_re("k")


def _paged():
    """A valid paged cache for _err_args: 3 pages of 64 rows, one page per sequence."""
    return dict(k_cache=grid_rand(3, 64, 2, 16), v_cache=grid_rand(3, 64, 2, 16),
                block_table=torch.tensor([[2], [0]], dtype=torch.int32))

# (id, overrides, exception, regexes the message must all contain)
ERROR_CASES = [
    ("block_table_empty_pages", lambda: dict(k_cache=grid_rand(3, 0, 2, 16),
                                             v_cache=grid_rand(3, 0, 2, 16),
                                             block_table=torch.zeros(2, 1, dtype=torch.int32)),
     ValueError, [r"page_block_size >= 1"]),
    ("block_table_int64", lambda: dict(_paged(), block_table=torch.zeros(2, 1,
                                                                          dtype=torch.long)),
     TypeError, [arg_re("block_table")]),
    ("block_table_wrong_batch", lambda: dict(_paged(), block_table=torch.zeros(3, 1,
                                                                               dtype=torch.int32)),
     ValueError, [arg_re("block_table")]),
    ("block_table_with_cache_batch_idx",
     lambda: dict(_paged(), cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError,
     [arg_re("block_table"), arg_re("cache_batch_idx")]),
    ("block_table_page_out_of_range",
     lambda: dict(_paged(), block_table=torch.tensor([[0], [3]], dtype=torch.int32)),
     ValueError, [arg_re("block_table")]),
    ("cache_leftpad_int64", lambda: dict(cache_leftpad=torch.zeros(2, dtype=torch.long)),
     TypeError, [arg_re("cache_leftpad")]),
    ("cache_leftpad_len3", lambda: dict(cache_leftpad=seqlens(0, 0, 0)), ValueError,
     [arg_re("cache_leftpad")]),
    ("cache_leftpad_past_seqlens", lambda: dict(cache_leftpad=seqlens(3, 0)), ValueError,
     [arg_re("cache_leftpad"), r"cache_leftpad\[0\] = 3"]),
    ("cache_leftpad_negative", lambda: dict(cache_leftpad=seqlens(0, -1)), ValueError,
     [arg_re("cache_leftpad")]),
    ("cache_leftpad_past_cache", lambda: dict(k=None, v=None, cache_seqlens=None,
                                              cache_leftpad=seqlens(9, 0)),
     ValueError, [arg_re("cache_leftpad")]),
    ("alibi_slopes_shape", lambda: dict(alibi_slopes=torch.ones(2)), ValueError,
     [arg_re("alibi_slopes")]),
    ("num_splits_2", lambda: dict(num_splits=2), NotImplementedError, [arg_re("num_splits")]),
    ("rotary_without_k", lambda: dict(k=None, v=None, rotary_cos=grid_cos_sin(16, 16)[0],
                                      rotary_sin=grid_cos_sin(16, 16)[1]),
     ValueError, [arg_re("rotary_cos"), arg_re("k")]),
    ("k_without_v", lambda: dict(v=None), ValueError, [arg_re("k"), arg_re("v")]),
    ("k_cache_expanded", lambda: dict(k_cache=grid_rand(1, 8, 2, 16).expand(2, 8, 2, 16)),
     ValueError, [arg_re("k_cache"), r"stride 0"]),
    ("v_cache_is_k_cache", lambda: (lambda c: dict(k_cache=c, v_cache=c))(grid_rand(2, 8, 2, 16)),
     ValueError, [arg_re("k_cache"), arg_re("v_cache")]),
    ("block_table_page_0", lambda: dict(k_cache=grid_rand(3, 0, 2, 16),
                                        v_cache=grid_rand(3, 0, 2, 16),
                                        block_table=torch.zeros(2, 1, dtype=torch.int32)),
     ValueError, [r"page_block_size"]),
    ("v_without_k", lambda: dict(k=None), ValueError, [arg_re("k"), arg_re("v")]),
    ("rotary_cos_without_sin", lambda: dict(rotary_cos=grid_cos_sin(8, 16)[0]), ValueError,
     [arg_re("rotary_cos"), arg_re("rotary_sin")]),
    ("rotary_sin_without_cos", lambda: dict(rotary_sin=grid_cos_sin(8, 16)[1]), ValueError,
     [arg_re("rotary_cos"), arg_re("rotary_sin")]),
    ("kv_without_cache_seqlens", lambda: dict(cache_seqlens=None), ValueError,
     [arg_re("cache_seqlens")]),
    ("seqlen_new_gt_seqlen_cache", lambda: dict(k=grid_rand(2, 9, 2, 16),
                                                v=grid_rand(2, 9, 2, 16),
                                                cache_seqlens=seqlens(0, 0)),
     ValueError, [_K_OR_CACHE_OR_SEQLEN]),
    ("cache_seqlens_int64", lambda: dict(cache_seqlens=torch.tensor([2, 5])), TypeError,
     [arg_re("cache_seqlens")]),
    ("cache_seqlens_len3", lambda: dict(cache_seqlens=seqlens(2, 5, 1)), ValueError,
     [arg_re("cache_seqlens")]),
    ("cache_seqlens_2d", lambda: dict(cache_seqlens=seqlens(2, 5)[:, None]), ValueError,
     [arg_re("cache_seqlens")]),
    ("cache_seqlens_int_negative", lambda: dict(cache_seqlens=-1), ValueError,
     [arg_re("cache_seqlens")]),
    ("cache_seqlens_int_too_large", lambda: dict(cache_seqlens=8), ValueError,  # > 8 - 1
     [arg_re("cache_seqlens")]),
    ("cache_seqlens_int_too_large_no_kv", lambda: dict(k=None, v=None, cache_seqlens=9),
     ValueError, [arg_re("cache_seqlens")]),
    ("rotary_dim_gt_headdim", lambda: dict(zip(("rotary_cos", "rotary_sin"),
                                               grid_cos_sin(8, 32))),
     ValueError, [r"rotary"]),
    ("q_int32", lambda: dict(q=torch.ones(2, 1, 4, 16, dtype=torch.int32)), TypeError,
     [arg_re("q")]),
    ("k_cache_float32", lambda: dict(k_cache=grid_rand(2, 8, 2, 16, dtype=torch.float32)),
     TypeError, [arg_re("k_cache")]),
    ("v_cache_float32", lambda: dict(v_cache=grid_rand(2, 8, 2, 16, dtype=torch.float32)),
     TypeError, [arg_re("v_cache")]),
    ("q_rank3", lambda: dict(q=grid_rand(2, 4, 16)), ValueError, [arg_re("q")]),
    ("k_cache_rank3", lambda: dict(k_cache=grid_rand(8, 2, 16), v_cache=grid_rand(8, 2, 16)),
     ValueError, [arg_re("k_cache")]),
    ("nheads_not_divisible", lambda: dict(q=grid_rand(2, 1, 3, 16)), ValueError, [r"heads"]),
    ("batch_cache_lt_batch", lambda: dict(k_cache=grid_rand(1, 8, 2, 16),
                                          v_cache=grid_rand(1, 8, 2, 16)),
     ValueError, [r"batch"]),
    ("k_wrong_nheads", lambda: dict(k=grid_rand(2, 1, 4, 16), v=grid_rand(2, 1, 4, 16)),
     ValueError, [arg_re("k")]),
]


@pytest.mark.parametrize("over,exc,patterns",
                         [pytest.param(o, e, p, id=i) for i, o, e, p in ERROR_CASES])
def test_errors(over, exc, patterns):
    """Each bad argument raises the documented exception type with a message that starts with
    'flash_attn_with_kvcache:' and names the argument; nothing is written to the caches."""
    torch.manual_seed(18)
    args = _err_args(**over())
    before = {n: t.clone() for n, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc) as info:
        flash_attn_with_kvcache(**args)
    msg = str(info.value)
    assert msg.startswith(FN + ":"), msg
    for pat in patterns:
        assert re.search(pat, msg), f"{pat!r} not found in: {msg}"
    for n, t0 in before.items():
        assert torch.equal(args[n], t0), f"{n} was modified by a call that raised"
