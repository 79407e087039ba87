#!/usr/bin/env bash
# Unpack the CUTLASS headers from the nvidia-cutlass wheel into third_party/cutlass/include.
#   bash third_party/fetch_cutlass.sh [path/to/nvidia_cutlass-*.whl]
# Default wheel: ../shared/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl (from the repo root);
# without it, the wheel is downloaded from PyPI with `pip download --no-deps`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEEL="${1:-../shared/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
if [ ! -f "$WHEEL" ]; then
  echo "$WHEEL not found: downloading nvidia-cutlass==4.2.0.0 from PyPI"
  python3 -m pip download --no-deps --only-binary=:all: -d "$TMP/dl" nvidia-cutlass==4.2.0.0
  WHEEL="$(ls "$TMP"/dl/nvidia_cutlass-*.whl)"
fi
python3 - "$WHEEL" "$TMP/x" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix)]
    if not names:
        sys.exit(f"{wheel}: no {prefix} inside")
    z.extractall(dest, names)
PY
rm -rf third_party/cutlass/include
mkdir -p third_party/cutlass
mv "$TMP/x/cutlass_library/source/include" third_party/cutlass/include
grep -E '#define CUTLASS_(MAJOR|MINOR|PATCH)' third_party/cutlass/include/cutlass/version.h
echo "CUTLASS headers in third_party/cutlass/include"
