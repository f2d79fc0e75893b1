#!/usr/bin/env bash
# Before/after decode and prefill figures of one change, in one GPU run.
# On the GPU machine, from the repo root, with .deps carried (scripts/device-debs.sh)
# and the earlier tree unpacked in $BEFORE (e.g. `git archive COMMIT | tar -x -C .before`
# here, .before carried):
#   1. builds `strata` from both trees (build-before, build-gpu), in parallel;
#   2. generates Llama-3-8B-shaped models (32 layers) with the new tree's
#      `strata mkmodel` for each of $DTYPES (default "bf16 q4_0");
#   3. runs, per dtype, the same `strata bench MODEL --prompt $PROMPT --gen $GEN
#      --seqs $SEQS $BENCH_ARGS` with the before binary then the after one (each prints its
#      rooflines measured in the same run), logs in $OUT/ba_<dtype>_{before,after}.log;
#   4. prints the decode and prefill lines of both side by side.
# BUILD_ONLY=1 stops after 1; SKIP_BUILD=1 starts at 2 (both trees built).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
BEFORE=${BEFORE:-.before}
OUTDIR=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/strata-gpu}
DTYPES=${DTYPES:-bf16 q4_0}
PROMPT=${PROMPT:-512}
GEN=${GEN:-128}
SEQS=${SEQS:-1,8,64}
BENCH_ARGS=${BENCH_ARGS:-} # more `strata bench` options for both sides (e.g. --verify 4,8)
mkdir -p "$OUTDIR" "$WORK"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
build() { # source tree, build dir (outside a carried tree: carrying it again would wipe it)
  (cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release > "$2.cfg.log" 2>&1 &&
     cmake --build "$2" -j 8 --target strata > "$2.log" 2>&1) || { tail -30 "$2.log"; return 1; }
}
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  stamp "build before ($BEFORE) and after"
  build "$BEFORE" build-before & pb=$!
  build . build-gpu & pa=$!
  wait $pb || { echo "before: build failed"; exit 2; }
  wait $pa || { echo "after: build failed"; exit 2; }
  stamp "built"
fi
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rc=0
for dt in $DTYPES; do
  if [ "$dt" = bf16 ]; then m=$WORK/llama3_8b_bf16; else m=$WORK/llama3_8b_$dt.gguf; fi
  if [ ! -e "$m" ]; then
    stamp "mkmodel llama3-8b ($dt)"
    build-gpu/strata mkmodel --config llama3-8b --dtype "$dt" "$m" > "$OUTDIR/mkmodel_$dt.log" 2>&1 ||
      { tail -5 "$OUTDIR/mkmodel_$dt.log"; rc=1; continue; }
  fi
  for side in before after; do
    bin=build-gpu/strata
    [ $side = before ] && bin=build-before/strata
    stamp "bench $dt ($side)"
    timeout 400 "$bin" bench "$m" --device cuda --prompt "$PROMPT" --gen "$GEN" --seqs "$SEQS" $BENCH_ARGS \
      > "$OUTDIR/ba_${dt}_$side.log" 2>&1 || { rc=1; tail -5 "$OUTDIR/ba_${dt}_$side.log"; }
    grep -E "^(prefill|decode|roofline|HBM|verify)" "$OUTDIR/ba_${dt}_$side.log" | sed "s/^/  $dt $side: /"
  done
done
stamp "done"
exit $rc
