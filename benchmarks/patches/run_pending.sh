#!/usr/bin/env bash
# One GPU-machine call (about 6 minutes on one H100/H200; give it 600 s), from the repo root
# with .cutlass carried:
#   bash benchmarks/patches/run_pending.sh
# Builds main and sm80_det_deferred_pass (d = 64/128, bf16 + fp16) in parallel, then on the
# SM80 kernels (FLASH_ATTN_FORCE_SM80=1) times the deterministic and the default backward in
# turns in one process, and runs the deterministic GPU tests on the patched build.
source scripts/call_prelude.sh build/pending_logs
P=benchmarks/patches
FLASH_ATTN_HEADDIMS=64,128 FLASH_ATTN_DTYPES=bf16,fp16 \
  VARIANTS="base deferred:$P/sm80_det_deferred_pass.patch" AB_ARGS=none OUT="$OUT" \
  timeout 330 bash scripts/dev_ab.sh; t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so deferred=/tmp/ab/deferred/flash_attn/$so"
ab() { FLASH_ATTN_FORCE_SM80=1 timeout 70 python3 benchmarks/ab_builds.py $B --pass bwd \
  --hdims 64,128 --seqlens 1024,4096,16384 --causal both --rounds 3 "$@"; }
echo "== SM80 deterministic"; ab --deterministic
echo "== SM80 default"; ab; t
(cd /tmp/ab/deferred && PYTHONPATH=$PWD FLASH_ATTN_FORCE_SM80=1 timeout 150 python3 -m pytest \
  -q -x tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "determin" 2>&1 | tail -3); t
