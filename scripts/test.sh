#!/usr/bin/env bash
# Builds strata and runs every test: once in a normal build (CUDA code compiled
# too when nvcc is present), once under AddressSanitizer + UndefinedBehaviorSanitizer;
# then the threaded parts (pool, weight streaming, KV tiers, engine, server)
# under ThreadSanitizer. All are test builds (-DSTRATA_TESTING=ON: the tools'
# hidden fault-injection option). Then the fuzz harnesses (tests/fuzz: clang +
# libFuzzer, CPU only), 30 s each. The sanitizer builds compile the CPU kernels
# uninstrumented and optimized for every test but the backend's own, which link a
# checked copy (CMakeLists.txt says why: CI's 90 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/fetch-default-model.sh   # the default model, used by the end-to-end tests
JOBS=$(nproc)
# each stage's start and the time so far, so that a slow CI run shows where its time went
stage() { echo "test.sh: [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }

stage "normal build (CUDA code compiled where nvcc is)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_TESTING=ON >/dev/null
cmake --build build -j "$JOBS"
stage "normal build: tests"
(cd build && ctest --output-on-failure -j "$JOBS")

# Sanitizers: CPU code only (the CUDA runtime does not run under ASan here).
stage "ASan + UBSan build"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF -DSTRATA_TESTING=ON \
  >/dev/null
cmake --build build-asan -j "$JOBS"
stage "ASan + UBSan build: tests"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure -j "$JOBS")

# ThreadSanitizer: CPU code only, the tests that run threads: the CPU backend's
# pool (test_backend_*: its kernels instrumented there, see CMakeLists.txt), the
# weight manager's reader / copier / pinner, the KV host tier's pinner and the
# SSD tier's writer, the engine thread and its callers, the HTTP server's
# threads (test_server*.py drive build-tsan/strata, passed to them by CTest),
# the router's (test_router.py: connection, health and prefill threads), the
# P-D export thread (test_pd_engine) and the UCX transport's (test_pd_xfer).
# A report fails its test: exit 66 (halt_on_error), or a server that does not
# exit 0. No suppressions: none has been needed (third-party code only, ever).
stage "TSan build"
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DSTRATA_TSAN=ON -DSTRATA_TESTING=ON >/dev/null
cmake --build build-tsan -j "$JOBS"
TSAN_TESTS='^(test_backend_cpu|test_backend_paged|test_scheduler|test_runner|test_engine|test_weights_stream|test_kv_ssd|test_kv_tiers|test_api|test_server.*|test_router|test_pd_engine|test_pd_xfer)$'
# UCX_MEM_EVENTS=no: UCX's memory hooks (libucm, loaded with the KV transport of P-D: it
# intercepts madvise, which an exiting thread calls after TSan dropped its state) crash
# under ThreadSanitizer; UCX needs them only for its registration cache, unused by TCP and
# shared memory, and reads the setting when it is loaded.
stage "TSan build: the threaded tests"
(cd build-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 UCX_MEM_EVENTS=no \
  ctest --output-on-failure -j "$JOBS" --timeout 400 -R "$TSAN_TESTS")

# Fuzzing: the libFuzzer harnesses of tests/fuzz, built with clang (install-deps
# installs it and the libFuzzer runtime; configuring fails when either is
# missing), each run for a bounded time from its seed corpus; a crash, a
# sanitizer report, a slow input or a memory blow-up fails the script.
command -v clang >/dev/null || { echo "test.sh: clang is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
stage "fuzz build"
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_FUZZ=ON >/dev/null
cmake --build build-fuzz -j "$JOBS" --target strata_fuzzers
stage "fuzzing"
bash scripts/fuzz.sh -t 30 -b build-fuzz
stage "all passed"
