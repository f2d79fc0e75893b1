#!/usr/bin/env bash
# Decode GEMV kernels (src/backend/cuda/cuda_gemv.cu, cuda_gemv1.cu, issues 6
# and 15): builds strata with the CUDA backend, runs every op check of
# gpu_check_ops (the GEMV: the staged kernels, the one-token int8 kernel and
# its rows-per-warp variants, rmsnorm_matmul, and the older kernel for the
# types it keeps: f32, q8_0, q6_k, odd rows), then the kernel bench's decode
# GEMV sections (bench_cuda_ops --only gemv: times per dtype / shape / n
# beside the copy roofline; --only gemv1: the one-token int8 kernel's
# variants on the 8B step's matmuls, the table cuda_matmul.cu's rule comes
# from).
# Run from the repository root on a machine with an NVIDIA GPU. Exit status:
# 0 when every check passed. Prints the GEMV lines of both logs.
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
echo "GEMV checks: $(grep -cE '^PASS +(rmsnorm_)?matmul' "$build/gpu_check_ops.log") passed, $(grep -cE '^FAIL +(rmsnorm_)?matmul' "$build/gpu_check_ops.log") failed (matmul, matmul_multi, matmul_swiglu, rmsnorm_matmul lines)"
echo "(full log: $build/gpu_check_ops.log)"

echo "== bench_cuda_ops (decode GEMV section)"
timeout 300 stdbuf -oL "$build/bench_cuda_ops" --only gemv > "$build/bench_cuda_ops.log" 2>&1 || echo "bench_cuda_ops failed or timed out"
grep -E '^roofline|^-- decode GEMV|^gemv ' "$build/bench_cuda_ops.log"
timeout 300 stdbuf -oL "$build/bench_cuda_ops" --only gemv1 > "$build/bench_cuda_ops_gemv1.log" 2>&1 || echo "bench_cuda_ops --only gemv1 failed or timed out"
grep -E '^-- one-token|^gemv1 ' "$build/bench_cuda_ops_gemv1.log"
echo "(full logs: $build/bench_cuda_ops.log, $build/bench_cuda_ops_gemv1.log)"
exit $rc
