#!/usr/bin/env bash
# On the GPU machine, from the repo root, with .deps carried (scripts/device-debs.sh):
#   1. builds strata with CUDA;
#   2. checks every op against the CPU backend (tests/gpu/run_gpu_checks.sh);
#   3. checks the logits of every reference model on the GPU against HF in both
#      prefill modes (tests/gpu/check_logits_modes.py): precise (--precise: hi+lo
#      split bf16 operands; tests/test_logits_ref.py with the CPU's f32-level
#      tolerances), fast (--fast-prefill: bf16 operands, fp32 accumulation, the
#      default for bf16/f16/quantized models; bf16-level bounds: rel error < 3e-2
#      whole / chunked / GGUF f16, < 0.15 GGUF q8_0, argmax equal where the
#      reference's top-2 margin is clear), and that with neither flag the f32
#      models run precise and the bf16 ones fast (bit-identical logits);
#   4. builds a Llama-3-8B-shaped 4-layer bf16 model with HF (tools/ref/make_refs.py
#      --big) and checks it the same way (precise and fast);
#   5. (before 4, for bf16) generates a full 32-layer Llama-3-8B-shaped model with `strata mkmodel`
#      (bf16 safetensors, 16 GB; then Q8_0 and Q4_0 GGUF) on the machine's disk
#      and runs `strata bench MODEL --prompt 2048 --gen 128` on each: every
#      figure beside its roofline measured in the same run;
#   6. (PROFILE=1) profiles one 2048-token prefill of the 4-layer model with
#      Nsight Compute (kernel durations, summed per kernel name);
#   7. chats with the default model when it is at $SMOLLM2 (optional).
# Steps can be skipped: SKIP_OPS=1, SKIP_REFS=1, SKIP_BIG=1, SKIP_BENCH=1; DEADLINE=S
# skips the steps that would end later than S seconds after the start.
# BENCH_DTYPES (default "bf16 q8_0 q4_0"), BENCH_LAYERS (default 32).
# Logs go to $OUT (or /tmp/out). Exit status: non-zero when a check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
WORK=${WORK:-/tmp/strata-gpu}
mkdir -p "$WORK"
rc=0
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# DEADLINE (seconds from the start): a step that would likely end past it is skipped
have_time() { # seconds the next step needs
  if [ $(( $(date +%s) - t0 + $1 )) -gt "${DEADLINE:-100000}" ]; then stamp "skipped: no time left ($*)"; return 1; fi
}

stamp "build"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > /tmp/cfg.log 2>&1 || { cat /tmp/cfg.log; exit 2; }
grep "CUDA backend" /tmp/cfg.log
cmake --build build-gpu -j "$(nproc)" --target strata gpu_check_ops bench_cuda_ops > /tmp/build.log 2>&1 ||
  { tail -40 /tmp/build.log; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader

# Each step runs under a time limit (seconds), so that one slow step cannot
# eat a whole lease: T_OPS, T_REFS, T_BIG, T_BENCH, T_PROFILE.
bench_one() { # dtype
  local dt=$1 layers=${BENCH_LAYERS:-32} m
  have_time 60 "bench $dt" || return
  if [ "$dt" = bf16 ]; then m=$WORK/llama3_8b_${layers}l_bf16; else m=$WORK/llama3_8b_${layers}l_$dt.gguf; fi
  stamp "mkmodel llama3-8b ($layers layers, $dt)"
  timeout "${T_BENCH:-150}" build-gpu/strata mkmodel --config llama3-8b --layers "$layers" --dtype "$dt" "$m" ||
    { rc=1; rm -rf "$m"; return; }
  stamp "strata bench ($dt)"
  timeout "${T_BENCH:-150}" build-gpu/strata bench "$m" --device cuda --prompt 2048 --gen 128 2>&1 |
    tee "$OUTDIR/bench_$dt.log" || rc=1
  rm -rf "$m"
}
dtypes=${BENCH_DTYPES:-bf16 q8_0 q4_0}

if [ "${SKIP_OPS:-0}" != 1 ]; then
  stamp "op checks (CUDA vs CPU backend)"
  BUILD_DIR=build-gpu NO_BENCH=${NO_BENCH:-0} timeout "${T_OPS:-200}" bash tests/gpu/run_gpu_checks.sh \
    > "$OUTDIR/ops.log" 2>&1 || rc=1
  grep -v '^PASS' "$OUTDIR/ops.log" | tail -80
  cp build-gpu/gpu_check_ops.log "$OUTDIR/" 2>/dev/null
fi

if [ "${SKIP_REFS:-0}" != 1 ]; then
  for mode in precise fast default; do
    stamp "reference models on the GPU vs HF, $mode prefill"
    STRATA_BIN=build-gpu/strata STRATA_DEVICE=cuda STRATA_TMP=$WORK/st timeout "${T_REFS:-150}" \
      python3 tests/gpu/check_logits_modes.py $mode > "$OUTDIR/refs_$mode.log" 2>&1 || rc=1
    grep -E "FAIL|passed|^model|^precise|^fast|safetensors|whole|gguf|chunk|pos-offset|default ==" "$OUTDIR/refs_$mode.log" |
      tail -70
  done
fi

# the bf16 model first: decode and prefill figures of the main goal
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for dt in $dtypes; do [ "$dt" = bf16 ] && bench_one bf16; done
fi

if [ "${SKIP_BIG:-0}" != 1 ] && have_time 150 "HF 8B-shaped check"; then
  stamp "Llama-3-8B-shaped, 4 layers, bf16, vs HF (float32 compute)"
  timeout "${T_BIG:-240}" python3 tools/ref/make_refs.py --big $WORK/big > $WORK/big.log 2>&1 ||
    { tail -20 $WORK/big.log; rc=1; }
  grep llama3_8b $WORK/big.log
  for mode in precise fast; do
    stamp "Llama-3-8B-shaped vs HF, $mode prefill"
    STRATA_REF_DATA=$WORK/big STRATA_NO_GGUF=1 STRATA_BIN=build-gpu/strata STRATA_DEVICE=cuda STRATA_TMP=$WORK/st \
      timeout "${T_REFS:-150}" python3 tests/gpu/check_logits_modes.py $mode 2>&1 | tee "$OUTDIR/big_$mode.log" ||
      rc=1
  done
  if [ "${PROFILE:-0}" = 1 ] && command -v ncu > /dev/null && have_time 60 "profile"; then
    for mode in precise fast; do
      stamp "profile: one 2048-token prefill of the 4-layer model, $mode (ncu, kernel durations)"
      flag=--precise; [ $mode = fast ] && flag=--fast-prefill
      timeout "${T_PROFILE:-120}" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        build-gpu/strata bench $WORK/big/models/llama3_8b_4layers_bf16 --device cuda --prompt 2048 --prefill-only \
        $flag > "$OUTDIR/ncu_prefill_$mode.csv" 2> "$OUTDIR/ncu_prefill.err" || echo "ncu failed (see ncu_prefill.err)"
      python3 tests/gpu/ncu_summary.py "$OUTDIR/ncu_prefill_$mode.csv" | tee "$OUTDIR/ncu_prefill_$mode.txt"
    done
  fi
  rm -rf $WORK/big/models
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for dt in $dtypes; do [ "$dt" != bf16 ] && bench_one "$dt"; done
fi

if [ -n "${SMOLLM2:-}" ] && [ -f "$SMOLLM2" ]; then
  stamp "default model on cuda"
  build-gpu/strata run "$SMOLLM2" --device cuda -p "What is the capital of France?" -n 32 --temp 0 || rc=1
  STRATA_BIN=build-gpu/strata STRATA_SMOLLM2_GGUF=$SMOLLM2 STRATA_DEVICE=cuda python3 tests/test_smollm2_ref.py || rc=1
  build-gpu/strata bench "$SMOLLM2" --device cuda --prompt 512 --gen 128 || rc=1
fi
stamp "done (rc $rc)"
exit $rc
