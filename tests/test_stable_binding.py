"""The built extension on PyTorch's stable C ABI (docs/stable_abi.md), without a GPU: importing
``flash_attn._C`` registers ``torch.ops.flash_attn_cuda`` (``_C.op_namespace``), the library needs no torch C++ symbol,
and the binding's own checks raise RuntimeErrors. Skipped where no extension was built (a CPU
torch builds one with FLASH_ATTN_BUILD_WITH_CPU_TORCH=1)."""

import importlib.util
import re
import shutil
import subprocess
from typing import Callable

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flash_attn._C") is None,
                                reason="flash_attn._C was not built")

_CUDA_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def _q() -> torch.Tensor:
    return torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)


def _ops():
    """The kernels' ops: torch.ops.flash_attn_cuda, or an A/B build's own namespace."""
    import flash_attn._C as ext

    return getattr(torch.ops, ext.op_namespace)


def test_import_registers_the_ops():
    import flash_attn._C as ext

    assert ext.op_namespace.startswith("flash_attn_cuda")
    for name in ("fwd", "bwd", "fwd_plain", "bwd_plain", "kvcache_update", "stream_value32"):
        assert hasattr(_ops(), name)
    assert {"archs", "kernels", "cuda", "cutlass", "sass_archs"} <= set(ext.build_info())
    assert ext.bad_input_word_address(0) == 0 or torch.cuda.is_available()


def test_no_torch_cxx_symbols():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed")
    import flash_attn._C as ext

    out = subprocess.run([nm, "-D", "--undefined-only", "--demangle", ext.__file__],
                         capture_output=True, text=True, check=True).stdout
    torch_cxx = [line for line in out.splitlines() if re.search(r" (at|c10|torch)::", line)]
    assert torch_cxx == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_stream_value32_writes_then_waits():
    # Ring attention's copy-engine transport orders its streams by these two operations.
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    _ops().stream_value32(word, 7, False)
    _ops().stream_value32(word, 7, True)  # already satisfied: the stream goes on
    torch.cuda.synchronize()
    assert word.item() == 7
    with pytest.raises(RuntimeError, match="int32 tensor of one element"):
        _ops().stream_value32(torch.zeros(2, dtype=torch.int32, device="cuda"), 1, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors on the CUDA key")
def test_cpu_tensors_get_the_dispatcher_error():
    import flash_attn._C as ext

    q = _q()
    with pytest.raises(NotImplementedError, match=f"{ext.op_namespace}::fwd"):
        _ops().fwd(q, q, q, None, None, None, 8, 8, 0.125, True, -1, 0, 0.0)


@pytest.mark.parametrize("call, message", [
    (lambda q: _ops().fwd.default.redispatch(
        _CUDA_KEY, q, q, q, None, None, None, 8, 8, 0.125, True, -1, 0, 0.0),
     "flash_attn: q must be a CUDA tensor"),
    (lambda q: _ops().fwd.default.redispatch(
        _CUDA_KEY, q.float(), q, q, None, None, None, 8, 8, 0.125, True, -1, 0, 0.0),
     "flash_attn: expected float16 or bfloat16 tensors, got Float"),
    (lambda q: _ops().fwd.default.redispatch(
        _CUDA_KEY, q, q, q, None, None, None, 8, 8, 0.125, True, -1, 0, 0.0, None, None, None,
        None, None, 0.0, None, -3),
     "flash_attn: sm_margin must be >= 0, got -3"),
    (lambda q: _ops().bwd.default.redispatch(
        _CUDA_KEY, q, q, q, q, q, torch.zeros(1, 2, 8), None, None, 8, 8, 0.125, True, -1, 0,
        0.0, False),
     "flash_attn: q must be a CUDA tensor"),
    (lambda q: _ops().fwd_plain.default.redispatch(
        _CUDA_KEY, q, q, q, [8.0, 8.0, 0.125, 1.0, -1.0, 0.0, 0.0, 0.0]),
     "flash_attn: q must be a CUDA tensor"),
    (lambda q: _ops().fwd_plain.default.redispatch(
        _CUDA_KEY, q, q, q, [8.0, 8.0, 0.125, 1.0, -1.0, 0.0, 0.0, -3.0]),
     "flash_attn: sm_margin must be >= 0, got -3"),
    (lambda q: _ops().fwd_plain.default.redispatch(_CUDA_KEY, q, q, q, [8.0, 8.0]),
     "flash_attn: fwd_plain takes [max_seqlen_q, max_seqlen_k, softmax_scale, causal, "
     "window_left, window_right, softcap, sm_margin], got 2 numbers"),
    (lambda q: _ops().bwd_plain.default.redispatch(
        _CUDA_KEY, q, q, q, q, q, torch.zeros(1, 2, 8),
        [8.0, 8.0, 0.125, 1.0, -1.0, 0.0, 0.0, 0.0]),
     "flash_attn: q must be a CUDA tensor"),
    (lambda q: _ops().kvcache_update.default.redispatch(
        _CUDA_KEY, q, q.clone(), None, q, None, None, None, 0, None, None, None, False, False),
     "flash_attn: q must be a 4-D CUDA tensor"),
])
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors on the CUDA key")
def test_binding_checks_raise(call: Callable[[torch.Tensor], object], message: str):
    """CPU tensors sent to the CUDA kernels by redispatch reach the binding, whose checks raise
    (a C++ exception across the stable ABI becomes a RuntimeError, not a crash)."""
    with pytest.raises(RuntimeError, match=re.escape(message)):
        call(_q())
