"""torch.compile / torch.library integration on CPU: the custom ops trace as opaque nodes with
correct fake implementations, without graph breaks (fullgraph=True)."""

import os
import shutil
import time

import pytest
import torch

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from flash_attn import ops  # noqa: F401  (registers torch.ops.flash_attn.*)


class Attention(torch.nn.Module):
    def __init__(self, causal=True, window_size=(-1, -1), softcap=0.0):
        super().__init__()
        self.causal, self.window_size, self.softcap = causal, window_size, softcap

    def forward(self, q, k, v):
        out = flash_attn_func(q, k, v, causal=self.causal, window_size=self.window_size,
                              softcap=self.softcap)
        return out * 2.0 + 1.0


def _fwd_bwd(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    dout = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin()
    out.backward(dout)
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("headdim", [8, 12])  # 12 exercises the zero padding to 16
def test_compile_aot_eager_fullgraph_fwd_bwd(headdim):
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, headdim)
    k = torch.randn(2, 6, 2, headdim)
    v = torch.randn(2, 6, 2, headdim)
    torch._dynamo.reset()
    mod = Attention(causal=True, window_size=(3, -1), softcap=1.5)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    out_c, grads_c = _fwd_bwd(compiled, q, k, v)
    out_e, grads_e = _fwd_bwd(mod, q, k, v)
    torch.testing.assert_close(out_c, out_e, atol=0, rtol=0)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_compile_packed_and_varlen_fullgraph():
    torch.manual_seed(1)
    torch._dynamo.reset()

    def f(qkv, q, kv, qv, kvv, cu_q, cu_k):
        a = flash_attn_qkvpacked_func(qkv, causal=True)
        b = flash_attn_kvpacked_func(q, kv, softcap=2.0)
        c = flash_attn_varlen_func(qv, kvv, kvv, cu_q, cu_k, 3, 4, causal=True)
        return a.sum() + b.sum() + (c * c).sum()

    qkv = torch.randn(2, 4, 3, 2, 8)
    q = torch.randn(2, 3, 4, 8)
    kv = torch.randn(2, 5, 2, 2, 8)
    qv = torch.randn(5, 2, 8)
    kvv = torch.randn(6, 2, 8)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6], dtype=torch.int32)
    tensors = (qkv, q, kv, qv, kvv)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    ins_c = [t.clone().requires_grad_() for t in tensors]
    ins_e = [t.clone().requires_grad_() for t in tensors]
    out_c = compiled(*ins_c, cu_q, cu_k)
    out_e = f(*ins_e, cu_q, cu_k)
    torch.testing.assert_close(out_c, out_e)
    out_c.backward()
    out_e.backward()
    for a, b in zip(ins_c, ins_e):
        torch.testing.assert_close(a.grad, b.grad)


def test_compile_dynamic_shapes():
    torch.manual_seed(2)
    torch._dynamo.reset()
    mod = Attention(causal=True)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager", dynamic=True)
    for sq, sk in [(3, 5), (4, 7), (6, 6)]:
        q = torch.randn(1, sq, 2, 8)
        k = torch.randn(1, sk, 2, 8)
        v = torch.randn(1, sk, 2, 8)
        out_c, g_c = _fwd_bwd(compiled, q, k, v)
        out_e, g_e = _fwd_bwd(mod, q, k, v)
        torch.testing.assert_close(out_c, out_e)
        for a, b in zip(g_c, g_e):
            torch.testing.assert_close(a, b)


def test_compile_kvcache_fullgraph():
    """A decode step (rotary, the cache written in place, attention) compiles without graph
    breaks and updates the cache as eager mode does."""
    torch.manual_seed(3)
    torch._dynamo.reset()
    cos, sin = torch.randn(32, 4), torch.randn(32, 4)

    def step(q, k_cache, v_cache, k, v, lens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                       rotary_sin=sin, cache_seqlens=lens, causal=True)

    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    kc_e, vc_e, kc_c, vc_c = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    out_e = step(q, kc_e, vc_e, k, v, lens)
    out_c = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc_c, vc_c, k, v, lens)
    torch.testing.assert_close(out_c, out_e, atol=0, rtol=0)
    assert torch.equal(kc_c, kc_e) and torch.equal(vc_c, vc_e)
    assert not torch.equal(kc_e, k_cache)


def test_compile_validation_error_surfaces():
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: flash_attn_func(q, q, q, softcap=-1.0),
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="softcap must be"):
        compiled(torch.randn(1, 2, 2, 8))


def _opcheck(op, args):
    res = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in res.values()), res


def test_opcheck_fwd_bwd():
    torch.manual_seed(3)
    q = torch.randn(2, 4, 4, 8, requires_grad=True)
    k = torch.randn(2, 5, 2, 8, requires_grad=True)
    v = torch.randn(2, 5, 2, 8, requires_grad=True)
    fwd, bwd = torch.ops.flash_attn._fwd.default, torch.ops.flash_attn._bwd.default
    _opcheck(fwd, (q, k, v, None, None, None, 4, 5, 0.3, True, -1, 0, 0.0, False))
    # strided views of a packed tensor (what the packed variants pass)
    qkv = torch.randn(2, 4, 3, 2, 8, requires_grad=True)
    _opcheck(fwd, (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None, None, None, 4, 4, 0.35,
                   False, 2, 1, 1.5, False))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    qv = torch.randn(5, 4, 8, requires_grad=True)
    kv = torch.randn(5, 2, 8, requires_grad=True)
    _opcheck(fwd, (qv, kv, kv, cu, cu, None, 3, 3, 0.3, True, -1, 0, 0.0, False))
    out, lse = torch.ops.flash_attn._fwd(q, k, v, None, None, None, 4, 5, 0.3, True, -1, 0,
                                         0.0, False)
    assert lse.shape == (2, 4, 4) and lse.dtype == torch.float32
    _opcheck(bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                   lse, None, None, 4, 5, 0.3, True, -1, 0, 0.0, False))
    out, lse = torch.ops.flash_attn._fwd(qv, kv, kv, cu, cu, None, 3, 3, 0.3, True, -1, 0,
                                         0.0, False)
    assert lse.shape == (4, 5) and lse.dtype == torch.float32
    _opcheck(bwd, (torch.randn_like(out), qv.detach(), kv.detach(), kv.detach(),
                   out.detach(), lse, cu, cu, 3, 3, 0.3, True, -1, 0, 0.0, False))
    # the trailing optional tensors: ALiBi slopes ((nheads,) and (batch, nheads)), leftpad_k
    for slopes in (torch.rand(4), torch.rand(2, 4)):
        _opcheck(fwd, (q, k, v, None, None, None, 4, 5, 0.3, True, -1, 0, 0.0, False, None,
                       None, None, slopes))
        _opcheck(bwd, (torch.randn(2, 4, 4, 8), q.detach(), k.detach(), v.detach(),
                       torch.randn(2, 4, 4, 8), torch.randn(2, 4, 4), None, None, 4, 5, 0.3,
                       True, -1, 0, 0.0, False, slopes))
    used, pad = torch.tensor([3, 4], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    _opcheck(fwd, (q.detach(), k.detach(), v.detach(), None, None, used, 4, 5, 0.3, True, -1,
                   0, 0.0, False, None, None, pad))  # forward only


def _have_cxx():
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.skipif(os.environ.get("FLASH_ATTN_SKIP_INDUCTOR") == "1",
                    reason="FLASH_ATTN_SKIP_INDUCTOR=1")
@pytest.mark.skipif(not _have_cxx(), reason="inductor on CPU needs a C++ compiler")
def test_compile_inductor_forward():
    """Forward only; ~40 s cold on 2 cores (C++ codegen), set FLASH_ATTN_SKIP_INDUCTOR=1 to skip."""
    torch.manual_seed(4)
    torch._dynamo.reset()
    mod = Attention(causal=True)
    q = torch.randn(2, 5, 4, 8)
    k = torch.randn(2, 5, 2, 8)
    v = torch.randn(2, 5, 2, 8)
    t0 = time.time()
    with torch.no_grad():
        out_c = torch.compile(mod, fullgraph=True, backend="inductor")(q, k, v)
        out_e = mod(q, k, v)
    torch.testing.assert_close(out_c, out_e)
    assert time.time() - t0 < 300
