#!/usr/bin/env bash
# One GPU-machine call: the backward step timelines of ours (bwd_step_timeline.patch) and of
# FlashAttention-3 (fa3_step_timeline.py), d=128 8k, both masks, summarised side by side.
# Needs .cutlass (CUTLASS headers) and PEERS (default .peers: a copy of ../shared/peers) carried.
#   bash benchmarks/patches/run_step_timelines.sh      (OUT: where logs go)
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-$ROOT/build/timeline_logs}
PEERS=${PEERS:-$ROOT/.peers}
mkdir -p "$OUT"
dest=$ROOT/build/peers_tl
rm -rf "$dest" && mkdir -p "$dest" && tar -xJf "$PEERS/fa3-src.tar.xz" -C "$dest"
python3 benchmarks/patches/fa3_step_timeline.py "$dest/fa3/hopper" || exit 1
(export FLASH_ATTENTION_DISABLE_HDIM64=TRUE FLASH_ATTENTION_DISABLE_HDIM256=TRUE MAX_JOBS=8
 bash "$PEERS/build_fa3.sh" "$dest" > "$OUT/fa3_build.log" 2>&1; echo "fa3 build rc=$?") &
FLASH_ATTN_HEADDIMS=128 FLASH_ATTN_DTYPES=bf16 VARIANTS="tl:benchmarks/patches/bwd_step_timeline.patch" \
  AB_ARGS=none AB_CMD="python3 benchmarks/patches/bwd_step_timeline_run.py" OUT="$OUT" \
  bash scripts/dev_ab.sh > "$OUT/ours.log" 2>&1
wait
lib=$(ls "$dest"/fa3/hopper/flash_attn_3/_C*.so 2>/dev/null | head -1)
[ -n "$lib" ] || { tail -20 "$OUT/fa3_build.log"; exit 1; }
for mask in full causal; do
  echo "RUN $mask" >> "$OUT/fa3_tl.log"
  PYTHONPATH=/tmp/ab/tl python3 benchmarks/ncu_bwd_pair.py --which fa3 --fa3 "$lib" --hdim 128 \
    --seqlen 8192 $([ $mask = causal ] && echo --causal) >> "$OUT/fa3_tl.log" 2>&1
done
# A printf or other call in a kernel serializes its WGMMAs (ptxas C7510): none may appear.
echo "C7510 warnings: ours $(grep -c C7510 "$OUT/build_tl.log"), FA3 $(grep -c C7510 "$OUT/fa3_build.log")"
python3 benchmarks/patches/step_timeline_summary.py "$OUT/tl.log" "$OUT/fa3_tl.log"
