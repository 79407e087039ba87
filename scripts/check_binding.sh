#!/usr/bin/env bash
# Compile check of the torch binding (csrc/flash_api.cpp) and of the Python module
# (csrc/module.cpp) on a machine without a GPU or a CUDA build of torch. The binding is on
# PyTorch's stable C ABI (docs/stable_abi.md), whose headers every torch wheel carries, CPU
# builds included, so it is compiled against this Python's torch, for the stable-ABI release
# setup.py targets (TORCH_TARGET_VERSION). The kernels are checked by CMake's targets; this
# checks the two files g++ compiles, so that a slip in them is caught before a GPU machine
# builds them.
#
#   bash scripts/check_binding.sh
#   PYTHON=/path/to/python bash scripts/check_binding.sh
#
# Needs torch in $PYTHON (any build), g++ with C++17, CUDA's headers (/usr/local/cuda/include
# or CUDA_HOME) and CUTLASS's (as setup.py finds them: CUTLASS_INCLUDE_DIR,
# third_party/cutlass/include or the nvidia-cutlass package).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"

read -r TORCH_VERSION TORCH_INC TARGET < <("$PY" - <<'PYEOF'
import importlib.util, pathlib, torch
spec = importlib.util.spec_from_file_location("flash_attn_setup", "setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)  # defines functions only: setup() runs under __main__
print(torch.__version__, pathlib.Path(torch.__file__).parent / "include",
      setup.TORCH_TARGET_VERSION)
PYEOF
)
if [ ! -f "$TORCH_INC/torch/csrc/stable/library.h" ]; then
  echo "check_binding: torch $TORCH_VERSION has no stable-ABI headers ($TORCH_INC)" >&2
  exit 1
fi
CUTLASS_INC="$("$PY" - <<'PYEOF'
import importlib.util, os, pathlib
env = os.environ.get("CUTLASS_INCLUDE_DIR")
cands = [env] if env else []
cands += ["third_party/cutlass/include", ".cutlass/include"]
spec = importlib.util.find_spec("cutlass_library")
if spec and spec.submodule_search_locations:
    cands.append(str(pathlib.Path(list(spec.submodule_search_locations)[0]) / "source" / "include"))
print(next((c for c in cands if c and pathlib.Path(c, "cute", "tensor.hpp").is_file()), ""))
PYEOF
)"
if [ -z "$CUTLASS_INC" ]; then
  echo "check_binding: CUTLASS headers not found (third_party/README.md says how to get them)" >&2
  exit 1
fi
PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"

echo "check_binding: csrc/flash_api.cpp, csrc/module.cpp against torch $TORCH_VERSION's" \
  "stable headers (TORCH_TARGET_VERSION=$TARGET)"
for src in csrc/flash_api.cpp csrc/module.cpp; do
  g++ -std=c++17 -c -o /dev/null -Wall -Wextra -Werror \
    "-DTORCH_TARGET_VERSION=$TARGET" '-DFLASH_ATTN_SASS_ARCHS="80,90"' \
    -isystem "$TORCH_INC" -isystem "$PY_INC" -isystem "$CUDA_INC" -isystem "$CUTLASS_INC" \
    -Icsrc -I. "$src"
done
echo "check_binding: ok"
