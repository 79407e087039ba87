#!/usr/bin/env bash
# One GPU-machine call (about 6 minutes; give it 600 s), from the repo root with .cutlass
# carried: against main, d = 64/128 bf16, bwd_no_turns.patch (nt), bwd_mask_rows.patch (mr)
# and bwd_mask_rows_d128.patch (mr2). Builds all four in parallel, runs the backward GPU tests
# of those dims on nt and mr2, then times the backward of the four builds in turns (1k/2k/4k/16k,
# causal or not), and deterministic at d = 128.
#   bash benchmarks/patches/run_pending_bwd.sh
source scripts/call_prelude.sh build/pending_bwd_logs
P=benchmarks/patches
FLASH_ATTN_HEADDIMS=64,128 FLASH_ATTN_DTYPES=bf16 \
  VARIANTS="base nt:$P/bwd_no_turns.patch mr:$P/bwd_mask_rows.patch mr2:$P/bwd_mask_rows_d128.patch" \
  AB_ARGS=none OUT="$OUT" timeout 330 bash scripts/dev_ab.sh; t
for v in mr2 nt; do
  (cd /tmp/ab/$v && PYTHONPATH=$PWD timeout 60 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "bwd or grad or determin" 2>&1 \
    | tail -1 | sed "s/^/$v: /"); t
done
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
B=""; for v in base nt mr mr2; do B="$B $v=/tmp/ab/$v/flash_attn/$so"; done
timeout 120 python3 benchmarks/ab_builds.py $B --pass bwd --hdims 64,128 \
  --seqlens 1024,2048,4096,16384 --causal both --rounds 3; t
timeout 40 python3 benchmarks/ab_builds.py $B --pass bwd --deterministic --hdims 128 \
  --seqlens 4096,16384 --causal 1 --rounds 3; t
