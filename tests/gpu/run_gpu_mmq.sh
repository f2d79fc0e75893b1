#!/usr/bin/env bash
# Int8 tensor-core matmul of fast mode (MMQ, src/backend/cuda/cuda_mmq.cu,
# issue 15 item 1): builds gpu_check_ops and bench_cuda_ops with the CUDA
# backend, runs the MMQ checks (gpu_check_ops --only-mmq: error against the
# CPU's fp32 result, 1e-2; FULL=1: --only-gemv, the decode GEMV checks too),
# then the switch-point table (bench_cuda_ops --only mmq: int8 GEMV / MMQ /
# dequantize + GEMM at n = 1 .. 256 on the Llama-3-8B shapes, beside the
# weights' bytes at the copy bandwidth), from which cuda_matmul.cu's
# MMQ_MIN_N / MMQ_MAX_N are set.
# Run from the repository root on a machine with an NVIDIA GPU. Exit status:
# 0 when every check passed. Logs in $OUT (default build dir) as mmq_*.log.
#   BUILD_DIR  build directory (default build-gpu)
#   TARGETS    extra build targets (e.g. strata)
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-gpu}
logs=${OUT:-$build}
jobs=$(nproc 2>/dev/null || echo 4)
mkdir -p "$logs"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON -DSTRATA_TESTING=ON > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 2; }
cmake --build "$build" -j "$jobs" --target gpu_check_ops bench_cuda_ops ${TARGETS:-} > "$build.build.log" 2>&1 ||
  { grep -E 'error|Error' "$build.build.log" | head -40; tail -20 "$build.build.log"; echo "build failed"; exit 2; }

echo "== gpu_check_ops $([ "${FULL:-0}" = 1 ] && echo --only-gemv || echo --only-mmq)"
"$build/gpu_check_ops" $([ "${FULL:-0}" = 1 ] && echo --only-gemv || echo --only-mmq) > "$logs/mmq_checks.log" 2>&1
rc=$?
grep -v '^PASS' "$logs/mmq_checks.log"
grep -E '^PASS .*mmq int8' "$logs/mmq_checks.log" | sed -E 's/.*err=([0-9.e+-]+).*/\1/' | sort -g | tail -1 |
  sed 's/^/largest MMQ error: /'

echo "== bench_cuda_ops --only mmq"
timeout 400 stdbuf -oL "$build/bench_cuda_ops" --only mmq > "$logs/mmq_bench.log" 2>&1 || echo "bench_cuda_ops failed or timed out"
grep -E '^roofline|^-- |^mmq-table' "$logs/mmq_bench.log"
exit $rc
