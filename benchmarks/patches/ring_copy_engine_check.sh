#!/usr/bin/env bash
# One nvidia-h100-x4 call for ring_copy_engine.patch (run from the repo root, .cutlass carried):
# applies the patch, builds d=64/128 bf16+fp16, runs the 4-rank GPU ring tests on each
# transport separately (a hang of one leaves the other's result), then the 128k benchmark with
# NCCL and with the copy engines, and a trace of the copy-engine run.
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=64 FLASH_ATTN_HEADDIMS=64,128 FLASH_ATTN_DTYPES=bf16,fp16
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-build/ring_ce}
mkdir -p "$OUT"
patch -p1 -s < benchmarks/patches/ring_copy_engine.patch || exit 1
OUT=$OUT/gc bash scripts/gpu_check.sh build > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
export PYTHONPATH=$PWD
# Each step in its own session, killed with its spawned ranks when its time is up.
run() { local secs=$1; shift; setsid timeout -k 10 "$secs" "$@"; local rc=$?; pkill -9 -f "multiprocessing.spawn" 2>/dev/null; return $rc; }
for t in nccl copy_engine; do
  echo "== tests, $t"
  run 150 python -m pytest -q -p no:cacheprovider tests/test_ring_attention_gpu.py -k "$t" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
done
for t in nccl copy_engine; do
  echo "== benchmark, $t"
  run 120 python benchmarks/benchmark_ring.py --world 4 --seqlens 131072 --causal both \
    --iters 5 --transport "$t" 2>&1 | grep '^|'
done
run 120 python benchmarks/benchmark_ring.py --world 4 --seqlens 131072 --causal true \
  --iters 5 --transport copy_engine --trace /tmp/trace_ce > "$OUT/trace_run.txt" 2>&1
tar czf "$OUT/trace_ce.tgz" -C /tmp trace_ce
