#!/usr/bin/env bash
# One GPU-machine call (about 3.5 minutes; give it 300 s), from the repo root with .cutlass
# carried: bwd_gqa_sum_in_dtype.patch against main, d = 128 bf16. Builds both in parallel, runs
# the GQA GPU tests (batched and varlen) on the patched build, then times the backward with 4
# query heads per K/V head in turns (1k/4k/16k, causal or not).
#   bash benchmarks/patches/run_pending_gqa.sh
source scripts/call_prelude.sh build/pending_gqa_logs
FLASH_ATTN_HEADDIMS=128 FLASH_ATTN_DTYPES=bf16 \
  VARIANTS="base gqasum:benchmarks/patches/bwd_gqa_sum_in_dtype.patch" AB_ARGS=none \
  OUT="$OUT" timeout 200 bash scripts/dev_ab.sh; t
(cd /tmp/ab/gqasum && PYTHONPATH=$PWD timeout 60 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "gqa or kvpacked or mqa" 2>&1 \
  | tail -2); t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so gqasum=/tmp/ab/gqasum/flash_attn/$so"
timeout 60 python3 benchmarks/ab_builds.py $B --pass bwd --gqa 4 --hdims 128 \
  --seqlens 1024,4096,16384 --causal both --rounds 5; t
