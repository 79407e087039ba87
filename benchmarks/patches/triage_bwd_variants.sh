#!/usr/bin/env bash
# One device call that tests and times bwd_sm90_d96.patch (d=80/96 on SM90; the base build runs
# the SM80 backward there) against main. Run from the repo root on the GPU machine with
# .cutlass carried. The patched build runs its tests (d=80/96 and every backward case); then
# one A/B of the backward at d=64/96/128/256 (d=256: the shared dQ code changed).
P=benchmarks/patches
export VARIANTS="base d96:$P/bwd_sm90_d96.patch"
export FLASH_ATTN_HEADDIMS=64,96,128,256 AB_ARGS="--pass bwd --hdims 64,96,128,256 --seqlens 1024,4096,16384"
export AB_CMD='[ "$(basename "$PWD")" = d96 ] && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "96 or 80 or bwd" 2>&1 | tail -5'
bash scripts/dev_ab.sh
