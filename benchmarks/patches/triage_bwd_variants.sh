#!/usr/bin/env bash
# One device call that tests and times two backward patches against main, each as its own
# variant (they do not stack): bwd_sm90_d96 (d=96 now on SM90; the base build runs the SM80
# backward there) and bwd_det_early_giveback (deterministic dQ hand-back). Run from the repo
# root on the GPU machine with .cutlass carried. Each patched build runs its own tests; then
# one A/B of the backward (d=64/96/128) and one of the deterministic backward (d=128).
P=benchmarks/patches
export VARIANTS="base d96:$P/bwd_sm90_d96.patch det:$P/bwd_det_early_giveback.patch"
export FLASH_ATTN_HEADDIMS=64,96,128 AB_ARGS="--pass bwd --hdims 64,96,128 --seqlens 1024,4096,16384"
export AB_CMD='case "$(basename "$PWD")" in
  d96) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py -k "96 or 80" ;;
  det) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_flash_attn_gpu.py -k deterministic ;;
esac'
bash scripts/dev_ab.sh
so=$(python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
python3 benchmarks/ab_builds.py base=/tmp/ab/base/flash_attn/$so det=/tmp/ab/det/flash_attn/$so \
  --pass bwd --deterministic --hdims 128 --seqlens 4096,16384
