"""The bad-input word (flash_attn/_bad_input.py, csrc/common/bad_input.h) on the CPU: the Python
decoder agrees with the C++ codes, names the argument, the index and the value, and
raise_pending raises a recorded word once and clears it. The kernels' side runs in
tests/test_errors_gpu.py."""

import ctypes
import pathlib
import re

import pytest
import torch

from flash_attn import _bad_input, ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pack(code: int, index: int, value: int) -> int:
    return (code << 56) | ((index & 0xFFFFFF) << 32) | (value & 0xFFFFFFFF)


def _cpp_codes():
    text = (ROOT / "csrc" / "common" / "bad_input.h").read_text()
    body = text[text.index("enum class BadInput"):]
    body = body[:body.index("};")]
    return {name: int(v) for name, v in re.findall(r"\b(k\w+)\s*=\s*(\d+)", body)}


# The C++ enumerator for each argument name the Python table reports.
CPP_NAMES = {
    "kCuSeqlensQ": "cu_seqlens_q", "kCuSeqlensK": "cu_seqlens_k", "kSequsedK": "seqused_k",
    "kKvBatchIdx": "cache_batch_idx", "kLeftpadK": "cache_leftpad",
    "kBlockTable": "block_table", "kMaxSeqlenQ": "max_seqlen_q",
    "kMaxSeqlenK": "max_seqlen_k", "kCacheSeqlens": "cache_seqlens",
}


def test_codes_match_the_cpp_enum():
    codes = _cpp_codes()
    assert codes.pop("kNone") == 0
    assert set(codes) == set(CPP_NAMES)
    assert set(codes.values()) == set(_bad_input._CODES)
    for enumerator, code in codes.items():
        assert _bad_input._CODES[code][0].startswith(CPP_NAMES[enumerator]), enumerator


@pytest.mark.parametrize("code", sorted(_bad_input._CODES))
def test_describe_names_argument_index_and_value(code):
    msg = _bad_input.describe(_pack(code, 12345, -7))
    name, index_kind, _ = _bad_input._CODES[code]
    assert msg.startswith(f"flash_attn: {name} was out of range")
    assert f"{index_kind} 12345 has value -7" in msg
    assert "check_bad_inputs" in msg


def test_describe_large_values_and_unknown_code():
    assert "entry 16777214 has value 2147483647" in _bad_input.describe(
        _pack(1, 0xFFFFFE, 2**31 - 1))
    assert "entry >= 16777215 has value" in _bad_input.describe(_pack(1, 0xFFFFFF, 5))
    assert "code 200" in _bad_input.describe(_pack(200, 1, 1))


class _FakeExt:
    """The extension's word functions over a ctypes word (the binding swaps atomically)."""

    def __init__(self, word: ctypes.c_uint64):
        self.word = word
        self.takes = 0

    def take_bad_input(self, index: int) -> int:
        self.takes += 1
        value, self.word.value = self.word.value, 0
        return value


@pytest.fixture
def fake_word(monkeypatch):
    word = ctypes.c_uint64(0)
    ext = _FakeExt(word)
    monkeypatch.setattr(ops, "_EXT", ext)  # as if the extension had run kernels
    monkeypatch.setattr(_bad_input, "_word", lambda index: word)
    monkeypatch.delenv("FLASH_ATTN_BAD_INPUTS", raising=False)
    return word, ext


def test_raise_pending_raises_once_and_clears(fake_word):
    word, ext = fake_word
    word.value = _pack(6, 3, 99)
    cuda0 = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"block_table .*element offset 3 has value 99"):
        _bad_input.raise_pending(cuda0)
    assert word.value == 0 and ext.takes == 1
    _bad_input.raise_pending(cuda0)  # nothing recorded: no error, and no take
    assert ext.takes == 1
    _bad_input.raise_pending(torch.device("cpu"))


def test_modes_warn_and_off(fake_word, monkeypatch):
    word, ext = fake_word
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setenv("FLASH_ATTN_BAD_INPUTS", "warn")
    word.value = _pack(4, 1, 7)
    with pytest.warns(RuntimeWarning, match=r"cache_batch_idx .*batch index 1 has value 7"):
        _bad_input.raise_pending(cuda0)
    assert word.value == 0
    monkeypatch.setenv("FLASH_ATTN_BAD_INPUTS", "off")
    word.value = _pack(4, 1, 7)
    _bad_input.raise_pending(cuda0)
    assert word.value == _pack(4, 1, 7) and ext.takes == 1  # not read, not cleared
    monkeypatch.setenv("FLASH_ATTN_BAD_INPUTS", "loud")
    with pytest.raises(ValueError, match="FLASH_ATTN_BAD_INPUTS must be one of raise, warn, off"):
        _bad_input.raise_pending(cuda0)


def test_no_word_yet_means_nothing_recorded(monkeypatch):
    monkeypatch.setattr(ops, "_EXT", object())
    monkeypatch.setattr(_bad_input, "_word", lambda index: None)
    _bad_input.raise_pending(torch.device("cuda", 0))


def test_raise_pending_is_free_before_any_kernel(monkeypatch):
    monkeypatch.setattr(ops, "_EXT", None)

    def no_word(index):
        raise AssertionError("the word is not read before the extension is loaded")

    monkeypatch.setattr(_bad_input, "_word", no_word)
    _bad_input.raise_pending(torch.device("cuda", 0))


def test_check_bad_inputs_without_cuda_is_a_no_op():
    if torch.cuda.is_available():
        pytest.skip("covered by tests/test_errors_gpu.py on a GPU")
    import flash_attn

    flash_attn.check_bad_inputs()
