"""FlashAttention-2's modules beyond attention: flash_attn.layers.rotary,
flash_attn.ops.triton.rotary, the rest of flash_attn.bert_padding, the flash_attn.ops package,
and the ImportError of the FlashAttention-2 modules this package does not provide.

The rotary functions are checked against an independent float64 rotation written here with
complex numbers: pair (a, b) of a head is a + ib, and the rotation multiplies it by
cos + i sin (conjugated for the inverse)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Optional, Union

import pytest
import torch
from torch import Tensor

from flash_attn.bert_padding import (
    index_first_axis_residual,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
from flash_attn.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
    rotate_half,
)
from flash_attn.ops.triton.rotary import apply_rotary

REPO = Path(__file__).resolve().parent.parent
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# --------------------------------------------------------------------------------------------
# Independent float64 rotary
# --------------------------------------------------------------------------------------------


def rotate64(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool,
             conjugate: bool = False) -> Tensor:
    """x (..., nheads, headdim) with rows at positions pos (...) rotated, in float64; positions
    outside the tables stay unrotated."""
    x = x.double()
    half = cos.shape[1]
    rd = 2 * half
    table = torch.complex(cos.double(), sin.double())
    table = torch.cat((table, torch.ones(1, half, dtype=table.dtype, device=table.device)))
    outside = (pos < 0) | (pos >= cos.shape[0])
    idx = torch.where(outside, cos.shape[0], pos).long()
    rot = table[idx].unsqueeze(-2)  # (..., 1, half)
    if conjugate:
        rot = rot.conj()
    if interleaved:
        z = torch.complex(x[..., 0:rd:2], x[..., 1:rd:2]) * rot
        pairs = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        z = torch.complex(x[..., :half], x[..., half:rd]) * rot
        pairs = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((pairs, x[..., rd:]), dim=-1)


def batch_positions(batch: int, seqlen: int, offsets: Union[int, Tensor]) -> Tensor:
    pos = torch.arange(seqlen).expand(batch, seqlen)
    if isinstance(offsets, Tensor):
        return pos + offsets.cpu().long()[:, None]
    return pos + offsets


def varlen_positions(cu: list, total: int, offsets: Union[int, Tensor]) -> Tensor:
    """Positions of a varlen x written row by row (-1 outside every sequence)."""
    pos = torch.full((total,), -1, dtype=torch.long)
    for b in range(len(cu) - 1):
        off = int(offsets[b]) if isinstance(offsets, Tensor) else offsets
        for t in range(cu[b], cu[b + 1]):
            pos[t] = t - cu[b] + off
    return pos


def tables(seqlen_ro: int, rotary_dim: int, dtype=torch.float32, device="cpu"):
    """Random (not unit-norm) tables: the rotation is linear in (cos, sin), so any values
    exercise every term."""
    g = torch.Generator().manual_seed(seqlen_ro * 1000 + rotary_dim)
    cos = torch.randn(seqlen_ro, rotary_dim // 2, generator=g, dtype=torch.float64)
    sin = torch.randn(seqlen_ro, rotary_dim // 2, generator=g, dtype=torch.float64)
    return cos.to(device, dtype), sin.to(device, dtype)


TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float64: dict(atol=1e-12, rtol=0),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=2e-3),
}


def close(out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), **TOL[dtype])


# --------------------------------------------------------------------------------------------
# apply_rotary_emb / apply_rotary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor32", "tensor64"])
def test_apply_rotary_emb(device, dtype, interleaved, rotary_fraction, offsets):
    torch.manual_seed(0)
    b, s, h, d = 3, 11, 4, 32
    rd = int(d * rotary_fraction)
    seqlen_ro = 20
    cos, sin = tables(seqlen_ro, rd, dtype, device)
    off = {"zero": 0, "int": 5,
           "tensor32": torch.tensor([0, 9, 3], dtype=torch.int32, device=device),
           "tensor64": torch.tensor([4, 0, 9], dtype=torch.int64, device=device)}[offsets]
    x = torch.randn(b, s, h, d, device=device, dtype=dtype)
    x0 = x.clone()
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
    ref = rotate64(x, cos, sin, batch_positions(b, s, off).to(device), interleaved)
    close(out, ref, dtype)
    assert torch.equal(x, x0)  # out of place leaves x alone
    assert torch.equal(out[..., rd:], x[..., rd:])  # the dims past rotary_dim pass through
    assert apply_rotary_emb_func is apply_rotary_emb


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_apply_rotary_emb_varlen(device, interleaved, offsets):
    torch.manual_seed(1)
    lengths = [5, 0, 9, 1, 4]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1] + 2  # two trailing rows outside every sequence stay unrotated
    h, d, rd = 3, 16, 12
    cos, sin = tables(16, rd, torch.float32, device)
    off = {"zero": 0, "int": 2,
           "tensor": torch.tensor([0, 3, 7, 15, 1], dtype=torch.int32, device=device)}[offsets]
    x = torch.randn(total, h, d, device=device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off,
                           cu_seqlens=cu_t, max_seqlen=max(lengths))
    ref = rotate64(x, cos, sin, varlen_positions(cu, total, off).to(device), interleaved)
    close(out, ref, torch.float32)
    assert torch.equal(out[cu[-1]:], x[cu[-1]:])
    # Positions restart at each sequence: sequence 2 equals a batched call on it alone.
    seq = x[cu[2]:cu[3]].unsqueeze(0)
    off2 = off if isinstance(off, int) else off[2:3]
    alone = apply_rotary_emb(seq, cos, sin, interleaved=interleaved, seqlen_offsets=off2)
    torch.testing.assert_close(out[cu[2]:cu[3]], alone[0])
    # max_seqlen is optional here (FlashAttention-2 requires it); the result is the same.
    no_max = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off,
                              cu_seqlens=cu_t)
    torch.testing.assert_close(no_max, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("varlen", [False, True])
def test_apply_rotary_emb_inplace(device, interleaved, varlen):
    torch.manual_seed(2)
    cos, sin = tables(12, 8, torch.float32, device)
    if varlen:
        x = torch.randn(10, 2, 12, device=device)
        kw = dict(cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32, device=device),
                  max_seqlen=6)
    else:
        x = torch.randn(2, 7, 3, 12, device=device)
        kw = {}
    expected = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=3, **kw)
    tail = x[..., 8:].clone()
    ptr = x.data_ptr()
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=3,
                           **kw)
    assert out is x and x.data_ptr() == ptr
    torch.testing.assert_close(x, expected)
    assert torch.equal(x[..., 8:], tail)


def test_apply_rotary_conjugate_and_positions_outside_tables():
    torch.manual_seed(3)
    cos, sin = tables(8, 16)
    x = torch.randn(2, 6, 2, 16)
    # conjugate=True is the inverse rotation when each (cos, sin) is a unit complex number.
    ang = torch.rand(8, 8) * 6.0
    cu, su = torch.cos(ang), torch.sin(ang)
    y = apply_rotary(x, cu, su, seqlen_offsets=2)
    torch.testing.assert_close(apply_rotary(y, cu, su, seqlen_offsets=2, conjugate=True), x)
    ref = rotate64(x, cos, sin, batch_positions(2, 6, 1), False, conjugate=True)
    close(apply_rotary(x, cos, sin, seqlen_offsets=1, conjugate=True), ref, torch.float32)
    # A tensor offset may run past the tables: those rows are left unrotated (as
    # FlashAttention-2's kernel leaves them).
    off = torch.tensor([0, 5])
    out = apply_rotary(x, cos, sin, seqlen_offsets=off)
    close(out, rotate64(x, cos, sin, batch_positions(2, 6, off), False), torch.float32)
    assert torch.equal(out[1, 3:], x[1, 3:])


def test_apply_rotary_rejects_what_flash_attention_2_rejects():
    cos, sin = tables(8, 8)
    x = torch.randn(2, 6, 2, 8)
    with pytest.raises(ValueError, match="exceeds"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=3)  # 3 + 6 > 8
    with pytest.raises(ValueError, match="longer than"):
        apply_rotary_emb(torch.randn(1, 9, 2, 8), cos, sin)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(torch.randn(2, 6, 2, 6), cos, sin)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary_emb(x, cos, sin[:, :2])
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="total_seqlen"):
        apply_rotary_emb(x, cos, sin, cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
                         max_seqlen=2)


def test_apply_rotary_emb_torch_and_rotate_half():
    torch.manual_seed(4)
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    cos, sin = tables(5, 12, torch.float64)
    for interleaved in (False, True):
        ref = rotate64(x, cos, sin, batch_positions(2, 5, 0), interleaved)
        torch.testing.assert_close(apply_rotary_emb_torch(x, cos, sin, interleaved), ref)
        # Per-batch tables (batch, seqlen, rotary_dim / 2).
        torch.testing.assert_close(
            apply_rotary_emb_torch(x, cos.expand(2, 5, 6), sin.expand(2, 5, 6), interleaved), ref)
    v = torch.arange(4.0)
    assert rotate_half(v).tolist() == [-2.0, -3.0, 0.0, 1.0]
    assert rotate_half(v, interleaved=True).tolist() == [-1.0, 0.0, -3.0, 2.0]


# --------------------------------------------------------------------------------------------
# Packed qkv / kv
# --------------------------------------------------------------------------------------------


def _qkv_parts(qkv: Tensor, num_heads_q: Optional[int]):
    if qkv.dim() == 5:
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    hk = (qkv.shape[2] - num_heads_q) // 2
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + hk], \
        qkv[:, :, num_heads_q + hk:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["5d", "5d_strided", "gqa", "mqa"])
@pytest.mark.parametrize("separate_k_tables", [False, True])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
def test_apply_rotary_emb_qkv_(device, layout, separate_k_tables, interleaved, offsets):
    torch.manual_seed(5)
    b, s, d, rd = 2, 7, 16, 8
    num_heads_q = None
    if layout == "5d":
        qkv = torch.randn(b, s, 3, 4, d, device=device)
    elif layout == "5d_strided":  # heads not adjacent to the (3,) axis: q and k rotate apart
        qkv = torch.randn(b, s, 4, 3, d, device=device).transpose(2, 3)
    else:
        num_heads_q, hk = (6, 2) if layout == "gqa" else (4, 1)
        qkv = torch.randn(b, s, num_heads_q + 2 * hk, d, device=device)
    cos, sin = tables(12, rd, torch.float32, device)
    cos_k, sin_k = (tables(13, rd, torch.float32, device) if separate_k_tables
                    else (None, None))
    off = 3 if offsets == "int" else torch.tensor([1, 4], device=device)
    q0, k0, v0 = (t.clone() for t in _qkv_parts(qkv, num_heads_q))
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=interleaved,
                                seqlen_offsets=off, num_heads_q=num_heads_q)
    assert out is qkv
    q, k, v = _qkv_parts(qkv, num_heads_q)
    pos = batch_positions(b, s, off).to(device)
    close(q, rotate64(q0, cos, sin, pos, interleaved), torch.float32)
    close(k, rotate64(k0, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, pos,
                      interleaved), torch.float32)
    assert torch.equal(v, v0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_apply_rotary_emb_kv_(device, interleaved):
    torch.manual_seed(6)
    kv = torch.randn(2, 5, 2, 3, 16, device=device)
    cos, sin = tables(9, 16, torch.float32, device)
    k0, v0 = kv[:, :, 0].clone(), kv[:, :, 1].clone()
    off = torch.tensor([0, 4], device=device)
    assert apply_rotary_emb_kv_(kv, cos, sin, interleaved=interleaved, seqlen_offsets=off) is kv
    close(kv[:, :, 0], rotate64(k0, cos, sin, batch_positions(2, 5, off).to(device),
                                interleaved), torch.float32)
    assert torch.equal(kv[:, :, 1], v0)


def test_packed_layouts_are_checked():
    cos, sin = tables(8, 8)
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.randn(1, 4, 6, 8), cos, sin)
    with pytest.raises(ValueError, match="heads"):
        apply_rotary_emb_qkv_(torch.randn(1, 4, 7, 8), cos, sin, num_heads_q=4)
    with pytest.raises(ValueError, match="kv must be"):
        apply_rotary_emb_kv_(torch.randn(1, 4, 3, 2, 8), cos, sin)


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_gradcheck_float64(interleaved):
    torch.manual_seed(7)
    cos, sin = tables(10, 6, torch.float64)
    off = torch.tensor([2, 0])
    x = torch.randn(2, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb(t, cos, sin, interleaved=interleaved, seqlen_offsets=off),
        (x,))
    # In place: on a copy (autograd forbids in-place writes to a leaf).
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb(t.clone(), cos, sin, interleaved=interleaved, inplace=True,
                                   seqlen_offsets=1), (x,))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    xv = torch.randn(8, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb(t, cos, sin, interleaved=interleaved, seqlen_offsets=off,
                                   cu_seqlens=cu, max_seqlen=4), (xv,))
    qkv = torch.randn(2, 4, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    cos_k, sin_k = tables(10, 6, torch.float64)
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb_qkv_(t.clone(), cos, sin, cos_k * 0.5, sin_k,
                                        interleaved=interleaved, seqlen_offsets=off), (qkv,))
    gqa = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb_qkv_(t.clone(), cos, sin, interleaved=interleaved,
                                        seqlen_offsets=2, num_heads_q=4), (gqa,))
    kv = torch.randn(2, 4, 2, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb_kv_(t.clone(), cos, sin, interleaved=interleaved,
                                       seqlen_offsets=off), (kv,))


def test_backward_is_rotation_by_minus_sin():
    torch.manual_seed(8)
    cos, sin = tables(9, 8)
    x = torch.randn(2, 5, 2, 12, requires_grad=True)
    g = torch.randn(2, 5, 2, 12)
    apply_rotary_emb(x * 1.0, cos, sin, inplace=True, seqlen_offsets=2).backward(g)
    ref = rotate64(g, cos, sin, batch_positions(2, 5, 2), False, conjugate=True)
    close(x.grad, ref, torch.float32)
    # The incoming gradient is not modified (it may be shared with other consumers).
    g_copy = g.clone()
    qkv = torch.randn(2, 5, 3, 2, 12, requires_grad=True)
    gq = torch.randn(2, 5, 3, 2, 12)
    gq_copy = gq.clone()
    apply_rotary_emb_qkv_(qkv * 1.0, cos, sin).backward(gq)
    assert torch.equal(gq, gq_copy) and torch.equal(g, g_copy)
    assert torch.equal(qkv.grad[:, :, 2], gq[:, :, 2])


# --------------------------------------------------------------------------------------------
# RotaryEmbedding
# --------------------------------------------------------------------------------------------


def embedding_tables(dim: int, seqlen: int, base: float, scale_base: Optional[float]):
    """float64 (cos, sin, cos_k, sin_k) tables for seqlen positions, from the formulas."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(seqlen, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cos(ang), torch.sin(ang)
    if scale_base is None:
        return cos, sin, cos, sin
    scale = (torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    power = (torch.arange(seqlen, dtype=torch.float64) - seqlen // 2) / scale_base
    decay = scale ** power[:, None]
    return cos * decay, sin * decay, cos / decay, sin / decay


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("scale_base", [None, 16.0], ids=["rope", "xpos"])
@pytest.mark.parametrize("layout", ["qkv", "gqa", "q_kv"])
def test_rotary_embedding(device, interleaved, scale_base, layout):
    torch.manual_seed(9)
    b, s, d, dim, off = 2, 6, 16, 12, 3
    emb = RotaryEmbedding(dim, base=100.0, interleaved=interleaved, scale_base=scale_base,
                          device=device)
    pos = batch_positions(b, s, off).to(device)
    cos, sin, cos_k, sin_k = embedding_tables(dim, s + off, 100.0, scale_base)
    cos, sin, cos_k, sin_k = (t.to(device) for t in (cos, sin, cos_k, sin_k))
    if layout == "q_kv":
        q = torch.randn(b, s, 4, d, device=device)
        kv = torch.randn(b, s, 2, 2, d, device=device)
        q0, k0, v0 = q.clone(), kv[:, :, 0].clone(), kv[:, :, 1].clone()
        q_out, kv_out = emb(q, kv, seqlen_offset=off)
        assert q_out is q and kv_out is kv
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        num_heads_q = 4 if layout == "gqa" else None
        qkv = (torch.randn(b, s, 3, 4, d, device=device) if layout == "qkv"
               else torch.randn(b, s, 4 + 2 * 2, d, device=device))
        q0, k0, v0 = (t.clone() for t in _qkv_parts(qkv, num_heads_q))
        assert emb(qkv, seqlen_offset=off, num_heads_q=num_heads_q) is qkv
        q, k, v = _qkv_parts(qkv, num_heads_q)
    close(q, rotate64(q0, cos, sin, pos, interleaved), torch.float32)
    close(k, rotate64(k0, cos_k, sin_k, pos, interleaved), torch.float32)
    assert torch.equal(v, v0)


def test_rotary_embedding_cache_and_tensor_offsets():
    torch.manual_seed(10)
    emb = RotaryEmbedding(8)
    assert emb.state_dict() == {}  # inv_freq is not saved: a function of the arguments
    qkv = torch.randn(2, 5, 3, 2, 8)
    emb(qkv.clone())
    assert emb._seq_len_cached == 5 and emb._cos_cached.dtype == torch.float32
    emb(qkv.clone(), seqlen_offset=4)
    assert emb._seq_len_cached == 9
    emb(qkv.clone())  # a shorter call keeps the longer tables
    assert emb._seq_len_cached == 9
    emb(qkv.double())  # another dtype recomputes them
    assert emb._cos_cached.dtype == torch.float64 and emb._seq_len_cached == 5
    # Tensor offsets (decoding a batch whose caches differ in length): max_seqlen sizes the
    # tables; the result equals per-sequence int offsets.
    offsets = torch.tensor([1, 7], dtype=torch.int32)
    fresh = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="max_seqlen"):
        fresh(qkv.clone(), seqlen_offset=offsets)
    out = fresh(qkv.clone(), seqlen_offset=offsets, max_seqlen=12)
    for i, o in enumerate(offsets.tolist()):
        one = RotaryEmbedding(8)(qkv[i:i + 1].clone(), seqlen_offset=o)
        torch.testing.assert_close(out[i:i + 1], one)
    # Gradients flow through the in-place rotation of a non-leaf qkv.
    w = torch.randn(2, 5, 3, 2, 8, requires_grad=True)
    RotaryEmbedding(8, scale_base=8.0)(w * 2.0).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_rotary_embedding_half_precision_module():
    """A module cast with .half() still computes its angles from float32 frequencies."""
    emb = RotaryEmbedding(16, scale_base=32.0).half()
    assert emb.inv_freq.dtype == torch.float16
    qkv = torch.randn(1, 300, 3, 1, 16, dtype=torch.float16)
    q0 = qkv[:, :, 0].clone()
    emb(qkv)
    cos, sin, _, _ = embedding_tables(16, 300, 10000.0, 32.0)
    ref = rotate64(q0, cos.half(), sin.half(), batch_positions(1, 300, 0), False)
    close(qkv[:, :, 0], ref, torch.float16)


# --------------------------------------------------------------------------------------------
# bert_padding additions
# --------------------------------------------------------------------------------------------


def test_unpad_input_for_concatenated_sequences():
    torch.manual_seed(11)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.randn(3, 6, 2, 4, requires_grad=True)
    out, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16]
    assert isinstance(max_seqlen, int) and max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    torch.testing.assert_close(out, x.reshape(18, 2, 4)[indices])
    out.sum().backward()
    assert x.grad[0, 5].abs().sum() == 0 and x.grad[1, 5].abs().sum() == 0
    assert (x.grad[2] == 1).all()
    # Rows with one sample each give unpad_input's sequences.
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    lens = torch.tensor([[3, 0, 0, 0], [1, 0, 0, 0]])
    y = torch.randn(2, 4, 5)
    got = unpad_input_for_concatenated_sequences(y, lens)
    want = unpad_input(y, mask)
    for a, b in zip(got, want[:4]):
        assert (a == b).all() if isinstance(a, Tensor) else a == b


def test_index_first_axis_residual():
    torch.manual_seed(12)
    x = torch.randn(6, 3, 2, requires_grad=True)
    idx = torch.tensor([4, 1, 1])
    out, residual = index_first_axis_residual(x, idx)
    torch.testing.assert_close(out, x[idx])
    torch.testing.assert_close(residual, x)
    g_out, g_res = torch.randn(3, 3, 2), torch.randn(6, 3, 2)
    g_res_copy = g_res.clone()
    torch.autograd.backward((out, residual), (g_out, g_res))
    expected = g_res.clone()
    expected.index_add_(0, idx, g_out)
    torch.testing.assert_close(x.grad, expected)
    assert torch.equal(g_res, g_res_copy)


# --------------------------------------------------------------------------------------------
# Module layout and the ImportError of modules not provided
# --------------------------------------------------------------------------------------------


def test_ops_package_keeps_its_names():
    import flash_attn.ops.triton.rotary as triton_rotary
    from flash_attn import ops

    assert triton_rotary.apply_rotary is apply_rotary
    for name in ("_bwd_cuda", "_fwd_cuda", "load_extension", "_HEADDIM_TIERS", "flash_attn_fwd",
                 "flash_attn_bwd", "kvcache_update", "require_kernel"):
        assert hasattr(ops, name), name
    assert Path(ops.__file__).name == "__init__.py"


def test_headdim_tiers_match_csrc():
    """ops._HEADDIM_TIERS is a copy of csrc/common/tiers.h's kHeadDimTiers."""
    from flash_attn import ops

    spec = importlib.util.spec_from_file_location("_generate_kernels",
                                                  REPO / "scripts" / "generate_kernels.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert ops._HEADDIM_TIERS == gen.read_headdim_tiers(REPO / "csrc" / "common" / "tiers.h")


MISSING = [
    ("flash_attn.ops.rms_norm", "flash_attn.ops.rms_norm"),
    ("flash_attn.ops.layer_norm", "flash_attn.ops.layer_norm"),
    ("flash_attn.ops.fused_dense", "flash_attn.ops.fused_dense"),
    ("flash_attn.ops.activations", "flash_attn.ops.activations"),
    ("flash_attn.ops.triton.layer_norm", "flash_attn.ops.triton.layer_norm"),
    ("flash_attn.losses.cross_entropy", "flash_attn.losses"),
    ("flash_attn.modules.mha", "flash_attn.modules"),
    ("flash_attn.models.gpt", "flash_attn.models"),
    ("flash_attn.flash_attn_triton", "flash_attn.flash_attn_triton"),
    ("flash_attn.layers.patch_embed", "flash_attn.layers.patch_embed"),
]


@pytest.mark.parametrize("requested,missing", MISSING)
def test_missing_fa2_module_error(requested, missing):
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(requested)
    err = info.value
    assert isinstance(err, ImportError) and err.name == missing
    msg = str(err)
    assert f"No module named {missing!r}" in msg and requested in msg
    assert "FlashAttention-2 module that this package does not provide" in msg
    for provided in ("flash_attn_func", "flash_attn.bert_padding", "flash_attn.layers.rotary",
                     "flash_attn.ops.triton.rotary"):
        assert provided in msg
    assert requested not in sys.modules and missing not in sys.modules
    # Raised again on every import, and by the import statement's own forms.
    with pytest.raises(ModuleNotFoundError, match="does not provide"):
        exec(f"import {requested}", {})
    with pytest.raises(ImportError, match="does not provide"):
        exec(f"from {requested} import something", {})


def test_missing_module_messages():
    with pytest.raises(ModuleNotFoundError, match="torch.nn.RMSNorm"):
        importlib.import_module("flash_attn.ops.rms_norm")
    with pytest.raises(ModuleNotFoundError, match="not a module of this package"):
        importlib.import_module("flash_attn.no_such_module")


def test_find_spec_probes_are_unaffected():
    """Libraries probe optional modules with importlib.util.find_spec: a missing one is None,
    not an error; existing ones are found."""
    for name in ("flash_attn.ops.rms_norm", "flash_attn.modules", "flash_attn.no_such_module",
                 "flash_attn.layers.patch_embed"):
        assert importlib.util.find_spec(name) is None, name
    for name in ("flash_attn", "flash_attn.bert_padding", "flash_attn.layers.rotary",
                 "flash_attn.ops", "flash_attn.ops.triton.rotary", "flash_attn.reference"):
        assert importlib.util.find_spec(name) is not None, name
    # A probe below a missing package raises, as importlib does for any missing parent.
    with pytest.raises(ModuleNotFoundError):
        importlib.util.find_spec("flash_attn.modules.mha")


def test_extension_import_error_is_ordinary():
    """flash_attn._C (the compiled extension) keeps Python's own ImportError, which
    ops.load_extension turns into its RuntimeError."""
    if importlib.util.find_spec("flash_attn._C") is not None:
        pytest.skip("the extension is built here")
    with pytest.raises(ImportError) as info:
        importlib.import_module("flash_attn._C")
    assert "does not provide" not in str(info.value)
    from flash_attn import ops

    with pytest.raises(RuntimeError, match="flash_attn._C is not available"):
        ops.load_extension()


def test_finder_is_installed_once():
    from flash_attn import _missing_modules

    _missing_modules.install()  # as a second import of flash_attn would
    finders = [f for f in sys.meta_path if isinstance(f, _missing_modules.MissingModuleFinder)]
    assert len(finders) == 1
