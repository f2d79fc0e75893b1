#!/usr/bin/env bash
# Issue 19 / 16 on the GPU machine's CPU, without llama.cpp: where a 16-thread decode step, a
# prefill and a verification pass of the 8B-shaped q4_0 model go (strata bench --op-times), the
# int8 matmul at n = 1, 2, 4, 8 tokens against the read rate (bench_cpu_matmul), and the pool's
# cost per parallel loop (bench_pool). From the repo root, carrying .deps:
#   bash tests/gpu/run_gpu_cpu_profile.sh
# THREADS (default: every core), LAYERS (default 8), MM_DTYPES (default q4_0), ACT (default int8).
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
stamp "build strata (CPU)"
TGT="strata bench_cpu_matmul bench_pool"
[ "${TESTS:-0}" = 1 ] && TGT="$TGT test_backend_cpu"
(cmake -S . -B build-cpu -DSTRATA_CUDA=OFF -DSTRATA_TESTING=ON -DCMAKE_BUILD_TYPE=Release > "$OUT/cfg.log" 2>&1 &&
  cmake --build build-cpu -j "$THREADS" --target $TGT > "$OUT/build.log" 2>&1) || { tail -20 "$OUT/build.log"; exit 1; }
if [ "${TESTS:-0}" = 1 ]; then
  stamp "test_backend_cpu"
  build-cpu/test_backend_cpu > "$OUT/test_backend_cpu.log" 2>&1; echo "test_backend_cpu rc $?"; tail -4 "$OUT/test_backend_cpu.log"
fi
M=/tmp/m/l8b-$LAYERS-q4_0.gguf
if [ ! -f "$M" ]; then
  stamp "mkmodel llama3-8b --layers $LAYERS q4_0"
  mkdir -p /tmp/m
  build-cpu/strata mkmodel --config llama3-8b --layers "$LAYERS" --dtype q4_0 "$M" > "$OUT/mk.log" 2>&1 || { tail "$OUT/mk.log"; exit 1; }
fi
stamp "strata bench --op-times ($ACT)"
build-cpu/strata bench "$M" --device cpu --threads "$THREADS" --cpu-act "$ACT" --prompt "${PROMPT:-512}" --gen 32 --reps 2 \
  --verify "${VERIFY:-1,3,7}" --op-times 2>&1 | tee "$OUT/optimes.log" | grep -v '^weights'
stamp "bench_cpu_matmul $THREADS threads"
build-cpu/bench_cpu_matmul "$THREADS" "${MM_REPS:-5}" "${MM_DTYPES:-q4_0}" 2>&1 | tee "$OUT/matmul.log"
stamp "bench_pool $THREADS"
build-cpu/bench_pool "$THREADS" 2>&1 | tail -8
stamp done
