#!/usr/bin/env bash
# Issue 19 on the GPU machine's CPU (all its cores): strata's CPU backend beside llama.cpp's
# CPU build on the same q4_0 GGUF, the rows of bench/cpu_vs_llama.sh (prefill 512; decode 32
# after 64; decode 128 after 512). From the repo root, carrying .deps and .peer
# (bash ../shared/peer/fetch-llama-cpp.sh packs llama.cpp's source there):
#   1. builds llama.cpp's llama-bench CPU-only (GGML_CUDA off) and strata CPU-only, at once;
#   2. a Llama-3-8B-shaped q4_0 model of $LAYERS layers (strata mkmodel; default 8 layers,
#      ~2B parameters with the embeddings) with tokenizer.ggml.model "none" added so that
#      llama.cpp loads it (.peer/gguf_novocab.py; both engines read that one file);
#   3. bench/cpu_vs_llama.sh with $THREADS threads (default: every core), $REPS repetitions,
#      strata with its default (precise) activations, then with --cpu-act int8;
#   4. bench/bench_cpu_matmul (a 70B FFN's decode shapes, q4_0: GB/s of weights beside the
#      read rate at 1, 4 and 8 tokens; int8 on AMX tiles where usable) at $MM_THREADS threads
#      (default "1,$THREADS").
# MODES (default "precise int8"): the strata activation modes of step 3. BASE_SRC: another
# source tree (e.g. the branch point) built CPU-only too and run in step 3 first, as a
# baseline from the same run. TESTS=1: build and run test_backend_cpu first (its int8 AMX
# checks run where the CPU has AMX-INT8). The CPU's AMX / AVX-512 flags are printed first.
# Logs: $OUT (default /tmp/cpub).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
OUT=${OUT:-/tmp/cpub}
mkdir -p "$OUT"
THREADS=${THREADS:-$(nproc)}
LAYERS=${LAYERS:-8}
REPS=${REPS:-2}
MODES=${MODES:-precise int8}
MM_THREADS=${MM_THREADS:-1,$THREADS}
echo "cpu flags: $(grep -o -E 'amx[a-z_0-9]*|avx512[a-z_0-9]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
[ -f .peer/llama.cpp.tgz ] || { echo "no .peer/llama.cpp.tgz: run bash ../shared/peer/fetch-llama-cpp.sh here and carry .peer"; exit 2; }
L=/tmp/llama-cpu/llama.cpp
stamp "build llama.cpp (CPU) and strata (CPU)"
if [ ! -x $L/build/bin/llama-bench ]; then
  mkdir -p /tmp/llama-cpu && tar xzf .peer/llama.cpp.tgz -C /tmp/llama-cpu
  (cd $L && cmake -S . -B build -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
     > "$OUT/llama_cfg.log" 2>&1 && cmake --build build -j "$THREADS" --target llama-bench > "$OUT/llama_build.log" 2>&1) &
fi
if [ -n "${BASE_SRC:-}" ]; then
  (cmake -S "$BASE_SRC" -B /tmp/build-base -DSTRATA_CUDA=OFF -DCMAKE_BUILD_TYPE=Release > "$OUT/base_cfg.log" 2>&1 &&
    cmake --build /tmp/build-base -j "$THREADS" --target strata > "$OUT/base_build.log" 2>&1) &
fi
TGT="strata bench_cpu_matmul"
[ "${TESTS:-0}" = 1 ] && TGT="$TGT test_backend_cpu"
(cmake -S . -B build-cpu -DSTRATA_CUDA=OFF -DSTRATA_TESTING=ON -DCMAKE_BUILD_TYPE=Release > "$OUT/cfg.log" 2>&1 &&
  cmake --build build-cpu -j "$THREADS" --target $TGT > "$OUT/build.log" 2>&1) || { tail -20 "$OUT/build.log"; exit 1; }
wait
if [ "${TESTS:-0}" = 1 ]; then
  stamp "test_backend_cpu"
  build-cpu/test_backend_cpu > "$OUT/test_backend_cpu.log" 2>&1; echo "test_backend_cpu rc $?"; tail -6 "$OUT/test_backend_cpu.log"
fi
[ -x $L/build/bin/llama-bench ] || { tail -20 "$OUT/llama_build.log"; exit 1; }
M=/tmp/m/l8b-$LAYERS-q4_0.gguf
if [ ! -f "${M%.gguf}.novocab.gguf" ]; then
  stamp "mkmodel llama3-8b --layers $LAYERS q4_0"
  mkdir -p /tmp/m
  build-cpu/strata mkmodel --config llama3-8b --layers "$LAYERS" --dtype q4_0 "$M" > "$OUT/mk.log" 2>&1 || { tail "$OUT/mk.log"; exit 1; }
  python3 .peer/gguf_novocab.py "$M" "${M%.gguf}.novocab.gguf" && rm -f "$M"
fi
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $THREADS threads"
for mode in $MODES; do
  a=; [ "$mode" = int8 ] && a=int8
  if [ -n "${BASE_SRC:-}" ]; then
    stamp "baseline ($BASE_SRC) vs llama.cpp, strata $mode"
    bash bench/cpu_vs_llama.sh "${M%.gguf}.novocab.gguf" $L/build/bin/llama-bench "$THREADS" /tmp/build-base/strata "$REPS" $a
  fi
  stamp "strata vs llama.cpp, strata $mode"
  bash bench/cpu_vs_llama.sh "${M%.gguf}.novocab.gguf" $L/build/bin/llama-bench "$THREADS" build-cpu/strata "$REPS" $a
done
stamp "bench_cpu_matmul $MM_THREADS threads"
build-cpu/bench_cpu_matmul "$MM_THREADS" 10 ${MM_DTYPES:-q4_0,q8_0,q4_K}
stamp done
