#!/usr/bin/env bash
# One GPU-machine call (about 5 minutes; give it 480 s), from the repo root with .cutlass
# carried: bwd_no_turns.patch against main, d = 96/128 bf16. Builds both in parallel, runs the
# backward GPU tests of those dims on the build without turns, then times the backward of both
# builds in turns (1k/4k/16k, causal or not; deterministic at d = 128).
#   bash benchmarks/patches/run_pending_noturn.sh
source scripts/call_prelude.sh build/pending_noturn_logs
FLASH_ATTN_HEADDIMS=96,128 FLASH_ATTN_DTYPES=bf16 \
  VARIANTS="base nt:benchmarks/patches/bwd_no_turns.patch" \
  AB_ARGS=none OUT="$OUT" timeout 300 bash scripts/dev_ab.sh; t
(cd /tmp/ab/nt && PYTHONPATH=$PWD timeout 90 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "bwd or grad or determin" 2>&1 \
  | tail -2); t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so nt=/tmp/ab/nt/flash_attn/$so"
timeout 70 python3 benchmarks/ab_builds.py $B --pass bwd --hdims 96,128 \
  --seqlens 1024,4096,16384 --causal both --rounds 3; t
timeout 40 python3 benchmarks/ab_builds.py $B --pass bwd --deterministic --hdims 128 \
  --seqlens 4096,16384 --causal both --rounds 3; t
