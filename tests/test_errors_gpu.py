"""GPU tests: bad inputs raise named Python errors (never a device-side error), and CUDA stays
usable after each one.

Error contract (flash_attn/_validation.py): ``TypeError`` for a wrong type or dtype, ``ValueError``
for a bad value or shape, ``NotImplementedError`` for a valid request this package does not
implement; the message names the argument. After every bad call a good ``flash_attn_func`` call
runs and ``torch.cuda.synchronize()`` succeeds.

Values of device-valued inputs (cu_seqlens, max_seqlen against them, seqused_k / cache_seqlens,
cache_batch_idx, cache_leftpad, block_table) are checked before the call only with
``FLASH_ATTN_CHECK_INPUTS=1`` (checking them costs a device sync). Without it the kernels clamp a
bad value and record it (flash_attn/_bad_input.py): ``flash_attn.check_bad_inputs()`` or the
next call raises a ValueError naming the argument, the index and the value, and CUDA stays
usable. Those cases run in a subprocess so that a crash shows up as one failed test instead of
taking the rest of the suite down with a poisoned CUDA context.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import (  # noqa: E402
    REF_DTYPE,
    arg_re,
    assert_accuracy,
    attention_ref,
    check_fwd_bwd,
    rand,
)
from attn_ref import kernel_path, poisoned_allocator  # noqa: E402,F401  (autouse fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from flash_attn import (
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
    )

BF16 = torch.bfloat16


def assert_cuda_usable():
    """A real call on good inputs works and the device syncs (no sticky CUDA error)."""
    torch.cuda.synchronize()
    q, k, v = (torch.randn(2, 65, 4, 64, dtype=BF16, device="cuda") for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    out_ref, _ = attention_ref(q, k, v, causal=True, compute_dtype=REF_DTYPE)
    out_pt, _ = attention_ref(q, k, v, causal=True, compute_dtype=BF16)
    assert_accuracy("out (good call after a bad one)", out, out_ref, out_pt, 2)


def qkv(b=2, s=64, h=4, hk=None, d=64, sk=None, dtype=BF16, device="cuda", grad=False):
    hk = hk or h
    sk = sk or s
    return (rand(b, s, h, d, dtype=dtype, device=device, requires_grad=grad),
            rand(b, sk, hk, d, dtype=dtype, device=device, requires_grad=grad),
            rand(b, sk, hk, d, dtype=dtype, device=device, requires_grad=grad))


def varlen_args(lens_q=(3, 0, 40), lens_k=(5, 7, 33), h=4, hk=4, d=64, dtype=BF16):
    def cu(lens):
        c = [0]
        for n in lens:
            c.append(c[-1] + n)
        return torch.tensor(c, dtype=torch.int32, device="cuda")

    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device="cuda")
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype, device="cuda")
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype, device="cuda")
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k),
                max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))


def _call(**over):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v)
    args.update(over)
    return flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _vcall(**over):
    args = varlen_args()
    args.update(over)
    return flash_attn_varlen_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _swap(i, fn):
    """flash_attn_func with q/k/v number i replaced by fn(that tensor)."""
    t = list(qkv())
    t[i] = fn(t[i])
    return flash_attn_func(*t)


# (id, thunk, exception, regex the message must contain)
ERROR_CASES = [
    # dtype / device / rank / shapes
    ("fp32_on_cuda", lambda: flash_attn_func(*qkv(dtype=torch.float32)), TypeError, arg_re("q")),
    ("k_fp16_q_bf16", lambda: _swap(1, lambda t: t.half()), TypeError, arg_re("k")),
    ("v_on_cpu", lambda: _swap(2, lambda t: t.cpu()), ValueError, arg_re("v")),
    ("k_on_cpu", lambda: _swap(1, lambda t: t.cpu()), ValueError, arg_re("k")),
    ("q_rank3", lambda: _swap(0, lambda t: t[0]), ValueError, arg_re("q")),
    ("k_rank5", lambda: _swap(1, lambda t: t.unsqueeze(0)), ValueError, arg_re("k")),
    ("q_int_tensor", lambda: _swap(0, lambda t: t.to(torch.int32)), TypeError, arg_re("q")),
    ("q_not_tensor", lambda: _swap(0, lambda t: t.tolist()), TypeError, arg_re("q")),
    ("nheads_not_divisible", lambda: flash_attn_func(*qkv(h=6, hk=4)), ValueError, r"heads"),
    ("k_v_shapes_differ", lambda: _swap(2, lambda t: t[:, :-1]), ValueError, arg_re("v")),
    ("batch_differs", lambda: _swap(0, lambda t: t[:1]), ValueError, r"batch"),
    ("headdim_264", lambda: flash_attn_func(*qkv(d=264)), ValueError, r"headdim"),
    ("headdim_0", lambda: flash_attn_func(*qkv(d=0)), ValueError, r"headdim"),
    ("headdim_q_k_differ", lambda: _swap(0, lambda t: t[..., :32]), ValueError, r"headdim"),
    # options
    ("window_size_-2", lambda: _call(window_size=(-2, 0)), ValueError, arg_re("window_size")),
    ("window_size_3_items", lambda: _call(window_size=(1, 2, 3)), TypeError, arg_re("window_size")),
    ("softcap_-1", lambda: _call(softcap=-1.0), ValueError, arg_re("softcap")),
    ("softcap_nan", lambda: _call(softcap=float("nan")), ValueError, arg_re("softcap")),
    ("softmax_scale_nan", lambda: _call(softmax_scale=float("nan")), ValueError,
     arg_re("softmax_scale")),
    ("dropout_p_1.5", lambda: _call(dropout_p=1.5), ValueError, arg_re("dropout_p")),
    ("dropout_p_-0.1", lambda: _call(dropout_p=-0.1), ValueError, arg_re("dropout_p")),
    ("alibi_slopes_fp16", lambda: _call(alibi_slopes=torch.ones(4, device="cuda").half()),
     TypeError, arg_re("alibi_slopes")),
    ("alibi_slopes_on_cpu", lambda: _call(alibi_slopes=torch.ones(4)), ValueError,
     arg_re("alibi_slopes")),
    # packed layouts
    ("qkvpacked_pack_dim_2", lambda: flash_attn_qkvpacked_func(
        torch.randn(2, 64, 2, 4, 64, dtype=BF16, device="cuda")), ValueError, arg_re("qkv")),
    ("kvpacked_pack_dim_3", lambda: flash_attn_kvpacked_func(
        qkv()[0], torch.randn(2, 64, 3, 4, 64, dtype=BF16, device="cuda")), ValueError,
     arg_re("kv")),
    # varlen
    ("cu_seqlens_q_int64", lambda: _vcall(cu_seqlens_q=varlen_args()["cu_seqlens_q"].long()),
     TypeError, arg_re("cu_seqlens_q")),
    ("cu_seqlens_k_int64", lambda: _vcall(cu_seqlens_k=varlen_args()["cu_seqlens_k"].long()),
     TypeError, arg_re("cu_seqlens_k")),
    ("cu_seqlens_q_on_cpu", lambda: _vcall(cu_seqlens_q=varlen_args()["cu_seqlens_q"].cpu()),
     ValueError, arg_re("cu_seqlens_q")),
    ("cu_seqlens_q_2d", lambda: _vcall(cu_seqlens_q=varlen_args()["cu_seqlens_q"][None]),
     ValueError, arg_re("cu_seqlens_q")),
    ("cu_seqlens_wrong_length", lambda: _vcall(cu_seqlens_k=torch.tensor(
        [0, 5, 12, 45, 45], dtype=torch.int32, device="cuda")), ValueError, r"cu_seqlens"),
    ("varlen_q_rank4", lambda: _vcall(q=varlen_args()["q"][None]), ValueError, arg_re("q")),
    # 0-dim integer tensors are accepted (as by FlashAttention-2); float ones are not.
    ("max_seqlen_q_float_tensor", lambda: _vcall(max_seqlen_q=torch.tensor(40.0)), TypeError,
     arg_re("max_seqlen_q")),
    ("max_seqlen_k_negative", lambda: _vcall(max_seqlen_k=-1), ValueError, arg_re("max_seqlen_k")),
    ("varlen_nheads_not_divisible", lambda: _vcall(**varlen_args(h=5, hk=2)), ValueError,
     r"heads"),
]


@pytest.mark.parametrize("thunk,exc,match", [pytest.param(t, e, m, id=i) for i, t, e, m in
                                             ERROR_CASES])
def test_bad_input_raises_named_error(thunk, exc, match):
    torch.manual_seed(30)
    with pytest.raises(exc, match=match):
        thunk()
    assert_cuda_usable()


def test_deterministic_forward_only_is_fine():
    """deterministic only concerns the backward: a forward without gradients runs."""
    torch.manual_seed(32)
    q, k, v = qkv()
    with torch.no_grad():
        out = flash_attn_func(q, k, v, deterministic=True)
    out_ref, _ = attention_ref(q, k, v, compute_dtype=REF_DTYPE)
    out_pt, _ = attention_ref(q, k, v, compute_dtype=BF16)
    assert_accuracy("out", out, out_ref, out_pt, 2)
    assert_cuda_usable()


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_noncontiguous_last_dim_works_or_raises(which):
    """A last dim with stride != 1 either works (the layer copies) or raises a named error."""
    torch.manual_seed(33)
    b, s, h, d = 2, 97, 4, 64
    leaves = [rand(b, s, h, 2 * d, dtype=BF16) for _ in range(3)]
    i = "qkv".index(which)

    def to_qkv(*t):
        return tuple(x[..., ::2] if j == i else x[..., :d] for j, x in enumerate(t))

    assert to_qkv(*leaves)[i].stride(-1) == 2
    try:
        check_fwd_bwd(lambda *t: flash_attn_func(*to_qkv(*t), causal=True), leaves, to_qkv,
                      dict(causal=True))
    except (ValueError, TypeError) as e:
        assert "contiguous" in str(e) or "stride" in str(e), str(e)
        assert re.search(arg_re(which), str(e)), str(e)
    assert_cuda_usable()


# ---------------------------------------------------------------------------------------------
# cu_seqlens values: checked with FLASH_ATTN_CHECK_INPUTS=1, recorded by the kernels without it
# ---------------------------------------------------------------------------------------------

# name -> ((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for q (100, h, d) and
# k/v (120, hk, d), what the kernels record without the checks: (argument, index, value) as the
# message says).
BAD_CU_SEQLENS = {
    "q_last_too_large": (([0, 30, 60, 600], [0, 40, 80, 120], 540, 40),
                         ("cu_seqlens_q", "entry 3", "value 600")),
    "k_last_too_large": (([0, 30, 60, 100], [0, 40, 80, 4000], 40, 3920),
                         ("cu_seqlens_k", "entry 3", "value 4000")),
    "q_non_monotonic": (([0, 70, 30, 100], [0, 40, 80, 120], 70, 40),
                        ("cu_seqlens_q", "entry 2", "value 30")),
    "max_seqlen_q_too_small": (([0, 30, 60, 100], [0, 40, 80, 120], 10, 40),
                               ("max_seqlen_q", "index ", "value ")),
    "q_not_from_0": (([5, 30, 60, 100], [0, 40, 80, 120], 40, 40),
                     ("cu_seqlens_q", "entry 0", "value 5")),
    "k_negative": (([0, 30, 60, 100], [0, -40, 80, 120], 40, 80),
                   ("cu_seqlens_k", "entry 1", "value -40")),
    "max_seqlen_k_too_small": (([0, 30, 60, 100], [0, 40, 80, 120], 40, 20),
                               ("max_seqlen_k", "index ", "value ")),
}

# The end of each case in the subprocess scripts (at their loop's indentation): what
# check_bad_inputs() raises for the case, then a good call, and the case's line.
_CASE_TAIL = """\
    try:
        check_bad_inputs()
        recorded = "nothing"
    except ValueError as e:
        recorded = "ValueError: " + str(e)
    a = torch.randn(2, 65, 4, 64, dtype=torch.bfloat16, device="cuda")
    good = flash_attn_func(a, a, a, causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(good).all()
    print("CASE", name, "|", result.replace("\\n", " "), "||", recorded.replace("\\n", " "),
          flush=True)
print("ALL_DONE", flush=True)
"""


def _inputs(cases):
    """The cases' inputs, as the subprocess scripts take them (JSON)."""
    return json.dumps({name: inputs for name, (inputs, _) in cases.items()})


def _assert_recorded(results, cases) -> None:
    """Each case returned, and check_bad_inputs() then raised naming (argument, index, value)."""
    for name, (_, (arg, index, value)) in cases.items():
        before, _, recorded = results[name].partition(" || ")
        assert before == "returned", f"{name}: {before}"
        assert recorded.startswith("ValueError: flash_attn: " + arg), f"{name}: {recorded}"
        assert index in recorded and value in recorded, f"{name}: {recorded}"


_SUBPROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from flash_attn import check_bad_inputs, flash_attn_func, flash_attn_varlen_func
    cases = json.loads(sys.argv[1])
    torch.manual_seed(0)
    for name, (cq, ck, mq, mk) in cases.items():
        q = torch.randn(100, 4, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        k = torch.randn(120, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        v = torch.randn(120, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        cu_q = torch.tensor(cq, dtype=torch.int32, device="cuda")
        cu_k = torch.tensor(ck, dtype=torch.int32, device="cuda")
        try:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                         max_seqlen_q=mq, max_seqlen_k=mk, causal=True)
            torch.cuda.synchronize()
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            result = "returned"
        except ValueError as e:
            result = "ValueError: " + str(e)
    """
) + _CASE_TAIL


def _run_script(script: str, *args: str, **env_extra: str):
    """Runs `script` in a fresh Python with this test's import path. Returns (proc, results, log);
    results maps each "CASE name | result" line the script printed to its result."""
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    log = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    missing = [line for line in proc.stderr.splitlines() if "kernel was built for" in line]
    if proc.returncode != 0 and missing:
        # The child needed a kernel this build lacks: the same error in-process, which
        # conftest.py turns into a skip in a subset build (and a failure in a full one).
        message = missing[-1].partition("NotImplementedError: ")[2]
        raise NotImplementedError(message or missing[-1])
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            name, _, result = line[5:].partition(" | ")
            results[name] = result
    return proc, results, log


def _run_cases(check_inputs: bool):
    return _run_script(_SUBPROCESS_SCRIPT, _inputs(BAD_CU_SEQLENS),
                       FLASH_ATTN_CHECK_INPUTS="1" if check_inputs else "0")


def test_check_inputs_env_rejects_bad_cu_seqlens():
    """FLASH_ATTN_CHECK_INPUTS=1: every bad cu_seqlens / max_seqlen raises a ValueError naming it."""
    proc, results, log = _run_cases(check_inputs=True)
    assert proc.returncode == 0 and "ALL_DONE" in proc.stdout, log
    for name in BAD_CU_SEQLENS:
        before, _, recorded = results.get(name, "").partition(" || ")
        assert before.startswith("ValueError"), f"{name}: {results.get(name)}\n{log}"
        assert ("cu_seqlens" in before) or ("max_seqlen" in before), before
        assert recorded == "nothing", f"{name}: no kernel should have run: {recorded}"
    assert_cuda_usable()


def test_bad_cu_seqlens_without_checks_are_recorded():
    """Without the checks, the call with wrong cu_seqlens / max_seqlen values returns (a wrong
    result, never a CUDA error), check_bad_inputs() raises a ValueError naming the argument, the
    index and the value the kernels recorded, and a good call works afterwards."""
    proc, results, log = _run_cases(check_inputs=False)
    assert proc.returncode == 0 and "ALL_DONE" in proc.stdout, (
        f"crashed after cases {list(results)} (next: a CUDA error?)\n{log}")
    assert set(results) == set(BAD_CU_SEQLENS), log
    _assert_recorded(results, BAD_CU_SEQLENS)
    assert_cuda_usable()


# flash_attn_with_kvcache's device-valued inputs, without FLASH_ATTN_CHECK_INPUTS: each case
# returns, then check_bad_inputs() must name (argument, index, value). q (2, 1, 4, 64); caches
# (2, 256, 2, 64), or paged: 8 pages of 64 rows, 2 table columns per sequence (128 keys).
KVCACHE_CASES = {
    "batch_idx_too_large": (dict(seqlens=[5, 9], batch_idx=[0, 7]),
                            ("cache_batch_idx", "index 1", "value 7")),
    "batch_idx_negative": (dict(seqlens=[5, 9], batch_idx=[-1, 0]),
                           ("cache_batch_idx", "index 0", "value -1")),
    "seqlens_past_capacity": (dict(seqlens=[5, 5000]), ("cache_seqlens", "index 1", "value 5000")),
    "seqlens_negative": (dict(seqlens=[-3, 5]), ("cache_seqlens", "index 0", "value -3")),
    "append_overflows": (dict(seqlens=[250, 5], new=10),
                         ("cache_seqlens", "index 0", "value 250")),
    "leftpad_past_seqlens": (dict(seqlens=[5, 9], leftpad=[10, 0]),
                             ("cache_leftpad", "index 0", "value 10")),
    "block_table_too_large": (dict(seqlens=[70, 9], table=[[0, 99], [2, 3]]),
                              ("block_table", "offset 1 ", "value 99")),
    "block_table_negative": (dict(seqlens=[5, 9], table=[[-2, 1], [2, 3]]),
                             ("block_table", "offset 0 ", "value -2")),
    "seqlens_past_pages": (dict(seqlens=[5, 300], table=[[0, 1], [2, 3]]),
                           ("cache_seqlens", "index 1", "value 300")),
}

_KVCACHE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from flash_attn import check_bad_inputs, flash_attn_func, flash_attn_with_kvcache
    cases = json.loads(sys.argv[1])
    dev, bf16 = "cuda", torch.bfloat16
    for name, c in cases.items():
        q = torch.randn(2, 1, 4, 64, dtype=bf16, device=dev)
        paged = "table" in c
        shape = (8, 64, 2, 64) if paged else (2, 256, 2, 64)
        k_cache = torch.randn(shape, dtype=bf16, device=dev)
        v_cache = torch.randn(shape, dtype=bf16, device=dev)
        kw = dict(cache_seqlens=torch.tensor(c["seqlens"], dtype=torch.int32, device=dev))
        if "batch_idx" in c:
            kw["cache_batch_idx"] = torch.tensor(c["batch_idx"], dtype=torch.int32, device=dev)
        if "leftpad" in c:
            kw["cache_leftpad"] = torch.tensor(c["leftpad"], dtype=torch.int32, device=dev)
        if paged:
            kw["block_table"] = torch.tensor(c["table"], dtype=torch.int32, device=dev)
        if c.get("new"):
            kw["k"] = torch.randn(2, c["new"], 2, 64, dtype=bf16, device=dev)
            kw["v"] = torch.randn(2, c["new"], 2, 64, dtype=bf16, device=dev)
        try:
            flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, **kw)
            torch.cuda.synchronize()
            result = "returned"
        except ValueError as e:
            result = "ValueError: " + str(e)
    """
) + _CASE_TAIL


def test_bad_kvcache_values_are_recorded():
    """Out-of-range cache_batch_idx, cache_seqlens (negative, past the cache or its pages, an
    append that overflows), cache_leftpad and block_table entries: the call returns, then
    check_bad_inputs() raises a ValueError naming the argument, the batch index and the value,
    and a good call works afterwards."""
    proc, results, log = _run_script(_KVCACHE_SCRIPT, _inputs(KVCACHE_CASES),
                                     FLASH_ATTN_CHECK_INPUTS="0")
    assert proc.returncode == 0 and "ALL_DONE" in proc.stdout, (
        f"crashed after cases {list(results)} (next: a CUDA error?)\n{log}")
    _assert_recorded(results, KVCACHE_CASES)
    assert_cuda_usable()


def test_bad_input_raised_by_the_next_call():
    """Without check_bad_inputs(): the call after the bad one raises the recorded error before
    launching anything, and the one after that runs."""
    script = textwrap.dedent(
        """
        import torch
        from flash_attn import flash_attn_varlen_func
        q = torch.randn(100, 4, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(120, 2, 64, dtype=torch.bfloat16, device="cuda")
        cu_q = torch.tensor([0, 70, 30, 100], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 40, 80, 120], dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q, k, k, cu_q, cu_k, 70, 40)
        torch.cuda.synchronize()
        try:
            flash_attn_varlen_func(q, k, k, cu_k[:1].new_tensor([0, 30, 60, 100]), cu_k, 40, 40)
            print("CASE next | no error", flush=True)
        except ValueError as e:
            print("CASE next | ValueError: " + str(e).replace("\\n", " "), flush=True)
        flash_attn_varlen_func(q, k, k, cu_k[:1].new_tensor([0, 30, 60, 100]), cu_k, 40, 40)
        torch.cuda.synchronize()
        print("CASE after | ok", flush=True)
        """
    )
    proc, results, log = _run_script(script, FLASH_ATTN_CHECK_INPUTS="0")
    assert proc.returncode == 0, log
    assert results.get("next", "").startswith("ValueError: flash_attn: cu_seqlens_q"), log
    assert "entry 2" in results["next"] and "value 30" in results["next"], results["next"]
    assert results.get("after") == "ok", log


# Errors raised by the C++ binding itself (its FA_CHECKs), reached by calling the extension
# directly, past the Python validation. Run in a subprocess: if the error path crashed the
# process, the test fails instead of taking the suite down. Each case prints its outcome.
_BINDING_ERRORS_SCRIPT = textwrap.dedent('''
    import sys, torch
    from flash_attn.ops import load_extension
    ext = load_extension()

    def case(name, fn):
        try:
            fn()
            print(f"CASE {name} | no error", flush=True)
        except Exception as e:
            print(f"CASE {name} | {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        torch.cuda.synchronize()

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16, device="cuda")
    v_bad = torch.randn(2, 63, 4, 64, dtype=torch.bfloat16, device="cuda")
    args = (None, None, None, 64, 64, 0.125, False, -1, -1, 0.0)
    case("k_v_shapes_differ", lambda: ext.fwd(q, k, v_bad, *args))
    # Messages that format a number, a dtype and a shape (these once crashed, see str_of).
    q12 = torch.randn(2, 64, 4, 12, dtype=torch.bfloat16, device="cuda")
    case("head_dim_not_multiple_of_8", lambda: ext.fwd(q12, q12, q12, *args))
    case("k_dtype_differs", lambda: ext.fwd(q, k.half(), k, *args))
    built = {(e["kind"], e["dtype"], e["headdim"]) for e in ext.build_info()["kernels"]}
    if ("fwd", "bf16", 64) in built:
        bad_scale = args[:5] + (-1.5,) + args[6:]
        case("negative_scale", lambda: ext.fwd(q, k, k, *bad_scale))
    missing = [(dt, d) for dt in ("fp16", "bf16") for d in (32, 64, 96, 128, 160, 192, 224, 256)
               if ("fwd", dt, d) not in built]
    if missing:
        dt, d = missing[0]
        dtype = torch.float16 if dt == "fp16" else torch.bfloat16
        x = torch.randn(1, 8, 2, d, dtype=dtype, device="cuda")
        case("kernel_not_built", lambda: ext.fwd(x, x, x, None, None, None, 8, 8, 0.1,
                                                  False, -1, -1, 0.0))
    print("DONE", flush=True)
''')


def test_binding_errors_raise_and_do_not_crash():
    """Check failures in the binding (inconsistent shapes, messages with numbers; in a subset
    build, a kernel that was not compiled) raise Python exceptions; the process survives and CUDA
    stays usable."""
    proc, results, log = _run_script(_BINDING_ERRORS_SCRIPT)
    assert proc.returncode == 0 and "DONE" in proc.stdout, f"the process died:\n{log}"
    assert results["k_v_shapes_differ"].startswith("RuntimeError"), log
    assert results["head_dim_not_multiple_of_8"].startswith("RuntimeError"), log
    assert "multiple of 8 in [8, 256], got 12" in results["head_dim_not_multiple_of_8"], log
    assert results["k_dtype_differs"].startswith("RuntimeError"), log
    assert "k has dtype Half, q has BFloat16" in results["k_dtype_differs"], log
    if "negative_scale" in results:
        assert "softmax_scale must be finite and > 0, got -1.5" in results["negative_scale"], log
    if "kernel_not_built" in results:
        # The stable ABI carries a C++ exception to Python as a RuntimeError only; the Python
        # layer raises NotImplementedError before the call (ops.require_kernel).
        assert results["kernel_not_built"].startswith("RuntimeError"), log
        assert "FLASH_ATTN_HEADDIMS" in results["kernel_not_built"], log
    assert_cuda_usable()
