#!/usr/bin/env bash
# On the GPU machine (after run_gpu_model_checks.sh's build, or building here):
# where a decode step's time goes. Makes a Llama-3-8B-shaped model of
# $LAYERS layers (default 4) with mkmodel, times `strata bench` on it (wall
# time per token, no profiler), then runs the same bench under Nsight Compute
# with an 8-token prompt (so prefill takes the GEMV kernels too) and sums the
# kernel durations per name. Kernel time per step vs wall time per step = the
# gaps between kernels (launch latency, dependencies). DTYPE=bf16|q8_0|q4_0
# (default bf16) picks the weights' type; PROMPT (default 8) the prompt's
# length, so the context decode attention reads; DETAIL=REGEX also collects Nsight
# Compute's throughput, instruction and warp-stall sections for the first
# decode-time launch of each kernel whose name matches REGEX.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
OUTDIR=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/strata-gpu}
mkdir -p "$OUTDIR" "$WORK"
if [ ! -x build-gpu/strata ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > /tmp/cfg.log 2>&1 || { cat /tmp/cfg.log; exit 2; }
  cmake --build build-gpu -j "$(nproc)" --target strata > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 2; }
fi
L=${LAYERS:-4}
P=${PROMPT:-8}
D=${DTYPE:-bf16}
m=$WORK/llama3_8b_${L}l_$D
ext=""; [ "$D" = bf16 ] || ext=.gguf
m=$m$ext
build-gpu/strata mkmodel --config llama3-8b --layers "$L" --dtype "$D" "$m" > /dev/null || exit 1
build-gpu/strata bench "$m" --device cuda --prompt "$P" --gen 64 --reps 1 2>&1 | grep -E "decode|HBM" | tee "$OUTDIR/decode_wall_${L}l_$D.txt"
if command -v ncu > /dev/null; then
  timeout "${T_PROFILE:-120}" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    build-gpu/strata bench "$m" --device cuda --prompt "$P" --gen 16 --reps 1 \
    > "$OUTDIR/ncu_decode_$D.csv" 2> "$OUTDIR/ncu_decode_$D.err" || echo "ncu failed (see ncu_decode_$D.err)"
  python3 tests/gpu/ncu_summary.py "$OUTDIR/ncu_decode_$D.csv" 40 | tee "$OUTDIR/ncu_decode_$D.txt"
  if [ -n "${DETAIL:-}" ]; then
    timeout "${T_PROFILE:-120}" ncu --clock-control none --kernel-name "regex:${DETAIL}" --launch-skip 40 --launch-count 3 \
      --section SpeedOfLight --section InstructionStats --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
      build-gpu/strata bench "$m" --device cuda --prompt "$P" --gen 16 --reps 1 > "$OUTDIR/ncu_detail_$D.txt" 2>&1 ||
      echo "ncu detail failed"
    grep -E "^  [a-z_]+.*\(|Duration|Throughput|Issue Slots|Executed Ipc|Achieved Occupancy|Theoretical Occupancy|Registers|Stall|One or More|No Eligible|Warp Cycles Per Issued" \
      "$OUTDIR/ncu_detail_$D.txt" | head -80
  fi
fi
rm -rf "$m"
