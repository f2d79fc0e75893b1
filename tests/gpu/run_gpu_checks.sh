#!/usr/bin/env bash
# Builds strata with the CUDA backend and checks every CUDA op against the CPU
# backend (tests/gpu/gpu_check_ops.c), then times the decode kernels
# (bench/bench_cuda_ops.c). Run from the repository root on a machine with an
# NVIDIA GPU, nvcc and cmake. Exit status: that of gpu_check_ops (0 = all
# passed). Takes about a minute (most of it compiling).
#   BUILD_DIR   build directory (default build-gpu)
#   NO_BENCH=1  skip the benchmark
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-gpu}
jobs=$(nproc 2>/dev/null || echo 4)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
if ! cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON > "$build.configure.log" 2>&1; then
  cat "$build.configure.log"; echo "configure failed"; exit 2
fi
grep -q "strata: CUDA backend ON" "$build.configure.log" || { cat "$build.configure.log"; echo "nvcc not found: CUDA backend not built"; exit 2; }
if ! cmake --build "$build" -j "$jobs" --target gpu_check_ops bench_cuda_ops > "$build.build.log" 2>&1; then
  tail -50 "$build.build.log"; echo "build failed"; exit 2
fi

echo "== gpu_check_ops"
"$build/gpu_check_ops" > "$build/gpu_check_ops.log" 2>&1
rc=$?
grep -v '^PASS' "$build/gpu_check_ops.log"   # failures, notes and the summary
echo "(full log: $build/gpu_check_ops.log)"

if [ "${NO_BENCH:-0}" != 1 ]; then
  echo "== bench_cuda_ops"
  timeout 120 "$build/bench_cuda_ops" || echo "bench_cuda_ops failed"
fi
exit $rc
