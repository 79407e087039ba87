#!/usr/bin/env bash
# The one script run on the GPU machine (H100), from the repository root:
#
#   bash scripts/gpu_check.sh                 # env, build, info, test, bench
#   bash scripts/gpu_check.sh build           # any subset of: env build info test bench
#   FLASH_ATTN_HEADDIMS=128 FLASH_ATTN_DTYPES=bf16 bash scripts/gpu_check.sh
#
# Environment:
#   OUT              where logs go (default build/gpu_check_logs): env.log build.log info.log
#                    tests.log bench.log nvcc_jobs.tsv summary.txt
#   MAX_JOBS         parallel nvcc jobs (default 16)
#   FLASH_ATTN_CUDA_ARCHS  default here: 90 (this machine is an H100; sm_80 SASS cannot run
#                    on it, so compiling it would only cost build time). Set "80;90" to
#                    build what a default `pip install` builds.
#   FLASH_ATTN_*     build flags, passed through to setup.py (README.md, "Build flags")
#   CUTLASS_INCLUDE_DIR  default: $PWD/.cutlass/include when that folder exists
#   BUILD_MODE       inplace (default: `setup.py build_ext --inplace`, incremental through
#                    ninja) or pip (`pip install --no-build-isolation --no-deps -v -e .`)
#   GPU_TEST_ARGS    extra pytest arguments, e.g. "-k fwd"
#   BENCH_ARGS       benchmark arguments (default --quick)
#   BUILD_TIMEOUT, TEST_TIMEOUT, BENCH_TIMEOUT   seconds per step (default: none), so a
#                    step can be cut short and the summary still written
#   NVCC_RSS=0       do not wrap nvcc (the wrapper records each nvcc job's peak RSS and time)
# Every step runs even when an earlier one failed (tests and bench are skipped only when
# the build failed); the summary is printed at the end and kept in $OUT/summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT="$PWD"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/build/gpu_check_logs}"
TOOLS="$ROOT/build/gpu_check_tools"   # stable path: it is part of the ninja commands
mkdir -p "$OUT_DIR" "$TOOLS"
export MAX_JOBS="${MAX_JOBS:-16}"
export FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-90}"
if [ -z "${CUTLASS_INCLUDE_DIR:-}" ] && [ -d "$ROOT/.cutlass/include" ]; then
  export CUTLASS_INCLUDE_DIR="$ROOT/.cutlass/include"
fi
# benchmarks/*.py run as scripts: make the in-place build importable from anywhere.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

STEPS="${*:-env build info test bench}"
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

declare -A STATUS SECS NOTE
ORDER=(env build info test bench)
for s in "${ORDER[@]}"; do STATUS[$s]="not run"; SECS[$s]=""; NOTE[$s]=""; done

# ------------------------------------------------------------------ helpers ----
cat > "$TOOLS/timed.py" <<'PYEOF'
"""timed.py REPORT -- CMD...: run CMD; write wall time, the peak RSS of its largest process
and the peak memory in use on the machine (sampled each second) to REPORT."""
import os, resource, subprocess, sys, threading, time

report, cmd = sys.argv[1], sys.argv[3:]
def mem_used_kb():
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0])
    return info["MemTotal"] - info.get("MemAvailable", info["MemFree"])
base = mem_used_kb()
peak = [base]
done = threading.Event()
def sample():
    while not done.wait(1.0):
        peak[0] = max(peak[0], mem_used_kb())
threading.Thread(target=sample, daemon=True).start()
t0 = time.monotonic()
rc = subprocess.call(cmd)
wall = time.monotonic() - t0
done.set()
maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, largest process
with open(report, "w") as f:
    f.write(f"rc={rc} wall_s={wall:.1f} max_rss_kb={maxrss} "
            f"mem_peak_delta_kb={peak[0] - base}\n")
sys.exit(rc)
PYEOF

cat > "$TOOLS/nvcc_rss.py" <<'PYEOF'
"""nvcc wrapper (PYTORCH_NVCC): runs the real nvcc and appends one line per job to
$NVCC_RSS_LOG: peak RSS (KiB) of its largest process (cicc/ptxas/...), seconds, rc, source."""
import os, resource, subprocess, sys, time

real = os.environ.get("FLASH_NVCC_REAL") or os.path.join(
    os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
t0 = time.monotonic()
rc = subprocess.call([real] + sys.argv[1:])
dt = time.monotonic() - t0
log = os.environ.get("NVCC_RSS_LOG")
if log:
    src = next((a for a in sys.argv[1:] if a.endswith((".cu", ".cpp"))), "?")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(log, "a") as f:
        f.write(f"{rss}\t{dt:.1f}\t{rc}\t{os.path.basename(src)}\n")
sys.exit(rc)
PYEOF

# run_logged STEP LOGFILE TIMEOUT CMD...: runs CMD (tee'd to LOGFILE), records status and time.
run_logged() {
  local step="$1" log="$2" tmo="$3" t0 rc
  shift 3
  echo
  echo "==> [$step] $*" | tee -a "$log"
  t0=$(date +%s)
  if [ -n "$tmo" ]; then
    timeout --signal=TERM --kill-after=20 "$tmo" "$@" 2>&1 | tee -a "$log"
  else
    "$@" 2>&1 | tee -a "$log"
  fi
  rc=${PIPESTATUS[0]}
  SECS[$step]=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then STATUS[$step]="ok"
  elif [ -n "$tmo" ] && [ "$rc" -eq 124 ]; then STATUS[$step]="TIMEOUT (${tmo}s)"
  else STATUS[$step]="FAILED (rc=$rc)"; fi
  echo "<== [$step] ${STATUS[$step]} in ${SECS[$step]}s" | tee -a "$log"
  write_summary
  return "$rc"
}

human_kb() { awk -v k="${1:-0}" 'BEGIN { printf "%.1f GiB", k / 1048576 }'; }

write_summary() {
  {
    echo "==================== gpu_check summary ===================="
    [ -n "${DEVICE_LINE:-}" ] && echo "$DEVICE_LINE"
    echo "flags: MAX_JOBS=$MAX_JOBS $(env | grep -E '^FLASH_ATTN_' | sort | tr '\n' ' ')"
    for s in "${ORDER[@]}"; do
      printf '%-6s %-18s %6s  %s\n' "$s" "${STATUS[$s]}" "${SECS[$s]:+${SECS[$s]}s}" "${NOTE[$s]}"
    done
    if [ -n "${BUILD_DETAIL:-}" ]; then echo; echo "$BUILD_DETAIL"; fi
    if [ -s "$OUT_DIR/bench.log" ] && [ "${STATUS[bench]}" != "not run" ]; then
      echo
      echo "benchmark (last lines of bench.log):"
      grep -v '^\(==>\|<==\)' "$OUT_DIR/bench.log" | tail -n "${BENCH_TAIL:-25}"
    fi
  } > "$OUT_DIR/summary.txt"
}

# ---------------------------------------------------------------------- env ----
env_report() {
  echo "--- nvidia-smi -L"
  nvidia-smi -L || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null
  echo "--- versions"
  "$PY" --version
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())'
  (nvcc --version 2>/dev/null || "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version) | tail -2
  echo "ninja $(ninja --version 2>/dev/null || echo missing)"
  gcc --version | head -1
  echo "cores $(nproc), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM"
  echo "CUTLASS_INCLUDE_DIR=${CUTLASS_INCLUDE_DIR:-(unset)}"
  echo "--- build plan (setup.py)"
  FLASH_ATTN_PRINT_BUILD_PLAN=1 "$PY" setup.py --version 2>&1 | grep -v "^    "
}

if want env; then
  : > "$OUT_DIR/env.log"
  run_logged env "$OUT_DIR/env.log" "" env_report
  DEVICE_LINE="device: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) | $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null) | $(grep -m1 -o 'release [0-9.]*' "$OUT_DIR/env.log" | sed 's/release/nvcc/')"
  write_summary
fi

# -------------------------------------------------------------------- build ----
if want build; then
  : > "$OUT_DIR/build.log"
  : > "$OUT_DIR/nvcc_jobs.tsv"
  if [ "${NVCC_RSS:-1}" != "0" ]; then
    CUDA_HOME_GUESS="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)" 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}"
    export FLASH_NVCC_REAL="$CUDA_HOME_GUESS/bin/nvcc"
    export PYTORCH_NVCC="$PY $TOOLS/nvcc_rss.py"
    export NVCC_RSS_LOG="$OUT_DIR/nvcc_jobs.tsv"
  fi
  case "${BUILD_MODE:-inplace}" in
    pip) BUILD_CMD=("$PY" -m pip install --no-build-isolation --no-deps -v -e .) ;;
    *)   BUILD_CMD=("$PY" setup.py build_ext --inplace) ;;
  esac
  run_logged build "$OUT_DIR/build.log" "${BUILD_TIMEOUT:-}" \
    "$PY" "$TOOLS/timed.py" "$OUT_DIR/build_time.txt" -- "${BUILD_CMD[@]}"
  BUILD_RC=$?
  unset PYTORCH_NVCC
  # The in-place build's distribution metadata (flash_attn.egg-info, found through PYTHONPATH):
  # transformers' is_flash_attn_2_available() reads it, and without it the transformers tests
  # fail with ImportError.
  if [ "$BUILD_RC" -eq 0 ] && [ "${BUILD_MODE:-inplace}" != pip ]; then
    "$PY" setup.py -q egg_info >> "$OUT_DIR/build.log" 2>&1
  fi
  # Wall time and memory of the whole build, per-job RSS from the nvcc wrapper.
  read -r _ wall rss memd < <(sed 's/[a-z_]*=//g' "$OUT_DIR/build_time.txt" 2>/dev/null || echo "? ? 0 0")
  NOTE[build]="wall ${wall:-?}s, largest process $(human_kb "${rss:-0}"), peak machine memory +$(human_kb "${memd:-0}") (MAX_JOBS=$MAX_JOBS)"
  if [ -s "$OUT_DIR/nvcc_jobs.tsv" ]; then
    BUILD_DETAIL="nvcc jobs: $(wc -l < "$OUT_DIR/nvcc_jobs.tsv"); by peak RSS (KiB, s, rc, file):
$(sort -t$'\t' -k1,1nr "$OUT_DIR/nvcc_jobs.tsv" | head -5)
slowest:
$(sort -t$'\t' -k2,2nr "$OUT_DIR/nvcc_jobs.tsv" | head -5)"
  else
    BUILD_DETAIL="nvcc jobs: none recorded (nothing rebuilt, NVCC_RSS=0, or torch ignores PYTORCH_NVCC)"
  fi
  write_summary
else
  BUILD_RC=0
fi

# --------------------------------------------------------------------- info ----
if want info; then
  : > "$OUT_DIR/info.log"
  run_logged info "$OUT_DIR/info.log" 120 "$PY" -m flash_attn
  NOTE[info]="$(grep -m1 -E '^kernels|not available' "$OUT_DIR/info.log")"
  write_summary
fi

# -------------------------------------------------------------------- tests ----
if want test; then
  : > "$OUT_DIR/tests.log"
  if [ "$BUILD_RC" -ne 0 ]; then
    STATUS[test]="skipped"; NOTE[test]="build failed"
  else
    eval "TEST_EXTRA=(${GPU_TEST_ARGS:-})"   # shell quoting allowed: GPU_TEST_ARGS="-k 'fwd and not varlen'"
    run_logged test "$OUT_DIR/tests.log" "${TEST_TIMEOUT:-}" \
      "$PY" -m pytest tests -x -q "${TEST_EXTRA[@]}"
    NOTE[test]="$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT_DIR/tests.log" | grep -v '^\(==>\|<==\)' | tail -1)"
  fi
  write_summary
fi

# -------------------------------------------------------------------- bench ----
if want bench; then
  : > "$OUT_DIR/bench.log"
  if [ "$BUILD_RC" -ne 0 ]; then
    STATUS[bench]="skipped"; NOTE[bench]="build failed"
  elif [ ! -f benchmarks/benchmark_attn.py ]; then
    STATUS[bench]="skipped"; NOTE[bench]="benchmarks/benchmark_attn.py does not exist"
  else
    eval "BENCH_EXTRA=(${BENCH_ARGS:---quick})"
    run_logged bench "$OUT_DIR/bench.log" "${BENCH_TIMEOUT:-}" \
      "$PY" benchmarks/benchmark_attn.py "${BENCH_EXTRA[@]}"
  fi
  write_summary
fi

echo
cat "$OUT_DIR/summary.txt"
echo "(logs in $OUT_DIR)"
for s in "${ORDER[@]}"; do
  case "${STATUS[$s]}" in ok|"not run"|skipped) ;; *) exit 1 ;; esac
done
exit 0
