"""Build script for flash_attn.

One CUDA extension, ``flash_attn._C``, is built when torch has CUDA and nvcc is found;
otherwise only the pure-Python package is installed and a notice says why. The extension is on
PyTorch's stable C ABI (docs/stable_abi.md): it needs only torch's stable headers and C
functions, so with FLASH_ATTN_BUILD_WITH_CPU_TORCH=1 a CPU-only torch builds it too (nvcc and
the CUDA runtime from the toolkit), for checks without a GPU.
See docs/INTERNALS.md ("Build flags") and README.md ("Build flags") for the knobs.

Debugging aid: ``FLASH_ATTN_PRINT_BUILD_PLAN=1 python setup.py --version`` prints the
selected sources and the exact per-group compiler flags without compiling anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PKG_NAME = "flash_attn"
EXT_NAME = "flash_attn._C"

# e4m3: the SM90 forward of float8_e4m3fn inputs (no SM80 kernels, no backward).
ALL_DTYPES = ("fp16", "bf16", "e4m3")
DEFAULT_ARCHS = "80;90"
SM90_ARCH = 90

# The stable-ABI release the binding targets: built against a later torch, it still runs on this
# one (torch/csrc/stable/version.h).
TORCH_TARGET_VERSION = "0x020b000000000000"  # 2.11

SM80_INST_DIR = "csrc/instantiations"
SM90_INST_DIR = "hopper/instantiations"
GENERATOR = "scripts/generate_kernels.py"


def _headdim_tiers() -> tuple[int, ...]:
    # The one list of tiers is csrc/common/tiers.h; the generator reads it, and so does this.
    spec = importlib.util.spec_from_file_location("generate_kernels", ROOT / GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HEADDIM_TIERS


HEADDIM_TIERS = _headdim_tiers()


def log(msg: str) -> None:
    # stderr: keeps `python setup.py --version` output clean; pip shows it with -v.
    print(f"[flash_attn setup] {msg}", file=sys.stderr, flush=True)


def env_flag(name: str, env=None) -> bool:
    env = os.environ if env is None else env
    return str(env.get(name, "")).strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------
# Build configuration from the environment (pure functions of `env`: easy to reason about)
# --------------------------------------------------------------------------------------
class BuildConfigError(RuntimeError):
    pass


def _split_list(value: str) -> list[str]:
    return [t for t in re.split(r"[;,\s]+", value.strip()) if t]


def parse_archs(value: str) -> list[int]:
    """'80;90' / '8.0,9.0' / 'sm_80 sm_90a' -> [80, 90]."""
    archs = set()
    for tok in _split_list(value):
        t = tok.lower()
        for prefix in ("sm_", "compute_", "sm"):
            if t.startswith(prefix):
                t = t[len(prefix):]
                break
        t = t.replace(".", "")
        if t.endswith("a"):  # 90a: the SM90 kernels are always built for sm_90a anyway
            t = t[:-1]
        if not t.isdigit():
            raise BuildConfigError(
                f"FLASH_ATTN_CUDA_ARCHS: cannot parse {tok!r} (expected e.g. '80;90')")
        arch = int(t)
        if arch < 80:
            raise BuildConfigError(
                f"FLASH_ATTN_CUDA_ARCHS: sm_{arch} is not supported; the kernels need sm80 or newer")
        archs.add(arch)
    if not archs:
        raise BuildConfigError("FLASH_ATTN_CUDA_ARCHS is empty")
    return sorted(archs)


def parse_headdims(value: str | None) -> list[int]:
    if value is None or not value.strip() or value.strip().lower() == "all":
        return list(HEADDIM_TIERS)
    dims = set()
    for tok in _split_list(value):
        if not tok.isdigit() or int(tok) not in HEADDIM_TIERS:
            raise BuildConfigError(
                f"FLASH_ATTN_HEADDIMS: {tok!r} is not a head-dim tier; choose from "
                f"{','.join(map(str, HEADDIM_TIERS))} (a head dim runs on the smallest tier "
                f"that holds it, e.g. 80 -> 96)")
        dims.add(int(tok))
    return sorted(dims)


def parse_dtypes(value: str | None) -> list[str]:
    if value is None or not value.strip() or value.strip().lower() == "all":
        return list(ALL_DTYPES)
    aliases = {"fp16": "fp16", "float16": "fp16", "half": "fp16",
               "bf16": "bf16", "bfloat16": "bf16",
               "e4m3": "e4m3", "fp8": "e4m3", "float8_e4m3fn": "e4m3"}
    out = set()
    for tok in _split_list(value):
        if tok.lower() not in aliases:
            raise BuildConfigError(
                f"FLASH_ATTN_DTYPES: {tok!r} is not one of {','.join(ALL_DTYPES)}")
        out.add(aliases[tok.lower()])
    return [d for d in ALL_DTYPES if d in out]


def nvcc_base_flags(cxx_std: str) -> list[str]:
    return [
        "-O3",
        f"-std=c++{cxx_std}",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-lineinfo",
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
        "-DNDEBUG",  # CUTLASS's device-side debug checks cost registers in the hot loops
    ]


def sm80_gencode(archs: list[int]) -> list[str]:
    """The SM80 (Ampere-style) kernels get SASS for every requested arch: sm_80 SASS does
    not run on sm_90, so an H100 needs its own sm_90 copy."""
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags


def sm90_gencode() -> list[str]:
    return ["-gencode", "arch=compute_90a,code=sm_90a"]


def compute_build_config(env=None, root: Path = ROOT) -> dict:
    """Everything setup.py decides from the environment and the tree: the sources of the
    extension, grouped, and the compiler flags of each group.  No compilation, no torch."""
    env = os.environ if env is None else env
    archs = parse_archs(env.get("FLASH_ATTN_CUDA_ARCHS") or DEFAULT_ARCHS)
    headdims = parse_headdims(env.get("FLASH_ATTN_HEADDIMS"))
    dtypes = parse_dtypes(env.get("FLASH_ATTN_DTYPES"))
    backward = not env_flag("FLASH_ATTN_DISABLE_BACKWARD", env)
    cxx_std = (env.get("FLASH_ATTN_CXX_STD") or "17").strip()
    # Statics of inline functions and templates bound per build instead of process-wide (GNU
    # unique symbols), so that benchmarks/ab_builds.py can load several builds into one
    # process. GCC only; not for installs.
    ab_build = env_flag("FLASH_ATTN_AB_BUILD", env)
    # The kernels' torch.ops namespace; an A/B build's is its own (from the tree's path), since
    # one namespace cannot be registered twice in a process.
    op_namespace = "flash_attn_cuda"
    if ab_build:
        op_namespace += "_ab_" + hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:10]
    directions = ["fwd", "bwd"] if backward else ["fwd"]
    with_sm90 = SM90_ARCH in archs

    # The torch binding (stable ABI) and the pybind11 module flash_attn._C (no torch type).
    cxx_sources = [root / "csrc" / "flash_api.cpp", root / "csrc" / "module.cpp"]
    # Kernels of csrc/common (the KV-cache update) run on every arch: built like the SM80 ones.
    sm80_sources = sorted((root / "csrc" / "common").glob("*.cu"))
    missing = []
    for direction in directions:
        for d in headdims:
            for dt in [t for t in dtypes if t != "e4m3"]:  # no SM80 e4m3 kernels
                p = root / SM80_INST_DIR / f"flash_{direction}_hdim{d}_{dt}_sm80.cu"
                (sm80_sources if p.exists() else missing).append(p)
    sm90_sources, sm90_missing = [], []
    if with_sm90:
        for d in headdims:
            for dt in dtypes:
                p = root / SM90_INST_DIR / f"flash_fwd_hdim{d}_{dt}_sm90.cu"
                (sm90_sources if p.exists() else sm90_missing).append(p)
                # The SM90 backward's file of the tier, where the generator wrote one (every
                # tier today); a tier without it runs the SM80 backward.
                p = root / SM90_INST_DIR / f"flash_bwd_hdim{d}_{dt}_sm90.cu"
                if backward and p.exists():
                    sm90_sources.append(p)

    return {
        "archs": archs,
        "headdims": headdims,
        "dtypes": dtypes,
        "backward": backward,
        "cxx_std": cxx_std,
        "op_namespace": op_namespace,
        "cxx_sources": cxx_sources,
        "sm80_sources": sm80_sources,
        "sm90_sources": sm90_sources,
        "missing_sm80": missing,
        "missing_sm90": sm90_missing,
        # The binding includes torch's stable headers, so it takes the C++ standard torch's
        # cpp_extension passes unless FLASH_ATTN_CXX_STD names one. The kernels include no
        # torch header.
        "cxx_flags": ["-O3", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]
        + ([f"-std=c++{cxx_std}"] if env.get("FLASH_ATTN_CXX_STD") else [])
        + (["-fno-gnu-unique"] if ab_build else []),
        "nvcc_flags": nvcc_base_flags(cxx_std)
        + (["-Xcompiler=-fno-gnu-unique"] if ab_build else []),
        "sm80_gencode": sm80_gencode(archs),
        "sm90_gencode": sm90_gencode(),
    }


# --------------------------------------------------------------------------------------
# CUTLASS
# --------------------------------------------------------------------------------------
CUTLASS_HOWTO = """\
CUTLASS headers (cute/ and cutlass/) were not found. Looked in, in this order:
  1. $CUTLASS_INCLUDE_DIR            {env}
  2. third_party/cutlass/include     {tp}
  3. the installed nvidia-cutlass package (cutlass_library/source/include)   {pkg}
Get them one of these ways:
  1. export CUTLASS_INCLUDE_DIR=/path/to/cutlass/include   (a CUTLASS checkout's include/)
  2. unpack the headers into third_party/cutlass/include (see third_party/README.md), e.g.
       unzip -q ../shared/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl \\
         'cutlass_library/source/include/*' -d /tmp/cutlass_whl &&
       mkdir -p third_party/cutlass && cp -r /tmp/cutlass_whl/cutlass_library/source/include third_party/cutlass/
  3. pip install --no-deps nvidia-cutlass==4.2.0.0
     (or: pip install --no-deps ../shared/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl)"""


def _is_cutlass_include(p: Path) -> bool:
    return (p / "cutlass" / "cutlass.h").is_file() and (p / "cute" / "tensor.hpp").is_file()


def _cutlass_from_package() -> Path | None:
    try:
        # find_spec on a top-level package locates it without running its __init__.
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "source" / "include"
        if _is_cutlass_include(p):
            return p
    return None


def find_cutlass(env=None, root: Path = ROOT) -> tuple[Path | None, str]:
    """Returns (include dir or None, where it came from or the error text)."""
    env = os.environ if env is None else env
    env_dir = env.get("CUTLASS_INCLUDE_DIR", "").strip()
    if env_dir:
        p = Path(env_dir).expanduser().resolve()
        if _is_cutlass_include(p):
            return p, "CUTLASS_INCLUDE_DIR"
        return None, (f"CUTLASS_INCLUDE_DIR={env_dir} does not contain cutlass/cutlass.h and "
                      f"cute/tensor.hpp; point it at the folder holding cute/ and cutlass/.")
    tp = root / "third_party" / "cutlass" / "include"
    if _is_cutlass_include(tp):
        return tp, "third_party/cutlass/include"
    pkg = _cutlass_from_package()
    if pkg is not None:
        return pkg, "nvidia-cutlass package"
    return None, CUTLASS_HOWTO.format(env="(not set)", tp="(not found)",
                                      pkg="(not installed)")


def cutlass_version(include_dir: Path) -> str | None:
    try:
        text = (include_dir / "cutlass" / "version.h").read_text()
    except OSError:
        return None
    parts = []
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"#define\s+CUTLASS_{key}\s+(\d+)", text)
        if not m:
            return None
        parts.append(m.group(1))
    return ".".join(parts)


# --------------------------------------------------------------------------------------
# Decide whether to build the extension
# --------------------------------------------------------------------------------------
def _fix_cuda_home_env() -> None:
    """torch guesses CUDA_HOME from `which nvcc`; a wrapper script such as /usr/local/bin/nvcc
    would make that /usr/local. Prefer a real toolkit root when the guess would be wrong."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    import shutil
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for c in candidates:
        if (c / "bin" / "nvcc").is_file() and (c / "include" / "cuda_runtime.h").is_file():
            if nvcc is None or Path(nvcc).parent.parent != c:
                os.environ["CUDA_HOME"] = str(c)
                mod = sys.modules.get("torch.utils.cpp_extension")
                if mod is not None:  # already imported: it read CUDA_HOME at import time
                    mod.CUDA_HOME = str(c)
            return


def _set_cuda_home_for_cpu_torch() -> None:
    """torch's cpp_extension leaves CUDA_HOME None when torch has no CUDA; the stable-ABI build
    with a CPU torch compiles the kernels with the toolkit's nvcc all the same, so it is set
    from $CUDA_HOME / $CUDA_PATH, the nvcc on PATH or /usr/local/cuda."""
    import shutil

    import torch.utils.cpp_extension as cpp_ext

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file():
            os.environ["CUDA_HOME"] = c
            cpp_ext.CUDA_HOME = c
            return


def cuda_build_decision() -> tuple[bool, str]:
    if env_flag("FLASH_ATTN_SKIP_CUDA_BUILD"):
        return False, "FLASH_ATTN_SKIP_CUDA_BUILD=1 is set"
    try:
        import torch  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return False, (f"torch is not importable here ({type(e).__name__}: {e}); install torch "
                       f"first and use `pip install --no-build-isolation`")
    cpu_torch = torch.version.cuda is None
    if cpu_torch and not env_flag("FLASH_ATTN_BUILD_WITH_CPU_TORCH"):
        return False, (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is "
                       f"None; FLASH_ATTN_BUILD_WITH_CPU_TORCH=1 builds the extension anyway)")
    _fix_cuda_home_env()
    if cpu_torch:
        _set_cuda_home_for_cpu_torch()
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        return False, (f"nvcc was not found (CUDA_HOME={CUDA_HOME}); set CUDA_HOME to the CUDA "
                       f"toolkit matching torch's CUDA {torch.version.cuda}")
    if cpu_torch:
        return True, (f"torch {torch.__version__} (CPU-only, FLASH_ATTN_BUILD_WITH_CPU_TORCH=1), "
                      f"CUDA_HOME={CUDA_HOME}")
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={CUDA_HOME}"


def run_generator() -> None:
    script = ROOT / GENERATOR
    if not script.is_file():
        log(f"WARNING: {GENERATOR} not found; using the instantiation files already on disk")
        return
    log(f"running {GENERATOR}")
    subprocess.run([sys.executable, str(script)], cwd=str(ROOT), check=True)


def rel(p: Path) -> str:
    try:
        return str(Path(p).relative_to(ROOT))
    except ValueError:
        return str(p)


def print_plan(cfg: dict, cutlass: Path | None, cutlass_info: str, decision: tuple[bool, str]):
    q = " ".join
    lines = [
        "build plan",
        f"  build extension {EXT_NAME}: {'yes' if decision[0] else 'NO'} ({decision[1]})",
        f"  archs={cfg['archs']} headdims={cfg['headdims']} dtypes={cfg['dtypes']} "
        f"backward={cfg['backward']}",
        f"  CUTLASS: {cutlass if cutlass else 'NOT FOUND'} "
        f"({cutlass_info.splitlines()[0] if cutlass_info else ''})"
        + (f" version {cutlass_version(cutlass)}" if cutlass else ""),
        f"  MAX_JOBS={os.environ.get('MAX_JOBS', '(ninja default)')}",
        f"  C++ sources ({len(cfg['cxx_sources'])}): cxx flags: {q(cfg['cxx_flags'])}",
    ]
    lines += [f"    {rel(p)}" for p in cfg["cxx_sources"]]
    lines.append(f"  SM80 sources ({len(cfg['sm80_sources'])}): nvcc "
                 f"{q(cfg['nvcc_flags'] + cfg['sm80_gencode'])}")
    lines += [f"    {rel(p)}" for p in cfg["sm80_sources"]]
    if SM90_ARCH in cfg["archs"]:
        lines.append(f"  SM90 sources ({len(cfg['sm90_sources'])}): nvcc "
                     f"{q(cfg['nvcc_flags'] + cfg['sm90_gencode'])}")
        lines += [f"    {rel(p)}" for p in cfg["sm90_sources"]]
    for p in cfg["missing_sm80"]:
        lines.append(f"  MISSING (SM80): {rel(p)}")
    if cfg["missing_sm90"]:
        names = [rel(p) for p in cfg["missing_sm90"]]
        lines.append(f"  missing SM90 files, skipped ({len(names)}): "
                     + ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    log("\n".join(lines))


def skip_notice(reason: str) -> None:
    bar = "=" * 78
    log(f"\n{bar}\nNOTICE: the CUDA extension {EXT_NAME} is NOT being built: {reason}.\n"
        f"Installing the pure-Python package only: flash_attn runs through its PyTorch\n"
        f"reference path (CPU tensors). To build the kernels: CUDA-enabled torch + nvcc +\n"
        f"CUTLASS headers, then `pip install --no-build-isolation -e .` (see README.md).\n{bar}")


# --------------------------------------------------------------------------------------
# Extension + per-file nvcc flags
# --------------------------------------------------------------------------------------
def make_build_ext_class(cfg: dict):
    import torch.utils.cpp_extension as cpp_ext
    from torch.utils.cpp_extension import BuildExtension

    sm90_paths = {str(p.resolve()) for p in cfg["sm90_sources"]}
    sm80_gencode_text = " ".join(shlex.quote(f) for f in cfg["sm80_gencode"])
    sm90_gencode_text = " ".join(shlex.quote(f) for f in cfg["sm90_gencode"])

    def rewrite_ninja(path: str) -> None:
        """Give the SM90 sources their own gencode (sm_90a only) via ninja per-edge
        variable bindings; every other .cu keeps the global (SM80) cuda_post_cflags."""
        if not sm90_paths:
            return
        with open(path) as f:
            lines = f.read().split("\n")
        out, defined, n_edges = [], False, 0
        for line in lines:
            out.append(line)
            if line.startswith("cuda_post_cflags = "):
                value = line[len("cuda_post_cflags = "):]
                if value.count(sm80_gencode_text) != 1:
                    raise RuntimeError(
                        "flash_attn setup: cannot find the SM80 gencode flags in "
                        f"{path}; torch's ninja file layout changed?")
                out.append("cuda_post_cflags_sm90 = "
                           + value.replace(sm80_gencode_text, sm90_gencode_text))
                defined = True
            elif line.startswith("build ") and ": cuda_compile " in line:
                src = line.split(": cuda_compile ", 1)[1].replace("$ ", " ").replace("$:", ":")
                if str(Path(src).resolve()) in sm90_paths:
                    if not defined:
                        raise RuntimeError("flash_attn setup: cuda_post_cflags not found "
                                           f"before the build edges in {path}")
                    out.append("  cuda_post_cflags = $cuda_post_cflags_sm90")
                    n_edges += 1
        if n_edges != len(sm90_paths):
            raise RuntimeError(
                f"flash_attn setup: expected {len(sm90_paths)} SM90 build edges in {path}, "
                f"found {n_edges}")
        with open(path, "w") as f:
            f.write("\n".join(out))
        log(f"ninja: {n_edges} SM90 sources get `{sm90_gencode_text}` (rewrote {path})")

    class FlashBuildExtension(BuildExtension):
        def build_extensions(self):
            if not self.use_ninja:
                raise RuntimeError(
                    "flash_attn needs ninja to build (per-file nvcc flags for the SM80 and "
                    "SM90 kernels): `pip install ninja`")
            original = cpp_ext._write_ninja_file

            def write_ninja_file(*args, **kwargs):
                original(*args, **kwargs)
                path = kwargs["path"] if "path" in kwargs else args[0]
                rewrite_ninja(path)

            cpp_ext._write_ninja_file = write_ninja_file
            try:
                super().build_extensions()
            finally:
                cpp_ext._write_ninja_file = original

    return FlashBuildExtension


def make_extension(cfg: dict, cutlass: Path):
    from torch.utils.cpp_extension import CUDAExtension

    missing = cfg["missing_sm80"]
    if not cfg["cxx_sources"][0].is_file():
        missing = [cfg["cxx_sources"][0]] + missing
    if missing:
        raise BuildConfigError(
            "missing kernel sources:\n  " + "\n  ".join(rel(p) for p in missing)
            + f"\n({GENERATOR} should write the instantiation files; does it exist and run?)")
    if cfg["missing_sm90"]:
        log(f"WARNING: {len(cfg['missing_sm90'])} SM90 instantiation files do not exist (e.g. "
            f"{rel(cfg['missing_sm90'][0])}); those SM90 kernels are not built")

    # build_info() reports the SASS targets; only the binding reads it.
    defines = [f'-DFLASH_ATTN_SASS_ARCHS="{",".join(str(a) for a in cfg["archs"])}"',
               f"-DFLASH_ATTN_OP_NAMESPACE={cfg['op_namespace']}"]

    sources = cfg["cxx_sources"] + cfg["sm80_sources"] + cfg["sm90_sources"]
    ext = CUDAExtension(
        name=EXT_NAME,
        sources=[rel(p) for p in sources],
        include_dirs=[str(ROOT / "csrc"), str(ROOT), str(cutlass)],
        extra_compile_args={
            "cxx": cfg["cxx_flags"] + defines,
            "nvcc": cfg["nvcc_flags"] + defines + cfg["sm80_gencode"],
        },
        extra_link_args=stable_abi_link_args(),
    )
    # Not CUDAExtension's libraries (torch, torch_python, c10, c10_cuda, ...): the stable ABI's
    # C functions are all in libtorch_cpu (the CUDA stream's in libtorch_cuda, above).
    ext.libraries = ["torch_cpu", "cudart"]
    return ext


def stable_abi_link_args() -> list[str]:
    """libtorch_cuda as a needed library although the binding refers to it only weakly
    (aoti_torch_get_current_cuda_stream): --as-needed, the default of many toolchains, drops a
    library that satisfies only weak references, and the symbol would then stay null. A CPU
    torch has no libtorch_cuda; the weak symbol is null there and no kernel is reached."""
    import torch

    if torch.version.cuda is None:
        return []
    return ["-Wl,--no-as-needed", "-ltorch_cuda", "-Wl,--as-needed"]


# --------------------------------------------------------------------------------------
def read_version() -> str:
    init = ROOT / PKG_NAME / "__init__.py"
    if init.is_file():
        m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", init.read_text(), re.M)
        if m:
            return m.group(1)
    raise BuildConfigError(f"no __version__ = '...' line in {init}")


def dist_version(with_extension: bool) -> str:
    """The package version, plus the local label FLASH_ATTN_LOCAL_VERSION (for example
    `cu130torch2.11`, what scripts/build_wheel.sh sets) when the CUDA extension is built: the
    extension links against one torch release's C++ ABI, so a wheel that carries it names the
    torch and CUDA it fits. A wheel without it (CPU-only torch) is pure Python and unlabelled."""
    label = os.environ.get("FLASH_ATTN_LOCAL_VERSION", "").strip()
    if label and not re.fullmatch(r"[A-Za-z0-9]+(\.[A-Za-z0-9]+)*", label):
        raise BuildConfigError(f"FLASH_ATTN_LOCAL_VERSION={label!r} is not a local version label")
    return read_version() + (f"+{label}" if label and with_extension else "")


def main():
    ext_modules, cmdclass = [], {}
    try:
        decision = cuda_build_decision()
        want_plan = env_flag("FLASH_ATTN_PRINT_BUILD_PLAN")
        if decision[0] or want_plan:
            if decision[0]:
                run_generator()
            cfg = compute_build_config()
            cutlass, cutlass_info = find_cutlass()
            if want_plan:
                print_plan(cfg, cutlass, cutlass_info, decision)
            if decision[0]:
                if cutlass is None:
                    raise BuildConfigError(cutlass_info)
                log(f"building {EXT_NAME}: {decision[1]}; archs={cfg['archs']} "
                    f"headdims={cfg['headdims']} dtypes={cfg['dtypes']} "
                    f"backward={cfg['backward']}; CUTLASS {cutlass_version(cutlass)} at "
                    f"{cutlass} ({cutlass_info}); {len(cfg['sm80_sources'])} SM80 + "
                    f"{len(cfg['sm90_sources'])} SM90 kernel files; "
                    f"MAX_JOBS={os.environ.get('MAX_JOBS', '(ninja default)')}")
                ext_modules = [make_extension(cfg, cutlass)]
                cmdclass = {"build_ext": make_build_ext_class(cfg)}
        if not decision[0]:
            skip_notice(decision[1])
        version = dist_version(bool(ext_modules))
    except BuildConfigError as e:
        log(f"ERROR: {e}")
        sys.exit(1)

    readme = ROOT / "README.md"
    setup(
        name="flash_attn",
        version=version,
        description=("Exact, memory-efficient attention (FlashAttention-2 API) with SM80 and "
                     "SM90 CUDA kernels and a PyTorch reference path"),
        long_description=readme.read_text() if readme.is_file() else "",
        long_description_content_type="text/markdown",
        author="The flash_attn authors",
        license="BSD-3-Clause",
        license_files=["LICENSE"],
        keywords=["attention", "transformer", "cuda", "flash-attention"],
        project_urls={
            "API (FlashAttention-2, implemented here)":
                "https://github.com/Dao-AILab/flash-attention",
            "FlashAttention-2 paper": "https://arxiv.org/abs/2307.08691",
            "FlashAttention-3 paper": "https://arxiv.org/abs/2407.08608",
        },
        classifiers=[
            "Programming Language :: Python :: 3",
            "Operating System :: POSIX :: Linux",
            "Environment :: GPU :: NVIDIA CUDA",
            "Topic :: Scientific/Engineering :: Artificial Intelligence",
        ],
        packages=find_packages(include=[PKG_NAME, f"{PKG_NAME}.*"]),
        python_requires=">=3.10",
        install_requires=["torch"],
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
