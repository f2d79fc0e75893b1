#!/usr/bin/env bash
# Issue 16 part 1 (hybrid execution of streamed weights) on the GPU machine,
# one call (carry .deps):
#   0. build (build-gpu, incremental when it exists);
#   1. correctness: a small Llama-3-8B-shaped q4_0 model (2 layers) whose FFN
#      groups stream: logits with every streamed FFN group on the CPU tier
#      (--cpu-layers, computed by the CPU from host memory) against the
#      all-GPU resident run, as max abs / rel diff and argmax agreement, beside
#      the CPU backend's own distance to the GPU (the scale of "different
#      kernels"); prefill chunks computed on the CPU (8 tokens), streamed
#      (--cpu-max-tokens 2) and token by token (--chunk 1); the same with each
#      CPU-tier group split half and half (--cpu-split 0.5: the GPU computes
#      half of its rows from a streamed copy while the CPU computes the rest);
#   2. a Llama-3-70B-shaped q4_0 model (LAYERS layers, default all 80: 39.7 GB,
#      ~90 s to write; reused when already at $WORK) on --device-mem 16G
#      --host-mem 100G:
#        a. `strata plan` with hybrid off (--cpu-layers 0) and on (auto): the
#           three-way split, the rates measured alone and together (the copy
#           engine and the CPU share host memory) and the predicted decode step;
#        b. `strata bench` decode, hybrid off, then on (auto) (VARIANTS, default
#           "off auto"; "ringN": on with --ring-slots N, "tN": with --threads N,
#           both: "ring4t14"; "whole": on with --cpu-split 0, the CPU computing
#           whole groups; "sF": --cpu-split F): tok/s, and for hybrid the bound
#           max(PCIe bytes / H2D, CPU bytes / CPU rate) from the rates measured
#           in the same run, host memory's floor (PCIe + CPU bytes over the
#           rate both get together), and the fraction of each reached;
#        c. PEER=1: llama.cpp's llama-bench on the same file (tg GEN, pp 512,
#           flash attention, -ngl NGL (default 28, what fits 16 GB), all cores;
#           .peer carried, `bash .peer/vs-llama-cpp.sh start` run first in the
#           same machine session) and the ratio of each strata variant to it.
# Variables: VERIFY (e.g. 4,7: bench --verify, the cost of a speculative
# verification pass with the CPU tier), LAYERS (e.g. 20 for a quick try), WORK (model dir, default
# /tmp/strata-hybrid), GEN (decode steps, default 24), THREADS (CPU threads
# of the hybrid part, default: all cores), DEADLINE (seconds, default 470: a
# step that would end later is skipped), SKIP_CHECK=1 / SKIP_BENCH=1.
# Logs go to $OUT (or /tmp/out). Exit status non-zero when a check failed.
# STRATA_BIN skips the build. A dry run of the script's logic on a machine
# without a GPU: STRATA_BIN=build-cpu/strata GPU_DEVICE=cpu SMALL_CONFIG=tiny
# LAYERS=2 MARGIN=150000 DEVICE_MEM=2M (the tier is then forced on the CPU backend,
# the numbers mean nothing).
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .deps ] && source scripts/device-env.sh
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
WORK=${WORK:-/tmp/strata-hybrid}; mkdir -p "$WORK"
LAYERS=${LAYERS:-80}
GEN=${GEN:-24}
VARIANTS=${VARIANTS:-off auto}
DEADLINE=${DEADLINE:-470}
THREADS=${THREADS:-}
BIN=${STRATA_BIN:-build-gpu/strata}
GPU=${GPU_DEVICE:-cuda}
SMALL_CONFIG=${SMALL_CONFIG:-llama3-8b}
TH=(); [ -n "$THREADS" ] && TH=(--threads "$THREADS")
rc=0
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
have_time() { # seconds the step needs, what it is
  if [ $(( $(date +%s) - t0 + $1 )) -gt "$DEADLINE" ]; then stamp "SKIP  no time left ($2)"; return 1; fi
}
pass() { echo "PASS  $*"; }
fail() { echo "FAIL  $*"; rc=1; }

if [ -z "${STRATA_BIN:-}" ]; then
  stamp "build (build-gpu)"
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > "$OUTDIR/cfg.log" 2>&1 || { tail -30 "$OUTDIR/cfg.log"; exit 2; }
  cmake --build build-gpu -j "$(nproc)" --target strata > "$OUTDIR/build.log" 2>&1 || { tail -40 "$OUTDIR/build.log"; exit 2; }
fi
nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null

# 1. correctness: hybrid logits vs all-GPU
if [ "${SKIP_CHECK:-0}" != 1 ] && have_time 120 "hybrid logits check"; then
  S=$WORK/${SMALL_CONFIG}_2l_q4_0.gguf
  [ -f "$S" ] || "$BIN" mkmodel --config "$SMALL_CONFIG" --layers 2 --dtype q4_0 "$S" > "$OUTDIR/mk_small.log" 2>&1 \
    || fail "mkmodel small: $(tail -3 "$OUTDIR/mk_small.log")"
  TOK="1 50 300 77 90 12 46 33 81 27 104 6 60 5 42 7"
  # a budget that streams the FFN groups: the least the plan accepts (everything that can stream does)
  "$BIN" plan "$S" --device "$GPU" --ctx 64 --batch 8 --device-mem 1T --host-mem 8G --h2d-bw 25 --ssd-bw 3 \
    > "$OUTDIR/plan_small.log" 2>&1
  DEV=$(sed -nE 's/^minimum +device .*\(([0-9]+) bytes\).*/\1/p' "$OUTDIR/plan_small.log")
  # plus a margin (the logits command's own pool and scratch; less than an FFN group, 99 MB, so they
  # still stream). On CUDA the plan's minimum includes the backend's reserve (4.2 MB on an H100, tenth
  # session) and 25 MB keeps the FFN groups off the device: the whole 2-layer model needs 552 MB; 530 MB
  # put both FFN groups on the cpu tier there, 570 and 620 MB none (the check then fails)
  margin=67108864; [ "$GPU" = cuda ] && margin=26214400
  [ -n "$DEV" ] && DEV=$(( DEV + ${MARGIN:-$margin} ))
  DEV=${SMALL_DEVICE_MEM:-$DEV}
  if [ -z "$DEV" ]; then fail "small plan: no minimum: $(tail -3 "$OUTDIR/plan_small.log")"; else
    L() { # name, extra args (bandwidths given: the check does not depend on them)
      local n=$1; shift
      rm -f "$WORK/$n.f32"
      "$BIN" logits "$S" --tokens "$TOK" --out "$WORK/$n.f32" --ctx 64 --batch 8 --precise --h2d-bw 25 --ssd-bw 3 "$@" > "$OUTDIR/logits_$n.log" 2>&1 \
        || fail "logits $n: $(tail -3 "$OUTDIR/logits_$n.log")"
    }
    L gpu --device "$GPU"
    L cpu --device cpu
    L hyb8 --device "$GPU" --device-mem "$DEV" --host-mem 8G --cpu-layers 2 "${TH[@]}"
    L hyb2 --device "$GPU" --device-mem "$DEV" --host-mem 8G --cpu-layers 2 --cpu-max-tokens 2 "${TH[@]}"
    L hyb1 --device "$GPU" --device-mem "$DEV" --host-mem 8G --cpu-layers 2 --chunk 1 "${TH[@]}"
    L hybs8 --device "$GPU" --device-mem "$DEV" --host-mem 8G --cpu-layers 2 --cpu-split 0.5 "${TH[@]}"
    L hybs1 --device "$GPU" --device-mem "$DEV" --host-mem 8G --cpu-layers 2 --cpu-split 0.5 --chunk 1 "${TH[@]}"
    L str --device "$GPU" --device-mem "$DEV" --host-mem 8G --cpu-layers 0
    "$BIN" plan "$S" --device "$GPU" --ctx 64 --batch 8 --device-mem "$DEV" --host-mem 8G --cpu-layers 2 --h2d-bw 25 --ssd-bw 3 \
      > "$OUTDIR/plan_small_hyb.log" 2>&1
    grep -E "^(device|minimum) |^ +(device|host|ssd|cpu) " "$OUTDIR/plan_small_hyb.log" | sed 's/^/  small plan: /'
    # the check means something only when the FFN groups are on the cpu tier
    ncpu=$(sed -nE 's/^ +cpu +([0-9]+) .*/\1/p' "$OUTDIR/plan_small_hyb.log")
    [ "${ncpu:-0}" -ge 1 ] || fail "small plan at --device-mem $DEV puts no FFN group on the cpu tier (${ncpu:-?}): give SMALL_DEVICE_MEM"
    python3 - "$WORK" <<'PY' || rc=1
import array, sys, os
w = sys.argv[1]
def load(n):
    a = array.array("f"); p = os.path.join(w, n + ".f32")
    with open(p, "rb") as f: a.frombytes(f.read())
    return a
ref = load("gpu"); T = 16; V = len(ref) // T
def diff(n):
    try: x = load(n)
    except OSError: return None
    if len(x) != len(ref): return None
    mabs = max(abs(a - b) for a, b in zip(x, ref)); scale = max(abs(b) for b in ref)
    agree = sum(1 for t in range(T) if max(range(V), key=lambda i: x[t*V+i]) == max(range(V), key=lambda i: ref[t*V+i]))
    return mabs, mabs / scale, agree
base = diff("cpu"); ok = True
print("  reference: all-GPU resident logits [%d tokens x %d]" % (T, V))
for n, what in (("cpu", "CPU backend alone (the scale of different kernels)"), ("str", "streamed, hybrid off"),
                ("hyb8", "FFN on the CPU tier, prefill chunks of 8 on the CPU"),
                ("hyb2", "FFN on the CPU tier, prefill chunks streamed (--cpu-max-tokens 2)"),
                ("hyb1", "FFN on the CPU tier, token by token"),
                ("hybs8", "FFN on the CPU tier split half and half (GPU rows streamed), chunks of 8"),
                ("hybs1", "FFN on the CPU tier split half and half, token by token")):
    d = diff(n)
    if d is None: print("FAIL  %s: missing or of the wrong size" % n); ok = False; continue
    print("  %-5s max abs diff %.3e, max rel diff %.3e (of max |logit|), argmax agrees %d/%d  (%s)" % (n, d[0], d[1], d[2], T, what))
    if n.startswith("hyb"):
        # hyb8 / hyb1 compute on the CPU: not bit-identical to the all-GPU run (else the CPU computed
        # nothing); hyb2's chunks of 8 exceed --cpu-max-tokens 2: streamed, bit-identical
        good = (d[1] == 0 if n == "hyb2" else 0 < d[1] <= max(2 * base[1], 1e-3)) and d[2] >= min(base[2], T - 1)
        print("%s  hybrid logits %s within tolerance (hyb2: rel == 0, streamed; else 0 < rel <= max(2 x CPU-vs-GPU %.2e, 1e-3); argmax >= %d/%d)" % ("PASS" if good else "FAIL", n, base[1], min(base[2], T - 1), T))
        ok = ok and good
sys.exit(0 if ok else 1)
PY
  fi
fi

# 2. the 70B-shaped model
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  M=$WORK/l70_${LAYERS}l_q4_0.gguf
  if [ ! -f "$M" ] && have_time 150 "mkmodel 70B q4_0 ($LAYERS layers)"; then
    stamp "mkmodel --config ${BIG_CONFIG:-llama3-70b} --layers $LAYERS --dtype q4_0"
    "$BIN" mkmodel --config "${BIG_CONFIG:-llama3-70b}" --layers "$LAYERS" --dtype q4_0 "$M" > "$OUTDIR/mk70.log" 2>&1 \
      || { fail "mkmodel 70B: $(tail -3 "$OUTDIR/mk70.log")"; rm -f "$M"; }
    tail -1 "$OUTDIR/mk70.log"
  fi
  if [ -f "$M" ]; then
    BUD=(--device "$GPU" --device-mem "${DEVICE_MEM:-16G}" --host-mem "${HOST_MEM:-100G}")
    for h in off auto; do
      cl=0; [ $h = auto ] && cl=auto
      stamp "plan, hybrid $h"
      "$BIN" plan "$M" "${BUD[@]}" --cpu-layers $cl "${TH[@]}" > "$OUTDIR/plan70_$h.log" 2>&1 || fail "plan $h"
      grep -E "^(bandwidth|cpu|shared|host|host mem|decode|split) |^ +(device|host|ssd|cpu|total) " "$OUTDIR/plan70_$h.log" | cut -c1-300
    done
    declare -A TOKS
    if [ "${PEER:-0}" = 1 ]; then # llama.cpp's build (13 jobs) would share the cores with the CPU tier's timings
      stamp "llama.cpp: waiting for its build before the benches"
      while [ ! -f /tmp/peer/build.rc ] && have_time 300 "llama.cpp build"; do sleep 5; done
    fi
    for v in $VARIANTS; do
      have_time 150 "bench $v" || continue
      extra=(--cpu-layers 0); [ $v != off ] && extra=(--cpu-layers auto "${TH[@]}")
      [ $v = whole ] && extra+=(--cpu-split 0)
      [[ $v =~ ^s([0-9.]+)$ ]] && extra+=(--cpu-split "${BASH_REMATCH[1]}")
      # ringN: --ring-slots N; tN: --threads N (the CPU tier's threads); e.g. ring4t14
      [[ $v =~ ring([0-9]+) ]] && extra+=(--ring-slots "${BASH_REMATCH[1]}")
      [[ $v =~ t([0-9]+)$ ]] && extra+=(--threads "${BASH_REMATCH[1]}")
      stamp "bench decode, hybrid $v: ${BUD[*]} ${extra[*]}"
      [ -n "${VERIFY:-}" ] && extra+=(--verify "$VERIFY")
      timeout 300 "$BIN" bench "$M" "${BUD[@]}" --prompt 32 --gen "$GEN" --reps 1 "${extra[@]}" > "$OUTDIR/bench70_$v.log" 2>&1 \
        || fail "bench $v (rc $?): $(tail -3 "$OUTDIR/bench70_$v.log")"
      grep -E "^(decode|weights|hybrid|bound|bandwidth|streaming|verify|plan) " "$OUTDIR/bench70_$v.log" | cut -c1-400
      TOKS[$v]=$(sed -nE 's/^decode +[0-9]+ tokens in .* s: ([0-9.]+) tok\/s.*/\1/p' "$OUTDIR/bench70_$v.log" | head -1)
    done
    echo
    echo "== summary (LAYERS=$LAYERS, ${BUD[*]}, $(nproc) cores) =="
    for v in $VARIANTS; do
      [ -n "${TOKS[$v]:-}" ] || continue
      f=$(sed -nE 's/^bound +hybrid .* = ([0-9.]+) ms\/token, measured ([0-9.]+) ms\/token: ([0-9]+)% of it/bound \1 ms, measured \2 ms: \3% of the bound/p' "$OUTDIR/bench70_$v.log")
      hm=$(sed -nE 's/^bound +host memory: .* = ([0-9.]+) ms\/token; max with the above ([0-9.]+) ms\/token, measured [0-9.]+ ms\/token: ([0-9]+)% of it/host-memory floor \1 ms, max of both \2 ms: \3%/p' "$OUTDIR/bench70_$v.log")
      echo "decode hybrid $v: ${TOKS[$v]} tok/s ${f:+($f)} ${hm:+($hm)}"
    done
    if [ -n "${TOKS[off]:-}" ] && [ -n "${TOKS[auto]:-}" ]; then
      python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print('hybrid / off: %.2fx' % (b/a))" "${TOKS[off]}" "${TOKS[auto]}"
    fi
    if [ "${PEER:-0}" = 1 ] && have_time 240 "llama.cpp on the same file"; then
      P=/tmp/peer/llama.cpp/build/bin
      stamp "llama.cpp: waiting for its build"
      while [ ! -f /tmp/peer/build.rc ] && have_time 200 "llama.cpp build"; do sleep 10; done
      if [ "$(cat /tmp/peer/build.rc 2>/dev/null)" = 0 ]; then
        python3 .peer/gguf_novocab.py "$M" "$M" > "$OUTDIR/novocab.log" 2>&1 || fail "gguf_novocab: $(tail -2 "$OUTDIR/novocab.log")"
        stamp "llama-bench -ngl ${NGL:-28} -fa 1 -p 512 -n $GEN -t $(nproc)"
        timeout 400 $P/llama-bench -m "$M" -ngl "${NGL:-28}" -t "$(nproc)" -fa 1 -p 512 -n "$GEN" -r 2 > "$OUTDIR/llama70.log" 2>&1 \
          || fail "llama-bench: $(tail -3 "$OUTDIR/llama70.log")"
        grep -E "^\||rror|CUDA" "$OUTDIR/llama70.log" | head -12
        LT=$(sed -nE 's/^\|.* tg[0-9]+ *\| *([0-9.]+) ± .*/\1/p' "$OUTDIR/llama70.log" | head -1)
        if [ -n "$LT" ]; then
          for v in $VARIANTS; do
            [ -n "${TOKS[$v]:-}" ] && python3 -c "import sys; print('strata %s %s tok/s / llama.cpp -ngl %s %s tok/s = %.2fx' % (sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[2]) / float(sys.argv[4])))" "$v" "${TOKS[$v]}" "${NGL:-28}" "$LT"
          done
        fi
      else
        fail "llama.cpp is not built: $(tail -3 /tmp/peer/build.log 2>/dev/null)"
      fi
    fi
  fi
fi
stamp "done (rc $rc)"
exit $rc
