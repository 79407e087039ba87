"""GPU tests: the varlen API (cu_seqlens) and flash_attn.bert_padding against tests/attn_ref.py.

Sequence lengths are fixed lists with zero-length sequences on either side (queries with no keys:
out 0, lse +inf, zero dq; keys with no queries: zero dk, dv), seqlen_q != seqlen_k per sequence,
and lengths that are not multiples of any tile. Same accuracy rule as test_flash_attn_gpu.py.
"""

import itertools
import os
import sys
from typing import List, Sequence

import pytest
import torch

import flash_attn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import (  # noqa: E402
    REF_DTYPE,
    assert_accuracy,
    assert_backward_repeatable,
    assert_lse,
    attention_ref,
    check_fwd_bwd,
    check_seqused_k,
    compare_to_ref,
    plain_qkv,
    rand,
)
from attn_ref import kernel_path, poisoned_allocator  # noqa: E402,F401  (autouse fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from flash_attn import (
        flash_attn_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
    )
    from flash_attn.bert_padding import pad_input, unpad_input

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# name -> (seqlens_q, seqlens_k), one entry per sequence of the batch
LENGTHS = {
    "mixed": ([5, 0, 130, 1, 64, 300], [7, 3, 0, 1, 200, 257]),
    "long": ([0, 17, 1, 128, 255], [0, 256, 1000, 128, 31]),
    "many": ([(7 * i) % 23 for i in range(40)], [(5 * i + 3) % 29 for i in range(40)]),
}
EQUAL_LENGTHS = {
    "mixed": [5, 0, 130, 1, 64, 300],
    "many": [(7 * i) % 23 for i in range(40)],
    "single": [777],
}


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def api_kwargs(causal=False, window=(-1, -1), softcap=0.0, scale=None):
    return dict(dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=window,
                softcap=softcap)


def ref_kwargs(causal=False, window=(-1, -1), softcap=0.0, scale=None):
    return dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=scale)


def _varlen_cases():
    cases = []
    for lens, d, causal in itertools.product(LENGTHS, (64, 128, 256), (False, True)):
        cases.append(("bf16", lens, d, 1, causal, (-1, -1), 0.0, None))
    for lens, d, causal in itertools.product(("mixed", "long"), (40, 96), (False, True)):
        cases.append(("fp16", lens, d, 1, causal, (-1, -1), 0.0, None))
    for ratio, lens, causal in itertools.product((2, 4, 8), ("mixed", "long"), (False, True)):
        cases.append(("bf16", lens, 128, ratio, causal, (-1, -1), 0.0, None))
    for lens, (causal, window) in itertools.product(("mixed", "long"),
                                                    ((False, (64, 32)), (True, (32, 0)))):
        cases.append(("bf16", lens, 64, 2, causal, window, 0.0, None))
    for lens, causal in itertools.product(("mixed", "many"), (False, True)):
        cases.append(("bf16", lens, 128, 1, causal, (-1, -1), 30.0, 1.0))
    # The wide tile's unequal column parts (d = 160, 224; 200 is clipped inside the 224 tier),
    # whose partial varlen tiles go out in 16-byte pieces, and GQA on it.
    for lens, d, causal in itertools.product(("mixed", "long"), (160, 200), (False, True)):
        cases.append(("bf16", lens, d, 1, causal, (-1, -1), 0.0, None))
    cases.append(("fp16", "mixed", 224, 4, True, (-1, -1), 0.0, None))
    out = []
    for dt, lens, d, ratio, causal, window, cap, scale in cases:
        tag = [dt, lens, f"d{d}", f"g{ratio}"]
        if causal:
            tag.append("causal")
        if window != (-1, -1):
            tag.append(f"win{window[0]}_{window[1]}")
        if cap:
            tag.append(f"cap{cap:g}")
        out.append(pytest.param(dt, lens, d, ratio, causal, window, cap, scale, id="-".join(tag)))
    return out


@pytest.mark.parametrize("dtype,lens,d,ratio,causal,window,softcap,scale", _varlen_cases())
def test_varlen_fwd_bwd(dtype, lens, d, ratio, causal, window, softcap, scale):
    torch.manual_seed(20)
    dt = DTYPES[dtype]
    lq, lk = LENGTHS[lens]
    h = 8 if ratio > 1 else 4
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), h, d, dtype=dt)
    k = rand(sum(lk), h // ratio, d, dtype=dt)
    v = rand(sum(lk), h // ratio, d, dtype=dt)
    opts = api_kwargs(causal, window, softcap, scale)
    rk = dict(ref_kwargs(causal, window, softcap, scale), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

    def ours(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(lq), max_seqlen_k=max(lk), **opts)

    check_fwd_bwd(ours, [q, k, v], plain_qkv, rk)


@pytest.mark.parametrize("pack", ["0", "1"])
@pytest.mark.parametrize("dtype,lens,d,ratio,causal,window,softcap,scale",
                         [c for c in _varlen_cases() if c.values[3] > 1])
def test_varlen_gqa_packing(dtype, lens, d, ratio, causal, window, softcap, scale, pack,
                            monkeypatch):
    """The varlen GQA cases with the SM90 forward's GQA packing forced on and off."""
    monkeypatch.setenv("FLASH_ATTN_PACK_GQA", pack)
    test_varlen_fwd_bwd(dtype, lens, d, ratio, causal, window, softcap, scale)


@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_deterministic(d, causal):
    """deterministic=True with varlen (sequences of different key-tile counts, an empty one,
    queries fewer than keys): 5 backward runs are bitwise equal, and the gradients pass the
    accuracy rule."""
    torch.manual_seed(22)
    lq, lk = [300, 0, 1029, 77, 513], [700, 5, 1029, 1300, 513]
    h, hk = 4, 2
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), h, d, dtype=torch.bfloat16)
    k = rand(sum(lk), hk, d, dtype=torch.bfloat16)
    v = rand(sum(lk), hk, d, dtype=torch.bfloat16)

    def ours(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=causal,
                                      deterministic=True)

    check_fwd_bwd(ours, [q, k, v], plain_qkv,
                  dict(ref_kwargs(causal), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    assert_backward_repeatable(ours(q, k, v), (q, k, v), 5)


@pytest.mark.parametrize("lens", list(LENGTHS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_lse(lens, causal):
    torch.manual_seed(21)
    lq, lk = LENGTHS[lens]
    h, hk, d = 6, 2, 64
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), h, d, dtype=torch.bfloat16, requires_grad=False)
    k = rand(sum(lk), hk, d, dtype=torch.bfloat16, requires_grad=False)
    v = rand(sum(lk), hk, d, dtype=torch.bfloat16, requires_grad=False)
    res = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=causal,
                                 return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3, "return_attn_probs=True: (out, lse, probs)"
    out, lse, _ = res
    assert tuple(lse.shape) == (h, sum(lq)), tuple(lse.shape)
    rk = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out_ref, lse_ref = attention_ref(q, k, v, compute_dtype=REF_DTYPE, **rk)
    out_pt, _ = attention_ref(q, k, v, compute_dtype=q.dtype, **rk)
    assert_accuracy("out", out, out_ref, out_pt, 2)
    assert_lse("softmax_lse", lse, lse_ref)


@pytest.mark.parametrize("lens", list(EQUAL_LENGTHS))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_qkvpacked(lens, d, causal):
    torch.manual_seed(22)
    ls = EQUAL_LENGTHS[lens]
    cu = cu_seqlens(ls)
    qkv = rand(sum(ls), 3, 4, d, dtype=torch.bfloat16)
    unpack = lambda qkv: (qkv[:, 0], qkv[:, 1], qkv[:, 2])  # noqa: E731
    check_fwd_bwd(
        lambda qkv: flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens=cu, max_seqlen=max(ls),
                                                     causal=causal),
        [qkv], unpack, dict(causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu))


@pytest.mark.parametrize("lens", ["mixed", "long"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_kvpacked(lens, causal):
    torch.manual_seed(23)
    lq, lk = LENGTHS[lens]
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), 4, 96, dtype=torch.float16)
    kv = rand(sum(lk), 2, 2, 96, dtype=torch.float16)
    unpack = lambda q, kv: (q, kv[:, 0], kv[:, 1])  # noqa: E731
    check_fwd_bwd(
        lambda q, kv: flash_attn_varlen_kvpacked_func(
            q, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
            max_seqlen_k=max(lk), causal=causal),
        [q, kv], unpack, dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


def test_varlen_equal_lengths_match_batched():
    """All sequences the same length: varlen and the batched API agree (both within the rule)."""
    torch.manual_seed(24)
    b, s, h, d = 3, 200, 4, 128
    q, k, v = (rand(b, s, h, d, dtype=torch.bfloat16, requires_grad=False) for _ in range(3))
    cu = cu_seqlens([s] * b)
    out_b = flash_attn_func(q, k, v, causal=True)
    out_v = flash_attn_varlen_func(q.reshape(b * s, h, d), k.reshape(b * s, h, d),
                                   v.reshape(b * s, h, d), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   max_seqlen_q=s, max_seqlen_k=s, causal=True)
    out_ref, _ = attention_ref(q, k, v, causal=True, compute_dtype=REF_DTYPE)
    out_pt, _ = attention_ref(q, k, v, causal=True, compute_dtype=q.dtype)
    assert_accuracy("out (batched)", out_b, out_ref, out_pt, 2)
    assert_accuracy("out (varlen)", out_v.reshape(b, s, h, d), out_ref, out_pt, 2)


# ---------------------------------------------------------------------------------------------
# flash_attn.bert_padding
# ---------------------------------------------------------------------------------------------


def _unpad(x, mask):
    """unpad_input returns (x_unpad, indices, cu_seqlens, max_seqlen[, seqused]) depending on
    the FlashAttention-2 version it follows; the first four are what these tests rely on."""
    res = unpad_input(x, mask)
    x_unpad, indices, cu, max_seqlen = res[:4]
    return x_unpad, indices, cu, int(max_seqlen)


def prefix_mask(lengths: List[int], seqlen: int) -> torch.Tensor:
    lens = torch.tensor(lengths, device="cuda")
    return torch.arange(seqlen, device="cuda").unsqueeze(0) < lens.unsqueeze(1)


def test_unpad_pad_roundtrip():
    torch.manual_seed(25)
    b, s, h, d = 5, 77, 3, 16
    mask = torch.rand(b, s, device="cuda") < 0.6  # arbitrary (not prefix) mask
    mask[1] = False  # an empty sequence
    mask[2] = True  # a full one
    x = rand(b, s, h, d, dtype=torch.bfloat16)
    x_unpad, indices, cu, max_seqlen = _unpad(x, mask)
    lens = mask.sum(dim=1)
    assert cu.dtype == torch.int32 and cu.device == x.device
    assert cu.tolist() == [0] + torch.cumsum(lens, 0).tolist()
    assert max_seqlen == int(lens.max())
    assert torch.equal(x_unpad, x[mask])
    x_pad = pad_input(x_unpad, indices, b, s)
    assert x_pad.shape == x.shape
    assert torch.equal(x_pad, x.detach() * mask[:, :, None, None])
    # Gradients flow back through both index ops: 1 where kept, 0 where padded.
    (g,) = torch.autograd.grad(x_pad.float().sum(), x)
    assert torch.equal(g, mask[:, :, None, None].expand_as(g).to(g.dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_unpad_varlen_pad_matches_batched(causal, ratio):
    """Padded batch + key padding mask -> unpad_input -> varlen -> pad_input equals, at the kept
    query rows, the batched flash_attn_func run on each sequence without its padding; padded
    query rows come back as 0 and padded positions get zero gradients."""
    torch.manual_seed(26)
    b, sq, sk, h, d = 4, 150, 181, 4, 64
    lq, lk = [150, 77, 1, 0], [181, 100, 20, 9]
    dt = torch.bfloat16
    q = rand(b, sq, h, d, dtype=dt)
    k = rand(b, sk, h // ratio, d, dtype=dt)
    v = rand(b, sk, h // ratio, d, dtype=dt)
    mq, mk = prefix_mask(lq, sq), prefix_mask(lk, sk)

    q_u, idx_q, cu_q, max_q = _unpad(q, mq)
    k_u, idx_k, cu_k, max_k = _unpad(k, mk)
    v_u, _, _, _ = _unpad(v, mk)
    assert (max_q, max_k) == (max(lq), max(lk))
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal)
    out = pad_input(out_u, idx_q, b, sq)
    assert out.shape == q.shape
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    # Padded positions: out 0, gradients 0 (exactly: nothing flows to them).
    pad_q, pad_k = ~mq[:, :, None, None], ~mk[:, :, None, None]
    assert not out.masked_select(pad_q).any()
    assert not dq.masked_select(pad_q).any()
    assert not dk.masked_select(pad_k).any() and not dv.masked_select(pad_k).any()

    for i in range(b):
        if lq[i] == 0:
            continue
        sl_q, sl_k = (i, slice(0, lq[i])), (i, slice(0, lk[i]))
        leaves = [q[sl_q].detach().unsqueeze(0), k[sl_k].detach().unsqueeze(0),
                  v[sl_k].detach().unsqueeze(0)]
        # varlen path, per sequence, against the reference
        compare_to_ref(out[sl_q].unsqueeze(0),
                       [dq[sl_q].unsqueeze(0), dk[sl_k].unsqueeze(0), dv[sl_k].unsqueeze(0)],
                       leaves, plain_qkv, dict(causal=causal), dout[sl_q].unsqueeze(0),
                       tag=f" (varlen, sequence {i})")
        # the batched API on the same unpadded sequence agrees
        lv = [x.clone().requires_grad_() for x in leaves]
        out_b = flash_attn_func(*lv, causal=causal)
        g_b = torch.autograd.grad(out_b, lv, dout[sl_q].unsqueeze(0))
        compare_to_ref(out_b, g_b, leaves, plain_qkv, dict(causal=causal),
                       dout[sl_q].unsqueeze(0), tag=f" (batched, sequence {i})")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_keys_of_other_sequences_do_not_leak(d, causal):
    """The kernels read whole key blocks, so a sequence's last block overlaps the next
    sequence's rows. Those rows hold NaN and Inf here (sequences without queries, so no output
    depends on them): no other sequence's output may see them."""
    torch.manual_seed(22)
    lq, lk = [130, 0, 64, 0], [200, 50, 257, 90]
    h = 4
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), h, d, dtype=torch.bfloat16, requires_grad=False)
    k = rand(sum(lk), h, d, dtype=torch.bfloat16, requires_grad=False)
    v = rand(sum(lk), h, d, dtype=torch.bfloat16, requires_grad=False)
    k_ref, v_ref = k.clone(), v.clone()
    for i in (1, 3):
        lo, hi = int(cu_k[i]), int(cu_k[i + 1])
        k[lo:hi] = float("nan")
        v[lo:hi:2] = float("nan")
        v[lo + 1:hi:2] = float("inf")
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=causal)
    rk = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out_ref, _ = attention_ref(q, k_ref, v_ref, compute_dtype=REF_DTYPE, **rk)
    out_pt, _ = attention_ref(q, k_ref, v_ref, compute_dtype=q.dtype, **rk)
    assert_accuracy("out", out, out_ref, out_pt, 2)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_seqused_k_ignores_unused_cache_rows(d):
    """seqused_k (internal op; a KV cache filled up to a per-sequence length): the rows past it
    hold NaN and must not reach the output."""
    torch.manual_seed(23)
    b, sq, sk, h = 3, 64, 300, 4
    q = rand(b, sq, h, d, dtype=torch.bfloat16, requires_grad=False)
    k = rand(b, sk, h, d, dtype=torch.bfloat16, requires_grad=False)
    v = rand(b, sk, h, d, dtype=torch.bfloat16, requires_grad=False)
    check_seqused_k(q, k, v, [300, 1, 123], causal=False, check_lse=False)


def to_pages(x: torch.Tensor, lengths: Sequence[int], page: int, perm: List[int]):
    """Varlen keys x (sum(lengths), hk, d) in pages (len(perm), page, hk, d), sequence b's
    block i in page perm[b * width + i] (width: the most blocks a sequence needs); rows past
    a sequence's keys and unused pages hold NaN. Returns the pages and the block table."""
    width = max(1, max(-(-n // page) for n in lengths))
    table = torch.tensor(perm[:len(lengths) * width], dtype=torch.int32,
                         device=x.device).reshape(len(lengths), width)
    pages = torch.full((len(perm), page, *x.shape[1:]), float("nan"), dtype=x.dtype,
                       device=x.device)
    start = 0
    for b, n in enumerate(lengths):
        for i in range(0, n, page):
            m = min(page, n - i)
            pages[int(table[b, i // page]), :m] = x[start + i:start + i + m]
        start += n
    return pages, table


@pytest.mark.parametrize("pack", ["default", "unpacked"])
@pytest.mark.parametrize("d,page", [(64, 16), (64, 64), (64, 128), (128, 1), (128, 48),
                                    (128, 128), (128, 256), (256, 256), (256, 320)])
@pytest.mark.parametrize("lens", ["mixed", "long"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_paged(causal, lens, d, page, pack, monkeypatch):
    """flash_attn_varlen_func with block_table: the keys of LENGTHS in shuffled pages (rows
    past a sequence's keys NaN) against the reference on the varlen keys. The SM90 kernels
    read pages of a multiple of 8 rows (by key blocks where a page holds whole ones: 128 rows
    to d=128, 80 to d=256), the SM80 kernels the others. unpacked: FLASH_ATTN_PACK_GQA=0."""
    if pack == "unpacked":
        monkeypatch.setenv("FLASH_ATTN_PACK_GQA", "0")
    torch.manual_seed(23)
    lq, lk = LENGTHS[lens]
    h, hk, dt = 6, 2, torch.bfloat16
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), h, d, dtype=dt, requires_grad=False)
    k = rand(sum(lk), hk, d, dtype=dt, requires_grad=False)
    v = rand(sum(lk), hk, d, dtype=dt, requires_grad=False)
    width = max(1, max(-(-n // page) for n in lk))
    perm = torch.randperm(len(lk) * width + 3).tolist()
    k_pages, table = to_pages(k, lk, page, perm)
    v_pages, _ = to_pages(v, lk, page, perm)
    out = flash_attn_varlen_func(q, k_pages, v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=causal,
                                 block_table=table)
    rk = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out_ref, _ = attention_ref(q, k, v, compute_dtype=REF_DTYPE, **rk)
    out_pt, _ = attention_ref(q, k, v, compute_dtype=q.dtype, **rk)
    assert_accuracy("out", out, out_ref, out_pt, 2)


def test_varlen_paged_inconsistent_lengths():
    """Unvalidated cu_seqlens_k of a paged call (not starting at 0, a sequence longer than its
    table row, a decreasing offset), through the op without the Python checks: no fault, the
    kernels count each sequence's keys as the CPU op does (clamped offsets, at most
    min(max_seqlen_k, the row's capacity)), and they record a bad value (check_bad_inputs
    raises it)."""
    from flash_attn import ops

    torch.manual_seed(24)
    h, hk, d, page, dt = 4, 2, 64, 64, torch.bfloat16
    q = rand(30, h, d, dtype=dt, requires_grad=False)
    k_pages = rand(7, page, hk, d, dtype=dt, requires_grad=False)
    v_pages = rand(7, page, hk, d, dtype=dt, requires_grad=False)
    table = torch.tensor([[4, 1], [0, 6], [2, 3]], dtype=torch.int32, device="cuda")
    cu_q = cu_seqlens([10, 10, 10])
    cu_k = torch.tensor([3, 10, 300, 5], dtype=torch.int32, device="cuda")
    args = (None, 10, 200, d ** -0.5, False, -1, -1, 0.0, False, None, table)
    out, lse = ops.flash_attn_fwd(q, k_pages, v_pages, cu_q, cu_k, *args)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="(cu_seqlens_k|max_seqlen_k) was out of range"):
        flash_attn.check_bad_inputs()
    cpu = [x.cpu().double() if x.is_floating_point() else x.cpu()
           for x in (q, k_pages, v_pages, cu_q, cu_k)]
    out_ref, lse_ref = ops.flash_attn_fwd(*cpu, None, 10, 200, d ** -0.5, False, -1, -1, 0.0,
                                          False, None, table.cpu())
    torch.testing.assert_close(out.double().cpu(), out_ref, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double().cpu(), lse_ref.double(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("per_batch", [False, True], ids=["per_head", "per_batch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", ["mixed", "long"])
def test_varlen_alibi(lens, causal, per_batch):
    """ALiBi on varlen sequences (each aligned to its own lengths; (batch, nheads) slopes take
    row b for sequence b), GQA 8:4, forward + backward."""
    torch.manual_seed(21)
    dt, d, h = torch.bfloat16, 128, 8
    lq, lk = LENGTHS[lens]
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = rand(sum(lq), h, d, dtype=dt)
    k = rand(sum(lk), h // 2, d, dtype=dt)
    v = rand(sum(lk), h // 2, d, dtype=dt)
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(h)], device="cuda")
    if per_batch:
        slopes = slopes[None, :] * torch.linspace(0.5, 2.0, len(lq), device="cuda")[:, None]
    rk = dict(ref_kwargs(causal, (-1, -1), 0.0, None), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              alibi_slopes=slopes)

    def ours(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=causal,
                                      alibi_slopes=slopes)

    check_fwd_bwd(ours, [q, k, v], plain_qkv, rk)
