#!/usr/bin/env bash
# One GPU-machine call (about 7 minutes; give it 600 s), from the repo root with .cutlass
# carried: fwd_tiers_160_224.patch against main at d = 192 and 224, bf16, forward only. Builds
# both in parallel, runs the patched build's forward, varlen and paged-cache tests at those
# dims, times causal 512-4k and non-causal varlen in turns, and decode with pages of 16 / 256.
#   bash benchmarks/patches/run_pending_tiers.sh
source scripts/call_prelude.sh build/pending_tiers_logs
FLASH_ATTN_HEADDIMS=192,224 FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DISABLE_BACKWARD=1 \
  VARIANTS="base tiers:benchmarks/patches/fwd_tiers_160_224.patch" AB_ARGS=none OUT="$OUT" \
  timeout 330 bash scripts/dev_ab.sh; t
(cd /tmp/ab/tiers && PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -x \
  tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py tests/test_kvcache_gpu.py \
  -k "(192 or 224) and (fwd or varlen or page or kvcache)" 2>&1 | tail -2); t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so tiers=/tmp/ab/tiers/flash_attn/$so"
timeout 60 python3 benchmarks/ab_builds.py $B --hdims 224 --seqlens 512,1024,2048,4096 \
  --causal 1 --rounds 3
timeout 40 python3 benchmarks/ab_builds.py $B --hdims 224 --varlen --seqlens 1024,2048 \
  --causal 0 --rounds 3; t
for v in base tiers; do
  echo "== decode d192, $v"
  (cd /tmp/ab/$v && PYTHONPATH=$PWD timeout 40 python3 benchmarks/benchmark_decode.py \
    --hdim 192 --pages 16,256 --seqlens-q 1 --heads 32:8 | tail -2)
done; t
