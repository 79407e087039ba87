#!/usr/bin/env bash
# One device call for the grid against the peers in one process (335 s on an H200, session 40;
# give it 600 s), from the repo root with .cutlass and .peers (a copy of ../shared/peers, which
# the device does not have) carried:
#   bash scripts/dev_peer_grid.sh
# Builds ours (d = 64/128/256, bf16 + e4m3, forward and backward) while FlashAttention-3 builds
# with its e4m3 forward (FP8=1) in the background, then:
#   1. benchmarks/benchmark_attn.py --fa3: the bf16 grid, forward and backward, ours against
#      FlashAttention-3, cuDNN and FlashAttention-2 (SDPA), with "ours / best peer";
#   2. benchmarks/benchmark_bwd.py at d = 128, 4k and 16k: deterministic against not, on both
#      kernel families (FLASH_ATTN_FORCE_SM80 for the SM80 one);
#   3. benchmarks/benchmark_fp8.py --fa3: the e4m3 forward grid.
# With .fa3x/fa3_so.tar.xz carried (the library an earlier call of this script returned), that
# library is used and nothing of FlashAttention-3 is built.
# OUT: where logs and tables go (default build/peer_grid_logs). TESTS=1 runs the GPU tests after
# the build (GPU_TEST_ARGS selects them; TEST_TIMEOUT, default 120 s). Each step has a
# timeout, so that a slow one cannot take the rest with it.
source scripts/call_prelude.sh build/peer_grid_logs
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, for the scripts
fa3=$(carried_fa3)
if [ -z "$fa3" ]; then
  (FP8=1 MAX_JOBS=${FA3_JOBS:-8} nice -n 5 bash .peers/build_fa3.sh "$ROOT/build/peers" \
     > "$OUT/fa3.log" 2>&1) &
  fa3_pid=$!
fi
FLASH_ATTN_HEADDIMS=64,128,256 FLASH_ATTN_DTYPES=bf16,e4m3 OUT="$OUT/check" \
  GPU_TEST_ARGS="${GPU_TEST_ARGS:-}" TEST_TIMEOUT=${TEST_TIMEOUT:-120} \
  timeout 400 bash scripts/gpu_check.sh env build info ${TESTS:+test} > "$OUT/check.log" 2>&1
tail -4 "$OUT/check/summary.txt"; t
if [ -z "$fa3" ]; then
  wait $fa3_pid
  fa3=$(ls build/peers/fa3/hopper/flash_attn_3/_C*.so 2>/dev/null | head -1)
  tail -2 "$OUT/fa3.log"
  # FlashAttention-3's library comes back in $OUT for later calls (carried as .fa3x/).
  [ -n "$fa3" ] && tar -C "$(dirname "$fa3")" -cJf "$OUT/fa3_so.tar.xz" "$(basename "$fa3")"
fi
echo "fa3: ${fa3:-none}"; t
timeout 240 python3 benchmarks/benchmark_attn.py ${fa3:+--fa3 $fa3} --json "$OUT/grid.json" \
  --markdown "$OUT/grid.md" > "$OUT/grid.log" 2>&1
sed -n '/^| hdim/,$p' "$OUT/grid.log"; t
timeout 60 python3 benchmarks/benchmark_bwd.py --hdims 128 --seqlens 4096,16384 --no-sdpa \
  2>&1 | tee "$OUT/det.log" | grep "^|"; t
timeout 90 python3 benchmarks/benchmark_fp8.py ${fa3:+--fa3 $fa3} 2>&1 | tee "$OUT/fp8.log" \
  | grep "^|"; t
