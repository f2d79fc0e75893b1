#!/usr/bin/env bash
# strata and llama.cpp side by side on the CPU (issue 19's table): the same
# GGUF, the same thread count, one run of each engine per row, interleaved.
#
#   bench/cpu_vs_llama.sh MODEL.gguf LLAMA_BENCH THREADS [STRATA] [REPS] [int8]
#
# LLAMA_BENCH: a CPU-only build of llama.cpp's llama-bench (not part of this
# repository). STRATA: the strata binary (default build-cpu/strata). REPS:
# llama-bench repetitions and strata prefill repetitions (default 3).
# STRATA_OPTS: "int8" runs strata with --cpu-act int8 (default: its default).
# Rows:
#   prefill 512                                strata bench --prompt 512 | llama-bench -p 512 -n 0
#   decode 32 tokens after a 64-token prompt   strata bench --prompt 64 --gen 32 | llama-bench -n 32 -d 64
#   decode 128 tokens after a 512-token prompt strata bench --prompt 512 --gen 128 | llama-bench -n 128 -d 512
# Both engines keep a 16-bit KV cache (strata bf16, llama.cpp f16). Prints
# the load before and after: on a shared machine run it under a lock
# (flock /tmp/bench.lock bench/cpu_vs_llama.sh ...) and compare only runs of
# similar load.
set -euo pipefail

if [ $# -lt 3 ]; then
    echo "usage: $0 MODEL.gguf LLAMA_BENCH THREADS [STRATA] [REPS]" >&2
    exit 2
fi
MODEL=$1 LLAMA=$2 THREADS=$3
STRATA=${4:-$(dirname "$0")/../build-cpu/strata}
REPS=${5:-3}
EXTRA=()
if [ "${6:-}" = int8 ]; then EXTRA=(--cpu-act int8); fi
for f in "$MODEL" "$LLAMA" "$STRATA"; do
    [ -e "$f" ] || { echo "$0: $f: not found" >&2; exit 2; }
done

# strata_run PROMPT GEN -> "prefill_tok_s decode_tok_s"
strata_run() {
    local out
    out=$("$STRATA" bench "$MODEL" --device cpu --threads "$THREADS" --prompt "$1" --gen "$2" --reps "$REPS" "${EXTRA[@]}" 2>&1) || {
        echo "$out" >&2
        echo "$0: strata bench failed" >&2
        exit 1
    }
    echo "$out" | grep -E '^(memory read|roofline)' >&2
    echo "$out" | awk '/^prefill /{for(i=1;i<=NF;i++) if($i=="tok/s") p=$(i-1)}
                       /^decode /{for(i=1;i<=NF;i++) if($i=="tok/s,") d=$(i-1)}
                       END{print p, d}'
}

# llama_run ARGS... -> the mean tok/s of the one test
llama_run() {
    local out
    out=$("$LLAMA" -m "$MODEL" -t "$THREADS" -r "$REPS" -o csv "$@" 2>/dev/null) || {
        echo "$0: llama-bench $* failed" >&2
        exit 1
    }
    echo "$out" | python3 -c '
import csv, sys
rows = list(csv.DictReader(sys.stdin))
print(rows[-1]["avg_ts"])'
}

echo "model   $MODEL"
echo "strata  ${EXTRA[*]:-(default options)}"
echo "threads $THREADS; load before: $(cut -d" " -f1-3 /proc/loadavg)"
read -r _ s_dec64 < <(strata_run 64 32)
l_dec64=$(llama_run -p 0 -n 32 -d 64)
read -r s_pre512 s_dec512 < <(strata_run 512 128)
l_pre512=$(llama_run -p 512 -n 0)
l_dec512=$(llama_run -p 0 -n 128 -d 512)
echo "load after: $(cut -d" " -f1-3 /proc/loadavg)"
echo
printf '| tok/s | strata | llama.cpp | ratio |\n|---|---|---|---|\n'
row() { awk -v n="$1" -v s="$2" -v l="$3" 'BEGIN { printf "| %s | %.1f | %.1f | %.2f |\n", n, s, l, s / l }'; }
row "prefill 512" "$s_pre512" "$l_pre512"
row "decode, 32 tokens after a 64-token prompt" "$s_dec64" "$l_dec64"
row "decode, 128 tokens after a 512-token prompt" "$s_dec512" "$l_dec512"
