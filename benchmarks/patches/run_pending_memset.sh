#!/usr/bin/env bash
# One GPU-machine call (about 4 minutes; give it 400 s), from the repo root with .cutlass
# carried: fwd_no_counter_memset.patch against main, d = 64/128 bf16, forward only. Builds both
# in parallel, runs the forward tests on the patched build (the counter must be back at zero
# after every launch, or the next call's tiles go missing), then times the band kernel's calls
# in turns: causal 512-4k, non-causal varlen 512/1k.
#   bash benchmarks/patches/run_pending_memset.sh
source scripts/call_prelude.sh build/pending_memset_logs
FLASH_ATTN_HEADDIMS=64,128 FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DISABLE_BACKWARD=1 \
  VARIANTS="base nomemset:benchmarks/patches/fwd_no_counter_memset.patch" AB_ARGS=none \
  OUT="$OUT" timeout 300 bash scripts/dev_ab.sh; t
(cd /tmp/ab/nomemset && PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "fwd or varlen" 2>&1 | tail -2); t
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B="base=/tmp/ab/base/flash_attn/$so nomemset=/tmp/ab/nomemset/flash_attn/$so"
timeout 60 python3 benchmarks/ab_builds.py $B --hdims 64,128 --seqlens 512,1024,2048,4096 \
  --causal 1 --rounds 5
timeout 40 python3 benchmarks/ab_builds.py $B --hdims 64,128 --varlen --seqlens 512,1024 \
  --causal 0 --rounds 5; t
