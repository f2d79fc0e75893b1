#!/usr/bin/env bash
# Runs the libFuzzer harnesses of tests/fuzz, each for a bounded time, from its
# seed corpus tests/fuzz/corpus/<name>/ (replayed first: the regression inputs
# of bugs found before are there). Fails on the first crash, sanitizer report,
# broken invariant, slow input (-timeout) or memory blow-up (-rss_limit_mb),
# printing the end of its log and where the input that did it was saved.
#   scripts/fuzz.sh [-t SECONDS] [-b BUILD_DIR] [NAME...]
# SECONDS per harness (default 30), BUILD_DIR the STRATA_FUZZ=ON build (default
# build-fuzz; scripts/test.sh makes it), NAMEs default to every harness.
# What a run learns (new inputs, crash files) stays under BUILD_DIR/fuzz-work/<name>/.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=30
BUILD=build-fuzz
while getopts "t:b:" o; do
  case $o in
    t) SECS=$OPTARG ;;
    b) BUILD=$OPTARG ;;
    *) echo "usage: scripts/fuzz.sh [-t SECONDS] [-b BUILD_DIR] [NAME...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
NAMES=("$@")
if [ ${#NAMES[@]} -eq 0 ]; then
  for f in tests/fuzz/fuzz_*.c; do n=$(basename "$f" .c); NAMES+=("${n#fuzz_}"); done
fi

for n in "${NAMES[@]}"; do
  bin=$BUILD/fuzz_$n
  seeds=tests/fuzz/corpus/$n
  if [ ! -x "$bin" ]; then
    echo "fuzz: $bin is missing (configure with -DCMAKE_C_COMPILER=clang -DSTRATA_FUZZ=ON, build strata_fuzzers)" >&2
    exit 1
  fi
  if [ ! -d "$seeds" ]; then
    echo "fuzz: no seed corpus $seeds" >&2
    exit 1
  fi
  work=$BUILD/fuzz-work/$n
  rm -rf "$work"
  mkdir -p "$work/corpus"
  start=$(date +%s)
  # -timeout: one input taking longer is a finding; -rss_limit_mb: so is memory
  # past it (and one allocation past it); -error_exitcode / -timeout_exitcode: a
  # failure is never exit 0. Inputs grow up to libFuzzer's default length (the
  # largest seed, at least 4096 bytes).
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     "$bin" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -error_exitcode=77 -timeout_exitcode=78 -artifact_prefix="$work/" "$work/corpus" "$seeds" \
       >"$work/log.txt" 2>&1; then
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$work/log.txt" | tail -n 1 | sed -E 's/.*DONE[[:space:]]+//' || true)
    runs=$(grep -E '^stat::number_of_executed_units' "$work/log.txt" | awk '{print $2}' || true)
    echo "fuzz: $n ok in $(( $(date +%s) - start ))s: ${runs:-?} runs; $done_line"
  else
    rc=$?
    echo "fuzz: $n FAILED (exit $rc); the end of $work/log.txt:" >&2
    tail -n 60 "$work/log.txt" >&2
    ls "$work" | grep -E '^(crash|leak|timeout|oom|slow-unit)-' | sed "s#^#fuzz: input saved: $work/#" >&2 || true
    exit 1
  fi
done
