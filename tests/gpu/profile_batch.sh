#!/usr/bin/env bash
# On the GPU machine: where a batched decode step's time goes (the serving
# path: st_llama_forward_batch over a paged KV cache). Builds strata if
# needed, makes Llama-3-8B-shaped bf16 models with mkmodel (32 layers for
# wall time, $PLAYERS layers (default 2) for the profile), times
# `strata bench --seqs` at several batch sizes, then profiles one run at
# batch $PB (default 64) with Nsight Systems (or Nsight Compute when nsys is
# missing) and sums kernel time per name.
#   SEQS (default 1,8,64), SEQ_PROMPT (default 512), KEEP=1 keeps the models.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh > /dev/null 2>&1
OUTDIR=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/strata-gpu}
mkdir -p "$OUTDIR" "$WORK"
if [ ! -x build-gpu/strata ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > /tmp/cfg.log 2>&1 || { cat /tmp/cfg.log; exit 2; }
fi
cmake --build build-gpu -j "$(nproc)" --target strata > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 2; }
m=$WORK/llama3_8b_32l_bf16
[ -f "$m/config.json" ] || build-gpu/strata mkmodel --config llama3-8b "$m" > /dev/null || exit 1
SEQS=${SEQS:-1,8,64}
SP=${SEQ_PROMPT:-512}
echo "== strata bench --seqs $SEQS --seq-prompt $SP (32 layers)"
timeout 240 build-gpu/strata bench "$m" --device cuda --prompt 16 --gen 16 --reps 1 --seqs "$SEQS" --seq-prompt "$SP" 2>&1 |
  grep -vE "^strata: (loading|pinning)" | tail -20
L=${PLAYERS:-2}
mp=$WORK/llama3_8b_${L}l_bf16
build-gpu/strata mkmodel --config llama3-8b --layers "$L" "$mp" > /dev/null || exit 1
PB=${PB:-64}
cmd=(build-gpu/strata bench "$mp" --device cuda --prompt 16 --gen 6 --reps 1 --seqs "$PB" --seq-prompt "$SP")
if command -v nsys > /dev/null; then
  echo "== nsys: ${cmd[*]}"
  timeout 200 nsys profile -t cuda -o "$WORK/batch" -f true "${cmd[@]}" > "$OUTDIR/nsys_run.log" 2>&1 || tail -5 "$OUTDIR/nsys_run.log"
  nsys stats -r cuda_gpu_kern_sum,cuda_api_sum -f csv -o "$OUTDIR/batch" "$WORK/batch.nsys-rep" > /dev/null 2>&1
  for f in "$OUTDIR"/batch_cuda_gpu_kern_sum.csv "$OUTDIR"/batch_cuda_api_sum.csv; do
    [ -f "$f" ] && { echo "-- $(basename "$f")"; head -25 "$f" | cut -c1-200; }
  done
elif command -v ncu > /dev/null; then
  echo "== ncu: ${cmd[*]}"
  timeout 240 ncu --clock-control none --metrics gpu__time_duration.sum --csv "${cmd[@]}" \
    > "$OUTDIR/ncu_batch.csv" 2> "$OUTDIR/ncu_batch.err" || echo "ncu failed (see ncu_batch.err)"
  python3 tests/gpu/ncu_summary.py "$OUTDIR/ncu_batch.csv" 30
else
  echo "no profiler found"
fi
[ "${KEEP:-0}" = 1 ] || rm -rf "$mp"
