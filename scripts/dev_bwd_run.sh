#!/usr/bin/env bash
# One device call for SM90 backward work: build (64/128, bf16), FlashAttention-3 in the
# background, the backward GPU tests on the SM90 path, then the backward benchmark.
set -uo pipefail
export FLASH_ATTN_HEADDIMS=${FLASH_ATTN_HEADDIMS:-64,128} FLASH_ATTN_DTYPES=${FLASH_ATTN_DTYPES:-bf16}
OUT=$PWD/build/gpu_check_logs bash scripts/gpu_check.sh ${STEPS:-env build info} > "$OUT/check.log" 2>&1
tail -12 build/gpu_check_logs/summary.txt
# FlashAttention-3: a library carried in .fa3/ (fetched from an earlier call's $OUT/fa3_so.tar.xz)
# saves its 200 s build; FA3_PACK=1 puts a fresh build into $OUT for that.
if [ "${FA3:-1}" = 1 ] && ! ls .fa3/_C*.so > /dev/null 2>&1; then
  (MAX_JOBS=12 bash .peers/build_fa3.sh "$PWD/build/peers" > "$OUT/fa3.log" 2>&1
   [ "${FA3_PACK:-0}" = 1 ] && tar -C build/peers/fa3/hopper/flash_attn_3 -cJf "$OUT/fa3_so.tar.xz" $(cd build/peers/fa3/hopper/flash_attn_3 && ls _C*.so)) &
fi
# transformers finds the package by its distribution metadata: install that (no build).
FLASH_ATTN_SKIP_CUDA_BUILD=1 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
# -v: each result is in the log as it happens, so a run cut short by its timeout still names
# its failures.
FLASH_ATTN_TEST_PATHS=${PATHS:-sm90} timeout "${TEST_TIMEOUT:-240}" python3 -m pytest ${TESTS:-tests/test_flash_attn_gpu.py tests/test_varlen_gpu.py} -v --maxfail=20 -rf -p no:cacheprovider -k "${TEST_K:-fwd_bwd or gqa or alibi or bwd}" > "$OUT/tests.log" 2>&1
echo "tests: $(grep -c " PASSED" "$OUT/tests.log") passed, $(grep -c " SKIPPED" "$OUT/tests.log") skipped"
grep -E " FAILED| ERROR|^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | grep -v "^tests/.* PASSED" | tail -30
wait
[ -n "${SANITIZE:-}" ] && for hd in $SANITIZE; do HEADDIM=$hd DTYPE=bf16 timeout 150 bash scripts/sanitize.sh > "$OUT/sanitize_$hd.log" 2>&1; echo "sanitize d=$hd rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize_$hd.log"; done
lib=$(ls .fa3/_C*.so build/peers/fa3/hopper/flash_attn_3/_C*.so 2>/dev/null | head -1)
tail -3 "$OUT/fa3.log" 2>/dev/null
[ "${BENCH_TIMEOUT:-200}" = 0 ] || timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/benchmark_bwd.py ${lib:+--fa3 $lib} --hdims "${BENCH_HDIMS:-64,128}" --seqlens "${BENCH_SEQLENS:-512,2048,8192}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -20
