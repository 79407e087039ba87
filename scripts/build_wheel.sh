#!/usr/bin/env bash
# Builds a wheel of flash_attn for the torch installed in this Python, into dist/ (or $1):
#   bash scripts/build_wheel.sh [OUTDIR]
# With a CUDA torch and nvcc the wheel carries the extension flash_attn._C (every flag of
# README.md "Build flags" applies, e.g. FLASH_ATTN_CUDA_ARCHS, MAX_JOBS) and is named for the
# torch and CUDA it was built against (local version +cuXYZtorchA.B, platform tag). With a
# CPU-only torch it is a pure Python wheel (py3-none-any). Afterwards the script counts the
# extension's undefined dynamic symbols from torch's C++ libraries (at::, c10::, torch::) and
# fails unless there are none: the binding is on PyTorch's stable C ABI (docs/stable_abi.md),
# so it needs only C functions (aoti_torch_*, torch_*), which later torch releases keep.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-dist}"
PY="${PYTHON:-python3}"
label=$("$PY" -c "
import torch
cu = torch.version.cuda
major_minor = '.'.join(torch.__version__.split('+')[0].split('.')[:2])
print('cu' + cu.replace('.', '') + 'torch' + major_minor if cu else '')
")
mkdir -p "$out"
FLASH_ATTN_LOCAL_VERSION="$label" "$PY" -m pip wheel --no-build-isolation --no-deps -w "$out" .
wheel=$(ls -t "$out"/flash_attn-*.whl | head -1)
echo "wheel: $wheel"
so=$("$PY" -c 'import sys, zipfile
names = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.startswith("flash_attn/_C")]
print(names[0] if names else "")' "$wheel")
if [ -z "$so" ]; then
  echo "no CUDA extension in the wheel (pure Python: the CPU reference path only)"
  exit 0
fi
tmp=$(mktemp -d)
"$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' "$wheel" "$so" "$tmp"
n=$(nm -D --undefined-only "$tmp/$so" | c++filt | grep -cE ' (at|c10|torch)::' || true)
rm -rf "$tmp"
echo "undefined torch C++ symbols in $so: $n"
if [ "$n" -ne 0 ]; then
  echo "build_wheel: the extension needs torch C++ symbols; the stable-ABI binding must not" >&2
  exit 1
fi
