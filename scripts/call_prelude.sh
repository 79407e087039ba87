# Sourced by the one-call device scripts (scripts/dev_peer_grid.sh, benchmarks/patches/run_*.sh)
# from the repo root: `source scripts/call_prelude.sh DEFAULT_OUT`. Sets ROOT, OUT (where logs
# go: $OUT if set, else DEFAULT_OUT under the repo) and t, which prints the seconds since the
# start, so that a call's output shows where its time went.
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$PWD
OUT=${OUT:-$ROOT/$1}
mkdir -p "$OUT"
T0=$(date +%s)
t() { echo "t=$(( $(date +%s) - T0 ))s"; }
