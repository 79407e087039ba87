#!/usr/bin/env bash
# One call on a multi-GPU machine (nvidia-h200-x2 / -x4, H100 kinds alike; about 8 minutes,
# give it 600 s), from the repo root with .cutlass carried: issue 31's checks.
#   bash scripts/dev_ring.sh
# Builds d = 64/128 in bf16 + fp16 (what the ring GPU tests use), runs
# tests/test_ring_attention_gpu.py (2 ranks and, with 4 GPUs, 4; both transports), then
# benchmarks/benchmark_ring.py on every GPU at 32k tokens per GPU (128k on 4, 64k on 2), causal,
# over both transports, and one traced call (rank 0's kernels by device time). OUT: where logs
# go.
source scripts/call_prelude.sh build/ring_logs
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, for the scripts
FLASH_ATTN_HEADDIMS=64,128 FLASH_ATTN_DTYPES=bf16,fp16 OUT="$OUT/check" \
  timeout 300 bash scripts/gpu_check.sh env build info > "$OUT/check.log" 2>&1
tail -4 "$OUT/check/summary.txt"; t
timeout 200 python3 -m pytest -q tests/test_ring_attention_gpu.py 2>&1 | tail -4; t
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for transport in nccl copy_engine; do
  echo "== benchmark_ring, $gpus GPUs, $transport"
  timeout 100 python3 benchmarks/benchmark_ring.py --world "$gpus" \
    --seqlens $(( 32768 * gpus )) --causal true --transport "$transport" 2>&1 | grep "^|"
done; t
# Where a ring call's time goes: rank 0's kernels by device time, one traced causal fwd+bwd
# (copy engines), beside the one-GPU baseline's trace (files in $OUT/trace).
echo "== trace, $gpus GPUs, copy_engine"
timeout 120 python3 benchmarks/benchmark_ring.py --world "$gpus" --seqlens $(( 32768 * gpus )) \
  --causal true --transport copy_engine --iters 3 --trace "$OUT/trace" 2>&1 \
  | grep -v "^|" | head -70; t
