#!/usr/bin/env bash
# One GPU-machine call for the patch prepared in session 40 (about 6 minutes on one H100/H200;
# give it 600 s), from the repo root with .cutlass carried:
#   bash benchmarks/patches/run_pending.sh
# Builds base and sm80_det_copies (d = 64/128, bf16 + fp16) in parallel, then on the SM80
# kernels (FLASH_ATTN_FORCE_SM80=1) times deterministic and default backward in turns in one
# process, the patched build with the turns forced (FLASH_ATTN_DET_COPIES_MB=0) beside it, and
# runs the deterministic GPU tests (both paths) on the patched build. OUT: where logs go.
source scripts/call_prelude.sh build/pending_logs
P=benchmarks/patches
FLASH_ATTN_HEADDIMS=64,128 FLASH_ATTN_DTYPES=bf16,fp16 \
  VARIANTS="base copies:$P/sm80_det_copies.patch" AB_ARGS=none OUT="$OUT" \
  timeout 330 bash scripts/dev_ab.sh; t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so copies=/tmp/ab/copies/flash_attn/$so"
ab() { FLASH_ATTN_FORCE_SM80=1 timeout 70 python3 benchmarks/ab_builds.py $B --pass bwd \
  --hdims 64,128 --seqlens 1024,4096,16384 --causal both --rounds 3 "$@"; }
echo "== SM80 deterministic"; ab --deterministic
echo "== SM80 deterministic, copies build with the turns (FLASH_ATTN_DET_COPIES_MB=0)"
FLASH_ATTN_DET_COPIES_MB=0 ab --deterministic
echo "== SM80 default"; ab; t
(cd /tmp/ab/copies && PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -x \
  tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "determin" 2>&1 | tail -3); t
