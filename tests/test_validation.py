"""Every bad argument raises the documented error type, naming the function and the argument.

CUDA-only rules (dtype, head dim limit, device of cu_seqlens) are exercised with fake CUDA
tensors (``FakeTensorMode``), which need no GPU: only the validators run on them.
"""

import math

import pytest
import torch

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flash_attn import _validation as V


def qkv4(b=2, sq=4, sk=5, h=4, hk=2, d=8, dtype=torch.float32):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def varlen_inputs(lens_q=(2, 3), lens_k=(4, 1), h=4, hk=2, d=8):
    q = torch.randn(sum(lens_q), h, d)
    k = torch.randn(sum(lens_k), hk, d)
    v = torch.randn(sum(lens_k), hk, d)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def raises(exc, *words):
    """Context manager: raises `exc` whose message contains all `words`."""

    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *a):
            res = self.ctx.__exit__(*a)
            msg = str(self.info.value)
            for w in words:
                assert w in msg, f"{w!r} not in message: {msg}"
            return res

    return _Ctx()


@pytest.fixture
def fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    try:
        with mode:
            torch.empty(1, device="cuda")
    except Exception as e:  # pragma: no cover
        pytest.skip(f"fake CUDA tensors unavailable: {e}")
    return mode


# ---------------------------------------------------------------------------------------------
# tensor checks
# ---------------------------------------------------------------------------------------------


def test_not_a_tensor():
    torch.manual_seed(0)
    q, k, v = qkv4()
    with raises(TypeError, "flash_attn_func", "q", "torch.Tensor", "list"):
        flash_attn_func([1.0], k, v)
    with raises(TypeError, "v", "torch.Tensor", "NoneType"):
        flash_attn_func(q, k, None)
    with raises(TypeError, "flash_attn_qkvpacked_func", "qkv", "ndarray"):
        flash_attn_qkvpacked_func(q.numpy())


def test_integer_dtype_on_cpu():
    q, k, v = (torch.ones(1, 2, 2, 8, dtype=torch.int32) for _ in range(3))
    with raises(TypeError, "flash_attn_func", "q", "torch.int32", "floating point"):
        flash_attn_func(q, k, v)


def test_mixed_dtypes():
    torch.manual_seed(1)
    q, k, v = qkv4()
    with raises(TypeError, "k", "same dtype", "torch.float64", "torch.float32"):
        flash_attn_func(q, k.double(), v)
    with raises(TypeError, "v", "torch.float16"):
        flash_attn_func(q, k, v.half())


def test_device_mismatch():
    torch.manual_seed(2)
    q, k, v = qkv4()
    with raises(ValueError, "k", "same device", "meta"):
        flash_attn_func(q, k.to("meta"), v)


def test_ranks():
    torch.manual_seed(3)
    q, k, v = qkv4()
    with raises(ValueError, "flash_attn_func", "q", "4-D", "(batch, seqlen_q, nheads, headdim)",
                "3-D"):
        flash_attn_func(q[0], k, v)
    with raises(ValueError, "k", "4-D"):
        flash_attn_func(q, k[..., None], v)
    vq, vk, vv, cu_q, cu_k, mq, mk = varlen_inputs()
    with raises(ValueError, "flash_attn_varlen_func", "q", "3-D", "(total_q, nheads, headdim)"):
        flash_attn_varlen_func(vq[None], vk, vv, cu_q, cu_k, mq, mk)


def test_shape_consistency():
    torch.manual_seed(4)
    q, k, v = qkv4()
    with raises(ValueError, "k and v", "same shape"):
        flash_attn_func(q, k, v[:, :4])
    with raises(ValueError, "batch size"):
        flash_attn_func(q[:1], k, v)
    with raises(ValueError, "headdim", "q", "k"):
        flash_attn_func(q, k[..., :4], v[..., :4])
    with raises(ValueError, "divisible", "4", "3"):
        flash_attn_func(q, torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8))
    with raises(ValueError, "headdim", "> 0"):
        flash_attn_func(q[..., :0], k[..., :0], v[..., :0])


def test_packed_shapes():
    torch.manual_seed(5)
    with raises(ValueError, "flash_attn_qkvpacked_func", "qkv", "(batch, seqlen, 3, nheads, "
                "headdim)"):
        flash_attn_qkvpacked_func(torch.randn(2, 4, 2, 2, 8))
    with raises(ValueError, "qkv", "5-D"):
        flash_attn_qkvpacked_func(torch.randn(8, 3, 2, 8))
    with raises(ValueError, "flash_attn_kvpacked_func", "kv", "(batch, seqlen_k, 2, nheads_k"):
        flash_attn_kvpacked_func(torch.randn(2, 4, 2, 8), torch.randn(2, 4, 3, 2, 8))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with raises(ValueError, "flash_attn_varlen_qkvpacked_func", "qkv", "(total, 3, nheads"):
        flash_attn_varlen_qkvpacked_func(torch.randn(4, 2, 2, 8), cu, 4)
    with raises(ValueError, "flash_attn_varlen_kvpacked_func", "kv", "(total_k, 2, nheads_k"):
        flash_attn_varlen_kvpacked_func(torch.randn(4, 2, 8), torch.randn(4, 3, 2, 8), cu, cu,
                                        4, 4)
    with raises(ValueError, "kv", "batch size"):
        flash_attn_kvpacked_func(torch.randn(2, 4, 2, 8), torch.randn(3, 4, 2, 2, 8))


# ---------------------------------------------------------------------------------------------
# CUDA-only rules, on fake CUDA tensors
# ---------------------------------------------------------------------------------------------


def test_cuda_fp32_rejected_with_cast_hint(fake_cuda):
    with fake_cuda:
        q = torch.empty(2, 4, 2, 8, device="cuda", dtype=torch.float32)
        with raises(TypeError, "flash_attn_func: q must be float16 or bfloat16 on CUDA, got "
                    "torch.float32; cast with q.half() or q.bfloat16()"):
            V.validate_qkv("flash_attn_func", q, q, q)
        qkv = torch.empty(2, 4, 3, 2, 8, device="cuda", dtype=torch.float32)
        with raises(TypeError, "qkv must be float16 or bfloat16", "qkv.half()"):
            V.validate_qkvpacked("flash_attn_qkvpacked_func", qkv)


def test_cuda_headdim_limit(fake_cuda):
    with fake_cuda:
        q = torch.empty(1, 4, 2, 264, device="cuda", dtype=torch.float16)
        with raises(ValueError, "headdim", "<= 256", "264"):
            V.validate_qkv("flash_attn_func", q, q, q)
        q = torch.empty(1, 4, 2, 256, device="cuda", dtype=torch.bfloat16)
        a = V.validate_qkv("flash_attn_func", q, q, q)
        assert a.headdim == 256 and a.device_type == "cuda"
    # no limit on CPU
    q = torch.randn(1, 2, 1, 264)
    assert flash_attn_func(q, q, q).shape == q.shape


def test_cuda_cu_seqlens_device(fake_cuda):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with fake_cuda:
        q = torch.empty(4, 2, 8, device="cuda", dtype=torch.float16)
        with raises(ValueError, "cu_seqlens_q", "same device", "cpu"):
            V.validate_varlen_qkv("flash_attn_varlen_func", q, q, q, cu, cu, 4, 4)


def test_cuda_value_checks_are_env_gated(fake_cuda, monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_CHECK_INPUTS", raising=False)
    assert not V.check_inputs_enabled()
    with fake_cuda:
        q = torch.empty(4, 2, 8, device="cuda", dtype=torch.float16)
        cu = torch.empty(3, device="cuda", dtype=torch.int32)  # values unknown: no sync done
        a = V.validate_varlen_qkv("flash_attn_varlen_func", q, q, q, cu, cu, 4, 4)
        assert a.varlen and a.batch == 2 and a.total_q == 4
    monkeypatch.setenv("FLASH_ATTN_CHECK_INPUTS", "1")
    assert V.check_inputs_enabled()


def test_deterministic_is_a_bool_for_every_device():
    """deterministic reaches the backward (the binding decides per kernel path); validation
    only checks its type."""
    opts = dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, deterministic=True, return_attn_probs=False)
    V._check_options("fn", "cuda", 64, *opts.values())
    V._check_options("fn", "cpu", 64, *opts.values())


# ---------------------------------------------------------------------------------------------
# varlen arguments
# ---------------------------------------------------------------------------------------------


def test_cu_seqlens_type_and_shape():
    torch.manual_seed(6)
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    with raises(TypeError, "flash_attn_varlen_func", "cu_seqlens_q", "int32", "torch.int64"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, mq, mk)
    with raises(TypeError, "cu_seqlens_k", "torch.Tensor"):
        flash_attn_varlen_func(q, k, v, cu_q, [0, 4, 5], mq, mk)
    with raises(ValueError, "cu_seqlens_k", "1-D"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k[None], mq, mk)
    with raises(ValueError, "cu_seqlens_q", "cu_seqlens_k", "same length", "3", "2"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k[:2], mq, mk)
    with raises(ValueError, "cu_seqlens_k", "same device"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k.to("meta"), mq, mk)
    strided = torch.stack([cu_k, cu_k], dim=1)[:, 0]
    with raises(ValueError, "cu_seqlens_k", "contiguous"):
        flash_attn_varlen_func(q, k, v, cu_q, strided, mq, mk)


def test_cu_seqlens_values():
    torch.manual_seed(7)
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    with raises(ValueError, "cu_seqlens_q", "start at 0"):
        flash_attn_varlen_func(q, k, v, cu_q + 1, cu_k, mq, mk)
    bad = torch.tensor([0, 4, 3], dtype=torch.int32)
    with raises(ValueError, "cu_seqlens_k", "nondecreasing"):
        flash_attn_varlen_func(q, k, v, cu_q, bad, mq, mk)
    bad = torch.tensor([0, 2, 4], dtype=torch.int32)
    with raises(ValueError, "cu_seqlens_q[-1]", "number of rows", "5", "4"):
        flash_attn_varlen_func(q, k, v, bad, cu_k, mq, mk)
    with raises(ValueError, "max_seqlen_k", "longest", "4", "3"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, 3)
    qkv = torch.randn(5, 3, 2, 8)
    with raises(ValueError, "flash_attn_varlen_qkvpacked_func", "max_seqlen", "longest"):
        flash_attn_varlen_qkvpacked_func(qkv, cu_q, 2)
    with raises(ValueError, "cu_seqlens[-1]"):
        flash_attn_varlen_qkvpacked_func(qkv[:4], cu_q, 3)


def test_max_seqlen_type():
    torch.manual_seed(8)
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    with raises(ValueError, "max_seqlen_q", ">= 0", "-1"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, -1, mk)
    with raises(TypeError, "max_seqlen_q", "int"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3.0, mk)
    with raises(TypeError, "max_seqlen_k", "tensor", "(2,)"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, torch.tensor([4, 4]))
    with raises(TypeError, "max_seqlen_k", "torch.float32"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, torch.tensor(4.0))
    with raises(TypeError, "max_seqlen_q", "True"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, True, mk)
    with raises(ValueError, "max_seqlen_k", "longest", "4", "3"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, torch.tensor(3))
    # larger than needed is fine
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq + 3, mk + 1)


@pytest.mark.parametrize("kind", ["tensor_int32", "tensor_int64", "numpy"])
def test_max_seqlen_integer_scalars(kind):
    """What FlashAttention-2 takes for max_seqlen (transformers' packed-sequence path passes
    0-dim tensors): 0-dim integer tensors and numpy integers give the same result as ints."""
    import numpy as np

    torch.manual_seed(18)
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    wrap = {
        "tensor_int32": lambda n: torch.tensor(n, dtype=torch.int32),
        "tensor_int64": lambda n: torch.tensor(n),
        "numpy": np.int64,
    }[kind]
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, wrap(mq), wrap(mk), causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    qkv = torch.randn(q.shape[0], 3, 2, 8)
    want = flash_attn_varlen_qkvpacked_func(qkv, cu_q, mq)
    got = flash_attn_varlen_qkvpacked_func(qkv, cu_q, wrap(mq))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    a = V.validate_varlen_qkv("f", q, k, v, cu_q, cu_k, wrap(mq), wrap(mk),
                              window_size=(wrap(2), wrap(-1)))
    assert type(a.seqlen_q) is int and type(a.seqlen_k) is int
    assert (a.seqlen_q, a.seqlen_k, a.window_left, a.window_right) == (mq, mk, 2, -1)


def test_block_table_needs_paged_k():
    """With block_table, k and v are pages (num_blocks, page_block_size, nheads_k, headdim):
    a varlen (total_k, nheads_k, headdim) k is refused, naming k."""
    torch.manual_seed(9)
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    with raises(ValueError, "flash_attn_varlen_func", "k", "num_blocks"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk,
                               block_table=torch.zeros(2, 1, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# scalar options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_accepted_on_both_devices(p):
    """Both paths implement dropout (tests/test_dropout.py, tests/test_dropout_gpu.py)."""
    assert V._check_options("flash_attn_func", "cuda", 8, p, None, False, (-1, -1), 0.0, False,
                            False)[-1] == p
    assert V._check_options("flash_attn_func", "cpu", 8, p, None, False, (-1, -1), 0.0, False,
                            False)[-1] == p


@pytest.mark.parametrize("p", [-0.1, 1.0, 2.0, float("nan")])
def test_dropout_out_of_range(p):
    q, k, v = qkv4()
    with raises(ValueError, "dropout_p", "[0, 1)"):
        flash_attn_func(q, k, v, dropout_p=p)


def test_alibi_slopes_checked():
    """alibi_slopes: float32 (nheads,) or (batch, nheads); other dtypes a TypeError, other
    shapes a ValueError naming the expected ones."""
    q, k, v = qkv4()
    flash_attn_func(q, k, v, alibi_slopes=torch.ones(4))
    flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), alibi_slopes=torch.ones(2, 4))
    with raises(TypeError, "flash_attn_func", "alibi_slopes", "float32"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float64))
    with raises(TypeError, "flash_attn_func", "alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=[1.0, 1.0, 1.0, 1.0])
    with raises(ValueError, "flash_attn_kvpacked_func", "alibi_slopes", "(2, 4)"):
        flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), alibi_slopes=torch.ones(2))
    with raises(ValueError, "flash_attn_func", "alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(3, 4))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_softmax_scale(scale):
    q, k, v = qkv4()
    with raises(ValueError, "softmax_scale", "finite", "> 0"):
        flash_attn_func(q, k, v, softmax_scale=scale)


def test_softmax_scale_type():
    q, k, v = qkv4()
    with raises(TypeError, "softmax_scale", "'0.5'"):
        flash_attn_func(q, k, v, softmax_scale="0.5")


@pytest.mark.parametrize("cap", [-0.5, float("inf"), float("nan")])
def test_bad_softcap(cap):
    q, k, v = qkv4()
    with raises(ValueError, "softcap", ">= 0"):
        flash_attn_func(q, k, v, softcap=cap)
    with raises(TypeError, "softcap"):
        flash_attn_func(q, k, v, softcap=None)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5)])
def test_bad_window_value(window):
    q, k, v = qkv4()
    with raises(ValueError, "window_size", ">= -1", str(window)):
        flash_attn_func(q, k, v, window_size=window)


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (1.5, 2), "ab", None, (True, 1)])
def test_bad_window_type(window):
    q, k, v = qkv4()
    with raises(TypeError, "window_size", "pair of ints"):
        flash_attn_func(q, k, v, window_size=window)


def test_bad_bool_flags():
    q, k, v = qkv4()
    with raises(TypeError, "causal", "bool"):
        flash_attn_func(q, k, v, causal=1)
    with raises(TypeError, "deterministic", "bool"):
        flash_attn_func(q, k, v, deterministic="yes")
    with raises(TypeError, "return_attn_probs", "bool"):
        flash_attn_func(q, k, v, return_attn_probs=None)


def test_validation_happens_before_launch(monkeypatch):
    from flash_attn import ops

    def boom(*a, **kw):
        raise AssertionError("the op was launched before validation finished")

    monkeypatch.setattr(ops, "flash_attn_fwd", boom)
    q, k, v = qkv4()
    with pytest.raises(ValueError):
        flash_attn_func(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError):
        flash_attn_func(q, k, v, softcap=-1.0)


# ---------------------------------------------------------------------------------------------
# normalized result
# ---------------------------------------------------------------------------------------------


def test_normalized_args():
    q, k, v = qkv4(b=2, sq=4, sk=5, h=4, hk=2, d=12)
    a = V.validate_qkv("f", q, k, v, causal=True, window_size=(3, 7), softcap=1)
    assert (a.batch, a.seqlen_q, a.seqlen_k, a.nheads, a.nheads_k, a.headdim) == (2, 4, 5, 4, 2,
                                                                                  12)
    assert (a.window_left, a.window_right, a.causal) == (3, 0, True)
    assert a.softmax_scale == pytest.approx(1 / math.sqrt(12)) and a.softcap == 1.0
    assert not a.varlen and a.total_q is None
    a = V.validate_qkv("f", q, k, v, window_size=[-1, 2], softmax_scale=2)
    assert (a.window_left, a.window_right, a.causal, a.softmax_scale) == (-1, 2, False, 2.0)
    vq, vk, vv, cu_q, cu_k, mq, mk = varlen_inputs()
    a = V.validate_varlen_qkv("f", vq, vk, vv, cu_q, cu_k, mq, mk)
    assert a.varlen and (a.batch, a.seqlen_q, a.seqlen_k, a.total_q, a.total_k) == (2, 3, 4, 5, 5)
