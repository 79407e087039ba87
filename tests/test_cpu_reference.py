"""flash_attn.reference against an independent, explicit float64 loop implementation.

The loop below spells out docs/INTERNALS.md literally (one query row at a time, explicit
``i + shift - left <= j <= i + shift + right`` test, explicit head mapping), so it shares no code
with the vectorized reference.
"""

import math

import pytest
import torch

from flash_attn.reference import (
    attention_backward_ref,
    attention_forward_ref,
    attention_probs_ref,
    keep_mask,
)


def naive_attention(q, k, v, scale=None, causal=False, left=-1, right=-1, softcap=0.0,
                    seqused_k=None):
    """q (b, sq, h, d), k/v (b, sk, hk, d), any float dtype -> out (b, sq, h, d) fp64,
    lse (b, h, sq) fp64, probs (b, h, sq, sk) fp64. Differentiable (plain torch ops)."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if causal:
        right = 0
    group = h // hk
    outs, lses, probs = [], [], []
    for bi in range(b):
        n_k = sk if seqused_k is None else int(seqused_k[bi])
        shift = n_k - sq
        out_b, lse_b, p_b = [], [], []
        for hi in range(h):
            kh = hi // group
            out_h, lse_h, p_h = [], [], []
            for i in range(sq):
                kept = [
                    j for j in range(sk)
                    if j < n_k
                    and (left < 0 or j >= i + shift - left)
                    and (right < 0 or j <= i + shift + right)
                ]
                row_p = torch.zeros(sk, dtype=torch.float64)
                if not kept:
                    out_h.append(torch.zeros(d, dtype=torch.float64))
                    lse_h.append(torch.tensor(float("inf"), dtype=torch.float64))
                    p_h.append(row_p)
                    continue
                idx = torch.tensor(kept)
                s = (k[bi, idx, kh] @ q[bi, i, hi]) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                lse = torch.logsumexp(s, dim=0)
                p = torch.exp(s - lse)
                out_h.append(p @ v[bi, idx, kh])
                lse_h.append(lse)
                row_p = row_p.index_put((idx,), p)
                p_h.append(row_p)
            out_b.append(torch.stack(out_h) if out_h else torch.zeros(0, d, dtype=torch.float64))
            lse_b.append(torch.stack(lse_h) if lse_h else torch.zeros(0, dtype=torch.float64))
            p_b.append(torch.stack(p_h) if p_h else torch.zeros(0, sk, dtype=torch.float64))
        outs.append(torch.stack(out_b, dim=1))  # (sq, h, d)
        lses.append(torch.stack(lse_b))
        probs.append(torch.stack(p_b))
    return torch.stack(outs), torch.stack(lses), torch.stack(probs)


def rand_qkv(b, sq, sk, h, hk, d, dtype=torch.float64, requires_grad=False):
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, d, dtype=dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def assert_lse_close(lse, lse_ref, atol, rtol):
    inf = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse), inf), "+inf rows differ"
    assert (lse[inf] > 0).all()
    torch.testing.assert_close(lse[~inf].double(), lse_ref[~inf], atol=atol, rtol=rtol)


# (b, sq, sk, h, hk, d, causal, left, right, softcap)
CASES = [
    (1, 1, 1, 1, 1, 8, False, -1, -1, 0.0),
    (2, 5, 5, 2, 2, 8, True, -1, -1, 0.0),
    (2, 3, 7, 4, 2, 8, True, -1, -1, 0.0),   # sq < sk, causal: shifted diagonal
    (2, 7, 3, 2, 1, 8, True, -1, -1, 0.0),   # sq > sk, causal: first rows fully masked
    (1, 6, 6, 3, 1, 4, False, 2, 1, 0.0),    # window
    (1, 4, 9, 2, 2, 8, False, 1, 2, 0.0),    # window, sq < sk
    (1, 9, 4, 2, 2, 8, False, 0, 0, 0.0),    # window (0, 0), sq > sk: masked rows
    (2, 5, 6, 4, 1, 16, True, 2, -1, 0.0),   # causal + left window, MQA
    (1, 5, 5, 2, 2, 8, False, -1, -1, 1.5),  # softcap
    (2, 4, 6, 6, 3, 12, True, 3, -1, 0.7),   # GQA + causal + window + softcap, odd headdim
    (1, 6, 2, 2, 2, 8, False, -1, 0, 0.0),   # right-only window, sq > sk
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_forward_matches_naive(case):
    torch.manual_seed(hash(case) % 2**31)
    b, sq, sk, h, hk, d, causal, left, right, softcap = case
    q, k, v = rand_qkv(b, sq, sk, h, hk, d)
    out, lse = attention_forward_ref(q, k, v, causal=causal, window_left=left,
                                     window_right=right, softcap=softcap)
    out_n, lse_n, probs_n = naive_attention(q, k, v, causal=causal, left=left, right=right,
                                            softcap=softcap)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    assert out.is_contiguous() and lse.is_contiguous()
    torch.testing.assert_close(out, out_n, atol=1e-10, rtol=1e-10)
    assert_lse_close(lse, lse_n, atol=1e-5, rtol=1e-6)
    probs = attention_probs_ref(q, k, lse, causal=causal, window_left=left,
                                window_right=right, softcap=softcap)
    torch.testing.assert_close(probs, probs_n, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_low_precision_dtypes(dtype):
    torch.manual_seed(1)
    q, k, v = rand_qkv(2, 5, 7, 4, 2, 8, dtype=dtype)
    out, lse = attention_forward_ref(q, k, v, causal=True, softcap=2.0)
    out_n, lse_n, _ = naive_attention(q, k, v, causal=True, softcap=2.0)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), out_n, atol=tol, rtol=tol)
    assert_lse_close(lse, lse_n, atol=1e-4, rtol=1e-5)


def test_fully_masked_rows_out_zero_lse_inf():
    torch.manual_seed(2)
    q, k, v = rand_qkv(1, 6, 2, 2, 1, 8, requires_grad=True)
    out, lse = attention_forward_ref(q, k, v, causal=True)
    # shift = -4: rows 0..3 see no key
    assert torch.all(out[:, :4] == 0)
    assert torch.all(torch.isposinf(lse[:, :, :4]))
    assert torch.isfinite(lse[:, :, 4:]).all()
    (out * torch.randn_like(out)).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :4] == 0)


def test_zero_keys():
    torch.manual_seed(3)
    q, k, v = rand_qkv(2, 3, 0, 2, 2, 8)
    out, lse = attention_forward_ref(q, k, v)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))


def test_default_scale_is_inverse_sqrt_headdim():
    torch.manual_seed(4)
    q, k, v = rand_qkv(1, 4, 5, 2, 2, 12)
    out, _ = attention_forward_ref(q, k, v)
    out2, _ = attention_forward_ref(q, k, v, softmax_scale=1 / math.sqrt(12))
    out3, _ = attention_forward_ref(q, k, v, softmax_scale=0.5)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    out_n, _, _ = naive_attention(q, k, v, scale=0.5)
    torch.testing.assert_close(out3, out_n)


def test_keep_mask_examples():
    # the FlashAttention-2 documented examples (bottom-right aligned causal)
    m = keep_mask(2, 5, causal=True).int()
    assert m.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    m = keep_mask(5, 2, causal=True).int()
    assert m.tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    m = keep_mask(3, 3, window_left=1, window_right=0).int()
    assert m.tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]


def test_seqused_k_batched():
    torch.manual_seed(5)
    q, k, v = rand_qkv(3, 4, 6, 2, 1, 8)
    used = torch.tensor([6, 2, 0], dtype=torch.int32)
    out, lse = attention_forward_ref(q, k, v, seqused_k=used, causal=True)
    out_n, lse_n, _ = naive_attention(q, k, v, causal=True, seqused_k=used)
    torch.testing.assert_close(out, out_n)
    assert_lse_close(lse, lse_n, atol=1e-5, rtol=1e-6)
    # keys beyond seqused_k do not matter
    k2, v2 = k.clone(), v.clone()
    k2[1, 2:] = torch.randn_like(k2[1, 2:])
    v2[1, 2:] = torch.randn_like(v2[1, 2:])
    out2, _ = attention_forward_ref(q, k2, v2, seqused_k=used, causal=True)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    # not even NaN or Inf there (an unused KV-cache slot holds anything)
    k2[1, 2:] = float("nan")
    v2[1, 2::2] = float("nan")
    v2[1, 3::2] = float("inf")
    out3, _ = attention_forward_ref(q, k2, v2, seqused_k=used, causal=True)
    torch.testing.assert_close(out, out3, atol=0, rtol=0)


def _varlen_from_lists(lens_q, lens_k, h, hk, d, requires_grad=False):
    q = torch.randn(sum(lens_q), h, d, dtype=torch.float64, requires_grad=requires_grad)
    k = torch.randn(sum(lens_k), hk, d, dtype=torch.float64, requires_grad=requires_grad)
    v = torch.randn(sum(lens_k), hk, d, dtype=torch.float64, requires_grad=requires_grad)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    return q, k, v, cu_q, cu_k


VARLEN_CASES = [
    # lens_q, lens_k, causal, left, right, softcap
    ([3, 0, 4], [5, 2, 0], True, -1, -1, 0.0),
    ([2, 5, 1], [2, 3, 6], False, 1, 1, 0.0),
    ([4, 3], [4, 3], True, 1, -1, 2.0),
    ([0, 0], [0, 3], False, -1, -1, 0.0),
    ([6], [2], True, -1, -1, 0.0),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[str(c) for c in VARLEN_CASES])
def test_varlen_matches_naive_per_sequence(case):
    torch.manual_seed(6)
    lens_q, lens_k, causal, left, right, softcap = case
    h, hk, d = 4, 2, 8
    q, k, v, cu_q, cu_k = _varlen_from_lists(lens_q, lens_k, h, hk, d)
    out, lse = attention_forward_ref(q, k, v, cu_q, cu_k, None, max(lens_q), max(lens_k),
                                     causal=causal, window_left=left, window_right=right,
                                     softcap=softcap)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    assert out.is_contiguous() and lse.is_contiguous()
    probs = attention_probs_ref(q, k, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                causal=causal, window_left=left, window_right=right,
                                softcap=softcap)
    assert probs.shape == (len(lens_q), h, max(lens_q), max(lens_k))
    for b in range(len(lens_q)):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
        out_n, lse_n, p_n = naive_attention(
            q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], causal=causal, left=left,
            right=right, softcap=softcap,
        )
        torch.testing.assert_close(out[q0:q1], out_n[0])
        assert_lse_close(lse[:, q0:q1], lse_n[0], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(probs[b, :, : q1 - q0, : k1 - k0], p_n[0], atol=1e-5,
                                   rtol=1e-5)
        assert torch.all(probs[b, :, q1 - q0:] == 0) and torch.all(probs[b, :, :, k1 - k0:] == 0)


def test_varlen_seqused_k():
    torch.manual_seed(7)
    q, k, v, cu_q, cu_k = _varlen_from_lists([3, 2], [5, 4], 2, 2, 8)
    used = torch.tensor([2, 0], dtype=torch.int32)
    out, lse = attention_forward_ref(q, k, v, cu_q, cu_k, used, 3, 5, causal=True)
    out_n, lse_n, _ = naive_attention(q[:3][None], k[:5][None], v[:5][None], causal=True,
                                      seqused_k=[2])
    torch.testing.assert_close(out[:3], out_n[0])
    assert torch.all(out[3:] == 0) and torch.all(torch.isposinf(lse[:, 3:]))


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[6], CASES[9]],
                         ids=["causal_sq<sk", "causal_sq>sk", "window00", "gqa_softcap"])
def test_backward_matches_autograd_of_naive(case):
    torch.manual_seed(8)
    b, sq, sk, h, hk, d, causal, left, right, softcap = case
    q, k, v = rand_qkv(b, sq, sk, h, hk, d, requires_grad=True)
    dout = torch.randn(b, sq, h, d, dtype=torch.float64)
    out_n, _, _ = naive_attention(q, k, v, causal=causal, left=left, right=right,
                                  softcap=softcap)
    gn = torch.autograd.grad(out_n, (q, k, v), dout)
    out, lse = attention_forward_ref(q, k, v, causal=causal, window_left=left,
                                     window_right=right, softcap=softcap)
    g = attention_backward_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                               causal=causal, window_left=left, window_right=right,
                               softcap=softcap)
    ga = torch.autograd.grad(out, (q, k, v), dout)  # autograd through the reference forward
    for x, y, z in zip(g, gn, ga):
        assert torch.isfinite(x).all() and torch.isfinite(z).all()
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(z, y, atol=1e-10, rtol=1e-10)


def test_backward_varlen_matches_autograd():
    torch.manual_seed(9)
    q, k, v, cu_q, cu_k = _varlen_from_lists([3, 0, 4], [5, 2, 1], 4, 1, 8, requires_grad=True)
    dout = torch.randn_like(q)
    out, lse = attention_forward_ref(q, k, v, cu_q, cu_k, None, 4, 5, causal=True, softcap=1.0)
    ga = torch.autograd.grad(out, (q, k, v), dout)
    g = attention_backward_ref(dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k,
                               4, 5, causal=True, softcap=1.0)
    for x, y in zip(g, ga):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)
    # k rows of batch 1 are only visible to its (empty) queries: zero grads there
    assert torch.all(g[1][5:7] == 0) and torch.all(g[2][5:7] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_backward_dtypes(dtype):
    torch.manual_seed(10)
    q, k, v = rand_qkv(1, 4, 5, 2, 1, 8, dtype=dtype)
    dout = torch.randn_like(q)
    out, lse = attention_forward_ref(q, k, v, causal=True)
    dq, dk, dv = attention_backward_ref(dout, q, k, v, out, lse, causal=True)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out_n, _, _ = naive_attention(q64, k64, v64, causal=True)
    gn = torch.autograd.grad(out_n, (q64, k64, v64), dout.double())
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for x, y in zip((dq, dk, dv), gn):
        torch.testing.assert_close(x.double(), y, atol=tol, rtol=tol)
