#!/usr/bin/env bash
# One device call that checks stable_abi.patch against main (run from the repo root on the GPU
# machine, with .cutlass carried): builds both (scripts/dev_ab.sh, d=64/128 bf16), times the host
# cost per call of each (benchmarks/host_overhead.py; the patched build with torch.profiler's
# table), and runs the GPU suite on the patched build (dev_ab.sh writes each build's
# egg-info, which transformers' is_flash_attn_2_available() reads; without it
# tests/test_transformers_gpu.py fails with ImportError, as in session 30's call 5). The suite's
# whole output goes to $OUT/suite.log and its exit status is printed: in session 31's call its
# summary line never showed.
ROOT=$PWD
VARIANTS="old new:benchmarks/patches/stable_abi.patch" FLASH_ATTN_HEADDIMS=64,128 AB_ARGS=none \
AB_CMD="python3 $ROOT/benchmarks/host_overhead.py \$([ \"\$(basename \$PWD)\" = new ] && echo --profile);
if [ \"\$(basename \$PWD)\" = new ]; then
  nm -D --undefined-only --demangle flash_attn/_C*.so | grep -cE ' (at|c10|torch)::'
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/*gpu*.py tests/test_stable_binding.py > \${OUT:-/tmp}/suite.log 2>&1; echo \"pytest rc=\$?\"; tail -40 \${OUT:-/tmp}/suite.log
fi" bash scripts/dev_ab.sh
