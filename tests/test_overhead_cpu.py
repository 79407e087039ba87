"""The eager fast path of flash_attn.ops (device implementation called directly, through
``_FlashAttnFunc`` when a gradient is needed) against the custom-op path it bypasses, on CPU:
identical outputs, softmax_lse and gradients, the custom ops untouched in plain eager mode and
used whenever torch.compile, a mode or a tensor subclass could see them. Functional only: the
overhead itself is not timed here."""

import pytest
import torch

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    ops,
)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls that reach the custom ops ``flash_attn::_fwd`` / ``flash_attn::_bwd``."""
    calls = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = ops._fwd_op, ops._bwd_op

    def fwd(*args):
        calls["fwd"] += 1
        return real_fwd(*args)

    def bwd(*args):
        calls["bwd"] += 1
        return real_bwd(*args)

    monkeypatch.setattr(ops, "_fwd_op", fwd)
    monkeypatch.setattr(ops, "_bwd_op", bwd)
    return calls


def cu_from_lens(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def batched(b, sq, sk, h, hk, d, dtype=torch.float32):
    return [torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype)]


# (name, inputs factory, call) with call(*inputs) -> (out, softmax_lse)
CASES = [
    ("causal", lambda: batched(2, 5, 7, 4, 4, 16),
     lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]),
    ("window", lambda: batched(2, 6, 6, 2, 2, 8),
     lambda q, k, v: flash_attn_func(q, k, v, window_size=(2, 1), return_attn_probs=True)[:2]),
    ("softcap", lambda: batched(1, 4, 9, 2, 2, 24),
     lambda q, k, v: flash_attn_func(q, k, v, softcap=1.5, softmax_scale=0.7,
                                     return_attn_probs=True)[:2]),
    ("gqa", lambda: batched(2, 5, 5, 6, 2, 16),
     lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]),
    ("headdim33", lambda: batched(1, 5, 6, 2, 1, 33),
     lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(3, -1),
                                     return_attn_probs=True)[:2]),
    ("bf16", lambda: batched(1, 3, 4, 2, 2, 8, dtype=torch.bfloat16),
     lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]),
    ("varlen", lambda: [torch.randn(8, 4, 16), torch.randn(11, 2, 16), torch.randn(11, 2, 16)],
     lambda q, k, v: flash_attn_varlen_func(
         q, k, v, cu_from_lens([3, 1, 4]), cu_from_lens([5, 2, 4]), 4, 5, causal=True,
         softcap=2.0, return_attn_probs=True)[:2]),
    ("qkvpacked", lambda: [torch.randn(2, 5, 3, 2, 16)],
     lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)[:2]),
    ("kvpacked", lambda: [torch.randn(2, 3, 4, 8), torch.randn(2, 5, 2, 2, 8)],
     lambda q, kv: flash_attn_kvpacked_func(q, kv, window_size=(1, 1),
                                            return_attn_probs=True)[:2]),
]


def run(call, inputs, requires_grad):
    """(out, lse, grads) of call(*inputs); grads None where an input does not require grad."""
    inputs = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, requires_grad)]
    out, lse = call(*inputs)
    if out.requires_grad:
        dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
        out.backward(dout)
    return out.detach(), lse, [t.grad for t in inputs]


def assert_identical(a, b):
    (out_a, lse_a, grads_a), (out_b, lse_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    torch.testing.assert_close(lse_a, lse_b, atol=0, rtol=0)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(ga, gb, atol=0, rtol=0)


@pytest.mark.parametrize("grad", ["all", "first", "last", "none"])
@pytest.mark.parametrize("name,make,call", CASES, ids=[c[0] for c in CASES])
def test_fast_path_matches_custom_op(name, make, call, grad, op_calls, monkeypatch):
    torch.manual_seed(0)
    inputs = make()
    n = len(inputs)
    requires_grad = {"all": [True] * n, "first": [True] + [False] * (n - 1),
                     "last": [False] * (n - 1) + [True], "none": [False] * n}[grad]
    fast = run(call, inputs, requires_grad)
    assert op_calls == {"fwd": 0, "bwd": 0}  # plain eager: the custom ops are bypassed
    monkeypatch.setattr(ops, "_direct_call_ok", lambda *tensors: False)
    slow = run(call, inputs, requires_grad)
    assert op_calls == {"fwd": 1, "bwd": int(grad != "none")}
    assert_identical(fast, slow)


def test_no_grad_mode_bypasses_autograd(op_calls):
    torch.manual_seed(1)
    q, k, v = (t.requires_grad_() for t in batched(1, 4, 4, 2, 2, 8))
    with torch.no_grad():
        out = flash_attn_func(q, k, v)
    assert out.grad_fn is None and not out.requires_grad
    with torch.inference_mode():
        assert flash_attn_func(q, k, v).is_inference()
    out = flash_attn_func(q.detach(), k.detach(), v.detach())
    assert out.grad_fn is None
    assert op_calls == {"fwd": 0, "bwd": 0}


def test_ops_entry_points_match_custom_ops():
    """ops.flash_attn_fwd / flash_attn_bwd (fast path) against torch.ops.flash_attn._fwd / _bwd
    called directly, with the normalized arguments the interface passes (varlen, GQA,
    seqused_k)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu_q, cu_k = cu_from_lens([3, 4]), cu_from_lens([5, 4])
    seqused = torch.tensor([4, 2], dtype=torch.int32)
    for seqused_k in (None, seqused):
        args = (q, k, v, cu_q, cu_k, seqused_k, 4, 5, 0.3, True, 1, 0, 1.25, False)
        fast = ops.flash_attn_fwd(*args)
        slow = torch.ops.flash_attn._fwd(*args)
        for a, b in zip(fast, slow):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    out, lse = fast
    dout = torch.randn_like(out)
    bargs = (dout, q, k, v, out, lse, cu_q, cu_k, 4, 5, 0.3, True, 1, 0, 1.25, False)
    for a, b in zip(ops.flash_attn_bwd(*bargs), torch.ops.flash_attn._bwd(*bargs)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_seqused_k_backward_error_on_both_paths(monkeypatch):
    torch.manual_seed(3)
    q, k, v = (torch.randn(4, 2, 8, requires_grad=True) for _ in range(3))
    cu = cu_from_lens([4])
    args = (q, k, v, cu, cu, torch.tensor([3], dtype=torch.int32), 4, 4, 0.3, False, -1, -1,
            0.0, False)
    for op in (ops.flash_attn_fwd, torch.ops.flash_attn._fwd):
        out, _ = op(*args)
        with pytest.raises(NotImplementedError, match="does not support seqused_k"):
            out.sum().backward()


def test_double_backward_raises_like_the_op():
    """The backward is not differentiable: with create_graph=True the custom op _bwd keeps
    autograd's error for backpropagating through it."""
    torch.manual_seed(4)
    q, k, v = (t.requires_grad_() for t in batched(1, 3, 3, 2, 2, 8))
    (dq,) = torch.autograd.grad(flash_attn_func(q, k, v, causal=True).sum(), q,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dq.sum().backward()


def test_modes_and_meta_take_the_custom_op(op_calls):
    """Under a dispatch mode (here FakeTensorMode) and for meta tensors, the op (its fake
    implementation) runs, as before the fast path existed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 4, 2, 8, requires_grad=True)
        out = flash_attn_func(q, q, q, causal=True)
        assert out.shape == q.shape
    assert op_calls["fwd"] == 1
    q = torch.empty(2, 3, 2, 8, device="meta", requires_grad=True)
    out, lse = ops.flash_attn_fwd(q, q, q, None, None, None, 3, 3, 0.3, False, -1, -1, 0.0)
    assert out.device.type == "meta" and lse.shape == (2, 2, 3) and out.requires_grad
    assert op_calls["fwd"] == 2


def test_compile_fullgraph_traces_the_custom_ops():
    """torch.compile(fullgraph=True) of flash_attn_func records the custom ops (not the eager
    autograd.Function), and matches the eager fast path forward and backward."""
    torch.manual_seed(5)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True, softcap=1.5, return_attn_probs=True)[:2]

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    inputs = batched(2, 5, 6, 4, 2, 12)
    fast = run(f, inputs, [True] * 3)
    traced = run(compiled, inputs, [True] * 3)
    assert_identical(fast, traced)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes]
    assert any("flash_attn._fwd" in t for t in targets), targets
