#!/usr/bin/env bash
# One device call (about 4 minutes; give it 400 s), from the repo root with .cutlass and .fa3x
# (FlashAttention-3's library from scripts/dev_peer_grid.sh) carried: ncu --set full of our d64
# causal 16k backward next to FlashAttention-3's, details pages in $OUT/ncu_causal.txt. Why: at
# d64 causal ours ran at 0.92-0.95 of FlashAttention-3 at 7 of 8 points (8k and 16k over four
# batch and head counts; H100, 2026-12-08; 1.08 at the eighth, where FlashAttention-3 dropped
# to 453), d64 non-causal at 0.95-1.02 in the same call.
#   bash benchmarks/patches/run_ncu_d64_causal.sh
source scripts/call_prelude.sh build/ncu_d64_logs
fa3=$(carried_fa3)
[ -n "$fa3" ] || { echo "needs .fa3x/fa3_so.tar.xz carried"; exit 1; }
FLASH_ATTN_HEADDIMS=64 FLASH_ATTN_DTYPES=bf16 OUT="$OUT/check" timeout 240 bash scripts/gpu_check.sh build > "$OUT/check.log" 2>&1
tail -3 "$OUT/check/summary.txt"; t
export PYTHONPATH=$ROOT
timeout 150 ncu --clock-control none --set full --kernel-name-base demangled \
  -k regex:"flash_bwd_sm90_kernel|FlashAttnBwdSm90" --page details \
  python3 benchmarks/ncu_bwd_pair.py --fa3 "$fa3" --hdim 64 --seqlen 16384 --causal \
  > "$OUT/ncu_causal.txt" 2>&1
grep -E "^  [a-z].*\(|Duration|Elapsed Cycles|SM Frequency|Executed Instructions |Issue Slots Busy|Warp Cycles Per Issued|Compute \(SM\) Throughput|L2 Cache Throughput|L2 Hit Rate|DRAM Throughput|Registers Per|Stall" \
  "$OUT/ncu_causal.txt" | cut -c1-140 | head -60; t
