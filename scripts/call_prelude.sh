# Sourced by the one-call device scripts (scripts/dev_peer_grid.sh, benchmarks/patches/run_*.sh)
# from the repo root: `source scripts/call_prelude.sh DEFAULT_OUT`. Sets ROOT, OUT (where logs
# go: $OUT if set, else DEFAULT_OUT under the repo) and t, which prints the seconds since the
# start, so that a call's output shows where its time went, and carried_fa3, which prints the
# path of FlashAttention-3's library from a carried .fa3x/fa3_so.tar.xz (the archive
# scripts/dev_peer_grid.sh returns), or nothing when none was carried.
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD
OUT=${OUT:-$ROOT/$1}
mkdir -p "$OUT"
T0=$(date +%s)
t() { echo "t=$(( $(date +%s) - T0 ))s"; }
carried_fa3() {
  [ -f .fa3x/fa3_so.tar.xz ] || return 0
  mkdir -p "$ROOT/build/peers/fa3x" && tar -C "$ROOT/build/peers/fa3x" -xJf .fa3x/fa3_so.tar.xz
  ls "$ROOT"/build/peers/fa3x/_C*.so | head -1
}
