#!/usr/bin/env bash
# Fast-mode prefill attention, FA2 kernel (src/backend/cuda/cuda_attn_prefill_fa2.cu):
# builds strata with the CUDA backend, runs every op check of gpu_check_ops
# (whose "-- prefill attention, fast mode" sections check the FA2 kernel and,
# on a second backend, STRATA_ATTN_PREFILL=old, against the CPU at 1e-2),
# then the prefill attention section of the kernel bench (BENCH_ONLY_PREFILL_ATTN=1:
# precise and fast mode at 512/4K/16K, then fa2 vs old side by side).
# Run from the repository root on a machine with an NVIDIA GPU. Exit status:
# 0 when every check passed. Prints the failures, the fast attention lines and the bench.
#   BUILD_DIR  build directory (default build-gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-gpu}
jobs=$(nproc 2>/dev/null || echo 4)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 2; }
cmake --build "$build" -j "$jobs" --target gpu_check_ops bench_cuda_ops > "$build.build.log" 2>&1 || { tail -50 "$build.build.log"; echo "build failed"; exit 2; }

echo "== gpu_check_ops"
"$build/gpu_check_ops" > "$build/gpu_check_ops.log" 2>&1
rc=$?
grep -v '^PASS' "$build/gpu_check_ops.log"
echo "== fast prefill attention lines"
grep -E '^-- prefill attention, fast mode|^(PASS|FAIL) +attention.*fast' "$build/gpu_check_ops.log"
echo "fast attention checks: $(grep -cE '^PASS +attention.*fast' "$build/gpu_check_ops.log") passed, $(grep -cE '^FAIL +attention.*fast' "$build/gpu_check_ops.log") failed"
echo "(full log: $build/gpu_check_ops.log)"

echo "== bench_cuda_ops (prefill attention)"
BENCH_ONLY_PREFILL_ATTN=1 timeout 300 stdbuf -oL "$build/bench_cuda_ops" > "$build/bench_cuda_ops.log" 2>&1 || echo "bench_cuda_ops failed or timed out"
cat "$build/bench_cuda_ops.log"
exit $rc
