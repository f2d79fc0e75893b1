#!/usr/bin/env bash
# On the GPU machine, from the repo root, with .deps carried (scripts/device-debs.sh):
# builds strata with CUDA, checks every op against the CPU backend, checks the
# logits of every reference model on the GPU against HF (same tolerances as on
# the CPU), builds a Llama-3-8B-shaped 4-layer model with HF and checks it too,
# and chats with the default model when it is at $SMOLLM2 (optional).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-/tmp/out}
rc=0
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > /tmp/cfg.log 2>&1 || { cat /tmp/cfg.log; exit 2; }
grep "CUDA backend" /tmp/cfg.log
cmake --build build-gpu -j "$(nproc)" > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 2; }

echo "== op checks (CUDA vs CPU backend)"
BUILD_DIR=build-gpu NO_BENCH=${NO_BENCH:-0} bash tests/gpu/run_gpu_checks.sh || rc=1

echo "== reference models on the GPU vs HF"
STRATA_BIN=build-gpu/strata STRATA_DEVICE=cuda STRATA_TMP=/tmp/st python3 tests/test_logits_ref.py || rc=1

echo "== Llama-3-8B-shaped, 4 layers, bf16, vs HF (float32 compute)"
python3 tools/ref/make_refs.py --big /tmp/big > /tmp/big.log 2>&1 || { tail -20 /tmp/big.log; rc=1; }
grep llama3_8b /tmp/big.log
STRATA_REF_DATA=/tmp/big STRATA_NO_GGUF=1 STRATA_BIN=build-gpu/strata STRATA_DEVICE=cuda STRATA_TMP=/tmp/st \
  python3 tests/test_logits_ref.py || rc=1
echo "== strata bench on it (cuda)"
build-gpu/strata bench /tmp/big/models/llama3_8b_4layers_bf16 --device cuda --prompt 2048 --gen 128 || rc=1

if [ -n "${SMOLLM2:-}" ] && [ -f "$SMOLLM2" ]; then
  echo "== default model on cuda"
  build-gpu/strata run "$SMOLLM2" --device cuda -p "What is the capital of France?" -n 32 --temp 0 || rc=1
  build-gpu/strata run "$SMOLLM2" --device cuda -p "Explain in two sentences why the sky is blue." -n 80 --temp 0 || rc=1
  STRATA_BIN=build-gpu/strata STRATA_SMOLLM2_GGUF=$SMOLLM2 STRATA_DEVICE=cuda python3 tests/test_smollm2_ref.py || rc=1
  build-gpu/strata bench "$SMOLLM2" --device cuda --prompt 512 --gen 128 || rc=1
fi
exit $rc
