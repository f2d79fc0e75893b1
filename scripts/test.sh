#!/usr/bin/env bash
# Builds strata and runs every test: once in a normal build (CUDA code compiled
# too when nvcc is present), once under AddressSanitizer + UndefinedBehaviorSanitizer.
# Both are test builds (-DSTRATA_TESTING=ON: the tools' hidden fault-injection option).
# Then the fuzz harnesses (tests/fuzz: clang + libFuzzer, CPU only), 30 s each.
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

# Fuzzing: the libFuzzer harnesses of tests/fuzz, built with clang (install-deps
# installs it and the libFuzzer runtime; configuring fails when either is
# missing), each run for a bounded time from its seed corpus; a crash, a
# sanitizer report, a slow input or a memory blow-up fails the script.
command -v clang >/dev/null || { echo "test.sh: clang is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_FUZZ=ON >/dev/null
cmake --build build-fuzz -j "$JOBS" --target strata_fuzzers
bash scripts/fuzz.sh -t 30 -b build-fuzz
