#!/usr/bin/env bash
# Fast-mode prefill attention: the Hopper wgmma kernel (src/backend/cuda/
# cuda_attn_prefill_wgmma.cu: head dim 128 on compute capability 9.0) and the
# FA2 kernel (src/backend/cuda/cuda_attn_prefill_fa2.cu): builds strata with the
# CUDA backend, prints each kernel's resources (registers, spills, shared
# memory: ptxas), runs the attention checks of gpu_check_ops --only-attention
# (whose "-- prefill attention, fast mode" sections check the default choice
# (auto: the wgmma kernel where it applies) and every configuration (b128w8,
# b128w8r, b128w4, b256w8, wgmma, wgmma-pp: st_backend_params.attn_fa2) against
# the CPU at 1e-2, and whose attention_part sections check pieces, causal and
# not, on auto, wgmma-pp and FA2), then the prefill attention section of the
# kernel bench (bench_cuda_ops --only prefill-attn: precise and fast mode at
# 512/4K/16K, then every configuration side by side at 2K/4K/16K hd 128 and
# 16K hd 64, against a bf16 GEMM), then PyTorch's SDPA on its flash and cuDNN
# backends at 2K/4K/16K (tests/gpu/sdpa_peers.py; skipped without torch).
# Run from the repository root on a machine with an NVIDIA GPU. Exit status:
# 0 when every check passed and the bench ran. Prints the failures, one
# "PASS|FAIL fast attention <configuration>: N passed, M failed" line per
# configuration, and the bench.
#   BUILD_DIR  build directory (default build-gpu)
#   CHECK_TIMEOUT, BENCH_TIMEOUT  seconds for the checks (600) and the bench (400)
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-gpu}
jobs=$(nproc 2>/dev/null || echo 4)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 2; }
cmake --build "$build" -j "$jobs" --target gpu_check_ops bench_cuda_ops > "$build.build.log" 2>&1 || { tail -50 "$build.build.log"; echo "build failed"; exit 2; }

echo "== FA2 kernel resources (ptxas, sm_90a): hd, warps, m-tiles, keys per tile, Q in smem, reversed, min blocks"
if command -v nvcc > /dev/null; then
    nvcc -c -O3 -std=c++17 -Iinclude -Isrc -gencode=arch=compute_90a,code=sm_90a --resource-usage \
        src/backend/cuda/cuda_attn_prefill_fa2.cu -o "$build/fa2_resources.o" 2>&1 |
        grep -A3 "Compiling entry.*attn_prefill_fa2" | grep -v '^--' | paste - - - - |
        sed -E 's/^[^\t]*kernelILi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELb([01])ELb([01])ELi([0-9]+)[^\t]*\t[^\t]*\t */hd=\1 warps=\2 mt=\3 tk=\4 qs=\5 rev=\6 minb=\7: /; s/ptxas info *: //g; s/\t/ /g'
    echo "(shared memory, dynamic: (4 tk + (qs ? 16 warps mt : 0)) x (hd + 8) x 2 bytes)"
else
    echo "nvcc not on PATH: no resource report"
fi

echo "== wgmma kernel resources (ptxas, sm_90a)"
if command -v nvcc > /dev/null; then
    nvcc -c -O3 -std=c++17 -Iinclude -Isrc -gencode=arch=compute_90a,code=sm_90a --resource-usage \
        src/backend/cuda/cuda_attn_prefill_wgmma.cu -o "$build/wgmma_resources.o" 2>&1 |
        grep -A3 "Compiling entry" | grep -E "entry|Used|spill" | sed -E 's/ptxas info *: //'
fi

echo "== gpu_check_ops --only-attention"
timeout "${CHECK_TIMEOUT:-600}" stdbuf -oL "$build/gpu_check_ops" --only-attention > "$build/gpu_check_ops.log" 2>&1
rc=$?
[ $rc -eq 124 ] && { echo "gpu_check_ops timed out; its last lines:"; tail -5 "$build/gpu_check_ops.log"; }
grep -v '^PASS' "$build/gpu_check_ops.log"
echo "== fast prefill attention, per configuration"
awk '/^-- prefill attention, fast mode: /{ if (sec != "") report(); sec = substr($0, 34); p = 0; f = 0; next }
     /^-- /{ if (sec != "") report(); sec = ""; next }
     sec != "" && /^PASS +attention/ { p++ } sec != "" && /^FAIL +attention/ { f++ }
     function report() { printf "%s fast attention %s: %d passed, %d failed\n", (f == 0 && p > 0) ? "PASS" : "FAIL", sec, p, f }
     END { if (sec != "") report() }' "$build/gpu_check_ops.log"
echo "fast attention checks: $(grep -cE '^PASS +attention.*fast' "$build/gpu_check_ops.log") passed, $(grep -cE '^FAIL +attention.*fast' "$build/gpu_check_ops.log") failed"
echo "(full log: $build/gpu_check_ops.log)"

echo "== bench_cuda_ops (prefill attention)"
brc=0
timeout "${BENCH_TIMEOUT:-400}" stdbuf -oL "$build/bench_cuda_ops" --only prefill-attn > "$build/bench_cuda_ops.log" 2>&1 || { brc=$?; echo "bench_cuda_ops failed or timed out (status $brc)"; }
cat "$build/bench_cuda_ops.log"
echo "== PyTorch SDPA (flash, cuDNN), the peers"
if python3 -c "import torch" 2> /dev/null; then
    timeout 300 python3 tests/gpu/sdpa_peers.py 2>&1 | grep -v Warning
else
    echo "no torch: skipped"
fi
[ $rc -ne 0 ] && exit $rc
[ $brc -ne 0 ] && exit 3
exit 0
