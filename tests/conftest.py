"""Shared pytest configuration.

* Registers the ``gpu`` marker; tests marked ``gpu``, and the tests of files named
  ``test_*gpu*.py`` (the convention of the GPU test files), are skipped when no CUDA device is
  usable, so ``pytest tests/`` works on CPU-only machines. ``-k "not gpu"`` deselects them.
* A test that needs a kernel this build did not compile (a subset build, see the README's build
  flags) is skipped, naming the kernel, instead of failing.
* Keeps CPU tests quick and reproducible: few intra-op threads, no TF32.
"""

import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the built flash_attn._C")
    config.addinivalue_line("markers", "slow: slow test")


def _cuda_usable() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_usable():
        return
    skip = pytest.mark.skip(reason="no CUDA device available")
    for item in items:
        name = getattr(item, "path", None)
        in_gpu_file = name is not None and name.name.startswith("test_") and "gpu" in name.name
        if item.get_closest_marker("gpu") is not None or in_gpu_file:
            item.add_marker(skip)


def _subset_build() -> bool:
    """Whether the extension lacks any (kind, dtype, head-dim tier) of a full build."""
    try:
        from flash_attn.ops import _HEADDIM_TIERS, load_extension

        kernels = load_extension().build_info()["kernels"]
    except Exception:
        return False
    have = {(k["kind"], k["dtype"], k["headdim"]) for k in kernels}
    full = {(kind, dt, d) for kind in ("fwd", "bwd") for dt in ("fp16", "bf16")
            for d in _HEADDIM_TIERS}
    return not full <= have


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    try:
        return (yield)
    except NotImplementedError as e:
        # flash_attn.ops.require_kernel's message, in a subset build only: in a full build the
        # same error is a dispatch bug and fails the test.
        if "kernel was built for" not in str(e) or not _subset_build():
            raise
        # A record of a bad input that kernels run before the missing one left, which the test
        # would have taken, goes with the test (else the teardown check fails it).
        _take_bad_input_records()
        pytest.skip(f"not in this build: {e}")


def _take_bad_input_records() -> list:
    """The bad-input records (flash_attn/_bad_input.py) of every device, taken, once the
    device's work is done; empty without CUDA or before the extension's first use."""
    if not torch.cuda.is_available():
        return []
    from flash_attn import _bad_input, ops

    if ops._EXT is None:
        return []
    torch.cuda.synchronize()
    values = (_bad_input.take(index) for index in range(torch.cuda.device_count()))
    return [_bad_input.describe(value) for value in values if value]


@pytest.fixture(autouse=True)
def no_bad_input_left_behind():
    """After a test that ran kernels: a bad-input record it left fails that test, not the next
    one, whose first call would raise it. A test that passes bad values on purpose takes the
    record with flash_attn.check_bad_inputs()."""
    yield
    records = _take_bad_input_records()
    if records:
        pytest.fail("the test left a bad-input record behind: " + records[0])


def pytest_sessionstart(session):
    # The CPU suite is run on small machines; oversubscribing threads only slows it down.
    if "FLASH_ATTN_TEST_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["FLASH_ATTN_TEST_THREADS"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture
def seed():
    """Seed torch's RNG per test (tests draw fresh random data after this)."""
    torch.manual_seed(0)
    return 0
