#!/usr/bin/env bash
# One GPU-machine call for the d256 forward patches prepared in session 39, from the repo root
# with .cutlass carried (8-9 minutes on one H100/H200: give the call 600 s; OUT: where logs
# go):
#   bash benchmarks/patches/run_pending.sh
# Builds base and the three patched trees (d256, bf16 + e4m3, forward only) in parallel, then:
# fwd_d256_short_keys (bf16 and e4m3 causal 512-16k, non-causal varlen, its tests),
# fwd_e4m3_d256_n128 (e4m3 both masks, its tests), fwd_value_warp_two_groups (d256 decode with
# pages of 16/32/256 against the contiguous cache, the paged tests). Each step has a timeout so
# that a slow one cannot take the rest with it.
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD
OUT=${OUT:-$ROOT/build/pending_logs}
mkdir -p "$OUT"
T0=$(date +%s); t() { echo "t=$(( $(date +%s) - T0 ))s"; }
P=benchmarks/patches
FLASH_ATTN_HEADDIMS=256 FLASH_ATTN_DTYPES=bf16,e4m3 FLASH_ATTN_DISABLE_BACKWARD=1 \
  VARIANTS="base short:$P/fwd_d256_short_keys.patch n128:$P/fwd_e4m3_d256_n128.patch v2:$P/fwd_value_warp_two_groups.patch" \
  AB_ARGS=none OUT="$OUT" timeout 420 bash scripts/dev_ab.sh; t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B() { echo "$1=/tmp/ab/$1/flash_attn/$so"; }
run() { (cd "/tmp/ab/$1" && shift && PYTHONPATH=$PWD timeout "$@"); }
for dt in bf16 e4m3; do
  timeout 70 python3 benchmarks/ab_builds.py $(B base) $(B short) --dtype $dt --hdims 256 \
    --seqlens 512,1024,2048,4096,16384 --causal 1 --rounds 3
  timeout 40 python3 benchmarks/ab_builds.py $(B base) $(B short) --dtype $dt --hdims 256 \
    --varlen --seqlens 1024,2048,8192 --causal 0 --rounds 2
done; t
timeout 90 python3 benchmarks/ab_builds.py $(B base) $(B n128) --dtype e4m3 --hdims 256 \
  --seqlens 512,1024,2048,8192,16384 --causal both --rounds 3; t
for v in base v2; do
  echo "== decode d256, $v"
  run $v 40 python3 benchmarks/benchmark_decode.py --hdim 256 --pages 16,32,256 --seqlens-q 1 --heads 32:8 | tail -2
done; t
run short 60 python3 -m pytest -q -x tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "256 and (fwd or varlen)" 2>&1 | tail -2
run short 30 python3 -m pytest -q -x tests/test_fp8_gpu.py -k 256 2>&1 | tail -2
run n128 30 python3 -m pytest -q -x tests/test_fp8_gpu.py -k 256 2>&1 | tail -2
run v2 60 python3 -m pytest -q -x tests/test_kvcache_gpu.py -k page 2>&1 | tail -2; t
