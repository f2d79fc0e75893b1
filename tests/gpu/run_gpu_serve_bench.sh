#!/usr/bin/env bash
# Issue 5 serving benchmark on the GPU machine (carry .deps), from the repo root:
#   1. builds build-gpu/strata (incremental when build-gpu exists);
#   2. a Llama-3-8B-shaped bf16 model (`strata mkmodel --config llama3-8b`, 16 GB; reused
#      when $MODEL or $WORK/llama3_8b_32l_bf16 exists) with the SmolLM2 tokenizer of
#      tests/data copied in (mkmodel writes none; ids < 49152 < the model's 128256);
#   3. `strata serve --device cuda` with 64 sequence slots, a 16 GiB KV cache (64 x 1024
#      tokens of fp32 K/V), 512-token prompt chunks, 2048-token steps; the server measures
#      HBM bandwidth and the GEMM rate at start-up and publishes them in /metrics;
#   4. bench/bench_serve.py at concurrency 1, 8 and 64 (prompt 512, output 128, N = 4, 16,
#      128): throughput, TTFT p50/p99, TBT p50/p99, and the decode throughput of the
#      decode-only steps beside their roofline max(weights + KV bytes / HBM, FLOPs / GEMM
#      rate), with the fraction; a compact table at the end;
#   5. batch invariance on CUDA: 33 greedy requests together vs each alone (how many
#      differ; random weights have close logits, so this is reported, not judged), and the
#      same on the default model when $SMOLLM2 points at its GGUF (clear argmax: judged).
# PASS/FAIL lines; exit status non-zero when a check failed. DEADLINE=S (default 470)
# skips steps that would end later than S seconds after the start. PRECISE=1 adds a
# concurrency-64 run with --precise (hi+lo split bf16 operands; the bf16 model's
# default is fast prefill: bf16 operands, fp32 accumulation).
# Logs and JSON go to $OUT (or /tmp/out). For a dry run elsewhere: STRATA_BIN (no build),
# DEVICE (default cuda), MODEL, PROMPT / OUTPUT (default 512 / 128), KV_MEM (default 16G).
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -z "${STRATA_BIN:-}" ] && source scripts/device-env.sh
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
WORK=${WORK:-/tmp/strata-serve}
mkdir -p "$WORK"
DEADLINE=${DEADLINE:-470}
BIN=${STRATA_BIN:-build-gpu/strata}
DEVICE=${DEVICE:-cuda}
PROMPT=${PROMPT:-512}
OUTPUT=${OUTPUT:-128}
rc=0
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
have_time() { # seconds the next step needs
  if [ $(( $(date +%s) - t0 + $1 )) -gt "$DEADLINE" ]; then stamp "SKIP  no time left ($2)"; return 1; fi
}
pass() { echo "PASS  $*"; }
fail() { echo "FAIL  $*"; rc=1; }

if [ -z "${STRATA_BIN:-}" ]; then
  stamp "build"
  if [ ! -f build-gpu/CMakeCache.txt ]; then
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > "$OUTDIR/serve_cfg.log" 2>&1 ||
      { cat "$OUTDIR/serve_cfg.log"; exit 2; }
  fi
  cmake --build build-gpu -j "$(nproc)" --target strata > "$OUTDIR/serve_build.log" 2>&1 ||
    { tail -40 "$OUTDIR/serve_build.log"; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

M=${MODEL:-$WORK/llama3_8b_32l_bf16}
[ -f "$M/config.json" ] || { [ -f /tmp/strata-gpu/llama3_8b_32l_bf16/config.json ] && M=/tmp/strata-gpu/llama3_8b_32l_bf16; }
if [ ! -f "$M/config.json" ]; then
  stamp "mkmodel llama3-8b (32 layers, bf16) -> $M"
  timeout 240 "$BIN" mkmodel --config llama3-8b --dtype bf16 "$M" || { rm -rf "$M"; fail "mkmodel"; exit 1; }
fi
cp -n tests/data/tokenizer/smollm2/tokenizer.json tests/data/tokenizer/smollm2/tokenizer_config.json "$M/"
du -sh "$M"

SRV=""
PORT=""
start_server() { # tag model args...
  local tag=$1 model=$2
  shift 2
  stamp "serve $tag: $*"
  "$BIN" serve "$model" --device "$DEVICE" --port 0 "$@" > "$OUTDIR/serve_$tag.out" 2> "$OUTDIR/serve_$tag.log" &
  SRV=$!
  PORT=""
  for _ in $(seq 1 360); do
    PORT=$(sed -n 's/^listening on http:\/\/127\.0\.0\.1:\([0-9]*\)$/\1/p' "$OUTDIR/serve_$tag.out")
    [ -n "$PORT" ] && break
    kill -0 "$SRV" 2> /dev/null || break
    sleep 0.5
  done
  grep -E "rooflines|ready in|WARN|error" "$OUTDIR/serve_$tag.log"
  if [ -z "$PORT" ]; then
    tail -20 "$OUTDIR/serve_$tag.log"
    fail "serve $tag did not start"
    kill "$SRV" 2> /dev/null; wait "$SRV" 2> /dev/null
    SRV=""
    return 1
  fi
  pass "serve $tag listening on port $PORT ($(grep -o 'ready in [0-9.]* s' "$OUTDIR/serve_$tag.log"))"
}
stop_server() {
  [ -n "$SRV" ] || return
  kill -TERM "$SRV" 2> /dev/null
  local src=0
  timeout 60 tail --pid="$SRV" -f /dev/null || { kill -KILL "$SRV" 2> /dev/null; src=1; }
  wait "$SRV" 2> /dev/null || src=$?
  [ "$src" = 0 ] && pass "server stopped cleanly" || fail "server exit status $src"
  SRV=""
}
trap 'if [ -n "$SRV" ]; then kill -KILL "$SRV" 2> /dev/null; fi' EXIT

bench() { # tag concurrency n
  local tag=$1 c=$2 n=$3
  have_time 90 "bench $tag" || return 1
  stamp "bench_serve $tag: concurrency $c, $n requests, prompt $PROMPT, output $OUTPUT"
  if timeout 150 python3 bench/bench_serve.py --url "http://127.0.0.1:$PORT" -n "$n" -c "$c" --prompt-len "$PROMPT" \
      --output-len "$OUTPUT" --metrics --json "$OUTDIR/bench_$tag.json" 2>&1 | tee "$OUTDIR/bench_$tag.log"; then
    pass "bench $tag: $n requests, no errors"
  else
    fail "bench $tag"
    return 1
  fi
}

SERVE_ARGS=(--max-batch 64 --max-model-len 1024 --prefill-chunk 512 --step-tokens 2048 --kv-mem "${KV_MEM:-16G}"
            --model-name llama3-8b-shape)
TAGS=""
if have_time 120 "8B server" && start_server 8b "$M" "${SERVE_ARGS[@]}"; then
  bench c1 1 4 && TAGS="$TAGS c1"
  bench c8 8 16 && TAGS="$TAGS c8"
  bench c64 64 128 && TAGS="$TAGS c64"
  if have_time 90 "invariance (8B)"; then
    stamp "batch invariance on the 8B-shaped model (random weights: reported, not judged)"
    timeout 150 python3 bench/bench_serve.py --url "http://127.0.0.1:$PORT" --invariance 33 --prompt-len 256 \
      --output-len 32 --max-differ 33 --json "$OUTDIR/invariance_8b.json" 2>&1 | tee "$OUTDIR/invariance_8b.log" ||
      fail "invariance run (8B) had errors"
  fi
  stop_server
fi
if [ "${PRECISE:-0}" = 1 ] && have_time 150 "precise run" &&
   start_server 8b_precise "$M" "${SERVE_ARGS[@]}" --precise; then
  bench c64_precise 64 128 && TAGS="$TAGS c64_precise"
  stop_server
fi

if [ -n "${SMOLLM2:-}" ] && [ -f "$SMOLLM2" ] && have_time 90 "invariance (SmolLM2)"; then
  if start_server smol "$SMOLLM2" --max-batch 64 --max-model-len 1024 --kv-mem 3G; then
    stamp "batch invariance on the default model (clear argmax)"
    if timeout 150 python3 bench/bench_serve.py --url "http://127.0.0.1:$PORT" --invariance 33 --prompt-len 256 \
        --output-len 64 --json "$OUTDIR/invariance_smol.json" 2>&1 | tee "$OUTDIR/invariance_smol.log"; then
      pass "SmolLM2 on CUDA: 33 greedy requests together give the texts they give alone"
    else
      fail "SmolLM2 on CUDA: batch invariance (see above)"
    fi
    stop_server
  fi
else
  stamp "SKIP  SmolLM2 invariance (\$SMOLLM2 not set or no time)"
fi

stamp "summary"
python3 - "$OUTDIR" $TAGS <<'PY' || rc=1
import json, os, sys
out, tags = sys.argv[1], sys.argv[2:]
bad = 0
print("%-9s %5s %5s %9s %17s %17s %10s %6s %8s %10s %7s" % ("run", "conc", "reqs", "out tok/s", "TTFT p50/p99 ms",
      "TBT p50/p99 ms", "decode/s", "batch", "ctx", "roofline/s", "frac"))
for t in tags:
    r = json.load(open(os.path.join(out, "bench_%s.json" % t)))
    d = r.get("decode") or {}
    roof = d.get("roofline_tok_s")
    print("%-9s %5d %5d %9.1f %8.1f/%8.1f %8.2f/%8.2f %10.1f %6.1f %8.0f %10s %7s" % (
        t, r["concurrency"], r["requests"], r["output_tok_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"],
        r["tbt_ms"]["p50"], r["tbt_ms"]["p99"], d.get("tok_s") or 0, d.get("mean_batch") or 0,
        d.get("mean_context") or 0, "%.1f" % roof if roof else "-",
        "%.1f%%" % (100 * d["fraction"]) if d.get("fraction") else "-"))
    if r["errors"] or r["ok"] != r["requests"]:
        bad += 1
    if t.startswith("c64"):
        s = r.get("server") or {}
        if not roof:
            print("FAIL  %s: no roofline (the server published no rates?)" % t)
            bad += 1
        else:
            print("PASS  %s: decode %.1f tok/s in decode-only steps (mean batch %.1f) = %.1f%% of the roofline "
                  "%.1f tok/s (%s-bound: HBM %.0f GB/s, GEMM %.0f TFLOP/s)" % (
                      t, d["tok_s"], d["mean_batch"], 100 * d["fraction"], roof, d["bound"],
                      (d["mem_bw"] or 0) / 1e9, (d["gemm_rate"] or 0) / 1e12))
        if s.get("preemptions"):
            print("WARN  %s: %d preemptions (KV cache too small for the batch)" % (t, s["preemptions"]))
for name in ("8b", "smol"):
    p = os.path.join(out, "invariance_%s.json" % name)
    if os.path.exists(p):
        v = json.load(open(p))
        print("INFO  invariance %s: %d of %d greedy requests differ together vs alone (%d errors)" % (
            name, v["differ"], v["requests"], v["errors"]))
sys.exit(1 if bad else 0)
PY
stamp "done (exit $rc)"
exit $rc
