#!/usr/bin/env bash
# One device call (about 6 minutes with a build; give it 600 s), from the repo root with
# .cutlass carried: the measurements that scripts/dev_peer_grid.sh leaves out, and the
# single-GPU tests of what has not run on a GPU yet (the ring's: scripts/dev_ring.sh).
#   bash scripts/dev_bars_extra.sh
# Right after dev_peer_grid.sh on a warm machine its in-place build (d = 64/128/256) is reused;
# otherwise d = 64/128/256 bf16 + fp16 are built here. Then:
#   1. tests: ALiBi (alibi_offset, the long-sequence cases) and the paged cache;
#   2. benchmarks/benchmark_alibi.py: ALiBi against the same kernels without it (goal:
#      >= 0.95), forward and backward, CUDA graphs;
#   3. benchmarks/benchmark_decode.py, pages of 16 / 32 / 256 at d = 64, 128 and 256 (goal:
#      pages of 16 at >= 0.9 of pages of 256);
#   4. benchmarks/power_clocks.py --bwd: clock and power under the d128 16k backward,
#      non-causal, causal, with ALiBi, and FlashAttention-3's when dev_peer_grid.sh built it.
# OUT: where logs go (default build/bars_extra_logs).
source scripts/call_prelude.sh build/bars_extra_logs
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, for the scripts
have=$(timeout 60 python3 - <<'EOF' 2>/dev/null
import flash_attn._C  # noqa: F401
from flash_attn.build_info import build_info
dims = {(k["kind"], k["dtype"], k["headdim"]) for k in build_info()["kernels"]}
need = {(kind, dt, d) for kind in ("fwd", "bwd") for dt in ("bf16", "fp16") for d in (64, 128, 256)}
print("yes" if need <= dims else "no")
EOF
)
if [ "$have" != yes ]; then
  FLASH_ATTN_HEADDIMS=64,128,256 FLASH_ATTN_DTYPES=bf16,fp16 OUT="$OUT/check" \
    timeout 330 bash scripts/gpu_check.sh env build info > "$OUT/check.log" 2>&1
  tail -4 "$OUT/check/summary.txt"
fi; t
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_flash_attn_gpu.py \
  tests/test_kvcache_gpu.py -k "alibi or page" 2>&1 | tail -2; t
timeout 150 python3 benchmarks/benchmark_alibi.py --hdims 64,128 2>&1 | tee "$OUT/alibi.log" \
  | grep "^|"; t
for d in 64 128 256; do
  echo "== decode d$d"
  timeout 40 python3 benchmarks/benchmark_decode.py --hdim "$d" --pages 16,32,256 \
    --seqlens-q 1 --heads 32:8 2>&1 | tee "$OUT/decode_d$d.log" | grep "^|" | tail -3
done; t
fa3=$(ls build/peers/fa3/hopper/flash_attn_3/_C*.so 2>/dev/null | head -1)
timeout 60 python3 benchmarks/power_clocks.py --bwd ${fa3:+--fa3 "$fa3"} 2>&1 \
  | tee "$OUT/power_bwd.log" | grep -v Warning; t
