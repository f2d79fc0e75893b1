#!/usr/bin/env bash
# The main job on the default model. Until the tokenizer lands (issue 3) this
# builds strata and runs the forward pass on a reference model from tests/data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)"
MODEL=tests/data/models/llama3_bf16
./build/strata inspect "$MODEL" --no-tensors
./build/strata logits "$MODEL" --tokens-file tests/data/refs/llama3_bf16.tokens --out /tmp/strata-logits.f32
python3 - <<'PY'
import numpy as np
a = np.fromfile("/tmp/strata-logits.f32", dtype="<f4").reshape(40, 256)
r = np.fromfile("tests/data/refs/llama3_bf16.logits.f32", dtype="<f4").reshape(40, 256)
print("logits [40, 256]; max |strata - HF| / max |HF| = %.3g; argmax equal: %s"
      % (np.abs(a - r).max() / np.abs(r).max(), bool((a.argmax(1) == r.argmax(1)).all())))
PY
