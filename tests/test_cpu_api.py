"""Public API semantics on CPU (the PyTorch reference path): packed vs unpacked, gradients,
return_attn_probs, head dim padding, default scale, varlen, gradcheck through the public API."""

import inspect
import math

import pytest
import torch

import flash_attn
from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    ops,
)
from flash_attn.reference import attention_forward_ref


def explicit_attention(q, k, v, scale, causal=False, left=-1, right=-1, softcap=0.0, alibi=None,
                       alibi_offset=0):
    """Batched explicit-mask attention in float64 (independent of flash_attn.reference);
    alibi: ALiBi slopes (h,) or (b, h), its distance moved by alibi_offset (not the mask's)."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        right = 0
    i = torch.arange(sq).view(-1, 1) + (sk - sq)
    j = torch.arange(sk).view(1, -1)
    if alibi is not None:
        s = s - alibi.double().expand(b, h)[:, :, None, None] * (i + alibi_offset - j).abs()
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out, lse, p


def rand(*shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)


def cu_from_lens(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def test_exports_and_version():
    from importlib.metadata import version as dist_version

    from packaging.version import Version

    # The first three numbers are the FlashAttention-2 API level; transformers requires >= 2.3.3
    # of the installed distribution "flash-attn" before it selects the package.
    assert Version(flash_attn.__version__) >= Version("2.3.3")
    assert Version(flash_attn.__version__).release[:3] == (2, 8, 3)
    assert dist_version("flash-attn") == flash_attn.__version__
    for name in ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "build_info"]:
        assert callable(getattr(flash_attn, name)), name


def test_signatures_match_flash_attention_2():
    """FlashAttention-2's parameters, in its order, then ours: the learnable sink under its two
    names (s_aux, learnable_sink), and FlashAttention-3's FP8 descales, last so that
    FlashAttention-2's positional calls work."""
    common = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
              "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False")
    sink = "s_aux=None, learnable_sink=None"
    fp8 = "q_descale=None, k_descale=None, v_descale=None"
    expected = {
        flash_attn_func: f"(q, k, v, {common}, {sink}, {fp8})",
        flash_attn_qkvpacked_func: f"(qkv, {common}, {sink}, {fp8})",
        flash_attn_kvpacked_func: f"(q, kv, {common}, {sink}, {fp8})",
        flash_attn_varlen_qkvpacked_func:
            f"(qkv, cu_seqlens, max_seqlen, {common}, {sink}, {fp8})",
        flash_attn_varlen_kvpacked_func:
            f"(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, {common}, "
            f"{sink}, {fp8})",
        flash_attn_varlen_func:
            f"(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, {common}, "
            f"block_table=None, {sink}, {fp8})",
        flash_attn_with_kvcache:
            "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
            "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
            "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
            "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, "
            f"{sink}, {fp8})",
    }
    for fn, sig in expected.items():
        full = inspect.signature(fn)
        # Names, order and defaults as FlashAttention-2's; every parameter and the return typed.
        bare = full.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty)
                        for p in full.parameters.values()],
            return_annotation=inspect.Signature.empty)
        assert str(bare) == sig, fn.__name__
        assert all(p.annotation is not inspect.Parameter.empty
                   for p in full.parameters.values()), fn.__name__
        assert full.return_annotation is not inspect.Signature.empty, fn.__name__
        assert fn.__doc__ and "Arguments:" in fn.__doc__ and "Return:" in fn.__doc__


def test_build_info_without_extension():
    info = flash_attn.build_info()
    assert info["torch"] == torch.__version__
    assert info["flash_attn"] == flash_attn.__version__
    if not info["available"]:
        assert isinstance(info["reason"], str) and info["reason"]


def test_build_info_merges_extension_info(monkeypatch):
    import sys
    import types

    import flash_attn as fa

    fake = types.ModuleType("flash_attn._C")
    fake.build_info = lambda: {"archs": [80], "cuda": "12.4", "cutlass": "4.2.0", "kernels": [
        {"kind": "fwd", "arch": 80, "dtype": "bf16", "headdim": 64}]}
    monkeypatch.setitem(sys.modules, "flash_attn._C", fake)
    monkeypatch.setattr(fa, "_C", fake, raising=False)
    info = fa.build_info()
    assert info["available"] is True and "reason" not in info
    assert info["archs"] == [80] and info["cuda"] == "12.4" and info["cutlass"] == "4.2.0"
    assert info["kernels"][0]["headdim"] == 64 and info["torch"] == torch.__version__


def test_missing_extension_error_points_to_build_status():
    from flash_attn import ops

    if flash_attn.build_info()["available"]:
        pytest.skip("the extension is built here")
    with pytest.raises(RuntimeError, match="python -m flash_attn"):
        ops.load_extension()


def test_main_prints_status():
    from flash_attn.__main__ import format_build_info

    text = format_build_info(flash_attn.build_info())
    assert f"flash_attn {flash_attn.__version__}" in text and "torch" in text
    fake = {
        "available": True, "flash_attn": "0.1.0", "torch": "x", "torch_cuda": "12.4",
        "cuda_available": True, "archs": [80, 90], "cuda": "12.4", "cutlass": "3.5",
        "kernels": [
            {"kind": "fwd", "arch": 80, "dtype": "fp16", "headdim": 128},
            {"kind": "fwd", "arch": 80, "dtype": "fp16", "headdim": 64},
            {"kind": "bwd", "arch": 80, "dtype": "bf16", "headdim": 64},
            {"kind": "fwd", "arch": 90, "dtype": "bf16", "headdim": 128},
        ],
    }
    text = format_build_info(fake)
    assert "sm_80, sm_90" in text
    assert "sm_80 fwd fp16: headdim 64, 128" in text
    assert "sm_80 bwd bf16: headdim 64" in text
    assert "sm_90 fwd bf16: headdim 128" in text


@pytest.mark.parametrize(
    "sq,sk,h,hk,d,causal,window,softcap",
    [
        (5, 5, 2, 2, 8, False, (-1, -1), 0.0),
        (3, 8, 4, 2, 16, True, (-1, -1), 0.0),
        (8, 3, 4, 1, 8, True, (-1, -1), 0.0),
        (6, 7, 2, 2, 8, False, (2, 1), 0.0),
        (6, 6, 4, 2, 8, True, (1, -1), 1.5),
        (4, 6, 3, 3, 5, False, (-1, -1), 0.0),   # head dim not a multiple of 8
        (4, 4, 2, 1, 20, True, (-1, -1), 0.0),   # head dim not a multiple of 8
    ],
)
def test_flash_attn_func_matches_explicit(sq, sk, h, hk, d, causal, window, softcap):
    torch.manual_seed(sq * 100 + sk * 10 + d)
    q = rand(2, sq, h, d, requires_grad=True)
    k = rand(2, sk, hk, d, requires_grad=True)
    v = rand(2, sk, hk, d, requires_grad=True)
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                      softcap=softcap, return_attn_probs=True)
    scale = 1 / math.sqrt(d)
    out_e, lse_e, p_e = explicit_attention(q, k, v, scale, causal, window[0], window[1],
                                           softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, h, sq) and lse.dtype == torch.float32
    assert probs.shape == (2, h, sq, sk)
    torch.testing.assert_close(out, out_e, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, lse_e.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, p_e, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    ge = torch.autograd.grad(out_e, (q, k, v), dout)
    for x, y in zip(g, ge):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "sq,sk,h,hk,causal,window,softcap,per_batch",
    [
        (5, 9, 4, 2, False, (-1, -1), 0.0, False),
        (9, 5, 4, 4, True, (-1, -1), 0.0, True),
        (6, 6, 4, 1, False, (2, 1), 1.5, True),
        (7, 4, 2, 2, True, (1, -1), 0.7, False),
    ],
)
def test_alibi_matches_explicit(sq, sk, h, hk, causal, window, softcap, per_batch):
    """alibi_slopes ((nheads,) or (batch, nheads)): the bias -slope * |i + sk - sq - j| on the
    score after the softcap, in out, lse, the probabilities and the gradients."""
    torch.manual_seed(40 + sq)
    d = 8
    q = rand(2, sq, h, d, requires_grad=True)
    k = rand(2, sk, hk, d, requires_grad=True)
    v = rand(2, sk, hk, d, requires_grad=True)
    slopes = torch.rand(2, h) if per_batch else torch.rand(h)
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                      softcap=softcap, alibi_slopes=slopes,
                                      return_attn_probs=True)
    out_e, lse_e, p_e = explicit_attention(q, k, v, 1 / math.sqrt(d), causal, window[0],
                                           window[1], softcap, slopes)
    torch.testing.assert_close(out, out_e, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, lse_e.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, p_e, atol=1e-5, rtol=1e-5)
    out_0, _, _ = explicit_attention(q, k, v, 1 / math.sqrt(d), causal, window[0], window[1],
                                     softcap)
    assert (out_e - out_0).abs().max() > 1e-3  # the bias moves the output
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    ge = torch.autograd.grad(out_e, (q, k, v), dout)
    for x, y in zip(g, ge):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("offset", [-7, 3, 40])
def test_alibi_offset_moves_the_bias_only(offset):
    """flash_attn.ops' alibi_offset (ring attention's sub-blocks): the bias
    -slope * |i + sk - sq + offset - j|, the mask unmoved, in the forward and the backward."""
    torch.manual_seed(45)
    q, k, v = rand(2, 5, 4, 8), rand(2, 9, 2, 8), rand(2, 9, 2, 8)
    slopes = torch.rand(4)
    out, lse = ops.flash_attn_fwd(q, k, v, None, None, None, 5, 9, 1 / math.sqrt(8), True, -1,
                                  0, 0.0, alibi_slopes=slopes, alibi_offset=offset)
    out_e, lse_e, _ = explicit_attention(q, k, v, 1 / math.sqrt(8), True, alibi=slopes,
                                         alibi_offset=offset)
    torch.testing.assert_close(out, out_e, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, lse_e.float(), atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    grads = ops.flash_attn_bwd(dout, q, k, v, out, lse, None, None, 5, 9, 1 / math.sqrt(8), True,
                               -1, 0, 0.0, False, alibi_slopes=slopes, alibi_offset=offset)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out_e, _, _ = explicit_attention(*leaves, 1 / math.sqrt(8), True, alibi=slopes,
                                     alibi_offset=offset)
    grads_e = torch.autograd.grad(out_e, leaves, dout)
    for x, y in zip(grads, grads_e):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)
    # Through the op's autograd formula too: the backward gets the forward's offset.
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out_a, _ = ops.flash_attn_fwd(*leaves, None, None, None, 5, 9, 1 / math.sqrt(8), True, -1,
                                  0, 0.0, alibi_slopes=slopes, alibi_offset=offset)
    for x, y in zip(torch.autograd.grad(out_a, leaves, dout), grads_e):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)


def test_alibi_varlen_and_kvcache():
    """Varlen: sequence b takes row b of (batch, nheads) slopes and its own alignment;
    flash_attn_with_kvcache aligns the bias to each sequence's cache length."""
    torch.manual_seed(44)
    lens_q, lens_k = [3, 0, 5, 2], [4, 3, 7, 1]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, 8)
    slopes = torch.rand(4, 4)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True, alibi_slopes=slopes)
    for b in range(4):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        o, _, _ = explicit_attention(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None],
                                     1 / math.sqrt(8), True, alibi=slopes[b:b + 1])
        torch.testing.assert_close(out[q0:q1], o[0], atol=1e-10, rtol=1e-10)
    k_cache, v_cache = rand(2, 9, 2, 8), rand(2, 9, 2, 8)
    qd = rand(2, 2, 4, 8)
    lens = torch.tensor([4, 9], dtype=torch.int32)
    out = flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                  alibi_slopes=slopes[0])
    for b, n in enumerate(lens.tolist()):
        o, _, _ = explicit_attention(qd[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                                     1 / math.sqrt(8), True, alibi=slopes[0])
        torch.testing.assert_close(out[b:b + 1], o, atol=1e-10, rtol=1e-10)


def test_default_softmax_scale_uses_original_headdim():
    torch.manual_seed(11)
    d = 12  # padded to 16 internally; the scale must stay 1/sqrt(12)
    q, k, v = rand(1, 4, 2, d), rand(1, 5, 2, d), rand(1, 5, 2, d)
    out = flash_attn_func(q, k, v)
    out2 = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(d))
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    out3 = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(16))
    assert not torch.allclose(out, out3)
    out4 = flash_attn_func(q, k, v, softmax_scale=0.3)
    torch.testing.assert_close(out4, explicit_attention(q, k, v, 0.3)[0])


def test_return_attn_probs():
    torch.manual_seed(12)
    q, k, v = rand(2, 5, 4, 8), rand(2, 7, 2, 8), rand(2, 7, 2, 8)
    res = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out, lse, probs = res
    assert all(r is not None for r in res)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 5, dtype=probs.dtype))
    # causal with shift 2: row 0 sees keys 0..2 only
    assert torch.all(probs[:, :, 0, 3:] == 0)
    vv = v.repeat_interleave(2, dim=2)
    torch.testing.assert_close(torch.einsum("bhij,bjhd->bihd", probs, vv), out,
                               atol=1e-6, rtol=1e-6)
    assert isinstance(flash_attn_func(q, k, v), torch.Tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_dtypes(dtype):
    torch.manual_seed(13)
    q, k, v = (rand(2, 6, 4, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == dtype
    out.sum().backward()
    assert q.grad.dtype == dtype and torch.isfinite(q.grad.float()).all()
    out_e = explicit_attention(q, k, v, 1 / 4, causal=True)[0]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), out_e, atol=tol, rtol=tol)


def test_qkvpacked_equals_unpacked_and_grads_reach_packed():
    torch.manual_seed(14)
    qkv = rand(2, 6, 3, 4, 8, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(2, -1), softcap=1.0)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, causal=True, window_size=(2, -1), softcap=1.0)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout)
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))


def test_kvpacked_equals_unpacked_and_grads_reach_packed():
    torch.manual_seed(15)
    q = rand(2, 4, 6, 8, requires_grad=True)
    kv = rand(2, 7, 2, 3, 8, requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    q2 = q.detach().clone().requires_grad_()
    k, v = (kv[:, :, i].detach().clone().requires_grad_() for i in range(2))
    ref = flash_attn_func(q2, k, v, causal=True)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout)
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(kv.grad, torch.stack([k.grad, v.grad], dim=2))


def test_packed_variants_pass_views_without_copy(monkeypatch):
    from flash_attn import ops

    seen = {}
    real = ops.flash_attn_fwd

    def spy(q, k, v, *args):
        seen["ptrs"] = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        return real(q, k, v, *args)

    monkeypatch.setattr(ops, "flash_attn_fwd", spy)
    qkv = rand(1, 4, 3, 2, 8)
    flash_attn_qkvpacked_func(qkv)
    base, step = qkv.data_ptr(), qkv.stride(2) * qkv.element_size()
    assert seen["ptrs"] == (base, base + step, base + 2 * step)
    kv = rand(5, 2, 2, 8)
    q = rand(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    cuk = torch.tensor([0, 5], dtype=torch.int32)
    flash_attn_varlen_kvpacked_func(q, kv, cu, cuk, 4, 5)
    step = kv.stride(1) * kv.element_size()
    assert seen["ptrs"][1:] == (kv.data_ptr(), kv.data_ptr() + step)


def test_non_contiguous_last_dim_is_copied():
    torch.manual_seed(16)
    q = rand(1, 4, 2, 8).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q.stride(-1) != 1
    k, v = rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    torch.testing.assert_close(flash_attn_func(q, k, v), flash_attn_func(q.contiguous(), k, v))


def test_empty_sequences_batched():
    torch.manual_seed(17)
    q, k, v = rand(2, 0, 2, 8), rand(2, 3, 2, 8), rand(2, 3, 2, 8)
    assert flash_attn_func(q, k, v).shape == (2, 0, 2, 8)
    q = rand(2, 3, 2, 8, requires_grad=True)
    k, v = rand(2, 0, 2, 8), rand(2, 0, 2, 8)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    out.sum().backward()
    assert torch.all(q.grad == 0)


def _varlen_inputs(lens_q, lens_k, h, hk, d, requires_grad=True):
    q = rand(sum(lens_q), h, d, requires_grad=requires_grad)
    k = rand(sum(lens_k), hk, d, requires_grad=requires_grad)
    v = rand(sum(lens_k), hk, d, requires_grad=requires_grad)
    return q, k, v, cu_from_lens(lens_q), cu_from_lens(lens_k)


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (1, 2), 0.5)])
def test_varlen_equals_per_sequence_batched(causal, window, softcap):
    torch.manual_seed(18)
    lens_q, lens_k = [3, 0, 5, 2], [4, 3, 2, 0]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, 12)
    out, lse, probs = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window_size=window,
        softcap=softcap, return_attn_probs=True,
    )
    assert lse.shape == (4, q.shape[0]) and probs.shape == (4, 4, 5, 4)
    dout = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        qb, kb, vb = (t.detach()[a:z][None].requires_grad_() for t, a, z in
                      ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        ob, lb, pb = flash_attn_func(qb, kb, vb, causal=causal, window_size=window,
                                     softcap=softcap, return_attn_probs=True)
        torch.testing.assert_close(out[q0:q1], ob[0])
        torch.testing.assert_close(lse[:, q0:q1], lb[0])
        torch.testing.assert_close(probs[b, :, : q1 - q0, : k1 - k0], pb[0])
        if q1 > q0:
            g = torch.autograd.grad(ob, (qb, kb, vb), dout[q0:q1][None])
            torch.testing.assert_close(gq[q0:q1], g[0][0])
            torch.testing.assert_close(gk[k0:k1], g[1][0])
            torch.testing.assert_close(gv[k0:k1], g[2][0])
        else:
            assert torch.all(gk[k0:k1] == 0) and torch.all(gv[k0:k1] == 0)


def test_varlen_packed_variants_equal_unpacked():
    torch.manual_seed(19)
    lens = [3, 5, 1]
    cu = cu_from_lens(lens)
    qkv = rand(sum(lens), 3, 2, 8, requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
    q, k, v = (qkv[:, i].detach().clone().requires_grad_() for i in range(3))
    ref = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=1))

    lens_k = [2, 6, 4]
    cu_k = cu_from_lens(lens_k)
    q = rand(sum(lens), 4, 8, requires_grad=True)
    kv = rand(sum(lens_k), 2, 2, 8, requires_grad=True)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 5, 6, window_size=(1, 1))
    q2 = q.detach().clone().requires_grad_()
    k, v = (kv[:, i].detach().clone().requires_grad_() for i in range(2))
    ref = flash_attn_varlen_func(q2, k, v, cu, cu_k, 5, 6, window_size=(1, 1))
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    out.backward(dout.new_ones(out.shape))
    ref.backward(dout.new_ones(out.shape))
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(kv.grad, torch.stack([k.grad, v.grad], dim=1))


def test_deterministic_flag_accepted_on_cpu():
    torch.manual_seed(20)
    q, k, v = (rand(1, 4, 2, 8, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, deterministic=True)
    out.sum().backward()
    g1 = q.grad.clone()
    q.grad = None
    flash_attn_func(q, k, v, deterministic=True).sum().backward()
    assert torch.equal(g1, q.grad)


def test_lse_is_not_differentiable_but_usable():
    torch.manual_seed(21)
    q, k, v = (rand(1, 3, 2, 8, requires_grad=True) for _ in range(3))
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert not lse.requires_grad
    (out.sum() + lse.sum()).backward()  # lse contributes no gradient
    ref = explicit_attention(q, k, v, 1 / math.sqrt(8))[0]
    g = torch.autograd.grad(ref.sum(), q)[0]
    torch.testing.assert_close(q.grad, g)


# ---------------------------------------------------------------------------------------------
# gradcheck through the public API (float64, tiny sizes)
# ---------------------------------------------------------------------------------------------


def _gradcheck(fn, inputs, fast_mode=True):
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "sq,sk,h,hk,d,causal,window,softcap",
    [
        (3, 4, 2, 1, 4, True, (-1, -1), 0.0),
        (4, 2, 2, 2, 8, True, (-1, -1), 0.0),   # fully masked rows
        (3, 3, 2, 1, 6, False, (1, 0), 1.3),
    ],
)
def test_gradcheck_flash_attn_func(sq, sk, h, hk, d, causal, window, softcap):
    torch.manual_seed(22)
    q = rand(1, sq, h, d, requires_grad=True)
    k = rand(1, sk, hk, d, requires_grad=True)
    v = rand(1, sk, hk, d, requires_grad=True)
    # full Jacobian here (tiny sizes); fast mode for the other variants below
    _gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=window,
                                               softcap=softcap), (q, k, v), fast_mode=False)


def test_gradcheck_packed():
    torch.manual_seed(23)
    qkv = rand(1, 3, 3, 2, 4, requires_grad=True)
    _gradcheck(lambda x: flash_attn_qkvpacked_func(x, causal=True), (qkv,))
    q = rand(1, 2, 2, 4, requires_grad=True)
    kv = rand(1, 3, 2, 1, 4, requires_grad=True)
    _gradcheck(lambda q, kv: flash_attn_kvpacked_func(q, kv, softcap=0.8), (q, kv))


def test_gradcheck_varlen():
    torch.manual_seed(24)
    q, k, v, cu_q, cu_k = _varlen_inputs([2, 0, 3], [3, 1, 2], 2, 1, 4)
    _gradcheck(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True),
               (q, k, v))
    cu = cu_from_lens([2, 3])
    qkv = rand(5, 3, 2, 4, requires_grad=True)
    _gradcheck(lambda x: flash_attn_varlen_qkvpacked_func(x, cu, 3, window_size=(1, 0)),
               (qkv,))
    q = rand(5, 2, 4, requires_grad=True)
    kv = rand(4, 2, 2, 4, requires_grad=True)
    cu_k = cu_from_lens([1, 3])
    _gradcheck(lambda q, kv: flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 3, 3),
               (q, kv))


def test_reference_is_what_cpu_runs():
    torch.manual_seed(25)
    q, k, v = rand(2, 4, 2, 8), rand(2, 6, 2, 8), rand(2, 6, 2, 8)
    out = flash_attn_func(q, k, v, causal=True, window_size=(3, 5), softcap=2.0)
    ref, _ = attention_forward_ref(q, k, v, causal=True, window_left=3, window_right=0,
                                   softcap=2.0)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_python_m_flash_attn_runs():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "flash_attn"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"flash_attn {flash_attn.__version__}" in proc.stdout and "torch" in proc.stdout


def test_cuda_impls_call_extension_with_internals_signature(monkeypatch):
    """The CUDA kernels of the custom ops call the extension's fwd / bwd
    (torch.ops.flash_attn_cuda) with the argument order of docs/INTERNALS.md (checked with a
    stand-in extension running the reference on CPU)."""
    from flash_attn import ops, reference

    calls = {}

    class FakeExt:
        @staticmethod
        def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                kv_batch_idx=None, block_table=None, leftpad_k=None, alibi_slopes=None,
                sink=None, dropout_p=0.0, rng_state=None, sm_margin=0, q_descale=None,
                k_descale=None, v_descale=None, alibi_offset=0):
            calls["fwd"] = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                causal=causal, window=(window_left, window_right),
                                kv_batch_idx=kv_batch_idx, block_table=block_table,
                                leftpad_k=leftpad_k, alibi_slopes=alibi_slopes, sink=sink,
                                dropout_p=dropout_p, rng_state=rng_state, sm_margin=sm_margin,
                                alibi_offset=alibi_offset)
            if kv_batch_idx is not None:
                k, v = k[kv_batch_idx.long()], v[kv_batch_idx.long()]
            if block_table is not None:
                k, v = (x[block_table.long()].flatten(1, 2) for x in (k, v))
            if leftpad_k is not None:  # seqused_k[b] keys from row leftpad_k[b]
                k, v = (torch.stack([x[b].roll(-n, 0) for b, n in
                                     enumerate(leftpad_k.tolist())]) for x in (k, v))
            return tuple(reference.attention_forward_ref(
                q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, sink,
                alibi_offset=alibi_offset))

        @staticmethod
        def bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                softcap, deterministic, alibi_slopes=None, dropout_p=0.0, rng_state=None,
                alibi_offset=0):
            calls["bwd"] = dict(deterministic=deterministic, alibi_slopes=alibi_slopes,
                                dropout_p=dropout_p, rng_state=rng_state,
                                alibi_offset=alibi_offset)
            return tuple(reference.attention_backward_ref(
                dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                alibi_slopes=alibi_slopes, alibi_offset=alibi_offset))

    monkeypatch.setattr(ops, "_EXT", FakeExt)
    monkeypatch.setattr(ops, "require_kernel", lambda *args: None)  # no GPU to ask
    torch.manual_seed(26)
    q, k, v, cu_q, cu_k = _varlen_inputs([3, 2], [4, 5], 4, 2, 8, requires_grad=False)
    args = (q, k, v, cu_q, cu_k, None, 3, 5, 0.4, True, 2, 0, 1.5)
    out, lse = ops._fwd_cuda(*args)
    ref_out, ref_lse = reference.attention_forward_ref(*args)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
    assert calls["fwd"] == dict(max_seqlen_q=3, max_seqlen_k=5, causal=True,
                                window=(2, 0), kv_batch_idx=None, block_table=None,
                                leftpad_k=None, alibi_slopes=None, sink=None, dropout_p=0.0,
                                rng_state=None, sm_margin=0, alibi_offset=0)
    dout = torch.randn_like(out)
    g = ops._bwd_cuda(dout, q, k, v, out, lse, cu_q, cu_k, 3, 5, 0.4, True, 2, 0, 1.5, False)
    ref_g = reference.attention_backward_ref(dout, q, k, v, out, lse, cu_q, cu_k, 3, 5, 0.4,
                                             True, 2, 0, 1.5)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert calls["bwd"] == dict(deterministic=False, alibi_slopes=None, dropout_p=0.0,
                                rng_state=None, alibi_offset=0)
    # alibi_slopes last of fwd and of bwd
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out, lse = ops._fwd_cuda(*args, False, None, None, None, slopes)
    assert calls["fwd"]["alibi_slopes"] is slopes
    ops._bwd_cuda(dout, q, k, v, out, lse, cu_q, cu_k, 3, 5, 0.4, True, 2, 0, 1.5, False, slopes)
    assert calls["bwd"]["alibi_slopes"] is slopes
    # alibi_offset (ring attention's sub-blocks): fwd's keyword, bwd's last
    ops._fwd_cuda(*args, False, None, None, None, slopes, alibi_offset=-3)
    assert calls["fwd"]["alibi_offset"] == -3
    ops._bwd_cuda(dout, q, k, v, out, lse, cu_q, cu_k, 3, 5, 0.4, True, 2, 0, 1.5, False, slopes,
                  None, 0.0, None, 5)
    assert calls["bwd"]["alibi_offset"] == 5
    # kv_batch_idx is handed through last: query batch b reads K/V entry kv_batch_idx[b]
    qb, kb, vb = torch.randn(2, 3, 4, 8), torch.randn(3, 5, 2, 8), torch.randn(3, 5, 2, 8)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    out, lse = ops._fwd_cuda(qb, kb, vb, None, None, None, 3, 5, 0.4, False, -1, -1, 0.0,
                             False, idx)
    ref_out, ref_lse = reference.attention_forward_ref(qb, kb[[2, 0]], vb[[2, 0]], None, None,
                                                       None, 3, 5, 0.4)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    assert calls["fwd"]["kv_batch_idx"] is idx
    # block_table after it: batch b's keys are pages table[b, 0], table[b, 1], ...
    table = torch.tensor([[2, 0], [1, 1]], dtype=torch.int32)
    out, lse = ops._fwd_cuda(qb, kb, vb, None, None, None, 3, 10, 0.4, False, -1, -1, 0.0,
                             False, None, table)
    ref_out, ref_lse = reference.attention_forward_ref(
        qb, kb[[2, 0, 1, 1]].reshape(2, 10, 2, 8), vb[[2, 0, 1, 1]].reshape(2, 10, 2, 8), None,
        None, None, 3, 10, 0.4)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    assert calls["fwd"]["block_table"] is table
    # leftpad_k last: batch b's keys are the seqused_k[b] rows from row leftpad_k[b]
    pad, used = (torch.tensor(x, dtype=torch.int32) for x in ([1, 3], [3, 1]))
    out, lse = ops._fwd_cuda(qb, kb[:2], vb[:2], None, None, used, 3, 5, 0.4, True, -1, 0, 0.0,
                             False, None, None, pad)
    for b, (n, u) in enumerate(zip(pad.tolist(), used.tolist())):
        ref_out, _ = reference.attention_forward_ref(qb[b:b + 1], kb[b:b + 1, n:n + u],
                                                     vb[b:b + 1, n:n + u], None, None, None, 3,
                                                     u, 0.4, True, -1, 0)
        torch.testing.assert_close(out[b:b + 1], ref_out, atol=1e-6, rtol=1e-6)
    assert calls["fwd"]["leftpad_k"] is pad
    # empty inputs never reach the extension
    calls.clear()
    e_out, e_lse = ops._fwd_cuda(q[:0], k, v, cu_q, cu_k, None, 0, 9, 0.4, False, -1, -1, 0.0)
    assert e_out.shape == (0, 4, 8) and e_lse.shape == (4, 0) and not calls


def test_sm_margin_must_not_be_negative():
    """sm_margin (SMs the SM90 forward leaves free) is checked before any kernel or device
    path is chosen; 0 and positive values are scheduling hints the CPU path ignores."""
    from flash_attn import ops

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="sm_margin must be >= 0, got -1"):
        ops.flash_attn_fwd(q, q, q, None, None, None, 8, 8, 0.25, False, -1, -1, 0.0,
                           sm_margin=-1)
    out, _ = ops.flash_attn_fwd(q, q, q, None, None, None, 8, 8, 0.25, False, -1, -1, 0.0,
                                sm_margin=8)
    ref, _ = ops.flash_attn_fwd(q, q, q, None, None, None, 8, 8, 0.25, False, -1, -1, 0.0)
    assert torch.equal(out, ref)


def test_require_kernel_names_the_build_flags(monkeypatch):
    """A call whose (dtype, head-dim tier) this build did not compile raises NotImplementedError
    naming the flags, before entering the extension; SM90-only kernels count on compute
    capability 9.0 only, and not with FLASH_ATTN_FORCE_SM80=1."""
    from flash_attn import ops

    monkeypatch.setattr(ops, "_BUILT_KERNELS", {("fwd", 80, "bf16", 64), ("fwd", 90, "fp16", 128),
                                                ("bwd", 80, "bf16", 64)})
    cc = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc["value"])
    monkeypatch.delenv("FLASH_ATTN_FORCE_SM80", raising=False)
    dev = torch.device("cpu")
    ops.require_kernel("fwd", torch.bfloat16, 40, dev)  # tier 64, SM80 kernel
    ops.require_kernel("bwd", torch.bfloat16, 64, dev)
    ops.require_kernel("fwd", torch.float16, 128, dev)  # SM90 kernel on 9.0
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_HEADDIMS including 96"):
        ops.require_kernel("fwd", torch.bfloat16, 96, dev)
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_DISABLE_BACKWARD"):
        ops.require_kernel("bwd", torch.float16, 128, dev)
    monkeypatch.setenv("FLASH_ATTN_FORCE_SM80", "1")
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_DTYPES including fp16"):
        ops.require_kernel("fwd", torch.float16, 128, dev)
    monkeypatch.delenv("FLASH_ATTN_FORCE_SM80")
    cc["value"] = (8, 0)
    with pytest.raises(NotImplementedError):
        ops.require_kernel("fwd", torch.float16, 128, dev)


def test_main_lists_features_by_code_path():
    """`python -m flash_attn` says which path runs each feature, from the registered kernels."""
    from flash_attn.__main__ import format_build_info

    kernels = [{"kind": k, "arch": a, "dtype": "bf16", "headdim": d}
               for k, a, dims in (("fwd", 90, (64, 128, 256)), ("bwd", 90, (64, 128)),
                                  ("fwd", 80, (64, 128, 256)), ("bwd", 80, (64, 128, 256)))
               for d in dims]
    text = format_build_info({"available": True, "flash_attn": "v", "torch": "t",
                              "archs": [80, 90], "kernels": kernels})
    lines = {line.split("  ")[1].strip(): line for line in text.splitlines()
             if line.startswith("  ") and "  " in line.strip()}
    assert "SM90 for head-dim tiers 64, 128, else SM80" in lines["backward (alibi_slopes too)"]
    assert "NotImplementedError" not in lines["deterministic=True backward"]
    assert "SM90 for head-dim tiers 64, 128, else SM80" in lines["deterministic=True backward"]
    assert "SM90 for head-dim tiers 64, 128, 256, else SM80" in lines["forward with alibi_slopes"]
    assert "NotImplementedError" not in lines["dropout_p > 0"]
    assert "SM90" not in lines["dropout_p > 0"]
    assert lines["FP8 e4m3 inputs (CPU: the reference)"].count("NotImplementedError") == 2
    assert "NotImplementedError" not in lines["v head dim != q's (the wider one's kernels, padded)"]
    assert "SM90 for head-dim tiers 64, 128, 256, else SM80" in lines["learnable sink (s_aux)"]
    # e4m3 kernels (SM90 forward only): the FP8 row names their tiers, the others ignore them
    kernels += [{"kind": "fwd", "arch": 90, "dtype": "e4m3", "headdim": d} for d in (128, 192)]
    text = format_build_info({"available": True, "flash_attn": "v", "torch": "t",
                              "archs": [80, 90], "kernels": kernels})
    assert "sm_90 fwd e4m3: headdim 128, 192" in text
    lines = {line.split("  ")[1].strip(): line for line in text.splitlines()
             if line.startswith("  ") and "  " in line.strip()}
    fp8 = lines["FP8 e4m3 inputs (CPU: the reference)"]
    assert "SM90 for head-dim tiers 128, 192 (forward, bf16 out)" in fp8
    assert fp8.count("NotImplementedError") == 2  # other tiers, and 8.x
    cache = lines["FP8 e4m3 KV cache, paged or left-padded"]
    assert "SM90 for pages of a multiple of 8 rows and cache_leftpad without pages" in cache
    assert "SM90 for head-dim tiers 64, 128, 256, else SM80" in lines["forward"]
