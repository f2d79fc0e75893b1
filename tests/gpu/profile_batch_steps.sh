#!/usr/bin/env bash
# On the GPU machine: GPU kernel time of batched decode steps alone. Profiles
# `strata bench --seqs $PB` on a $PLAYERS-layer Llama-3-8B-shaped model twice
# with Nsight Compute, with --gen 2 and --gen $GEN, and prints per kernel the
# difference divided by the extra steps: the kernels of one decode step of
# $PB sequences (prefill and set-up cancel out). Compare the sum with the
# wall time per step that `strata bench --seqs` prints. DTYPE=bf16|q8_0|q4_0
# (default bf16) picks the weights' type.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh > /dev/null 2>&1
OUTDIR=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/strata-gpu}
mkdir -p "$OUTDIR" "$WORK"
cmake --build build-gpu -j "$(nproc)" --target strata > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 2; }
L=${PLAYERS:-2} PB=${PB:-64} GEN=${GEN:-6} SP=${SEQ_PROMPT:-512}
D=${DTYPE:-bf16}
mp=$WORK/llama3_8b_${L}l_$D
[ "$D" = bf16 ] || mp=$mp.gguf
[ -e "$mp" ] || build-gpu/strata mkmodel --config llama3-8b --layers "$L" --dtype "$D" "$mp" > /dev/null || exit 1
pre=$OUTDIR/ncu_steps_${D}_${PB}_
for g in 2 "$GEN"; do
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    build-gpu/strata bench "$mp" --device cuda --prompt 16 --gen "$g" --reps 1 --seqs "$PB" --seq-prompt "$SP" \
    > "$pre$g.csv" 2> "$pre$g.err" || echo "ncu failed (gen $g)"
  grep "decode batch" "$pre$g.csv" | head -2
done
python3 - "${pre}2.csv" "$pre$GEN.csv" "$(( GEN - 2 ))" "$L" <<'PY'
import csv, re, sys, collections
def load(p):
    d = collections.defaultdict(float); c = collections.Counter()
    rows = [l for l in open(p) if l.startswith('"')]
    for r in csv.DictReader(rows):
        if r.get("Metric Name") != "gpu__time_duration.sum": continue
        k = re.sub(r"\(.*", "", r["Kernel Name"]).replace("void ", "")[:70]
        v = float(r["Metric Value"].replace(",", "")); u = r.get("Metric Unit", "ns")
        v *= {"ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}.get(u, 1e-3)
        d[k] += v; c[k] += 1
    return d, c
a, ca = load(sys.argv[1]); b, cb = load(sys.argv[2]); steps = int(sys.argv[3]); L = int(sys.argv[4])
diff = {k: (b[k] - a.get(k, 0)) / steps for k in b}
tot = sum(v for v in diff.values() if v > 0)
print("kernels of one decode step (%d layers), us: total %.1f" % (L, tot))
for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:18]:
    if v <= 0.5: break
    print("%9.1f  %5.1f%%  %5.1f/step  %s" % (v, 100 * v / tot, (cb[k] - ca.get(k, 0)) / steps, k))
PY
