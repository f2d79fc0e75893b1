#!/usr/bin/env bash
# Contexts longer than the device on the GPU machine (issue #13's figures), from
# the repo root, with .deps carried (scripts/device-debs.sh):
#   1. builds strata, test_long_context and gpu_check_ops (CUDA);
#   2. checks: test_long_context --cuda-only (CUDA within 1e-4 of the fit: the
#      streamed sequence against one whose KV fits the pool) and gpu_check_ops'
#      attention_part cases (skipped with SKIP_CHECKS=1);
#   3. the benchmark: llama3-8b bf16, `strata bench --kv-stream` at each length
#      of $LENS (default 32768 131072 524288), fast prefill, passes of 4096:
#      prefill beside the GEMM floor, decode beside max(KV / H2D, weights / HBM),
#      the device memory peak (flat across lengths: the KV ring does not grow);
#   4. at each length of $SPLIT_LENS (default 131072): the decode with its oldest
#      keys attended on the CPU (--kv-cpu-attn auto, then 0.5) beside the run of
#      step 3 at that length, and with half the KV in the SSD tier
#      (--kv-stream-mem half, --kv-ssd-dir $OUTDIR/ssd) beside the file's read rate.
# Output: $OUTDIR (default /tmp/longctx) holds the logs; the summary is printed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
OUTDIR=${OUTDIR:-/tmp/longctx}
LENS=${LENS:-"32768 131072 524288"}
GEN=${GEN:-4}
mkdir -p "$OUTDIR"
stamp() { echo "[$(date +%T)] $*"; }
stamp build
(cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSTRATA_TESTING=ON > "$OUTDIR/cfg.log" 2>&1 &&
   cmake --build build-gpu -j 16 --target strata test_long_context gpu_check_ops > "$OUTDIR/build.log" 2>&1) ||
  { tail -30 "$OUTDIR/build.log"; exit 1; }
rc=0
if [ "${SKIP_CHECKS:-0}" != 1 ]; then
  stamp "test_long_context --cuda-only"
  STRATA_SRC=$PWD build-gpu/test_long_context --cuda-only > "$OUTDIR/test.txt" 2>&1 || rc=1
  tail -8 "$OUTDIR/test.txt"
  stamp "gpu_check_ops attention_part"
  build-gpu/gpu_check_ops --only-attention > "$OUTDIR/ops.txt" 2>&1 || rc=1
  grep -i "attention_part\|FAIL\|passed\|failed" "$OUTDIR/ops.txt" | tail -20
fi
stamp "mkmodel llama3-8b bf16"
[ -d /tmp/m8b ] || build-gpu/strata mkmodel --config llama3-8b --dtype bf16 /tmp/m8b > "$OUTDIR/mk.log" 2>&1 ||
  { tail "$OUTDIR/mk.log"; exit 1; }
for n in $LENS; do
  stamp "bench --kv-stream --prompt $n"
  build-gpu/strata bench /tmp/m8b --kv-stream --prompt "$n" --gen "$GEN" --batch 4096 --fast-prefill \
    > "$OUTDIR/bench-$n.txt" 2> "$OUTDIR/bench-$n.err" || rc=1
  cat "$OUTDIR/bench-$n.txt"; tail -2 "$OUTDIR/bench-$n.err"
done
for n in ${SPLIT_LENS-131072}; do
  for share in auto 0.5; do
    stamp "bench --kv-stream --prompt $n --kv-cpu-attn $share"
    build-gpu/strata bench /tmp/m8b --kv-stream --prompt "$n" --gen "$GEN" --batch 4096 --fast-prefill \
      --kv-cpu-attn "$share" > "$OUTDIR/bench-$n-cpu-$share.txt" 2> "$OUTDIR/bench-$n-cpu-$share.err" || rc=1
    grep -E "^(decode|cpu attn|roofline)" "$OUTDIR/bench-$n-cpu-$share.txt"; tail -2 "$OUTDIR/bench-$n-cpu-$share.err"
  done
  # half of the KV (bf16: 128 KiB a token over 32 layers) on the host, the rest in the SSD file
  half=$(( n * 131072 / 2 ))
  stamp "bench --kv-stream --prompt $n --kv-stream-mem $half --kv-ssd-dir $OUTDIR/ssd"
  build-gpu/strata bench /tmp/m8b --kv-stream --prompt "$n" --gen "$GEN" --batch 4096 --fast-prefill \
    --kv-stream-mem "$half" --kv-ssd-dir "$OUTDIR/ssd" > "$OUTDIR/bench-$n-ssd.txt" 2> "$OUTDIR/bench-$n-ssd.err" || rc=1
  grep -E "^(prefill|decode|ssd|roofline)" "$OUTDIR/bench-$n-ssd.txt"; tail -2 "$OUTDIR/bench-$n-ssd.err"
done
stamp done
exit $rc
