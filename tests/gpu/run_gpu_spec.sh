#!/usr/bin/env bash
# Issue 16, speculative decoding, on the GPU machine. From the repo root, carrying .deps:
#   1. builds strata with CUDA in build-gpu (skipped when built);
#   2. on CUDA, bench/spec_accept.py with prompt lookup and with the model drafting for itself:
#      each task's greedy text with drafts must equal plain decoding's. The model: $SMOLLM2 (the
#      default model, real weights: its acceptance) when given, else a SmolLM2-shaped model with
#      random weights and the repository's SmolLM2 tokenizer (the equality only; the default
#      model, 98 MB, does not fit what travels to this machine: measure acceptance elsewhere);
#   3. the cost of a verification pass (`strata bench --verify`) beside a one-token step:
#      a resident Llama-3-8B-shaped q4_0 model ($L8, made when absent), and the
#      70B-shaped q4_0 file ($L70, made when absent: ~90 s, 39.7 GB) at --device-mem 16G,
#      where the weight stream dominates a step;
#   4. the implied 70B speed: the default model's acceptance with the 70B pass costs.
# Logs: $OUT (default /tmp/specg). SKIP70=1 leaves out the 70B shape.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
OUT=${OUT:-/tmp/specg}
mkdir -p "$OUT" /tmp/m
L8=${L8:-/tmp/m/l8b-q4_0.gguf}
L70=${L70:-/tmp/m/l70.gguf}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ ! -x build-gpu/strata ]; then
  stamp "build (CUDA)"
  (cmake -S . -B build-gpu -DSTRATA_CUDA=ON -DCMAKE_BUILD_TYPE=Release > "$OUT/cfg.log" 2>&1 &&
    cmake --build build-gpu -j "$(nproc)" --target strata > "$OUT/build.log" 2>&1) || { tail -20 "$OUT/build.log"; exit 1; }
fi
S=build-gpu/strata
M=${SMOLLM2:-}
if [ -z "$M" ] || [ ! -e "$M" ]; then
  M=/tmp/m/smol-rand
  if [ ! -f "$M/config.json" ]; then
    stamp "mkmodel smollm2-135m (random weights) + the SmolLM2 tokenizer"
    $S mkmodel --config smollm2-135m --format hf "$M" > "$OUT/mksmol.log" 2>&1 || { tail "$OUT/mksmol.log"; exit 1; }
  fi
  cp -n tests/data/tokenizer/smollm2/tokenizer.json tests/data/tokenizer/smollm2/tokenizer_config.json "$M/"
fi
if [ ! -f "$L8" ]; then
  stamp "mkmodel llama3-8b q4_0"
  $S mkmodel --config llama3-8b --dtype q4_0 "$L8" > "$OUT/mk8.log" 2>&1 || { tail "$OUT/mk8.log"; exit 1; }
fi
stamp "verification passes, 8B q4_0 resident"
$S bench "$L8" --prompt 512 --gen 32 --verify 1,2,4,8 2>&1 | tee "$OUT/verify_8b.txt" | grep -E "^(decode|verify|roofline +decode)"
if [ "${SKIP70:-0}" != 1 ]; then
  if [ ! -f "$L70" ]; then
    stamp "mkmodel llama3-70b q4_0"
    $S mkmodel --config llama3-70b --dtype q4_0 "$L70" > "$OUT/mk70.log" 2>&1 || { tail "$OUT/mk70.log"; exit 1; }
  fi
  stamp "verification passes, 70B q4_0 at --device-mem 16G"
  $S bench "$L70" --device-mem 16G --host-mem 100G --prompt 512 --gen 6 --reps 1 --verify 2,4,8 2>&1 |
    tee "$OUT/verify_70b.txt" | grep -E "^(decode|verify|weights|roofline +decode)"
fi
rc=0
# the default model's acceptance (and, with the 70B pass costs, the implied 70B speed)
step=$(sed -n 's/^decode .* \([0-9.]*\) ms\/token.*/\1/p' "$OUT/verify_70b.txt" 2>/dev/null)
costs=$(sed -n 's/^verify *\([0-9]*\) drafts.*host: \([0-9.]*\) ms.*/\1:\2/p' "$OUT/verify_70b.txt" 2>/dev/null | paste -sd,)
implied=()
if [ -n "$step" ] && [ -n "$costs" ]; then
  # one draft's cost on the 70B shape, from its largest verification pass: (pass / step - 1) / k
  cost=$(echo "$costs" | tr , '\n' | tail -1 | awk -F: -v s="$step" '{c = ($2 / s - 1) / $1; print (c < 0.001 ? 0.001 : c)}')
  implied=(--verify-ms "$costs" --step-ms "$step" --spec-cost "$cost")
fi
stamp "default model on CUDA: prompt lookup ${implied[*]}"
python3 bench/spec_accept.py --bin $S --model "$M" --device cuda --spec lookup --n 200 "${implied[@]}" |
  tee "$OUT/accept_lookup.txt" || rc=1
stamp "default model on CUDA: the model drafting for itself"
python3 bench/spec_accept.py --bin $S --model "$M" --device cuda --spec "draft:$M" --n 200 | tee "$OUT/accept_self.txt" || rc=1
stamp "done (rc $rc)"
exit $rc
