#!/usr/bin/env bash
# Builds strata and runs every test: once in a normal build (CUDA code compiled
# too when nvcc is present), once under AddressSanitizer + UndefinedBehaviorSanitizer.
# Both are test builds (-DSTRATA_TESTING=ON: the tools' hidden fault-injection option).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/fetch-default-model.sh   # the default model, used by the end-to-end tests
JOBS=$(nproc)

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_TESTING=ON >/dev/null
cmake --build build -j "$JOBS"
(cd build && ctest --output-on-failure -j "$JOBS")

# Sanitizers: CPU code only (the CUDA runtime does not run under ASan here).
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF -DSTRATA_TESTING=ON \
  >/dev/null
cmake --build build-asan -j "$JOBS"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure -j "$JOBS")
