#!/usr/bin/env bash
# Issue 19 / 16 on the GPU machine's CPU, without llama.cpp: where a 16-thread decode step, a
# prefill and a verification pass of the 8B-shaped q4_0 model go (strata bench --op-times), the
# int8 matmul at n = 1, 2, 4, 8 tokens against the read rate (bench_cpu_matmul), and the pool's
# cost per parallel loop (bench_pool). From the repo root, carrying .deps:
#   bash tests/gpu/run_gpu_cpu_profile.sh
# THREADS (default: every core), LAYERS (default 8), MM_DTYPES (default q4_0), ACT (default int8).
# BUILD: a build directory that already has strata, bench_cpu_matmul and bench_pool (e.g. a CUDA
# build-gpu configured with -DSTRATA_TESTING=ON): no CPU-only build then.
# PEER=1: llama.cpp's llama-bench on the same file, CPU only (-dev none -ngl 0 -nopo 1, same
# threads, pp PROMPT, tg 32), after `bash .peer/vs-llama-cpp.sh start` in the same machine session.
# Logs: $OUT (default /tmp/cpup).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
OUT=${OUT:-/tmp/cpup}
mkdir -p "$OUT"
THREADS=${THREADS:-$(nproc)}
LAYERS=${LAYERS:-8}
ACT=${ACT:-int8}
echo "cpu flags: $(grep -o -E 'amx[a-z_0-9]*|avx512[a-z_0-9]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $THREADS threads"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
B=${BUILD:-build-cpu}
if [ -z "${BUILD:-}" ]; then
  stamp "build strata (CPU)"
  TGT="strata bench_cpu_matmul bench_pool"
  [ "${TESTS:-0}" = 1 ] && TGT="$TGT test_backend_cpu"
  (cmake -S . -B build-cpu -DSTRATA_CUDA=OFF -DSTRATA_TESTING=ON -DCMAKE_BUILD_TYPE=Release > "$OUT/cfg.log" 2>&1 &&
    cmake --build build-cpu -j "$THREADS" --target $TGT > "$OUT/build.log" 2>&1) || { tail -20 "$OUT/build.log"; exit 1; }
fi
if [ "${TESTS:-0}" = 1 ]; then
  stamp "test_backend_cpu"
  cmake --build "$B" -j "$THREADS" --target test_backend_cpu > "$OUT/build_test.log" 2>&1 || tail -5 "$OUT/build_test.log"
  "$B"/test_backend_cpu > "$OUT/test_backend_cpu.log" 2>&1; echo "test_backend_cpu rc $?"; tail -4 "$OUT/test_backend_cpu.log"
fi
M=/tmp/m/l8b-$LAYERS-q4_0.gguf
if [ ! -f "$M" ]; then
  stamp "mkmodel llama3-8b --layers $LAYERS q4_0"
  mkdir -p /tmp/m
  "$B"/strata mkmodel --config llama3-8b --layers "$LAYERS" --dtype q4_0 "$M" > "$OUT/mk.log" 2>&1 || { tail "$OUT/mk.log"; exit 1; }
fi
if [ "${PEER:-0}" = 1 ]; then # its build (13 jobs) would share the cores with strata's timings
  stamp "llama.cpp: waiting for its build"
  w=0; while [ ! -f /tmp/peer/build.rc ] && [ $w -lt "${PEER_WAIT:-600}" ]; do sleep 5; w=$((w + 5)); done
fi
stamp "strata bench --op-times ($ACT)"
"$B"/strata bench "$M" --device cpu --threads "$THREADS" --cpu-act "$ACT" --prompt "${PROMPT:-512}" --gen 32 --reps 2 \
  --verify "${VERIFY:-1,3,7}" --op-times 2>&1 | tee "$OUT/optimes.log" | grep -v '^weights'
if [ "${PEER:-0}" = 1 ]; then
  P=/tmp/peer/llama.cpp/build/bin
  if [ "$(cat /tmp/peer/build.rc 2>/dev/null)" = 0 ]; then
    python3 .peer/gguf_novocab.py "$M" "$M" > "$OUT/novocab.log" 2>&1 || tail -2 "$OUT/novocab.log"
    stamp "llama-bench CPU only: -dev none -ngl 0 -nopo 1 -t $THREADS -p ${PROMPT:-512} -n 32"
    $P/llama-bench -m "$M" -dev none -ngl 0 -nopo 1 -t "$THREADS" -p "${PROMPT:-512}" -n 32 -r 3 2>&1 | tee "$OUT/llama_cpu.log" | grep -E "^\||rror"
  else
    echo "llama.cpp is not built: $(tail -3 /tmp/peer/build.log 2>/dev/null)"
  fi
fi
stamp "bench_cpu_matmul $THREADS threads"
"$B"/bench_cpu_matmul "$THREADS" "${MM_REPS:-5}" "${MM_DTYPES:-q4_0}" 2>&1 | tee "$OUT/matmul.log"
stamp "bench_pool $THREADS"
"$B"/bench_pool "$THREADS" 2>&1 | tail -8
stamp done
