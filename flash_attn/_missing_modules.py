"""An import hook that makes ``import flash_attn.<module>`` of a FlashAttention-2 module this
package does not provide (``flash_attn.ops.rms_norm``, ``flash_attn.modules.mha``, ...) fail
with a ModuleNotFoundError that says so and lists what the package provides instead.

The finder is appended to the end of ``sys.meta_path``, so it only sees names that every other
finder failed to find: existing submodules import as before. Private names (a component
starting with ``_``, e.g. the compiled extension ``flash_attn._C``) are left alone, so that
their ordinary ImportError is unchanged. A lookup through ``importlib.util.find_spec`` (how
libraries probe for optional modules) gets None, as for any missing module; only an actual
import gets the explanatory error. The form ``from flash_attn.ops import rms_norm`` gets
Python's own "cannot import name" ImportError instead: the import system replaces the
ModuleNotFoundError of a submodule named in a from-list with that one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import FrameType, ModuleType
from typing import Optional, Sequence

__all__ = ["MissingModuleFinder", "install", "missing_module_message"]

PROVIDED = (
    "the attention functions in flash_attn (flash_attn_func, flash_attn_qkvpacked_func, "
    "flash_attn_kvpacked_func, flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, "
    "flash_attn_varlen_kvpacked_func, flash_attn_with_kvcache), flash_attn.bert_padding, "
    "flash_attn.layers.rotary and flash_attn.ops.triton.rotary"
)

# FlashAttention-2's top-level modules and packages below flash_attn: a missing name under one
# of them is one of its modules; any other name is a plain typo.
_FA2_TOP_LEVEL = frozenset({
    "cute", "flash_attn_triton", "flash_attn_triton_amd", "flash_attn_triton_og",
    "flash_blocksparse_attention", "flash_blocksparse_attn_interface", "fused_softmax",
    "layers", "losses", "models", "modules", "ops", "utils",
})

# What to use instead, by module name or package prefix (the longest match wins).
_ALTERNATIVES = {
    "flash_attn.ops.rms_norm": "torch.nn.RMSNorm or torch.nn.functional.rms_norm",
    "flash_attn.ops.layer_norm": "torch.nn.LayerNorm or torch.nn.functional.layer_norm",
    "flash_attn.ops.triton.layer_norm": "torch.nn.LayerNorm / torch.nn.RMSNorm",
    "flash_attn.ops.fused_dense": "torch.nn.Linear",
    "flash_attn.ops.triton.linear": "torch.nn.Linear",
    "flash_attn.ops.activations": "torch.nn.functional.gelu / silu",
    "flash_attn.ops.triton.k_activations": "torch.nn.functional.gelu / silu",
    "flash_attn.losses": "torch.nn.CrossEntropyLoss or torch.nn.functional.cross_entropy",
    "flash_attn.ops.triton.cross_entropy": "torch.nn.functional.cross_entropy",
    "flash_attn.flash_attn_triton": "flash_attn.flash_attn_func",
    "flash_attn.flash_attn_triton_og": "flash_attn.flash_attn_func",
    "flash_attn.modules.mha": "flash_attn.flash_attn_func (or flash_attn_varlen_func, "
                              "flash_attn_with_kvcache) between your own projections",
}


def missing_module_message(fullname: str, requested: Optional[str] = None) -> str:
    """The text of the ModuleNotFoundError for the missing module ``fullname``
    (``flash_attn.<...>``), found missing while importing ``requested`` (fullname itself or
    one of its submodules: ``import flash_attn.modules.mha`` fails at ``flash_attn.modules``)."""
    requested = requested or fullname
    parts = requested.split(".")
    if len(parts) > 1 and parts[1] in _FA2_TOP_LEVEL:
        what = "it is a FlashAttention-2 module that this package does not provide"
    else:
        what = "it is not a module of this package (nor of FlashAttention-2)"
    via = f" (importing {requested!r})" if requested != fullname else ""
    msg = f"No module named {fullname!r}{via}: {what}."
    for i in range(len(parts), 1, -1):
        alternative = _ALTERNATIVES.get(".".join(parts[:i]))
        if alternative is not None:
            msg += f" Use {alternative} instead."
            break
    return msg + f" This package provides {PROVIDED}."


def _requested_name(fullname: str, frame: Optional[FrameType]) -> str:
    """The submodule of ``fullname`` whose import is under way, if any, else fullname. An
    import of a.b.c imports a.b first, through nested calls of the import system's
    ``_find_and_load_unlocked(name, ...)``; their ``name`` arguments are on the stack above
    ``frame``, up to the first frame outside the import system."""
    requested = fullname
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        if frame.f_code.co_name == "_find_and_load_unlocked":
            name = frame.f_locals.get("name")
            if isinstance(name, str) and name.startswith(requested + "."):
                requested = name
        frame = frame.f_back
    return requested


def _is_probe(frame: Optional[FrameType]) -> bool:
    """Whether the lookup reaching ``frame`` comes from ``importlib.util.find_spec`` (a probe)
    rather than from an import: the nearer of the two callers decides. Both call the import
    system's ``_find_spec``, which calls the finders, so only the call stack tells them apart."""
    for _ in range(8):
        if frame is None:
            break
        if frame.f_code is importlib.util.find_spec.__code__:
            return True
        if frame.f_code.co_name == "_find_and_load_unlocked":
            return False
        frame = frame.f_back
    return False


class _MissingModuleLoader(importlib.abc.Loader):
    """Raises the explanatory ModuleNotFoundError instead of creating the module; nothing is
    added to sys.modules, so every later import raises again."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        try:
            requested = _requested_name(spec.name, sys._getframe(1))
        except (AttributeError, ValueError):  # no frame introspection on this interpreter
            requested = spec.name
        raise ModuleNotFoundError(missing_module_message(spec.name, requested), name=spec.name)

    def exec_module(self, module: ModuleType) -> None:
        # Not reached: create_module always raises.
        raise ModuleNotFoundError(missing_module_message(module.__name__), name=module.__name__)


class MissingModuleFinder(importlib.abc.MetaPathFinder):
    """Answers for public ``flash_attn.*`` names that no other finder found: a spec whose
    loader raises the explanatory error, or None for a find_spec probe."""

    _loader = _MissingModuleLoader()

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "flash_attn":
            return None
        if any(p.startswith("_") for p in parts[1:]):
            return None
        try:
            probe = _is_probe(sys._getframe(1))
        except (AttributeError, ValueError):  # no frame introspection on this interpreter
            probe = False
        if probe:
            return None
        return importlib.machinery.ModuleSpec(fullname, self._loader)


def install() -> None:
    """Append the finder to sys.meta_path once (a reload of flash_attn does not add a
    second one)."""
    if not any(type(f).__name__ == MissingModuleFinder.__name__
               and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.append(MissingModuleFinder())
