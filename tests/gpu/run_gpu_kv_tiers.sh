#!/usr/bin/env bash
# The KV tiers on the GPU machine (issue #12's benchmarks), from the repo root,
# with .deps carried (scripts/device-debs.sh):
#   1. builds strata (CUDA);
#   2. a small check: `strata bench-kv` on a 4-layer llama3-8b-shaped bf16 model,
#      2048-token prompt: the device-, host- and SSD-tier hits must give the same
#      last-position logits bit for bit (the command fails otherwise);
#   3. the benchmark: llama3-8b bf16, 32768-token prompt (TTFT cold / device / host /
#      SSD beside the floors measured in the same run), then the serving run with a
#      working set of shared prefixes 4x the device pool, tiers on and off.
# Output: $OUTDIR (default /tmp/kvtiers) holds the logs; the summary is printed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
OUTDIR=${OUTDIR:-/tmp/kvtiers}
SSD=${SSD:-/tmp/kvssd}
PROMPT=${PROMPT:-32768}
mkdir -p "$OUTDIR"
stamp() { echo "[$(date +%T)] $*"; }
stamp build
(cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > "$OUTDIR/cfg.log" 2>&1 &&
   cmake --build build-gpu -j 16 --target strata > "$OUTDIR/build.log" 2>&1) || { tail -30 "$OUTDIR/build.log"; exit 1; }
rc=0
stamp "small check (4 layers)"
build-gpu/strata mkmodel --config llama3-8b --layers 4 --dtype bf16 /tmp/m8b4 > "$OUTDIR/mk4.log" 2>&1 || { tail "$OUTDIR/mk4.log"; exit 1; }
rm -rf "$SSD"
build-gpu/strata bench-kv /tmp/m8b4 --prompt 2048 --chunk 512 --kv-ssd-dir "$SSD" > "$OUTDIR/small.txt" 2> "$OUTDIR/small.err" || rc=1
cat "$OUTDIR/small.txt"; tail -3 "$OUTDIR/small.err"
[ "${SMALL_ONLY:-0}" = 1 ] && exit $rc
stamp "mkmodel llama3-8b bf16"
[ -d /tmp/m8b ] || build-gpu/strata mkmodel --config llama3-8b --dtype bf16 /tmp/m8b > "$OUTDIR/mk.log" 2>&1 || { tail "$OUTDIR/mk.log"; exit 1; }
stamp "bench-kv llama3-8b, $PROMPT tokens"
rm -rf "$SSD"
build-gpu/strata bench-kv /tmp/m8b --prompt "$PROMPT" --kv-ssd-dir "$SSD" ${SERVE:+--serve} > "$OUTDIR/8b.txt" 2> "$OUTDIR/8b.err" || rc=1
cat "$OUTDIR/8b.txt"; tail -3 "$OUTDIR/8b.err"
stamp done
exit $rc
