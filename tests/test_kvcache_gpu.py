"""GPU tests of flash_attn_with_kvcache: the kernels (cache update, rotary, attention over the
first cache_seqlens[b] + seqlen_new keys of each cache entry, from row cache_leftpad[b] on)
against the CPU path.

* Output: the accuracy rule of test_flash_attn_gpu.py, max|ours - ref| <= 2 * max|pt - ref| +
  atol, with ``ref`` the same call run on CPU in float64 (on upcast copies of the inputs) and
  ``pt`` attention_ref in q's dtype on the explicitly concatenated keys (cache rows before the
  call + the new rows), q and the new k rotated in float32 and rounded to q's dtype.
* softmax_lse: assert_lse against the float64 CPU run; with rotary the accuracy rule as for the
  output (the rotated q and k are rounded to q's dtype before the attention).
* Cache update: equal to the same call run on CPU in q's dtype: bitwise without rotary, within
  1 ulp with rotary (float32 rotation; FMA contraction may round the other way).
* The cache rows from cache_seqlens[b] on hold NaN before the call: rows that are neither
  written nor attended must not reach the output; the output buffer is poisoned as in the other
  GPU tests.

Every test runs on each kernel path of the GPU (the ``kernel_path`` fixture).
"""

import os
import sys

import pytest
import torch

import flash_attn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import (  # noqa: E402
    arg_re,
    assert_accuracy,
    assert_lse,
    attention_ref,
)
from attn_ref import kernel_path, poisoned_allocator  # noqa: E402,F401  (autouse fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from flash_attn import flash_attn_with_kvcache

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NAN = float("nan")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def rotary_tables(seqlen_ro, rotary_dim, dtype, base=10000.0):
    """cos, sin (seqlen_ro, rotary_dim / 2) on CUDA in dtype: angle = pos * base^(-2i / dim)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().to("cuda", dtype), ang.sin().to("cuda", dtype)


def rotate(x, cos, sin, pos, interleaved):
    """x (b, s, heads, d), row (i, j) rotated at position pos[i, j] (first 2 * cos.shape[1]
    dims), computed in float32 and returned in x's dtype."""
    rd = 2 * cos.shape[1]
    xf = x.float()
    c = cos.float()[pos].unsqueeze(2)  # (b, s, 1, rd / 2)
    s = sin.float()[pos].unsqueeze(2)
    if interleaved:
        x0, x1 = xf[..., 0:rd:2], xf[..., 1:rd:2]
        r = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    else:
        x0, x1 = xf[..., : rd // 2], xf[..., rd // 2:rd]
        r = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    return torch.cat([r, xf[..., rd:]], dim=-1).to(x.dtype)


def lowp_baseline(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                  cache_seqlens=None, cache_batch_idx=None, causal=False, window_size=(-1, -1),
                  rotary_interleaved=True, block_table=None, cache_leftpad=None,
                  alibi_slopes=None):
    """``pt`` of the accuracy rule: attention_ref in q's dtype per sequence on
    cat(k_cache[e, cache_leftpad[b]:cache_seqlens[b]], rotated k[b]) (k_cache as before the
    call), q rotated at cache_seqlens[b] (+ j with causal or a window). Returns out (batch,
    seqlen_q, nheads, d) in q's dtype and lse (batch, nheads, seqlen_q) in float32."""
    b, sq = q.shape[:2]
    if block_table is not None:  # the pages as the contiguous cache they describe
        k_cache, v_cache = (x[block_table.long()].flatten(1, 2) for x in (k_cache, v_cache))
    if cache_seqlens is None:
        lens = torch.full((b,), k_cache.shape[1], dtype=torch.long, device=q.device)
    else:
        lens = cache_seqlens.long()
    if k is not None and rotary_cos is not None:
        local = causal or tuple(window_size) != (-1, -1)
        qpos = lens[:, None] + torch.arange(sq, device=q.device)[None, :] * int(local)
        kpos = lens[:, None] + torch.arange(k.shape[1], device=q.device)[None, :]
        q = rotate(q, rotary_cos, rotary_sin, qpos, rotary_interleaved)
        k = rotate(k, rotary_cos, rotary_sin, kpos, rotary_interleaved)
    outs, lses = [], []
    for i, c in enumerate(lens.tolist()):
        e = i if cache_batch_idx is None else int(cache_batch_idx[i])
        first = 0 if cache_leftpad is None else int(cache_leftpad[i])
        kb, vb = k_cache[e, first:c], v_cache[e, first:c]
        if k is not None:
            kb, vb = torch.cat([kb, k[i]]), torch.cat([vb, v[i]])
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i:i + 1]
        o, lse = attention_ref(q[i:i + 1], kb[None], vb[None], causal=causal,
                               window_size=window_size, compute_dtype=q.dtype,
                               alibi_slopes=slopes)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def to_cpu(kw, dtype=None):
    """kw with its tensors copied to CPU (floating ones but the float32 alibi_slopes cast to
    dtype when given)."""
    res = {}
    for name, x in kw.items():
        if isinstance(x, torch.Tensor):
            x = x.cpu()
            if dtype is not None and x.is_floating_point() and name != "alibi_slopes":
                x = x.to(dtype)
        res[name] = x
    return res


def _ordered_bits(x):
    """16-bit floats as int32 ordered like their values (neighbours differ by 1, +-0 is 0)."""
    i = x.view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def assert_cache_matches(name, got, want, max_ulps):
    """got (CUDA) against want (CPU), both 16-bit: bitwise (NaN included) for max_ulps 0, else
    within max_ulps (or 1e-6 absolute, for near-cancellations in the float32 rotation)."""
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype)
    if max_ulps == 0:
        same = got.view(torch.int16) == want.view(torch.int16)
        assert same.all(), f"{name}: {int((~same).sum())} entries differ bitwise from the CPU's"
        return
    ulps = (_ordered_bits(got) - _ordered_bits(want)).abs()
    tiny = (got.float() - want.float()).abs() <= 1e-6
    bad = (ulps > max_ulps) & ~tiny
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} entries differ from the CPU's by more than {max_ulps} ulp "
        f"(max {int(ulps[bad].max())} ulp)"
    )


def check_against_cpu(q, k_cache, v_cache, **kw):
    """Runs flash_attn_with_kvcache on the GPU (with and without return_softmax_lse) and checks
    out, softmax_lse and the caches as the module docstring says. Returns out."""
    rotary = kw.get("rotary_cos") is not None
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    # float64 reference on CPU; the NaN rows (never read) are zeroed for it
    out_ref, lse_ref = flash_attn_with_kvcache(
        q.cpu().double(), torch.nan_to_num(kc0.cpu().double()),
        torch.nan_to_num(vc0.cpu().double()), return_softmax_lse=True,
        **to_cpu(kw, torch.float64),
    )
    # the cache update on CPU in q's dtype (its output is not used)
    kc_cpu, vc_cpu = kc0.cpu(), vc0.cpu()
    flash_attn_with_kvcache(q.cpu(), kc_cpu, vc_cpu, **to_cpu(kw))
    out_pt, lse_pt = lowp_baseline(q, kc0, vc0, **kw)

    res = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    assert isinstance(res, tuple) and len(res) == 2, type(res)
    out, lse = res
    assert out.dtype == q.dtype and out.device == q.device, (out.dtype, out.device)
    assert out.shape == q.shape, (tuple(out.shape), tuple(q.shape))
    out_ref = out_ref.cuda()
    assert_accuracy("out", out, out_ref, out_pt, 2)
    if rotary:
        # q and k are rotated in float32 and rounded to q's dtype (the kernels' inputs), which
        # moves the lse by more than assert_lse's rtol: the accuracy rule instead.
        assert lse.dtype == torch.float32, lse.dtype
        assert_accuracy("softmax_lse", lse, lse_ref.cuda().double(), lse_pt, 2)
    else:
        assert_lse("softmax_lse", lse, lse_ref.cuda())
    assert_cache_matches("k_cache", k_cache, kc_cpu, 1 if rotary else 0)
    assert_cache_matches("v_cache", v_cache, vc_cpu, 0)

    # Again, output only: the same rows are written again with the same values.
    out2 = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert isinstance(out2, torch.Tensor), type(out2)
    assert_accuracy("out (return_softmax_lse=False)", out2, out_ref, out_pt, 2)
    assert_cache_matches("k_cache (second call)", k_cache, kc_cpu, 1 if rotary else 0)
    assert_cache_matches("v_cache (second call)", v_cache, vc_cpu, 0)
    return out


def make_inputs(dtype, d, b, sq, sn, sc, h, hk, lens, batch_cache=None, cache_batch_idx=None,
                leftpad=None):
    """q, k_cache, v_cache, k, v on CUDA; the cache rows of entry cache_batch_idx[i] (or i) from
    lens[i] on, and before leftpad[i], are NaN. k, v are None when sn is 0."""
    q = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
    k_cache = torch.randn(batch_cache or b, sc, hk, d, dtype=dtype, device="cuda")
    v_cache = torch.randn(batch_cache or b, sc, hk, d, dtype=dtype, device="cuda")
    entries = range(b) if cache_batch_idx is None else cache_batch_idx.tolist()
    for e, c in zip(entries, lens or []):
        k_cache[e, c:] = NAN
        v_cache[e, c:] = NAN
    for e, first in zip(entries, leftpad or []):
        k_cache[e, :first] = NAN
        v_cache[e, :first] = NAN
    if sn == 0:
        return q, k_cache, v_cache, None, None
    k = torch.randn(b, sn, hk, d, dtype=dtype, device="cuda")
    v = torch.randn(b, sn, hk, d, dtype=dtype, device="cuda")
    return q, k_cache, v_cache, k, v


def rotary_kwargs(rotary, sc, d, dtype):
    """rotary None / "interleaved" (GPT-J) / "neox" (half split); rotary_dim = d for d <= 64,
    else d / 2 (only the first half rotated)."""
    if rotary is None:
        return {}
    cos, sin = rotary_tables(sc, d if d <= 64 else d // 2, dtype)
    return dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary == "interleaved")


# ---------------------------------------------------------------------------------------------
# Decode and prefill chunks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kvcache(dtype, d, case, rotary):
    """GQA 8:2, seqlen_cache 512. decode: one new token per sequence, cache_seqlens random in
    [0, 500] (0 and 500 included), non-causal. prefill: a causal chunk of 64 queries and 64 new
    keys at random offsets. Output, lse and cache update against the CPU path."""
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    sc, h, hk = 512, 8, 2
    if case == "decode":
        b, s, causal = 4, 1, False
        lens = torch.randint(0, 501, (b,))
        lens[0], lens[1] = 0, 500
    else:
        b, s, causal = 2, 64, True
        lens = torch.randint(0, sc - s + 1, (b,))
    lens = lens.tolist()
    q, k_cache, v_cache, k, v = make_inputs(dt, d, b, s, s, sc, h, hk, lens)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    check_against_cpu(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, causal=causal,
                      **rotary_kwargs(rotary, sc, d, dt))


@pytest.mark.parametrize("mode", ["append", "append_rotary", "whole_cache"])
def test_split_kv_decode(mode, monkeypatch):
    """A decode step over a long cache (seqlen_cache 4096, batch 1, 32 query heads over 8 KV
    heads): a few query tiles against many key blocks, so the keys are split over SMs and the
    pieces merged. append: one new token at row 4000; append_rotary: at the last row (4095),
    rotated; whole_cache: no k/v and cache_seqlens None (all 4096 rows)."""
    monkeypatch.delenv("FLASH_ATTN_SPLIT", raising=False)
    torch.manual_seed(1)
    dt, d, sc, h, hk = torch.bfloat16, 128, 4096, 32, 8
    if mode == "whole_cache":
        q, k_cache, v_cache, _, _ = make_inputs(dt, d, 1, 1, 0, sc, h, hk, None)
        check_against_cpu(q, k_cache, v_cache)
        return
    lens = [4000] if mode == "append" else [sc - 1]
    q, k_cache, v_cache, k, v = make_inputs(dt, d, 1, 1, 1, sc, h, hk, lens)
    kw = dict(k=k, v=v, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
    if mode == "append_rotary":
        kw.update(rotary_kwargs("interleaved", sc, d, dt))
    check_against_cpu(q, k_cache, v_cache, **kw)


def strided_i32(values):
    """An int32 CUDA tensor of the values as a non-contiguous view (every other element)."""
    return torch.tensor([[x, -1] for x in values], dtype=torch.int32, device="cuda")[:, 0]


def test_cache_batch_idx():
    """Batch b reads and writes entry cache_batch_idx[b] of a larger cache (rotary, GQA 8:2);
    the entries not indexed keep their bits. cache_seqlens and cache_batch_idx are
    non-contiguous views."""
    torch.manual_seed(2)
    dt, d, sc = torch.bfloat16, 128, 256
    idx = strided_i32([4, 0, 5])
    lens = [17, 0, 255]
    q, k_cache, v_cache, k, v = make_inputs(dt, d, 3, 1, 1, sc, 8, 2, lens, batch_cache=6,
                                            cache_batch_idx=idx)
    check_against_cpu(q, k_cache, v_cache, k=k, v=v, cache_seqlens=strided_i32(lens),
                      cache_batch_idx=idx, **rotary_kwargs("neox", sc, d, dt))


def test_cache_batch_idx_plain_kernel():
    """Non-causal, without cache_seqlens and GQA, tiles that pair into clusters: the SM90
    plain (cluster) kernel reads entries cache_batch_idx[b] of a larger cache."""
    torch.manual_seed(11)
    dt, d, sq, sc = torch.bfloat16, 128, 384, 512
    q, k_cache, v_cache, _, _ = make_inputs(dt, d, 2, sq, 0, sc, 4, 4, None, batch_cache=3)
    check_against_cpu(q, k_cache, v_cache,
                      cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("case", ["decode_split", "prefill"])
def test_cache_batch_idx_shared_entries(case, monkeypatch):
    """Several batches read one cache entry in place (4 batches over 2 entries, indices
    [1, 1, 0, 1]; fewer entries than batches), without new k/v: decode over a long cache (the
    keys split over SMs) and a causal prefill chunk, each batch with its own cache_seqlens."""
    monkeypatch.delenv("FLASH_ATTN_SPLIT", raising=False)
    torch.manual_seed(5)
    dt, d, h, hk = torch.bfloat16, 128, 8, 2
    if case == "decode_split":
        sq, sc, lens = 1, 4096, [4096, 3000, 17, 1]
    else:
        sq, sc, lens = 64, 320, [320, 64, 200, 99]
    q, k_cache, v_cache, _, _ = make_inputs(dt, d, 4, sq, 0, sc, h, hk, None, batch_cache=2)
    idx = torch.tensor([1, 1, 0, 1], dtype=torch.int32, device="cuda")
    check_against_cpu(q, k_cache, v_cache, cache_batch_idx=idx, causal=case == "prefill",
                      cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))


def test_cache_batch_idx_backward():
    """Without cache_seqlens the call is differentiable: with cache_batch_idx the backward
    gathers the entries and sums the gradients of entries read by several batches (here
    [2, 0, 2]), as autograd through an explicit gather does."""
    torch.manual_seed(6)
    dt, d = torch.bfloat16, 64
    q = torch.randn(3, 40, 4, d, dtype=dt, device="cuda", requires_grad=True)
    kc = torch.randn(3, 72, 2, d, dtype=dt, device="cuda", requires_grad=True)
    vc = torch.randn(3, 72, 2, d, dtype=dt, device="cuda", requires_grad=True)
    idx = torch.tensor([2, 0, 2], dtype=torch.int32, device="cuda")
    dout = torch.randn(3, 40, 4, d, dtype=dt, device="cuda")
    out = flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=idx, causal=True)
    grads = torch.autograd.grad(out, (q, kc, vc), dout)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, kc, vc))
    sel = idx.long()
    out_ref, _ = attention_ref(qr, kr[sel], vr[sel], causal=True,
                               compute_dtype=torch.float64)
    grads_ref = torch.autograd.grad(out_ref, (qr, kr, vr), dout.double())
    out_pt, _ = attention_ref(q, kc[sel], vc[sel], causal=True, compute_dtype=dt)
    grads_pt = torch.autograd.grad(out_pt, (q, kc, vc), dout)
    assert_accuracy("out", out, out_ref, out_pt, 2)
    for name, g, g_ref, g_pt in zip(("dq", "dk_cache", "dv_cache"), grads, grads_ref, grads_pt):
        assert g.shape == g_ref.shape, (name, g.shape)
        assert_accuracy(name, g, g_ref, g_pt, 3)


def paged(cache, page, perm):
    """A contiguous cache (b, s, hk, d) as pages (len(perm), page, hk, d) in the order perm
    (sequence b's block i is page perm[b * s / page + i]; unused pages hold NaN) and its block
    table (b, s / page)."""
    b, s = cache.shape[:2]
    pages = torch.full((len(perm), page, *cache.shape[2:]), NAN, dtype=cache.dtype,
                       device=cache.device)
    table = torch.tensor(perm[:b * s // page], dtype=torch.int32,
                         device=cache.device).reshape(b, s // page)
    pages[table.reshape(-1).long()] = cache.reshape(b * s // page, page, *cache.shape[2:])
    return pages, table


@pytest.mark.parametrize("d,page", [(64, 64), (64, 128), (128, 64), (128, 128), (128, 256),
                                    (256, 256), (256, 320)])
@pytest.mark.parametrize("case", ["decode_split", "prefill_rotary"])
@pytest.mark.parametrize("pack", ["default", "unpacked"])
def test_paged_cache(pack, case, d, page, monkeypatch):
    """A paged cache (block_table, pages in shuffled order, unused pages NaN) read in place:
    on the Hopper kernels where the page is a multiple of 8 rows (a TMA copy per key block
    where it holds whole blocks, d=64/128: 128 rows, d=256: 80; else boxes as tall as the page
    allows), else on the SM80 kernels. decode_split: one new row per sequence over a long cache
    (the keys split over SMs); prefill_rotary: a causal chunk of 40 rows written across page
    boundaries, rotated. unpacked: FLASH_ATTN_PACK_GQA=0 (the SM90 band kernel, not the
    packed one)."""
    monkeypatch.delenv("FLASH_ATTN_SPLIT", raising=False)
    if pack == "unpacked":
        monkeypatch.setenv("FLASH_ATTN_PACK_GQA", "0")
    torch.manual_seed(10)
    dt, h, hk = torch.bfloat16, 8, 2
    if case == "decode_split":
        b, sq, sn, sc, lens = 2, 1, 1, 12 * page, [12 * page - 1, 5 * page + 3]
    else:
        b, sq, sn, sc, lens = 3, 40, 40, 4 * page, [0, page - 7, 3 * page - 40]
    q, k_cache, v_cache, k, v = make_inputs(dt, d, b, sq, sn, sc, h, hk, lens)
    perm = torch.randperm(b * sc // page + 2).tolist()
    k_pages, table = paged(k_cache, page, perm)
    v_pages, _ = paged(v_cache, page, perm)
    kw = dict(k=k, v=v, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
              causal=True, block_table=table)
    if case == "prefill_rotary":
        kw.update(rotary_kwargs("neox", sc, d, dt))
    check_against_cpu(q, k_pages, v_pages, **kw)


@pytest.mark.parametrize("page", [1, 16, 48, 64, 128])
@pytest.mark.parametrize("d", [64, 128, 192, 224, 256])
@pytest.mark.parametrize("case", ["decode_split", "prefill_rotary", "leftpad"])
def test_paged_cache_any_page_size(case, d, page, monkeypatch):
    """Pages of any size (shuffled, unused pages NaN), read in place: by the Hopper kernels'
    TMA for pages of a multiple of 8 rows, else by the SM80 kernels' row gather, and with
    cache_leftpad (which always takes the gather). d = 192 and 224: the two-consumer-group
    kernels' paged loads at the tiers between 128 and 256. decode_split: one new row over 640 cached
    keys (the keys split over SMs); prefill_rotary: a causal chunk of 40 rows written across
    page boundaries, rotated; leftpad: the chunk after pads of 0, an unaligned offset and a
    whole page or more."""
    monkeypatch.delenv("FLASH_ATTN_SPLIT", raising=False)
    torch.manual_seed(14 + page)
    dt, h, hk = torch.bfloat16, 8, 2
    pads, kw = None, {}
    if case == "decode_split":
        b, sq, sn, sc, lens = 2, 1, 1, 768, [640, 301]
    else:
        b, sq, sn, sc, lens = 3, 40, 40, 384, [0, 217, 300]
        if case == "leftpad":
            pads = [0, 13, min(page + 5, 217)]
            kw.update(cache_leftpad=torch.tensor(pads, dtype=torch.int32, device="cuda"))
        else:
            kw.update(rotary_kwargs("neox", sc, d, dt))
    sc = -(-sc // page) * page
    q, k_cache, v_cache, k, v = make_inputs(dt, d, b, sq, sn, sc, h, hk, lens, leftpad=pads)
    perm = torch.randperm(b * sc // page + 2).tolist()
    k_pages, table = paged(k_cache, page, perm)
    v_pages, _ = paged(v_cache, page, perm)
    kw.update(k=k, v=v, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
              causal=True, block_table=table)
    check_against_cpu(q, k_pages, v_pages, **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", ["decode_split", "prefill_rotary", "window", "whole_cache",
                                  "batch_idx"])
@pytest.mark.parametrize("pack", ["default", "unpacked"])
def test_cache_leftpad(pack, case, d, monkeypatch):
    """A left-padded cache: sequence b's keys are its rows [cache_leftpad[b], cache_seqlens[b]
    + seqlen_new), the rows before the pad NaN. decode_split: one new row over a long cache
    (keys split over SMs); prefill_rotary: a causal chunk of 40 rows, rotated at cache-row
    positions; window: a (100, 0) window over a chunk of 64; whole_cache: no k/v, no
    cache_seqlens (keys from the pad to the end, non-causal, Q tiles of 160 rows);
    batch_idx: with cache_batch_idx. Pads include 0, an unaligned offset and the whole cache
    before the new rows. unpacked: FLASH_ATTN_PACK_GQA=0 (the SM90 band kernel)."""
    monkeypatch.delenv("FLASH_ATTN_SPLIT", raising=False)
    if pack == "unpacked":
        monkeypatch.setenv("FLASH_ATTN_PACK_GQA", "0")
    torch.manual_seed(12)
    dt, h, hk = torch.bfloat16, 8, 2
    kw, idx, batch_cache = {}, None, None
    if case == "decode_split":
        b, sq, sn, sc, lens, pads = 2, 1, 1, 3000, [2999, 1500], [0, 777]
    elif case == "whole_cache":
        b, sq, sn, sc, lens, pads = 3, 160, 0, 512, None, [0, 131, 511]
    else:
        b, sq, sn, sc, lens, pads = 3, 40, 40, 384, [0, 217, 300], [0, 13, 300]
        kw.update(causal=True)
        if case == "window":
            sq = sn = 64
            kw = dict(window_size=(100, 0))
        if case == "prefill_rotary":
            kw.update(rotary_kwargs("neox", sc, d, dt))
        if case == "batch_idx":
            batch_cache = 4
            idx = torch.tensor([3, 0, 1], dtype=torch.int32, device="cuda")
            kw.update(cache_batch_idx=idx)
    q, k_cache, v_cache, k, v = make_inputs(dt, d, b, sq, sn, sc, h, hk, lens,
                                            batch_cache=batch_cache, cache_batch_idx=idx,
                                            leftpad=pads)
    if lens is not None:
        kw.update(k=k, v=v, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
    check_against_cpu(q, k_cache, v_cache,
                      cache_leftpad=torch.tensor(pads, dtype=torch.int32, device="cuda"), **kw)


@pytest.mark.parametrize("case", ["decode", "prefill_leftpad"])
def test_alibi(case):
    """ALiBi with a cache: the bias aligns to each sequence's keys (cache_seqlens plus the new
    rows, from cache_leftpad on), (batch, nheads) slopes, GQA 8:2."""
    torch.manual_seed(14)
    dt, d, sc, h, hk = torch.bfloat16, 128, 384, 8, 2
    b, s = (3, 1) if case == "decode" else (2, 40)
    lens = [0, 200, 383][:b] if case == "decode" else [100, 300]
    pads = None if case == "decode" else [0, 77]
    q, k_cache, v_cache, k, v = make_inputs(dt, d, b, s, s, sc, h, hk, lens, leftpad=pads)
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(h)], device="cuda")
    slopes = slopes[None, :] * torch.linspace(0.5, 2.0, b, device="cuda")[:, None]
    kw = dict(k=k, v=v, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
              causal=case != "decode", alibi_slopes=slopes)
    if pads is not None:
        kw["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32, device="cuda")
    check_against_cpu(q, k_cache, v_cache, **kw)


def test_cache_leftpad_out_of_range_without_checks(monkeypatch):
    """Without FLASH_ATTN_CHECK_INPUTS, pads outside [0, cache_seqlens] are clamped: no
    faults, a finite output where keys remain, CUDA stays usable, and the kernels record the
    bad pad (check_bad_inputs raises it)."""
    monkeypatch.delenv("FLASH_ATTN_CHECK_INPUTS", raising=False)
    torch.manual_seed(13)
    dt, d, sc = torch.bfloat16, 64, 128
    q, k_cache, v_cache, k, v = make_inputs(dt, d, 3, 2, 2, sc, 8, 2, None)
    pads = torch.tensor([-7, 100, 2**31 - 1], dtype=torch.int32, device="cuda")
    lens = torch.tensor([20, 50, 30], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                  cache_leftpad=pads, causal=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and torch.isfinite(out[0].float()).all()
    with pytest.raises(ValueError, match="cache_leftpad was out of range"):
        flash_attn.check_bad_inputs()
    check_against_cpu(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                      cache_leftpad=torch.tensor([3, 50, 0], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("window", [(-1, -1), (40, 0)], ids=["full", "window"])
def test_rotary_query_positions(window):
    """A non-causal chunk of 16 queries with rotary: without a window every q row is rotated at
    cache_seqlens[b], with a window row j at cache_seqlens[b] + j (as with causal)."""
    torch.manual_seed(4)
    dt, d, sc, s = torch.bfloat16, 128, 256, 16
    lens = [0, 100, sc - s]
    q, k_cache, v_cache, k, v = make_inputs(dt, d, 3, s, s, sc, 8, 2, lens)
    check_against_cpu(q, k_cache, v_cache, k=k, v=v,
                      cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                      window_size=window, **rotary_kwargs("interleaved", sc, d, dt))


# ---------------------------------------------------------------------------------------------
# The update kernel alone
# ---------------------------------------------------------------------------------------------


def _strided(x):
    """x's values in a tensor with other strides: heads outermost, every dim padded."""
    b, s, h, d = x.shape
    big = torch.full((h + 1, b + 1, s + 2, d + 8), NAN, dtype=x.dtype, device=x.device)
    view = big[:h, :b, 1:s + 1, 3:d + 3].permute(1, 2, 0, 3)
    view.copy_(x)
    return view


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox", "neox_fp32_tables"])
@pytest.mark.parametrize("lengths", ["int", "tensor", "out_of_range"])
def test_update_kernel_against_reference(lengths, rotary, layout):
    """ops.kvcache_update on CUDA (one kernel) against reference.kvcache_update_ref on CPU:
    the caches and q_rot within 1 ulp (bitwise without rotary), seqused_k equal. With
    out_of_range, cache_seqlens and cache_batch_idx hold values the Python checks would refuse
    (negative, past the cache, near 2^31; entries outside the cache) and the tables are shorter
    than the positions: rows outside the cache are dropped, indices and positions clamped, and
    a bad value recorded (check_bad_inputs raises it). cache_leftpad (in range, and out of
    range with out_of_range) shortens seqused_k."""
    from flash_attn import ops, reference

    torch.manual_seed(7)
    dt, d, b, sq, sn, sc, h, hk = torch.bfloat16, 96, 4, 3, 5, 40, 6, 2
    q = torch.randn(b, sq, h, d, dtype=dt, device="cuda")
    k_cache = torch.randn(b + 1, sc, hk, d, dtype=dt, device="cuda")
    v_cache = torch.randn(b + 1, sc, hk, d, dtype=dt, device="cuda")
    k = torch.randn(b, sn, hk, d, dtype=dt, device="cuda")
    v = torch.randn(b, sn, hk, d, dtype=dt, device="cuda")
    idx = torch.tensor([4, 0, 2, 1], dtype=torch.int32, device="cuda")
    pads = torch.tensor([0, 3, 11, 17], dtype=torch.int32, device="cuda")
    lens, offset = None, 0
    if lengths == "int":
        offset = 17
    elif lengths == "tensor":
        lens = torch.tensor([0, 9, sc - sn, 30], dtype=torch.int32, device="cuda")
    else:
        lens = torch.tensor([-3, sc - 2, 2**31 - 3, 7], dtype=torch.int32, device="cuda")
        idx = torch.tensor([9, -1, 2, 3], dtype=torch.int32, device="cuda")
        pads = torch.tensor([-5, 2**31 - 1, 3, 40], dtype=torch.int32, device="cuda")
    cos = sin = q_rot = None
    if rotary is not None:
        table_dt = torch.float32 if rotary.endswith("fp32_tables") else dt
        cos, sin = rotary_tables(20 if lengths == "out_of_range" else sc, 64, table_dt)
        q_rot = torch.full_like(q, NAN)
    if layout == "strided":
        q, k, v, k_cache, v_cache = (_strided(x) for x in (q, k, v, k_cache, v_cache))
        if q_rot is not None:
            q_rot = _strided(q_rot)
    interleaved = rotary == "interleaved"
    cpu = [x.cpu() if isinstance(x, torch.Tensor) else x for x in
           (k_cache, v_cache, q_rot, q, k, v, lens, offset, idx, cos, sin)]
    want_used = reference.kvcache_update_ref(*cpu, interleaved, True, None, pads.cpu())
    used = ops.kvcache_update(k_cache, v_cache, q_rot, q, k, v, lens, offset, idx, cos, sin,
                              interleaved, True, None, pads)
    torch.cuda.synchronize()
    assert used.dtype == torch.int32 and torch.equal(used.cpu(), want_used), (used, want_used)
    if lengths == "out_of_range":
        with pytest.raises(ValueError, match="was out of range"):
            flash_attn.check_bad_inputs()
    ulps = 0 if rotary is None else 1
    assert_cache_matches("k_cache", k_cache.contiguous(), cpu[0].contiguous(), ulps)
    assert_cache_matches("v_cache", v_cache.contiguous(), cpu[1].contiguous(), 0)
    if q_rot is not None:
        assert_cache_matches("q_rot", q_rot.contiguous(), cpu[2].contiguous(), ulps)


@pytest.mark.parametrize("leftpad", [False, True])
def test_compile_decode_step(leftpad):
    """A decode step under torch.compile(fullgraph=True) (inductor): the cache-update op
    mutates the caches as in eager mode and the output matches eager's bitwise (also with
    cache_leftpad)."""
    torch.manual_seed(9)
    torch._dynamo.reset()
    dt, d, sc = torch.bfloat16, 128, 256
    q, k_cache, v_cache, k, v = make_inputs(dt, d, 2, 1, 1, sc, 8, 2, None)
    lens = torch.tensor([5, 200], dtype=torch.int32, device="cuda")
    rot = rotary_kwargs("neox", sc, d, dt)
    if leftpad:
        rot["cache_leftpad"] = torch.tensor([2, 150], dtype=torch.int32, device="cuda")

    def step(q, k_cache, v_cache, k, v, lens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                       causal=True, **rot)

    kc_e, vc_e, kc_c, vc_c = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    out_e = step(q, kc_e, vc_e, k, v, lens)
    out_c = torch.compile(step, fullgraph=True)(q, kc_c, vc_c, k, v, lens)
    assert torch.equal(out_c, out_e)
    assert torch.equal(kc_c, kc_e) and torch.equal(vc_c, vc_e)
    assert not torch.equal(kc_e, k_cache)


def test_out_of_range_lengths_without_checks(monkeypatch):
    """Without FLASH_ATTN_CHECK_INPUTS, cache_seqlens past the cache (and negative) and
    cache_batch_idx outside it run without faults: CUDA stays usable, the output is finite, the
    kernels record a bad value (check_bad_inputs raises it), and a good call afterwards matches
    the CPU path."""
    monkeypatch.delenv("FLASH_ATTN_CHECK_INPUTS", raising=False)
    torch.manual_seed(8)
    dt, d, sc = torch.bfloat16, 64, 128
    q, k_cache, v_cache, k, v = make_inputs(dt, d, 3, 2, 2, sc, 8, 2, None, batch_cache=3)
    lens = torch.tensor([-7, sc - 1, 2**31 - 2], dtype=torch.int32, device="cuda")
    idx = torch.tensor([5, -2, 1], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                  cache_batch_idx=idx, causal=True,
                                  **rotary_kwargs("neox", 64, d, dt))
    torch.cuda.synchronize()
    assert out.shape == q.shape and torch.isfinite(out.float()).all()
    with pytest.raises(ValueError, match="(cache_seqlens|cache_batch_idx) was out of range"):
        flash_attn.check_bad_inputs()
    good = torch.tensor([3, 50, 0], dtype=torch.int32, device="cuda")
    check_against_cpu(q, k_cache, v_cache, k=k, v=v, cache_seqlens=good, causal=True,
                      cache_batch_idx=torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda"))


# ---------------------------------------------------------------------------------------------
# Errors leave CUDA usable
# ---------------------------------------------------------------------------------------------


def _i32(*shape):
    return torch.zeros(*shape, dtype=torch.int32, device="cuda")


def _all_fp32(a):
    return {n: a[n].float() for n in ("q", "k_cache", "v_cache", "k", "v")}


# (id, overrides of the good arguments, exception, argument the message names)
ERROR_CASES = [
    ("block_table_int64", lambda a: dict(block_table=_i32(2, 1).long()), TypeError,
     "block_table"),
    ("k_cache_expanded", lambda a: dict(k_cache=a["k_cache"][:1].expand_as(a["k_cache"])),
     ValueError, "k_cache"),
    ("cache_leftpad_int64", lambda a: dict(cache_leftpad=_i32(2).long()), TypeError,
     "cache_leftpad"),
    ("cache_leftpad_len3", lambda a: dict(cache_leftpad=_i32(3)), ValueError,
     "cache_leftpad"),
    ("num_splits", lambda a: dict(num_splits=4), NotImplementedError, "num_splits"),
    ("cache_seqlens_int64", lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), TypeError,
     "cache_seqlens"),
    ("k_without_v", lambda a: dict(v=None), ValueError, "v"),
    ("fp32_on_cuda", _all_fp32, TypeError, "q"),
]


@pytest.mark.parametrize("over,exc,name",
                         [pytest.param(o, e, n, id=i) for i, o, e, n in ERROR_CASES])
def test_error_then_cuda_works(over, exc, name):
    """A bad call (block_table, ...) raises a named Python error before touching the caches;
    the same caches then work in a good call, checked against the CPU path."""
    torch.manual_seed(3)
    lens = [10, 100]
    q, k_cache, v_cache, k, v = make_inputs(torch.bfloat16, 64, 2, 1, 1, 128, 8, 2, lens)
    good = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    bad = dict(good)
    bad.update(over(good))
    with pytest.raises(exc, match=arg_re(name)):
        flash_attn_with_kvcache(**bad)
    torch.cuda.synchronize()
    assert_cache_matches("k_cache", k_cache, kc0.cpu(), 0)
    assert_cache_matches("v_cache", v_cache, vc0.cpu(), 0)
    args = dict(good)
    check_against_cpu(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), causal=True,
                      **args)
    torch.cuda.synchronize()
