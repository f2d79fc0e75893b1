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
# SmolLM2-135M-Instruct's model card recommends temperature 0.2, top-p 0.9 (at
# strata's generic 0.7 the 135M model rambles); options the caller gives win.
SAMPLING=()
has_opt() { local o; for o in "${@:2}"; do [ "$o" = "$1" ] && return 0; done; return 1; }
has_opt --temp "$@" || has_opt --temperature "$@" || SAMPLING+=(--temp 0.2)
has_opt --top-p "$@" || SAMPLING+=(--top-p 0.9)
exec ./build/strata run "$MODEL" "${SAMPLING[@]}" "$@"
