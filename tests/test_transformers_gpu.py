"""GPU tests: end to end through Hugging Face transformers' own attention code.

Tiny random decoder models built from configs (no downloads, no network) run with
``attn_implementation="flash_attention_2"`` on CUDA in bf16, so transformers itself imports this
package (``transformers.modeling_flash_attention_utils._lazy_imports``), unpads, builds cu_seqlens
and calls ``flash_attn_func`` / ``flash_attn_varlen_func``:

* ``llama_gqa_hd128``: Llama, 4 query heads / 2 kv heads, head_dim 128;
* ``llama_hd64``: Llama, 4 heads, head_dim 64;
* ``mistral_swa``: Mistral, GQA, sliding window 24 (sequences are longer than the window);
* ``gemma2_softcap``: Gemma2, attn_logit_softcapping (and its alternating sliding/full layers);
* ``gpt_oss_sink``: gpt-oss, learnable sinks (``s_aux``), a sliding and a full layer.

Accuracy rule (the "2x rule" of the kernel tests, applied to whole models): the same weights run in
fp32 with ``attn_implementation="eager"`` are the reference, and
``max|flash_bf16 - ref| <= 2 * max|baseline_bf16 - ref| + atol`` where the baseline is the same
bf16 model with ``attn_implementation="sdpa"``. Gemma2 and gpt-oss are the exceptions:
transformers' sdpa path silently drops ``softcap``, and has no sinks, so their baseline is bf16
``eager``. ``atol`` is a
small fraction of the reference's scale (FWD_ATOL, GRAD_ATOL).

Cases per model: no padding, right padding and left padding (attention_mask with zeros; only
unpadded positions are compared), packed sequences through ``position_ids`` (batch 1, positions
restarting at 0, no attention_mask: transformers' padding-free path, which passes cu_seqlens and
0-dim tensor max_seqlen to flash_attn_varlen_func; compared to each sequence run alone), parameter
gradients for each of those layouts, a KV-cache decode (prefill, then single-token steps, with and
without left padding), and ``generate()``. One more test checks that transformers picks the
package unaided and that a forward really calls it.

Each model is built once in fp32 (seeded), with weights rounded to bf16-representable values so
that the reference and the bf16 copies hold the same weights and only bf16 arithmetic differs. The
bf16 copies are ``copy.deepcopy`` with the parameters cast: ``model.to(torch.bfloat16)`` would also
round the fp32 rotary ``inv_freq`` buffer to bf16 (a rotation-angle error growing with the
position, in both bf16 models alike), which ``from_pretrained(dtype=torch.bfloat16)`` does not do.
The query/key weights are drawn larger than the default init so that attention is peaked (with the
default, attention is nearly uniform and a wrong window, mask or softcap barely shows).

Like the other GPU tests, each test runs on each kernel path (attn_ref.kernel_path: "sm90" and
"sm80" on an H100) with a NaN-poisoned CUDA allocator.

Skipped when transformers is not importable or no CUDA device is usable (conftest.py also skips
``*gpu*`` files without CUDA).
"""

import copy
import functools
import importlib
import os
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ref import kernel_path, poisoned_allocator  # noqa: E402,F401  (autouse fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
FLASH = "flash_attention_2"
DTYPE = torch.bfloat16

FWD_ATOL = 1e-3  # of max|ref logits|
GRAD_ATOL = 1e-2  # of max|ref grad|: generous, the rule is "not much worse than bf16 sdpa"

PAD, BOS, EOS = 0, 1, 2
COMMON = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)

# name -> (config class, model class, config kwargs)
MODELS = {
    "llama_gqa_hd128": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128),
    ),
    "llama_hd64": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64),
    ),
    "mistral_swa": (
        "MistralConfig", "MistralForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=24),
    ),
    "gemma2_softcap": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
             sliding_window=24, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    ),
    # Learnable sinks (transformers passes them as s_aux), a sliding and a full layer; one
    # expert, so that bf16 rounding cannot flip the router's choice between the models.
    "gpt_oss_sink": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=24,
             num_local_experts=1, num_experts_per_tok=1,
             layer_types=["sliding_attention", "full_attention"]),
    ),
}
# transformers' sdpa_attention_forward ignores `softcap`; eager applies it. gpt-oss's sinks
# have no sdpa path either.
BASELINE = {"gemma2_softcap": "eager", "gpt_oss_sink": "eager"}

# Query/key projection weights are redrawn with this std (the default init, 0.02, gives attention
# logits of ~0.1: nearly uniform attention, where a wrong mask, window or softcap barely shows).
# With hidden 256 and RMS-normed inputs this gives logits of std ~4, so softcap 5 bites.
QK_STD = 0.125

# Sequence lengths (all longer than the sliding window 24, except the deliberately short ones).
PADDED_LENGTHS = [97, 80, 51, 13]
PACKED_LENGTHS = [37, 1, 64, 19, 90]
DENSE_SHAPE = (2, 97)
LAYOUTS = ["dense", "right_pad", "left_pad", "packed"]


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _classes(name):
    cfg_name, model_name, kwargs = MODELS[name]
    cfg_cls = getattr(transformers, cfg_name, None)
    model_cls = getattr(transformers, model_name, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"this transformers ({transformers.__version__}) has no {model_name}")
    return cfg_cls, model_cls, kwargs


# Models whose attention takes a learnable sink: transformers' set_attn_implementation does not
# offer them "flash_attention_2" (FlashAttention-2 has no sinks; it falls back to a hub kernel),
# so the test sets the config attribute that the attention modules read at each forward, as a
# user of this package does: model.config._attn_implementation = "flash_attention_2".
SINK_MODELS = {"GptOssForCausalLM"}


def _set_attn_impl(model, impl):
    """model.set_attn_implementation (transformers >= 4.5x) or, failing that or for SINK_MODELS,
    the config attribute that the attention modules read at each forward."""
    sink_flash = type(model).__name__ in SINK_MODELS and impl == FLASH
    if hasattr(model, "set_attn_implementation") and not sink_flash:
        model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:  # older API, or set_attn_implementation declined
        for m in model.modules():
            if hasattr(m, "config"):
                m.config._attn_implementation = impl
    assert model.config._attn_implementation == impl


def _bf16_copy(model, impl):
    m = copy.deepcopy(model)
    for p in m.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32
        p.data = p.data.to(DTYPE)
    m.config.dtype = DTYPE
    _set_attn_impl(m, impl)
    return m


def build_models(name):
    """(fp32 eager reference, bf16 baseline, bf16 flash): the same weights."""
    cfg_cls, model_cls, kwargs = _classes(name)
    config = cfg_cls(**COMMON, **kwargs)
    torch.manual_seed(_seed("model", name))
    ref = model_cls(config)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.q_proj.weight.normal_(0.0, QK_STD)
            layer.self_attn.k_proj.weight.normal_(0.0, QK_STD)
            if hasattr(layer.self_attn, "sinks"):  # zeros at init: make them matter
                layer.self_attn.sinks.normal_(0.0, 1.0)
        # Weights representable in bf16, so that the reference and the bf16 copies hold the same
        # weights and the errors compared are those of bf16 arithmetic alone.
        for p in ref.parameters():
            p.copy_(p.to(DTYPE).float())
    ref = ref.to(DEVICE).eval()
    _set_attn_impl(ref, "eager")
    base = _bf16_copy(ref, BASELINE.get(name, "sdpa"))
    flash = _bf16_copy(ref, FLASH)
    return ref, base, flash


def assert_2x(what, ours, base, ref, rel_atol, base_name="sdpa"):
    ours, base, ref = ours.float(), base.float(), ref.float()
    assert ours.shape == ref.shape == base.shape, (what, ours.shape, base.shape, ref.shape)
    assert torch.isfinite(ref).all(), f"{what}: reference not finite"
    assert torch.isfinite(ours).all(), f"{what}: flash output not finite"
    err = (ours - ref).abs().max().item()
    base_err = (base - ref).abs().max().item()
    scale = ref.abs().max().item()
    atol = rel_atol * scale
    assert err <= 2 * base_err + atol, (
        f"{what}: max|flash - ref_fp32| = {err:.3e} > 2 * max|{base_name}_bf16 - ref_fp32| "
        f"({base_err:.3e}) + atol {atol:.3e} (ref scale {scale:.3e})"
    )
    return err, base_err, scale


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def make_batch(layout, vocab):
    """Returns a dict: input_ids, attention_mask (or None), position_ids (or None), valid (bool
    mask of compared positions, (batch, seqlen)), lengths (packed only)."""
    if layout == "dense":
        b, n = DENSE_SHAPE
        ids = torch.randint(3, vocab, (b, n), device=DEVICE)
        return dict(input_ids=ids, attention_mask=None, position_ids=None,
                    valid=torch.ones(b, n, dtype=torch.bool, device=DEVICE))
    if layout in ("right_pad", "left_pad"):
        n = max(PADDED_LENGTHS)
        ids = torch.randint(3, vocab, (len(PADDED_LENGTHS), n), device=DEVICE)
        mask = torch.zeros_like(ids)
        for i, ln in enumerate(PADDED_LENGTHS):
            if layout == "right_pad":
                mask[i, :ln] = 1
            else:
                mask[i, n - ln:] = 1
        ids = ids.masked_fill(mask == 0, PAD)
        return dict(input_ids=ids, attention_mask=mask, position_ids=None, valid=mask.bool())
    if layout == "packed":
        total = sum(PACKED_LENGTHS)
        ids = torch.randint(3, vocab, (1, total), device=DEVICE)
        pos = torch.cat([torch.arange(ln, device=DEVICE) for ln in PACKED_LENGTHS])[None]
        return dict(input_ids=ids, attention_mask=None, position_ids=pos,
                    valid=torch.ones(1, total, dtype=torch.bool, device=DEVICE),
                    lengths=PACKED_LENGTHS)
    raise ValueError(layout)


def logits_of(model, batch, separate):
    """Logits (batch, seqlen, vocab) in fp32. ``separate``: for a packed batch, run each sequence
    alone (no position_ids, no mask) and concatenate, as the reference does."""
    if batch.get("lengths") is not None and separate:
        outs, start = [], 0
        for ln in batch["lengths"]:
            ids = batch["input_ids"][:, start:start + ln]
            outs.append(model(input_ids=ids, use_cache=False).logits.float())
            start += ln
        return torch.cat(outs, dim=1)
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=batch["position_ids"], use_cache=False).logits.float()


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(MODELS))
def test_forward(name, layout):
    ref, base, flash = build_models(name)
    base_name = base.config._attn_implementation
    torch.manual_seed(_seed("fwd", name, layout))
    batch = make_batch(layout, ref.config.vocab_size)
    with torch.no_grad():
        out_ref = logits_of(ref, batch, separate=True)
        out_base = logits_of(base, batch, separate=True)
        out_flash = logits_of(flash, batch, separate=False)
    assert flash.config._attn_implementation == FLASH
    v = batch["valid"]
    assert_2x(f"{name}/{layout} logits", out_flash[v], out_base[v], out_ref[v], FWD_ATOL, base_name)


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------

def _grad_names(model):
    n = len(model.model.layers) - 1
    return [f"model.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k", "v")] + [
        f"model.layers.{n}.self_attn.k_proj.weight"]


def grads_of(model, batch, labels, separate):
    """Grads of sum(CE over valid positions) / n_valid, for the parameters of _grad_names."""
    model.zero_grad(set_to_none=True)
    n_valid = int((labels != -100).sum())
    if batch.get("lengths") is not None and separate:
        start = 0
        for ln in batch["lengths"]:
            logits = model(input_ids=batch["input_ids"][:, start:start + ln],
                           use_cache=False).logits.float()
            lab = labels[:, start:start + ln]
            loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100,
                                   reduction="sum") / n_valid
            loss.backward()
            start += ln
    else:
        logits = logits_of(model, batch, separate=False)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction="sum") / n_valid
        loss.backward()
    params = dict(model.named_parameters())
    return {k: params[k].grad.detach().float().clone() for k in _grad_names(model)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(MODELS))
def test_grads(name, layout):
    ref, base, flash = build_models(name)
    base_name = base.config._attn_implementation
    torch.manual_seed(_seed("grad", name, layout))
    batch = make_batch(layout, ref.config.vocab_size)
    labels = torch.randint(3, ref.config.vocab_size, batch["input_ids"].shape, device=DEVICE)
    labels = labels.masked_fill(~batch["valid"], -100)
    g_ref = grads_of(ref, batch, labels, separate=True)
    g_base = grads_of(base, batch, labels, separate=True)
    g_flash = grads_of(flash, batch, labels, separate=False)
    for k in g_ref:
        assert g_ref[k].abs().max() > 0, f"{k}: zero reference gradient"
        assert_2x(f"{name}/{layout} grad {k}", g_flash[k], g_base[k], g_ref[k], GRAD_ATOL,
                  base_name)


# --------------------------------------------------------------------------------------------
# KV cache: prefill, then single-token decode steps
# --------------------------------------------------------------------------------------------

DECODE_PROMPTS = [40, 33, 12]
DECODE_STEPS = 3


def decode_logits(model, ids, mask, steps):
    """Prefill logits (batch, seqlen, vocab), then a list of (batch, vocab) logits, one per decode
    step, each step feeding the fixed token steps[:, i] through the model's own KV cache."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    prefill, cache = out.logits.float(), out.past_key_values
    per_step = []
    for i in range(steps.shape[1]):
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=steps[:, i:i + 1], attention_mask=mask, past_key_values=cache,
                    use_cache=True)
        cache = out.past_key_values
        per_step.append(out.logits[:, -1].float())
    return prefill, per_step


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", list(MODELS))
def test_kvcache_decode(name, padding):
    ref, base, flash = build_models(name)
    base_name = base.config._attn_implementation
    torch.manual_seed(_seed("decode", name, padding))
    vocab = ref.config.vocab_size
    n = max(DECODE_PROMPTS)
    b = len(DECODE_PROMPTS)
    ids = torch.randint(3, vocab, (b, n), device=DEVICE)
    if padding == "left":
        mask = torch.zeros_like(ids)
        for i, ln in enumerate(DECODE_PROMPTS):
            mask[i, n - ln:] = 1
        ids = ids.masked_fill(mask == 0, PAD)
        valid = mask.bool()
    else:
        mask = None
        valid = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    steps = torch.randint(3, vocab, (b, DECODE_STEPS), device=DEVICE)
    with torch.no_grad():
        p_ref, s_ref = decode_logits(ref, ids, mask, steps)
        p_base, s_base = decode_logits(base, ids, mask, steps)
        p_flash, s_flash = decode_logits(flash, ids, mask, steps)
    assert_2x(f"{name}/{padding} prefill logits", p_flash[valid], p_base[valid], p_ref[valid],
              FWD_ATOL, base_name)
    for i in range(DECODE_STEPS):
        assert_2x(f"{name}/{padding} decode step {i} logits", s_flash[i], s_base[i], s_ref[i],
                  FWD_ATOL, base_name)


# --------------------------------------------------------------------------------------------
# generate()
# --------------------------------------------------------------------------------------------

GEN_PROMPTS = [30, 30, 21, 9]
GEN_NEW = 6


def _generate(model, ids, mask):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=GEN_NEW, min_new_tokens=GEN_NEW,
        do_sample=False, pad_token_id=PAD, eos_token_id=EOS, return_dict_in_generate=True,
        output_scores=True,
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_generate(name):
    ref, base, flash = build_models(name)
    base_name = base.config._attn_implementation
    torch.manual_seed(_seed("generate", name))
    vocab = ref.config.vocab_size
    n, b = max(GEN_PROMPTS), len(GEN_PROMPTS)
    ids = torch.randint(3, vocab, (b, n), device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, ln in enumerate(GEN_PROMPTS):
        mask[i, n - ln:] = 1  # left padding, as generate() wants for decoder-only models
    ids = ids.masked_fill(mask == 0, PAD)

    with torch.no_grad():
        out_ref = _generate(ref, ids, mask)
        out_base = _generate(base, ids, mask)
        out_flash = _generate(flash, ids, mask)
    for out in (out_ref, out_base, out_flash):
        assert out.sequences.shape == (b, n + GEN_NEW)
        assert torch.equal(out.sequences[:, :n], ids)
        assert len(out.scores) == GEN_NEW

    # Step by step, over the rows whose greedy tokens so far are the same in all three models (so
    # the three saw the same inputs): the 2x rule on the step's scores (step 0 is the padded varlen
    # prefill, later steps are single-token decodes against the KV cache), and flash's token must
    # be the reference's wherever the reference's top1 - top2 margin exceeds twice flash's own
    # score error on that row (no near-tie). Rows that diverge at a near-tie drop out.
    new = [o.sequences[:, n:] for o in (out_ref, out_base, out_flash)]
    same = torch.ones(b, dtype=torch.bool, device=DEVICE)
    decided = 0
    for step in range(GEN_NEW):
        rows = same.nonzero().flatten()
        if rows.numel() == 0:
            break
        s_ref, s_base, s_flash = (o.scores[step][rows].float()
                                  for o in (out_ref, out_base, out_flash))
        finite = torch.isfinite(s_ref)  # min_new_tokens masks EOS with -inf
        assert torch.equal(finite, torch.isfinite(s_flash)), f"{name} step {step}: non-finite"
        assert_2x(f"{name} generate step {step} scores (rows {rows.tolist()})", s_flash[finite],
                  s_base[finite], s_ref[finite], FWD_ATOL, base_name)
        row_err = torch.where(finite, (s_flash - s_ref).abs(), 0).amax(dim=-1)
        top2 = s_ref.masked_fill(~finite, float("-inf")).topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        for i, row in enumerate(rows.tolist()):
            if margin[i] > 2 * row_err[i]:
                decided += 1
                assert new[2][row, step] == new[0][row, step], (
                    f"{name}: row {row} step {step}: flash picked {new[2][row, step].item()}, "
                    f"fp32 eager {new[0][row, step].item()} (reference margin "
                    f"{margin[i].item():.3e} > 2 * flash score error {row_err[i].item():.3e})")
        same &= (new[2][:, step] == new[0][:, step]) & (new[1][:, step] == new[0][:, step])
    assert decided > 0, f"{name}: every greedy step was a near-tie; change the seed"


# --------------------------------------------------------------------------------------------
# transformers selects this package unaided
# --------------------------------------------------------------------------------------------

def test_transformers_selects_flash_attn(tmp_path, monkeypatch):
    import flash_attn
    from transformers.utils import is_flash_attn_2_available

    assert is_flash_attn_2_available(), (
        "transformers does not see flash_attn as FlashAttention-2 (distribution 'flash-attn' "
        f">= 2.3.3; this is {flash_attn.__version__})")

    cfg_cls, _, kwargs = _classes("llama_gqa_hd128")
    config = cfg_cls(**COMMON, **kwargs)
    torch.manual_seed(_seed("select"))
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=FLASH, dtype=DTYPE).to(DEVICE).eval()
    assert model.config._attn_implementation == FLASH
    # The loading path (a local directory; no network).
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation=FLASH, dtype=DTYPE).to(DEVICE).eval()
    assert loaded.config._attn_implementation == FLASH

    # transformers (4.5x-5.x) imports the functions inside _lazy_imports with
    # `from flash_attn import flash_attn_func, flash_attn_varlen_func, ...` and caches them in
    # module globals of modeling_flash_attention_utils, which every attention call reads back
    # (lazy_import_flash_attention). Patching flash_attn's attributes after loading would miss
    # them, so count calls by wrapping those globals.
    mfau = importlib.import_module("transformers.modeling_flash_attention_utils")
    cached = ("_flash_fn", "_flash_varlen_fn", "_loaded_implementation")
    if not all(hasattr(mfau, g) for g in cached):
        pytest.skip("this transformers caches the flash functions elsewhere; call counting skipped")
    if mfau._loaded_implementation != FLASH:
        mfau.lazy_import_flash_attention(FLASH)
    assert mfau._loaded_implementation == FLASH
    assert mfau._flash_fn is flash_attn.flash_attn_func
    assert mfau._flash_varlen_fn is flash_attn.flash_attn_varlen_func

    calls = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}

    def counting(name, fn):
        @functools.wraps(fn)  # keeps the signature transformers inspects for supported kwargs
        def wrapper(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return wrapper

    monkeypatch.setattr(mfau, "_flash_fn", counting("flash_attn_func", mfau._flash_fn))
    monkeypatch.setattr(mfau, "_flash_varlen_fn",
                        counting("flash_attn_varlen_func", mfau._flash_varlen_fn))

    n_layers = loaded.config.num_hidden_layers
    vocab = loaded.config.vocab_size
    ids = torch.randint(3, vocab, (2, 50), device=DEVICE)
    with torch.no_grad():
        out = loaded(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(out).all()
    assert calls == {"flash_attn_func": n_layers, "flash_attn_varlen_func": 0}, calls

    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    with torch.no_grad():
        out = loaded(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.isfinite(out[mask.bool()]).all()
    assert calls == {"flash_attn_func": n_layers, "flash_attn_varlen_func": n_layers}, calls

    pos = torch.cat([torch.arange(20, device=DEVICE), torch.arange(30, device=DEVICE)])[None]
    with torch.no_grad():
        loaded(input_ids=ids[:1], position_ids=pos, use_cache=False)
    assert calls == {"flash_attn_func": n_layers, "flash_attn_varlen_func": 2 * n_layers}, calls
