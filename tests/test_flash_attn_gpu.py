"""GPU tests: the CUDA kernels (batched API) against the reference in tests/attn_ref.py.

Accuracy rule (per tensor): max|ours - ref| <= mult * max|pt - ref| + atol, with ``ref`` the
float64 reference on upcast inputs, ``pt`` the same attention computed "as PyTorch would" in the
input dtype, mult = 2 for out and dv, 3 for dq and dk, atol = 1e-5 * max(1, max|ref|).
Outputs cannot be passed in (FlashAttention-2's API), so the CUDA caching allocator is filled with
NaN before every test: anything a kernel forgets to write reads back as NaN and fails.

Every test runs on each kernel path of the GPU (``sm90`` and ``sm80`` on an H100; the id says
which; FLASH_ATTN_TEST_PATHS=sm90 narrows it): the SM90 path runs the Hopper kernels (the SM80
backward where dropout is on), the other forces the SM80 kernels.

Sizes are chosen for a whole-suite run of a few minutes on one H100.
"""

import itertools
import os
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import (  # noqa: E402
    REF_DTYPE,
    assert_backward_repeatable,
    assert_accuracy,
    assert_finite,
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
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
    )

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HDIMS = [32, 40, 64, 80, 96, 128, 160, 192, 224, 256]
SEQLENS = [(1, 1), (1, 239), (113, 203), (203, 113), (256, 17), (1000, 1000), (2048, 2048)]
MID_SEQLENS = SEQLENS[1:6]  # without (1, 1) and (2048, 2048)


def batch_heads(seqlen_q: int, seqlen_k: int) -> Tuple[int, int]:
    """Batch 2-4 and nheads 2-6, smaller for the long sequences (keeps every case cheap)."""
    work = seqlen_q * seqlen_k
    if work <= 1_000:
        return 4, 6
    if work <= 60_000:
        return 3, 4
    if work <= 1_100_000:
        return 2, 3
    return 2, 2


@dataclass(frozen=True)
class Case:
    dtype: str
    d: int
    sq: int
    sk: int
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    scale: Optional[float] = None

    @property
    def id(self) -> str:
        parts = [self.dtype, f"d{self.d}", f"{self.sq}x{self.sk}"]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        return "-".join(parts)

    def api_kwargs(self):
        return dict(dropout_p=0.0, softmax_scale=self.scale, causal=self.causal,
                    window_size=self.window, softcap=self.softcap)

    def ref_kwargs(self):
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap,
                    softmax_scale=self.scale)


def params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


def make_qkv(case: Case, b=None, h=None, hk=None):
    dtype = DTYPES[case.dtype]
    b0, h0 = batch_heads(case.sq, case.sk)
    b, h = b or b0, h or h0
    hk = hk or h
    return (rand(b, case.sq, h, case.d, dtype=dtype), rand(b, case.sk, hk, case.d, dtype=dtype),
            rand(b, case.sk, hk, case.d, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Main grid: forward + backward
# ---------------------------------------------------------------------------------------------


def _main_cases():
    cases = []
    # Full head-dim x seqlen grid, plain and causal, bf16.
    for d, (sq, sk), causal in itertools.product(HDIMS, SEQLENS, (False, True)):
        cases.append(Case("bf16", d, sq, sk, causal))
    # fp16: every head dim (every compiled fp16 kernel) over the mid-size seqlens, plus the long one.
    for d, (sq, sk), causal in itertools.product(HDIMS, MID_SEQLENS, (False, True)):
        cases.append(Case("fp16", d, sq, sk, causal))
    for d, causal in itertools.product((64, 128), (False, True)):
        cases.append(Case("fp16", d, 2048, 2048, causal))
    # Sliding windows (bottom-right aligned); (-1, 0) must equal causal.
    for w, d, (sq, sk) in itertools.product(((64, 32), (-1, 0), (32, -1), (0, 0)), (64, 128),
                                            MID_SEQLENS):
        cases.append(Case("bf16", d, sq, sk, window=w))
    for d, (sq, sk) in itertools.product((64, 128, 256), MID_SEQLENS):
        cases.append(Case("bf16", d, sq, sk, causal=True, window=(48, 0)))
    for d, (sq, sk) in itertools.product((96, 256), ((113, 203), (1000, 1000))):
        cases.append(Case("fp16", d, sq, sk, window=(64, 32)))
    # Local and softcap paths for every head-dim tier (they may be separate kernel instances).
    for d, (sq, sk) in itertools.product(HDIMS, ((113, 203), (1000, 1000))):
        cases.append(Case("bf16", d, sq, sk, window=(64, 32)))
    for d in HDIMS[::2]:
        cases.append(Case("fp16", d, 203, 113, causal=True, window=(32, 0)))
    for d, (sq, sk) in itertools.product(HDIMS, ((203, 113), (1000, 1000))):
        cases.append(Case("bf16", d, sq, sk, causal=sq < sk, softcap=30.0, scale=1.0))
    cases.append(Case("bf16", 128, 2048, 2048, window=(256, 0)))
    cases.append(Case("bf16", 64, 2048, 2048, window=(100, 300)))
    # Softcap: strong (scale 1, scores ~ sqrt(d)) and mild, both dtypes.
    for (cap, scale, dt), d, (sq, sk), causal in itertools.product(
        ((30.0, 1.0, "bf16"), (5.0, None, "fp16")), (64, 128, 256),
        ((113, 203), (203, 113), (1000, 1000)), (False, True)
    ):
        cases.append(Case(dt, d, sq, sk, causal, softcap=cap, scale=scale))
    # Custom softmax_scale.
    for d, (sq, sk) in itertools.product((64, 128), ((113, 203), (1000, 1000))):
        cases.append(Case("bf16", d, sq, sk, scale=0.3))
    # Head dims that are not tiers / not multiples of 8 (padded by the Python layer).
    for d, (sq, sk), causal in itertools.product((8, 59, 111, 250), ((113, 203), (203, 113)),
                                                 (False, True)):
        cases.append(Case("bf16", d, sq, sk, causal))
    cases.append(Case("fp16", 1, 113, 203))
    return list(dict.fromkeys(cases))  # drop repeats, keep order


MAIN_CASES = _main_cases()


@pytest.mark.parametrize("case", params(MAIN_CASES))
def test_fwd_bwd(case: Case):
    torch.manual_seed(0)
    q, k, v = make_qkv(case)
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, **case.api_kwargs()), [q, k, v],
                  plain_qkv, case.ref_kwargs())


# ---------------------------------------------------------------------------------------------
# softmax_lse (return_attn_probs=True), forward only
# ---------------------------------------------------------------------------------------------


def _lse_cases():
    cases = []
    for d, (sq, sk), (causal, w) in itertools.product(
        (32, 40, 64, 128, 256), SEQLENS, ((False, (-1, -1)), (True, (-1, -1)), (False, (64, 32)))
    ):
        cases.append(Case("bf16", d, sq, sk, causal, window=w))
    for (sq, sk) in SEQLENS:
        cases.append(Case("bf16", 128, sq, sk, softcap=30.0, scale=1.0))
    for (sq, sk), causal in itertools.product(SEQLENS, (False, True)):
        cases.append(Case("fp16", 64, sq, sk, causal))
    return cases


LSE_CASES = _lse_cases()


@pytest.mark.parametrize("case", params(LSE_CASES))
def test_lse(case: Case):
    torch.manual_seed(1)
    q, k, v = (x.detach() for x in make_qkv(case))
    res = flash_attn_func(q, k, v, return_attn_probs=True, **case.api_kwargs())
    assert isinstance(res, tuple) and len(res) == 3, "return_attn_probs=True: (out, lse, probs)"
    out, lse, _ = res
    b, sq, h, _d = q.shape
    assert tuple(lse.shape) == (b, h, sq), tuple(lse.shape)
    out_ref, lse_ref = attention_ref(q, k, v, compute_dtype=REF_DTYPE, **case.ref_kwargs())
    out_pt, _ = attention_ref(q, k, v, compute_dtype=q.dtype, **case.ref_kwargs())
    assert_accuracy("out", out, out_ref, out_pt, 2)
    assert_lse("softmax_lse", lse, lse_ref)
    # The plain call (no lse requested) returns the same output.
    out_plain = flash_attn_func(q, k, v, **case.api_kwargs())
    assert_accuracy("out (return_attn_probs=False)", out_plain, out_ref, out_pt, 2)


# ---------------------------------------------------------------------------------------------
# Row maxima that keep rising across key blocks, forward only
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rise", ["toward_end", "toward_start"])
def test_rising_row_max(rise: str, causal: bool, d: int, dtype: str):
    """Keys scaled by a ramp along the sequence, queries sharpened: a row's max moves in steps
    both below and above the lazy softmax's margin from one key block to the next (whichever
    order the kernel visits the blocks in), and rows are dominated by a few keys, where the
    rounding of the largest P shows in the output."""
    torch.manual_seed(2)
    sq, sk = 512, 2048
    ramp = torch.linspace(0.25, 4.0, sk, device="cuda")
    if rise == "toward_start":
        ramp = ramp.flip(0)
    q = rand(1, sq, 2, d, dtype=torch.float32, requires_grad=False) * 3
    k = rand(1, sk, 2, d, dtype=torch.float32, requires_grad=False) * ramp[None, :, None, None]
    v = rand(1, sk, 2, d, dtype=torch.float32, requires_grad=False)
    q, k, v = (x.to(DTYPES[dtype]) for x in (q, k, v))
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out_ref, lse_ref = attention_ref(q, k, v, compute_dtype=REF_DTYPE, causal=causal)
    out_pt, _ = attention_ref(q, k, v, compute_dtype=q.dtype, causal=causal)
    assert_accuracy("out", out, out_ref, out_pt, 2)
    assert_lse("softmax_lse", lse, lse_ref)


# ---------------------------------------------------------------------------------------------
# The static schedule's split last round (SM90 plain kernel), forward only
# ---------------------------------------------------------------------------------------------

# (dtype, d, batch, heads, seqlen_q, seqlen_k): shapes whose units (pairs of query tiles from
# d = 128; 192-row tiles up to d = 128) fill one round of the H100's clusters and leave a tail
# that is split by key blocks; the last one has fewer units than clusters, so every tile is
# split. A seqlen_k that is not a multiple of the key block puts the masked block in one piece
# only. The first two d = 128 shapes have 11 query tiles per head: some pairs span two heads.
SPLIT_SHAPES = [
    ("bf16", 128, 2, 7, 2048, 4096),
    ("fp16", 128, 2, 7, 2048, 4001),
    ("bf16", 64, 1, 13, 2048, 4096),
    ("bf16", 256, 1, 17, 1024, 4100),
    ("bf16", 128, 1, 1, 1024, 8192),
]


def set_split(monkeypatch, split: str) -> None:
    """FLASH_ATTN_SPLIT=0 for split "0"; unset (the default: split where it pays) for "1"."""
    if split == "0":
        monkeypatch.setenv("FLASH_ATTN_SPLIT", "0")
    else:
        monkeypatch.delenv("FLASH_ATTN_SPLIT", raising=False)


def check_out_lse(q, k, v, **kw):
    """flash_attn_func's output and LSE against the reference; returns the output.
    q: (batch, seqlen_q, nheads, d); k, v: (batch, seqlen_k, nheads_k, d)."""
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    out_ref, lse_ref = attention_ref(q, k, v, compute_dtype=REF_DTYPE, **kw)
    out_pt, _ = attention_ref(q, k, v, compute_dtype=q.dtype, **kw)
    assert_accuracy("out", out, out_ref, out_pt, 2)
    assert_lse("softmax_lse", lse, lse_ref)
    return out


@pytest.mark.parametrize("split", ["0", "1"])
@pytest.mark.parametrize("dtype,d,b,h,sq,sk", SPLIT_SHAPES,
                         ids=[f"{s[0]}-d{s[1]}-b{s[2]}h{s[3]}-{s[4]}x{s[5]}" for s in SPLIT_SHAPES])
def test_split_last_round(dtype: str, d: int, b: int, h: int, sq: int, sk: int, split: str,
                          monkeypatch):
    """Output and LSE with the static schedule's last round split by key blocks (default,
    FLASH_ATTN_SPLIT unset) and unsplit (=0); the pieces' partial outputs are merged by the
    last one to finish. The SM80 path ignores the variable."""
    set_split(monkeypatch, split)
    torch.manual_seed(5)
    q = rand(b, sq, h, d, dtype=DTYPES[dtype], requires_grad=False)
    k = rand(b, sk, h, d, dtype=DTYPES[dtype], requires_grad=False)
    v = rand(b, sk, h, d, dtype=DTYPES[dtype], requires_grad=False)
    check_out_lse(q, k, v)


# ---------------------------------------------------------------------------------------------
# Split-KV of the dynamic schedule (SM90 band and packed kernels), forward only
# ---------------------------------------------------------------------------------------------

# (dtype, d, batch, heads, heads_k, seqlen_q, seqlen_k, causal, window): grids of a few tiles
# against many key blocks, so each tile's keys are split over SMs and the pieces merged: decode
# with GQA packing, a short causal query block against a long prefix, a window, and key counts
# that are not a multiple of the key block (the last piece shorter). Without GQA (the d=256 and
# the second d=128 shape) the packed kernel runs with one query head per KV head: the band
# kernel's tiles would be too few (`run_fwd_sm90`'s few_tiles).
KV_SPLIT_SHAPES = [
    ("bf16", 128, 2, 8, 2, 1, 4100, True, None),
    ("fp16", 64, 1, 16, 1, 3, 2500, True, None),
    ("bf16", 256, 1, 4, 4, 100, 3000, True, None),
    ("bf16", 128, 1, 3, 3, 1, 4000, True, None),
    ("bf16", 128, 1, 4, 2, 150, 5000, False, (1000, 200)),
    ("bf16", 96, 3, 2, 1, 7, 9000, False, None),
]


@pytest.mark.parametrize("split", ["0", "1"])
@pytest.mark.parametrize("dtype,d,b,h,hk,sq,sk,causal,window", KV_SPLIT_SHAPES,
                         ids=[f"{s[0]}-d{s[1]}-b{s[2]}h{s[3]}k{s[4]}-{s[5]}x{s[6]}"
                              f"{'-causal' if s[7] else ''}{'-window' if s[8] else ''}"
                              for s in KV_SPLIT_SHAPES])
def test_split_kv_dynamic(dtype: str, d: int, b: int, h: int, hk: int, sq: int, sk: int,
                          causal: bool, window: Optional[Tuple[int, int]], split: str,
                          monkeypatch):
    """Output and LSE where the dynamic schedule splits each tile's keys into pieces (default)
    and where it does not (FLASH_ATTN_SPLIT=0). The SM80 path ignores the variable."""
    set_split(monkeypatch, split)
    torch.manual_seed(31)
    q = rand(b, sq, h, d, dtype=DTYPES[dtype], requires_grad=False)
    k = rand(b, sk, hk, d, dtype=DTYPES[dtype], requires_grad=False)
    v = rand(b, sk, hk, d, dtype=DTYPES[dtype], requires_grad=False)
    kw = dict(causal=causal, window_size=window or (-1, -1))
    out = check_out_lse(q, k, v, **kw)
    # The merge sums the pieces in a fixed order, whichever finished last.
    for _ in range(3):
        assert torch.equal(flash_attn_func(q, k, v, **kw), out)


# (d, batch, heads, seqlen_q, seqlen_k, causal): the plain kernel's static schedule with its
# split last round, the band kernel's dynamic one, and a few tiles split by keys.
SM_MARGIN_SHAPES = [(128, 2, 8, 1000, 1000, False), (64, 2, 4, 700, 900, True),
                    (128, 1, 2, 3, 5000, False)]


@pytest.mark.parametrize("margin", [8, 16, 1000])
@pytest.mark.parametrize("d,b,h,sq,sk,causal", SM_MARGIN_SHAPES,
                         ids=[f"d{s[0]}-b{s[1]}h{s[2]}-{s[3]}x{s[4]}{'-causal' if s[5] else ''}"
                              for s in SM_MARGIN_SHAPES])
def test_sm_margin(d: int, b: int, h: int, sq: int, sk: int, causal: bool, margin: int):
    """The forward with SMs left free (ring attention's ``sm_margin``; 1000 leaves one
    cluster): the persistent grid shrinks, the schedules and splits are planned for fewer
    CTAs, and the output and LSE stay within the accuracy rule."""
    from flash_attn import ops

    torch.manual_seed(41)
    q = rand(b, sq, h, d, dtype=torch.bfloat16, requires_grad=False)
    k = rand(b, sk, h, d, dtype=torch.bfloat16, requires_grad=False)
    v = rand(b, sk, h, d, dtype=torch.bfloat16, requires_grad=False)
    out, lse = ops.flash_attn_fwd(q, k, v, None, None, None, sq, sk, d ** -0.5, causal,
                                  -1, 0 if causal else -1, 0.0, sm_margin=margin)
    out_ref, lse_ref = attention_ref(q, k, v, compute_dtype=REF_DTYPE, causal=causal)
    out_pt, _ = attention_ref(q, k, v, compute_dtype=q.dtype, causal=causal)
    assert_accuracy("out", out, out_ref, out_pt, 2)
    assert_lse("softmax_lse", lse, lse_ref)


@pytest.mark.parametrize("split", ["0", "1"])
@pytest.mark.parametrize("d", [64, 128])
def test_split_kv_seqused_k(d: int, split: str, monkeypatch):
    """A KV cache filled to a different length per sequence (seqused_k), split into pieces
    (default) and not (FLASH_ATTN_SPLIT=0): pieces past a sequence's used keys see none, and
    the rows past it hold NaN."""
    set_split(monkeypatch, split)
    torch.manual_seed(37)
    b, sq, sk, h, hk = 3, 2, 6000, 8, 2
    q = rand(b, sq, h, d, dtype=torch.bfloat16, requires_grad=False)
    k = rand(b, sk, hk, d, dtype=torch.bfloat16, requires_grad=False)
    v = rand(b, sk, hk, d, dtype=torch.bfloat16, requires_grad=False)
    check_seqused_k(q, k, v, [6000, 700, 2049], causal=True, check_lse=True)


# ---------------------------------------------------------------------------------------------
# GQA / MQA
# ---------------------------------------------------------------------------------------------


def _gqa_cases():
    cases = []
    for ratio, d, (sq, sk), causal in itertools.product(
        (1, 2, 4, 8), (64, 128), ((113, 203), (203, 113), (1000, 1000)), (False, True)
    ):
        cases.append((ratio, Case("bf16", d, sq, sk, causal)))
    for ratio, causal in itertools.product((2, 8), (False, True)):
        cases.append((ratio, Case("bf16", 256, 1000, 1000, causal)))
    for ratio, d in itertools.product((2, 4), (160, 224)):
        cases.append((ratio, Case("bf16", d, 203, 113, True)))
    for ratio, (sq, sk) in itertools.product((4,), ((113, 203), (1000, 1000))):
        cases.append((ratio, Case("fp16", 96, sq, sk, window=(64, 32))))
    cases.append((8, Case("bf16", 128, 1, 239, softcap=30.0, scale=1.0)))
    return [pytest.param(r, c, id=f"g{r}-{c.id}") for r, c in cases]


@pytest.mark.parametrize("ratio,case", _gqa_cases())
def test_gqa(ratio: int, case: Case):
    torch.manual_seed(2)
    h = 8
    q, k, v = make_qkv(case, b=2, h=h, hk=h // ratio)
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, **case.api_kwargs()), [q, k, v],
                  plain_qkv, case.ref_kwargs())


def _gqa_packing_cases():
    cases = []
    for ratio, d, (sq, sk), causal in itertools.product(
        (2, 4, 8), (64, 128), ((1, 239), (5, 1000), (113, 203)), (False, True)
    ):
        cases.append((ratio, Case("bf16", d, sq, sk, causal)))
    cases.append((4, Case("bf16", 256, 3, 500, True)))
    cases.append((4, Case("fp16", 96, 7, 300, window=(64, 32))))
    cases.append((8, Case("bf16", 128, 3, 239, softcap=30.0, scale=1.0)))
    return [pytest.param(r, c, id=f"g{r}-{c.id}") for r, c in cases]


@pytest.mark.parametrize("pack", ["0", "1"])
@pytest.mark.parametrize("ratio,case", _gqa_packing_cases())
def test_gqa_packing(ratio: int, case: Case, pack: str, monkeypatch):
    """The SM90 forward with the query heads of each KV head packed into shared tiles
    (FLASH_ATTN_PACK_GQA=1, forced; by default only short query sequences pack) and without
    (=0): both match the reference. The SM80 path ignores the variable."""
    monkeypatch.setenv("FLASH_ATTN_PACK_GQA", pack)
    torch.manual_seed(4)
    h = 8
    q, k, v = make_qkv(case, b=2, h=h, hk=h // ratio)
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, **case.api_kwargs()), [q, k, v],
                  plain_qkv, case.ref_kwargs())


# ---------------------------------------------------------------------------------------------
# Packed inputs and non-contiguous views (last dim contiguous)
# ---------------------------------------------------------------------------------------------

PACKED_CASES = [Case("bf16", d, s, s, causal) for d, s, causal in
                itertools.product((40, 64, 128, 256), (113, 1000), (False, True))]
PACKED_CASES += [Case("fp16", 96, 113, 113, True, window=(16, 8)),
                 Case("bf16", 64, 1000, 1000, softcap=30.0, scale=1.0)]


@pytest.mark.parametrize("case", params(PACKED_CASES))
def test_qkvpacked(case: Case):
    torch.manual_seed(3)
    b, h = batch_heads(case.sq, case.sk)
    qkv = rand(b, case.sq, 3, h, case.d, dtype=DTYPES[case.dtype])
    unpack = lambda qkv: (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])  # noqa: E731
    check_fwd_bwd(lambda qkv: flash_attn_qkvpacked_func(qkv, **case.api_kwargs()), [qkv],
                  unpack, case.ref_kwargs())


@pytest.mark.parametrize("case", params(PACKED_CASES[::2]))
def test_qkv_views_of_packed(case: Case):
    """flash_attn_func on the strided views qkv[:, :, i] (no copy by the caller)."""
    torch.manual_seed(4)
    b, h = batch_heads(case.sq, case.sk)
    qkv = rand(b, case.sq, 3, h, case.d, dtype=DTYPES[case.dtype])
    unpack = lambda qkv: (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])  # noqa: E731
    check_fwd_bwd(lambda qkv: flash_attn_func(*unpack(qkv), **case.api_kwargs()), [qkv],
                  unpack, case.ref_kwargs())


KVPACKED_CASES = [pytest.param(r, c, id=f"g{r}-{c.id}") for r, c in [
    (r, Case("bf16", d, sq, sk, causal)) for r, d, (sq, sk), causal in
    itertools.product((1, 2), (64, 128), ((113, 203), (203, 113)), (False, True))
] + [(4, Case("fp16", 256, 1000, 1000, True))]]


@pytest.mark.parametrize("ratio,case", KVPACKED_CASES)
def test_kvpacked(ratio: int, case: Case):
    torch.manual_seed(5)
    b, h = 2, 4
    dtype = DTYPES[case.dtype]
    q = rand(b, case.sq, h, case.d, dtype=dtype)
    kv = rand(b, case.sk, 2, h // ratio, case.d, dtype=dtype)
    unpack = lambda q, kv: (q, kv[:, :, 0], kv[:, :, 1])  # noqa: E731
    check_fwd_bwd(lambda q, kv: flash_attn_kvpacked_func(q, kv, **case.api_kwargs()), [q, kv],
                  unpack, case.ref_kwargs())


LAYOUT_CASES = [Case("bf16", d, sq, sk, causal) for d, (sq, sk), causal in
                itertools.product((64, 128, 256), ((113, 203), (1000, 1000)), (False, True))]


@pytest.mark.parametrize("case", params(LAYOUT_CASES))
def test_bhsd_transposed_views(case: Case):
    """q, k, v stored (batch, nheads, seqlen, d) and passed as .transpose(1, 2) views."""
    torch.manual_seed(6)
    b, h = batch_heads(case.sq, case.sk)
    dtype = DTYPES[case.dtype]
    leaves = [rand(b, h, case.sq, case.d, dtype=dtype), rand(b, h, case.sk, case.d, dtype=dtype),
              rand(b, h, case.sk, case.d, dtype=dtype)]
    to_qkv = lambda q, k, v: (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # noqa
    check_fwd_bwd(lambda q, k, v: flash_attn_func(*to_qkv(q, k, v), **case.api_kwargs()), leaves,
                  to_qkv, case.ref_kwargs())


@pytest.mark.parametrize("case", params([Case("bf16", 64, 113, 203), Case("bf16", 96, 203, 113, True),
                                         Case("fp16", 128, 1000, 1000, True)]))
def test_row_padded_and_head_sliced_views(case: Case):
    """Views whose rows are padded (last dim sliced from d + 8) and a head slice with an offset."""
    torch.manual_seed(7)
    b, h = batch_heads(case.sq, case.sk)
    dtype = DTYPES[case.dtype]
    d = case.d
    qp = rand(b, case.sq, h, d + 8, dtype=dtype)
    kp = rand(b, case.sk, h + 2, d, dtype=dtype)
    vp = rand(b, case.sk, h, d + 16, dtype=dtype)
    to_qkv = lambda qp, kp, vp: (qp[..., :d], kp[:, :, 1:h + 1], vp[..., 8:8 + d])  # noqa: E731
    check_fwd_bwd(lambda *t: flash_attn_func(*to_qkv(*t), **case.api_kwargs()), [qp, kp, vp],
                  to_qkv, case.ref_kwargs())


# ---------------------------------------------------------------------------------------------
# Autograd plumbing, determinism, big grids, 64-bit offsets
# ---------------------------------------------------------------------------------------------


def test_no_grad_and_inference_mode():
    torch.manual_seed(8)
    case = Case("bf16", 64, 113, 203, True)
    q, k, v = (x.detach() for x in make_qkv(case))
    out_ref, _ = attention_ref(q, k, v, compute_dtype=REF_DTYPE, causal=True)
    out_pt, _ = attention_ref(q, k, v, compute_dtype=q.dtype, causal=True)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, causal=True)
    assert_accuracy("out (no_grad)", out, out_ref, out_pt, 2)
    with torch.inference_mode():
        out = flash_attn_func(q, k, v, causal=True)
    assert_accuracy("out (inference_mode)", out, out_ref, out_pt, 2)


@pytest.mark.parametrize("which", ["q", "k", "v", "kv"])
def test_partial_requires_grad(which):
    """Only some of q, k, v require grad: those get gradients equal to the full backward's."""
    torch.manual_seed(9)
    case = Case("bf16", 128, 203, 113, True)
    q, k, v = make_qkv(case)
    dout = torch.randn_like(q)
    full = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    names = {"q": 0, "k": 1, "v": 2}
    idx = [names[c] for c in which]
    inputs = [x.detach().requires_grad_(i in idx) for i, x in enumerate((q, k, v))]
    out = flash_attn_func(*inputs, causal=True)
    part = torch.autograd.grad(out, [inputs[i] for i in idx], dout)
    for i, g in zip(idx, part):
        assert_finite(f"d{'qkv'[i]}", g)
        # Same kernels, same inputs: equal up to dq's atomic accumulation order.
        torch.testing.assert_close(g, full[i], atol=2e-2, rtol=1e-2)


def test_forward_is_deterministic():
    torch.manual_seed(10)
    case = Case("bf16", 128, 1000, 1000, True)
    q, k, v = (x.detach() for x in make_qkv(case))
    out1 = flash_attn_func(q, k, v, causal=True)
    out2 = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out1, out2)


def _deterministic_cases():
    cases = [Case("bf16", d, s, s, c) for d in (64, 128) for s in (1000, 2048)
             for c in (False, True)]
    cases += [Case("bf16", 128, 203, 1000, window=(64, 32)), Case("fp16", 32, 1000, 113, True),
              Case("bf16", 64, 1000, 1000, softcap=30.0, scale=1.0),
              # Many key tiles per query tile, queries fewer than keys (causal aligned
              # bottom-right), a window over many tiles, unequal dQ parts (d = 96) and the wide
              # tile with halves (256) and unequal parts (192).
              Case("bf16", 128, 1500, 4099, True), Case("bf16", 64, 3000, 3000, window=(700, 0)),
              Case("bf16", 96, 1000, 1000, True), Case("bf16", 256, 777, 1500, True),
              Case("bf16", 192, 777, 1500, True)]
    return cases


@pytest.mark.parametrize("case", params(_deterministic_cases()))
def test_deterministic_backward(case: Case):
    """deterministic=True, on both kernel paths: 10 backward runs give bitwise equal dq, dk, dv
    (the key tiles add dq's partial sums one at a time, highest first), and the gradients pass
    the accuracy rule."""
    torch.manual_seed(11)
    kwargs = dict(case.api_kwargs(), deterministic=True)
    q, k, v = make_qkv(case, h=4, hk=2 if case.d == 128 else 4)
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, **kwargs), [q, k, v], plain_qkv,
                  case.ref_kwargs())
    assert_backward_repeatable(flash_attn_func(q, k, v, **kwargs), (q, k, v), 10)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b,h,s", [(1, 1, 100), (1, 3, 130), (3, 1, 1)],
                         ids=["b1-h1-s100", "b1-h3-s130", "b3-h1-s1"])
def test_deterministic_odd_tile_counts(d: int, b: int, h: int, s: int):
    """deterministic=True where query tiles x heads x batch is not a multiple of 4: the dQ
    accumulator, which follows the per-tile turn counters in one workspace, must stay 16-byte
    aligned for its vector and bulk accesses."""
    torch.manual_seed(13)
    dtype = torch.bfloat16
    q, k, v = (rand(b, s, h, d, dtype=dtype) for _ in range(3))
    kwargs = dict(causal=True, deterministic=True)
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, **kwargs), [q, k, v], plain_qkv,
                  dict(causal=True))
    assert_backward_repeatable(flash_attn_func(q, k, v, **kwargs), (q, k, v), 3)


@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (128, True), (256, True)],
                         ids=["d64-causal", "d128", "d128-causal", "d256-causal"])
def test_backward_more_key_tiles_than_sms(d: int, causal: bool):
    """Backward grids of several hundred key tiles of full length (the other cases stay below
    an H100's 132 SMs), so that a kernel whose CTAs run several tiles each does so here."""
    torch.manual_seed(12)
    dtype = torch.bfloat16
    b, s, h = 4, 1024, 8  # 8 key tiles of 128 rows x 32 (batch, head) pairs: 256 tiles
    q, k, v = (rand(b, s, h, d, dtype=dtype) for _ in range(3))
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), [q, k, v],
                  plain_qkv, dict(causal=causal))


@pytest.mark.parametrize("b,h", [(70000, 1), (1, 70000)], ids=["batch70000", "heads70000"])
def test_grid_beyond_65535(b, h):
    """More batches / heads than a grid's y or z dimension may hold."""
    torch.manual_seed(11)
    dtype = torch.bfloat16
    q, k, v = rand(b, 3, h, 32, dtype=dtype), rand(b, 5, h, 32, dtype=dtype), rand(b, 5, h, 32, dtype=dtype)
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, causal=True), [q, k, v], plain_qkv,
                  dict(causal=True))


def test_offsets_beyond_int32():
    """Tensors with more than 2^31 elements: batch offsets past 2^31 must not wrap around."""
    need = 60 << 30
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need >> 30} GiB free, {free >> 30} GiB free")
    torch.manual_seed(12)
    b, s, h, d = 17000, 256, 4, 128  # 2.23e9 elements per tensor; batch 16384+ starts past 2^31
    dtype = torch.bfloat16
    try:
        q, k, v = (rand(b, s, h, d, dtype=dtype) for _ in range(3))
        out = flash_attn_func(q, k, v, causal=True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for sl in (slice(0, 2), slice(b - 3, b)):
            leaves = [x[sl].detach() for x in (q, k, v)]
            compare_to_ref(out[sl], [dq[sl], dk[sl], dv[sl]], leaves, plain_qkv,
                           dict(causal=True), dout[sl], tag=f" (batch {sl.start}:{sl.stop})")
    finally:
        q = k = v = out = dout = dq = dk = dv = None  # noqa: F841
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# ALiBi: forward + backward (the SM80 kernels on either path)
# ---------------------------------------------------------------------------------------------


def alibi_slopes(b: int, h: int, per_batch: bool) -> torch.Tensor:
    """The usual geometric slopes 2^(-8 i / h), i = 1..h, on CUDA; per batch, each row scaled
    by a different factor so that a row mix-up shows."""
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
    if not per_batch:
        return slopes
    return slopes[None, :] * torch.linspace(0.5, 2.0, b, device="cuda")[:, None]


def _alibi_cases():
    cases = []
    for dtype, d, (sq, sk), (causal, w, cap) in itertools.product(
        ("bf16", "fp16"), (64, 128, 160, 256), ((113, 203), (203, 113), (1, 239), (512, 512)),
        ((False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (64, 32), 0.0),
         (True, (-1, -1), 30.0), (False, (-1, -1), 2.0)),
    ):
        if dtype == "fp16" and d != 128:
            continue
        cases.append(Case(dtype, d, sq, sk, causal, window=w, softcap=cap))
    return cases


@pytest.mark.parametrize("case", params([Case("bf16", 64, 2500, 2500),
                                          Case("bf16", 64, 2500, 2500, True),
                                          Case("bf16", 128, 1100, 3000),
                                          Case("fp16", 128, 3000, 1100, True),
                                          Case("bf16", 128, 1700, 1700, window=(900, 300))]))
def test_alibi_long(case: Case):
    """Long sequences and 16 heads, whose steepest slopes (2^-0.5) put key tiles far from the
    diagonal thousands of units below their rows' max: the kernels that split the bias into a
    column and a row term per tile keep the exps near the diagonal exact (forward and backward
    against the reference)."""
    torch.manual_seed(5)
    q, k, v = make_qkv(case, b=1, h=16, hk=4)
    slopes = alibi_slopes(1, 16, False)
    check_fwd_bwd(
        lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=slopes, **case.api_kwargs()),
        [q, k, v], plain_qkv, dict(case.ref_kwargs(), alibi_slopes=slopes))


@pytest.mark.parametrize("offset", [-300, 77, 1000])
@pytest.mark.parametrize("case", params([Case("bf16", 64, 700, 1300, True),
                                          Case("bf16", 128, 700, 1300)]))
def test_alibi_offset(case: Case, offset: int):
    """flash_attn.ops' alibi_offset (ring attention's sub-blocks; every kernel family): the bias
    -slope * |i + sk - sq + offset - j| with the mask unmoved, out, dq, dk, dv under the accuracy
    rule."""
    from flash_attn import ops

    torch.manual_seed(9)
    q, k, v = make_qkv(case, b=2, h=4, hk=2)
    slopes = torch.tensor([0.5, 0.1, 0.02, 0.004], device="cuda")
    scale = case.d ** -0.5
    right = 0 if case.causal else -1

    def ours(q, k, v):
        return ops.flash_attn_fwd(q, k, v, None, None, None, case.sq, case.sk, scale,
                                  case.causal, -1, right, 0.0, alibi_slopes=slopes,
                                  alibi_offset=offset)[0]

    check_fwd_bwd(ours, [q, k, v], plain_qkv,
                  dict(case.ref_kwargs(), alibi_slopes=slopes, alibi_offset=offset))


@pytest.mark.parametrize("case", params([Case("bf16", 128, 1000, 1000, True),
                                          Case("bf16", 64, 700, 900)]))
def test_deterministic_with_alibi(case: Case):
    """deterministic=True with alibi_slopes (on SM80 both live in the extras kernel): 5 backward
    runs are bitwise equal and the gradients pass the accuracy rule."""
    torch.manual_seed(12)
    q, k, v = make_qkv(case, h=4, hk=2)
    slopes = alibi_slopes(q.shape[0], 4, False)
    kwargs = dict(case.api_kwargs(), deterministic=True, alibi_slopes=slopes)
    check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, **kwargs), [q, k, v], plain_qkv,
                  dict(case.ref_kwargs(), alibi_slopes=slopes))
    assert_backward_repeatable(flash_attn_func(q, k, v, **kwargs), (q, k, v), 5)


@pytest.mark.parametrize("per_batch", [False, True], ids=["per_head", "per_batch"])
@pytest.mark.parametrize("case", params(_alibi_cases()))
def test_alibi(case: Case, per_batch: bool):
    """alibi_slopes (nheads,) or (batch, nheads): out, dq, dk, dv against the reference with
    the bias -slope * |i + sk - sq - j| (after the softcap: at softcap 2 a bias taken into the
    tanh, or into its derivative, would show), kv heads h // 2."""
    torch.manual_seed(3)
    b0, h0 = batch_heads(case.sq, case.sk)
    h = max(h0, 2)
    q, k, v = make_qkv(case, h=h, hk=h // 2)
    slopes = alibi_slopes(q.shape[0], h, per_batch)
    check_fwd_bwd(
        lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=slopes, **case.api_kwargs()),
        [q, k, v], plain_qkv, dict(case.ref_kwargs(), alibi_slopes=slopes))
