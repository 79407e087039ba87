#!/usr/bin/env bash
# One GPU-machine call (about 4 minutes): the SM90 backward's per-CTA fixed cost, A/B at d=128
# bf16 of main against bwd_dq_exit_after_read.patch (exit), bwd_staged_epilogue_d128.patch
# (stage) and both, then the backward tests of `both`. Needs .cutlass carried.
#   bash benchmarks/patches/run_fixed_cost_ab.sh
set -uo pipefail
dir=benchmarks/patches
mkdir -p build
cat $dir/bwd_dq_exit_after_read.patch $dir/bwd_staged_epilogue_d128.patch > build/both.patch
VARIANTS="base exit:$dir/bwd_dq_exit_after_read.patch stage:$dir/bwd_staged_epilogue_d128.patch both:build/both.patch" \
  FLASH_ATTN_HEADDIMS=128 AB_ARGS="--pass bwd --hdims 128 --seqlens 512,1024,2048,8192,16384" \
  AB_CMD='[ "$(basename "$PWD")" = both ] && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "bwd or deterministic or more_key_tiles or odd_tile or grad or gqa" 2>&1 | tail -3' \
  bash scripts/dev_ab.sh
