#!/usr/bin/env bash
# The main job on the default model: installs what is missing, builds, fetches
# SmolLM2-135M-Instruct once into models/, and chats with it.
#   bash scripts/run.sh                      interactive chat (on a terminal)
#   bash scripts/run.sh -p "Your question"   one answer
# Any further arguments go to `strata run` (see ./build/strata run --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/fetch-default-model.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" >/dev/null
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ $# -eq 0 ] && [ ! -t 0 ]; then
  set -- -p "What is the capital of France? Answer in one sentence."
fi
exec ./build/strata run "$MODEL" "$@"
