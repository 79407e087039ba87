#!/usr/bin/env bash
# One GPU-machine call (about 5 minutes; carry .cutlass): the SM90 backward's fixed cost per CTA,
# A/B at d=64/128 bf16 of main against bwd_k_before_v.patch (kfirst), bwd_dk_in_free_stage.patch
# (dkq) and both, and the backward tests of `both`. The sum compiles at d=128 (nvcc 13.0) with
# main's spills.
#   bash benchmarks/patches/run_bwd_prologue_epilogue_ab.sh
set -uo pipefail
dir=benchmarks/patches
mkdir -p build
cat $dir/bwd_k_before_v.patch $dir/bwd_dk_in_free_stage.patch > build/both.patch
VARIANTS="base kfirst:$dir/bwd_k_before_v.patch dkq:$dir/bwd_dk_in_free_stage.patch both:build/both.patch" \
  FLASH_ATTN_HEADDIMS=64,128 AB_ARGS="--pass bwd --hdims 64,128 --seqlens 512,1024,2048,8192" \
  AB_CMD='[ "$(basename "$PWD")" = both ] && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "bwd or grad or deterministic or more_key_tiles or odd_tile or gqa" 2>&1 | tail -3' \
  bash scripts/dev_ab.sh
