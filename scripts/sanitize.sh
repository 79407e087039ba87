#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over small forward + backward cases (causal, causal
# over several key blocks, decode with each tile's keys split over several CTAs, no mask with
# an even and with an odd number of query tiles per head,
# no mask with its keys split over several CTAs, and varlen with an empty sequence) on the
# kernels of the current build. Run from the repo root on a GPU machine after building (e.g.
# `bash scripts/gpu_check.sh build`). Exit status is non-zero if either tool reports an error.
#   HEADDIM=128 DTYPE=bf16 bash scripts/sanitize.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SANITIZER="${SANITIZER:-compute-sanitizer}"
command -v "$SANITIZER" >/dev/null || SANITIZER=/usr/local/cuda/bin/compute-sanitizer

CASES=$(cat <<'PY'
import os, torch
from flash_attn import flash_attn_func, flash_attn_varlen_func
d = int(os.environ.get("HEADDIM", "64"))
dt = torch.bfloat16 if os.environ.get("DTYPE", "bf16") == "bf16" else torch.float16
torch.manual_seed(0)
def run(fn, q, k, v, *args, **kw):
    ins = [t.requires_grad_() for t in (q, k, v)]
    out = fn(*ins, *args, **kw)
    torch.autograd.grad(out, ins, torch.randn_like(out))
b, h, hk = 2, 4, 2
q = torch.randn(b, 77, h, d, device="cuda", dtype=dt)
k = torch.randn(b, 150, hk, d, device="cuda", dtype=dt)
v = torch.randn(b, 150, hk, d, device="cuda", dtype=dt)
run(flash_attn_func, q, k, v, causal=True)
# Causal over several key blocks: the consumer groups holding a tile's first rows skip the
# key blocks right of those rows.
q, k, v = (torch.randn(1, 300, h, d, device="cuda", dtype=dt) for _ in range(3))
run(flash_attn_func, q, k, v, causal=True)
# Decode against a long cache: few tiles, each tile's keys split over SMs and merged.
q = torch.randn(b, 1, 2 * h, d, device="cuda", dtype=dt)
k = torch.randn(b, 3000, hk, d, device="cuda", dtype=dt)
v = torch.randn(b, 3000, hk, d, device="cuda", dtype=dt)
run(flash_attn_func, q, k, v, causal=True)
# No mask, an even number of query tiles: the SM90 cluster kernel (K/V multicast) above d = 64.
# GQA packing off from here: it would take these shapes to the band kernel.
os.environ["FLASH_ATTN_PACK_GQA"] = "0"
q = torch.randn(b, 256, h, d, device="cuda", dtype=dt)
k = torch.randn(b, 300, hk, d, device="cuda", dtype=dt)
v = torch.randn(b, 300, hk, d, device="cuda", dtype=dt)
run(flash_attn_func, q, k, v)
# An odd number of query tiles per head (3 at d = 128, 5 from d = 160): some clusters pair
# tiles of two heads, whose CTAs load K and V each for itself.
run(flash_attn_func, torch.randn(1, 520, h, d, device="cuda", dtype=dt), k[:1], v[:1])
# Few query tiles over many keys: the SM90 static schedule splits each tile's keys over several
# CTAs, which merge their partial outputs through global memory (SplitPlan).
k = torch.randn(1, 4096, hk, d, device="cuda", dtype=dt)
v = torch.randn(1, 4096, hk, d, device="cuda", dtype=dt)
run(flash_attn_func, q[:1], k, v)
os.environ.pop("FLASH_ATTN_PACK_GQA")
lens_q, lens_k = [5, 0, 70, 1, 300], [9, 3, 64, 0, 300]
cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dt)
k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dt)
v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dt)
run(flash_attn_varlen_func, q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
torch.cuda.synchronize()
print("cases done")
PY
)

status=0
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  log=$(mktemp)
  "$SANITIZER" --tool "$tool" --kernel-name kns=flash --error-exitcode 3 \
      python3 -c "$CASES" >"$log" 2>&1
  rc=$?
  # A race report's second line names the other access.
  grep -E -A1 "ERROR SUMMARY|RACECHECK SUMMARY|cases done|Error|error" "$log" | head -24
  if [ "$rc" -ne 0 ]; then echo "$tool: FAILED (rc=$rc)"; status=1; else echo "$tool: clean"; fi
  rm -f "$log"
done
exit "$status"
