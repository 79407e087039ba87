#!/usr/bin/env bash
# One GPU-machine call (about 9 minutes; give it 600 s), from the repo root with .cutlass
# carried: bwd_uniform_descriptors.patch against main, d = 64/128/256 bf16 (d = 96 and 32 take
# the same flag and are only compiled here). Builds both in parallel, runs the backward GPU
# tests of those dims on the patched build, then times the backward of both builds in turns
# (1k/4k/16k, causal or not; deterministic at d = 128).
#   bash benchmarks/patches/run_pending_uniform.sh
# SKIP_BUILD=1 reuses /tmp/ab/{base,uni} of an earlier call on the same warm machine.
source scripts/call_prelude.sh build/pending_uniform_logs
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  FLASH_ATTN_HEADDIMS=64,128,256 FLASH_ATTN_DTYPES=bf16 \
    VARIANTS="base uni:benchmarks/patches/bwd_uniform_descriptors.patch" AB_ARGS=none \
    OUT="$OUT" timeout 360 bash scripts/dev_ab.sh; t
fi
(cd /tmp/ab/uni && PYTHONPATH=$PWD timeout 90 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "bwd or grad or determin" 2>&1 \
  | tail -2); t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so uni=/tmp/ab/uni/flash_attn/$so"
timeout 100 python3 benchmarks/ab_builds.py $B --pass bwd --hdims 64,128,256 \
  --seqlens 1024,4096,16384 --causal both --rounds 3; t
timeout 40 python3 benchmarks/ab_builds.py $B --pass bwd --deterministic --hdims 128 \
  --seqlens 4096,16384 --causal both --rounds 3; t
