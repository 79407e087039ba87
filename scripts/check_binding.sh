#!/usr/bin/env bash
# Compile check of the torch binding (csrc/flash_api.cpp) on a machine without a GPU or a CUDA
# build of torch: a CPU torch's headers lack the CUDA build's generated ones, so the headers of
# a CUDA torch wheel (and of the cuBLAS, cuSPARSE and cuSOLVER versions that wheel pins, which
# ATen's CUDA context includes) are unpacked into build/binding_check and the binding is
# compiled against them with -fsyntax-only. The kernels are checked by CMake's targets; this
# checks the one file that only a CUDA torch could compile before, so that a slip in it is
# caught before a GPU machine builds it.
#
#   bash scripts/check_binding.sh                  # torch 2.14.1's headers
#   TORCH_VERSION=2.11.0 bash scripts/check_binding.sh
#
# The default, 2.14.1, is the newest CUDA torch this machine kind keeps on disk (the CPU tests
# use 2.13.0, whose wheel has no CUDA build's generated headers). Needs pip (the wheels come
# from pip's configured indexes: about 1.3 GB for 2.14.1), unzip, g++ with C++20, CUDA's
# headers (/usr/local/cuda/include or CUDA_HOME) and CUTLASS's (as setup.py finds them:
# CUTLASS_INCLUDE_DIR, third_party/cutlass/include or the nvidia-cutlass package).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.14.1}"
DIR="build/binding_check/torch-$TORCH_VERSION"
CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
DONE="$DIR/root/.complete"  # written once every header is unpacked

if [ ! -f "$DONE" ]; then
  rm -rf "$DIR"
  mkdir -p "$DIR/wheels" "$DIR/root"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/wheels" "torch==$TORCH_VERSION"
  whl="$(ls "$DIR"/wheels/torch-*.whl)"
  case "$(basename "$whl")" in
    *+cpu*) echo "check_binding: pip gave a CPU build of torch ($whl); a CUDA build is needed" >&2
            exit 1 ;;
  esac
  # The cuBLAS, cuSPARSE and cuSOLVER wheels this torch wheel pins, for their headers: through
  # the cuda-toolkit meta-package (torch >= 2.14), or as nvidia-* packages (earlier releases).
  pins_txt="$("$PY" - "$whl" <<'PYEOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        m = re.match(r"Requires-Dist: cuda-toolkit\[[^]]*\]\s*==\s*([\w.]+)", line)
        if m:
            print(f"cuda-toolkit[cublas,cusolver,cusparse]=={m.group(1)}")
        m = re.match(r"Requires-Dist: (nvidia-(cublas|cusparse|cusolver)-cu\d+)\s*==\s*([\w.]+)",
                     line)
        if m:
            print(f"{m.group(1)}=={m.group(3)}")
PYEOF
  )"
  if [ -z "$pins_txt" ]; then
    echo "check_binding: $whl pins no cuBLAS/cuSPARSE/cuSOLVER wheels; is it a CUDA build?" >&2
    exit 1
  fi
  while IFS= read -r pin; do
    case "$pin" in
      cuda-toolkit*) "$PY" -m pip download -q --only-binary=:all: -d "$DIR/wheels" "$pin" ;;
      *) "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/wheels" "$pin" ;;
    esac
  done <<< "$pins_txt"
  unzip -q -o "$whl" 'torch/include/*' -d "$DIR/root"
  for w in "$DIR"/wheels/nvidia_*.whl; do
    if unzip -Z1 "$w" | grep '/include/' > /dev/null; then
      unzip -q -o "$w" '*/include/*' -d "$DIR/root"
    fi
  done
  rm -rf "$DIR/wheels"
  touch "$DONE"
fi

TORCH_INC="$DIR/root/torch/include"
LIB_INCS=()
while IFS= read -r d; do LIB_INCS+=("-I$d"); done < <(find "$DIR/root/nvidia" -type d -name include 2>/dev/null)
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

echo "check_binding: csrc/flash_api.cpp against torch $TORCH_VERSION's headers"
g++ -std=c++20 -fsyntax-only -Wall -Wno-unused-function \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H '-DFLASH_ATTN_SASS_ARCHS="80,90"' \
  -isystem "$TORCH_INC" -isystem "$TORCH_INC/torch/csrc/api/include" -isystem "$PY_INC" \
  -isystem "$CUDA_INC" "${LIB_INCS[@]/#-I/-isystem}" -isystem "$CUTLASS_INC" -Icsrc -I. \
  csrc/flash_api.cpp
echo "check_binding: ok"
