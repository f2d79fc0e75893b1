#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .deps): recorded batched passes
# (CUDA graphs of st_llama_forward, model/llama.h) against direct runs.
#   1. gpu_check_batch_graph on the test models (and the default model when
#      present): every pass's
#      logits (and sampled ids) bitwise equal with and without graphs, graphs
#      actually replayed;
#   2. gpu_check_batch_graph --time on a Llama-3-8B-shaped bf16 model of
#      $LAYERS layers (default 32; `strata mkmodel`, kept in $WORK): ms per
#      decode step, graphs off vs on, batches 1, 8, 64 over 512-token prompts,
#      logits of every step compared.
# PASS / FAIL lines; exit status non-zero when a check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh > /dev/null 2>&1
WORK=${WORK:-/tmp/strata-gpu}
mkdir -p "$WORK"
L=${LAYERS:-32}
rc=0
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > /tmp/cfg_bg.log 2>&1 || { cat /tmp/cfg_bg.log; exit 2; }
cmake --build build-gpu -j "$(nproc)" --target strata gpu_check_batch_graph > /tmp/build_bg.log 2>&1 ||
  { tail -40 /tmp/build_bg.log; exit 2; }

echo "== correctness"
build-gpu/gpu_check_batch_graph || rc=1

mp=$WORK/llama3_8b_${L}l_bf16
[ -f "$mp/config.json" ] || build-gpu/strata mkmodel --config llama3-8b --layers "$L" "$mp" > /dev/null || exit 1
echo "== timing ($L-layer Llama-3-8B shape, bf16)"
build-gpu/gpu_check_batch_graph --time "$mp" 512 32 || rc=1

exit $rc
