#!/usr/bin/env bash
# A/B of kernel variants in one GPU-machine call. VARIANTS="name[:patch] ...": each variant is
# a copy of this tree, with `patch` (a unified diff, relative to the repo root) applied,
# built with FLASH_ATTN_AB_BUILD=1 (all in parallel), then timed in turns in one process by
# benchmarks/ab_builds.py (AB_ARGS, e.g. "--pass bwd --hdims 128 --seqlens 2048,8192").
# The copies stay in /tmp/ab/<name> for tests: PYTHONPATH=/tmp/ab/<name> python3 -m pytest ...
# A branch as a variant: `git diff main...<branch> > .ab/<name>.patch` here, then carry .ab.
#   VARIANTS="base:.ab/base.patch new" AB_ARGS="--pass bwd" bash scripts/dev_ab.sh
# FLASH_ATTN_CUDA_ARCHS (default 90; "80;90" for SM80 variants) and FLASH_ATTN_HEADDIMS /
# FLASH_ATTN_DTYPES pass through to the builds. AB_CMD, if set, also runs once per variant with
# that copy first on PYTHONPATH (e.g. AB_CMD="python3 -m pytest tests/test_dropout_gpu.py -q"
# or a benchmark script), its output in $LOGS/<name>.log; AB_ARGS=none skips ab_builds.py.
set -uo pipefail
ROOT=$PWD
LOGS=${OUT:-$ROOT/build/ab_logs}
mkdir -p "$LOGS"
export FLASH_ATTN_HEADDIMS=${FLASH_ATTN_HEADDIMS:-128} FLASH_ATTN_DTYPES=${FLASH_ATTN_DTYPES:-bf16}
export FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS:-90} FLASH_ATTN_AB_BUILD=1
export CUTLASS_INCLUDE_DIR=$ROOT/.cutlass/include
count=$(echo "$VARIANTS" | wc -w)
export MAX_JOBS=$(( (16 + count - 1) / count ))
builds=()
for v in $VARIANTS; do
  name=${v%%:*}
  patch_file=""
  [ "$name" != "$v" ] && patch_file=$ROOT/${v#*:}
  dir=/tmp/ab/$name
  rm -rf "$dir" && mkdir -p "$dir"
  tar --exclude=./build --exclude=./.fa3 --exclude=./.cutlass --exclude=./.git -cf - . | tar -C "$dir" -xf -
  (cd "$dir" && { [ -z "$patch_file" ] || patch -p1 -s < "$patch_file"; } &&
     python3 setup.py build_ext --inplace > "$LOGS/build_$name.log" 2>&1 &&
     python3 setup.py -q egg_info >> "$LOGS/build_$name.log" 2>&1  # metadata for transformers
   echo "build $name rc=$?") &
  builds+=("$name=$dir/flash_attn/$(cd "$ROOT" && python3 -c 'import sysconfig; print("_C" + sysconfig.get_config_var("EXT_SUFFIX"))')")
done
wait
if [ -n "${AB_CMD:-}" ]; then
  for v in $VARIANTS; do
    name=${v%%:*}
    (cd "/tmp/ab/$name" && PYTHONPATH=/tmp/ab/$name bash -c "$AB_CMD") > "$LOGS/$name.log" 2>&1
    echo "== $name (rc=$?)"; tail -15 "$LOGS/$name.log"
  done
fi
[ "${AB_ARGS:-}" = none ] || python3 benchmarks/ab_builds.py "${builds[@]}" ${AB_ARGS:-} 2>&1 | tee "$LOGS/ab.md"
