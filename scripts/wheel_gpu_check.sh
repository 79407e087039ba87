#!/usr/bin/env bash
# On a GPU machine, from the repo root: builds a wheel (scripts/build_wheel.sh, the build flags
# from the environment, default d=64/128 bf16+fp16 for sm_90a), installs it with pip alone into
# a fresh venv (torch from the building Python's site-packages, no build tools, no index), and
# runs GPU tests against the installed package from a copy of tests/ outside the tree, so that
# nothing is imported from the source checkout. TESTS (default: the single-GPU forward/backward files
# and, where 2+ GPUs exist, the ring tests) and OUT (logs) may be set.
set -uo pipefail
export FLASH_ATTN_HEADDIMS=${FLASH_ATTN_HEADDIMS:-64,128} FLASH_ATTN_DTYPES=${FLASH_ATTN_DTYPES:-bf16,fp16}
export FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-$(nproc)}
[ -d .cutlass/include ] && export CUTLASS_INCLUDE_DIR=${CUTLASS_INCLUDE_DIR:-$PWD/.cutlass/include}
OUT=${OUT:-/tmp/wheel_check}
mkdir -p "$OUT"
work=$(mktemp -d)
bash scripts/build_wheel.sh "$work/dist" > "$OUT/wheel_build.log" 2>&1 || { tail -30 "$OUT/wheel_build.log"; exit 1; }
tail -2 "$OUT/wheel_build.log"
python3 -m venv "$work/venv"
# torch from the building Python's site-packages (which may itself be a venv), after the new
# venv's own: the installed wheel comes first on sys.path.
torch_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
echo "$torch_site" > "$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch_site.pth"
"$work/venv/bin/pip" install -q --no-deps --no-index "$work"/dist/*.whl || exit 1
cp -r tests "$work/tests"
cd "$work" || exit 1
"$work/venv/bin/python" -c "import flash_attn, flash_attn._C; print('installed:', flash_attn.__version__, flash_attn.__file__)" || exit 1
TESTS=${TESTS:-"tests/test_flash_attn_gpu.py tests/test_stable_binding.py"}
timeout 400 "$work/venv/bin/python" -m pytest -q -x -p no:cacheprovider $TESTS 2>&1 | tail -4
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  for t in nccl copy_engine; do
    echo "== ring tests, $t"
    setsid timeout -k 10 150 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
      tests/test_ring_attention_gpu.py -k "$t" 2>&1 | tail -2
    pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null  # the ranks; [.] spares a shell naming it
  done
fi
