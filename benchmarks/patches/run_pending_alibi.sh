#!/usr/bin/env bash
# One GPU-machine call (about 6 minutes; give it 600 s), from the repo root with .cutlass
# carried: bwd_alibi_terms.patch against main at d = 64/128/256 (bf16 + fp16). Builds both in
# parallel, runs the ALiBi GPU tests on the patched build, times the backward with ALiBi in
# turns (ab_builds.py --alibi --pass bwd), and ALiBi's cost on each build
# (benchmark_alibi.py: with / without ALiBi, forward and backward, CUDA graphs).
#   bash benchmarks/patches/run_pending_alibi.sh
source scripts/call_prelude.sh build/pending_alibi_logs
FLASH_ATTN_HEADDIMS=64,128,256 FLASH_ATTN_DTYPES=bf16,fp16 \
  VARIANTS="base terms:benchmarks/patches/bwd_alibi_terms.patch" AB_ARGS=none OUT="$OUT" \
  timeout 330 bash scripts/dev_ab.sh; t
(cd /tmp/ab/terms && PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_flash_attn_gpu.py -k "alibi" 2>&1 | tail -2); t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so terms=/tmp/ab/terms/flash_attn/$so"
timeout 90 python3 benchmarks/ab_builds.py $B --alibi --pass bwd --hdims 64,128,256 \
  --seqlens 1024,4096,16384 --causal both --rounds 3; t
for v in base terms; do
  echo "== benchmark_alibi, $v"
  (cd /tmp/ab/$v && PYTHONPATH=$PWD timeout 60 python3 benchmarks/benchmark_alibi.py \
    --hdims 128 2>&1 | grep "^|")
done; t
