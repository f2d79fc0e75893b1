#!/usr/bin/env bash
# Issue 4 on the GPU machine, one call (carry .deps):
#   0. build (incremental when build-gpu exists);
#   1. correctness: tests/test_streaming_cli.py on CUDA (every placement mix of
#      the reference models within a small --device-mem: logits bit-identical
#      to the resident run; bench bytes per step equal to the plan's);
#   2. a Llama-3-70B-shaped bf16 model with LAYERS layers (default 20 of 80,
#      ~38 GB; reused when already at $WORK) with --device-mem 16G:
#        a. weights beyond the device in pinned DRAM (--host-mem 100G): decode
#           step vs its PCIe bound, prefill of 2048 tokens vs max(PCIe, compute),
#           then decode of 1, 8 and 32 sequences at once (--seqs 1,8,32);
#        b. part of the weights from the SSD (--host-mem $SSD_HOST_MEM, 12G):
#           decode step vs its SSD bound, SSD bytes per step vs the plan;
#   3. (HF=1) the baseline a user would try: transformers + accelerate,
#      device_map="auto" with a 16 GiB GPU cap, same model, a few decode steps.
# Prints PASS/FAIL lines, then a summary to paste into bench/RESULTS.md.
# DEADLINE=S (default 560) skips a step that would end later than S seconds
# after the start (each step's time is a generous guess); SKIP_CLI=1,
# SKIP_BENCH=1 skip steps 1 and 2. Logs go to $OUT (or /tmp/out). Exit status
# non-zero when a check failed. STRATA_BIN skips the build (dry runs).
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .deps ] && source scripts/device-env.sh
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
WORK=${WORK:-/tmp/strata-stream}; mkdir -p "$WORK"
LAYERS=${LAYERS:-20}
DEADLINE=${DEADLINE:-560}
SSD_HOST_MEM=${SSD_HOST_MEM:-12G}
M=$WORK/llama3_70b_${LAYERS}l_bf16
BIN=${STRATA_BIN:-build-gpu/strata}
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
free -g | head -2; df -h "$WORK" | tail -1

# 1. correctness on CUDA
if [ "${SKIP_CLI:-0}" != 1 ] && have_time "${T_CLI:-240}" "test_streaming_cli.py on CUDA"; then
  stamp "test_streaming_cli.py on CUDA"
  STRATA_DEVICE=cuda STRATA_BIN="$BIN" timeout "${T_CLI:-240}" python3 tests/test_streaming_cli.py \
    > "$OUTDIR/streaming_cli_cuda.log" 2>&1
  r=$?
  grep -E "^FAIL|ok:|checks" "$OUTDIR/streaming_cli_cuda.log" | cut -c1-400
  if [ $r = 0 ]; then pass "streaming CLI on CUDA: $(tail -1 "$OUTDIR/streaming_cli_cuda.log")"
  else fail "streaming CLI on CUDA (rc $r): $(tail -1 "$OUTDIR/streaming_cli_cuda.log")"; fi
fi

# 2. the 70B-shaped benchmark
bench() { # log name, seconds allowed, host budget, extra args
  local name=$1 secs=$2 hm=$3; shift 3
  have_time "$secs" "bench $name" || return 0
  stamp "bench $name: --device-mem 16G --host-mem $hm $*"
  timeout "$secs" "$BIN" bench "$M" --device cuda --device-mem 16G --host-mem "$hm" --prompt 2048 "$@" \
    > "$OUTDIR/bench_$name.log" 2>&1
  local r=$?
  grep -vE "^strata: (pinning|waited)" "$OUTDIR/bench_$name.log" | cut -c1-400
  [ $r = 0 ] || fail "bench $name (rc $r)"
  # bytes per decode step measured by the counters == the plan's
  if grep -qE "^bytes +per decode step" "$OUTDIR/bench_$name.log"; then
    python3 - "$OUTDIR/bench_$name.log" "$name" <<'PY' || rc=1
import re, sys
t = open(sys.argv[1]).read()
m = re.search(r"per decode step: file ([\d.]+) \(plan (\d+)\), to the device ([\d.]+) \(plan (\d+)\)", t)
ok = m and float(m.group(1)) == float(m.group(2)) and float(m.group(3)) == float(m.group(4))
print("%s  bytes per decode step (%s): %s" % ("PASS" if ok else "FAIL", sys.argv[2], m.group(0) if m else "no line"))
sys.exit(0 if ok else 1)
PY
  fi
}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  if [ ! -f "$M/model.safetensors" ] && [ ! -f "$M/model.safetensors.index.json" ]; then
    if have_time 240 "mkmodel"; then
      stamp "mkmodel llama3-70b, $LAYERS layers, bf16 -> $M"
      rm -rf "$M"
      timeout 230 "$BIN" mkmodel --config llama3-70b --layers "$LAYERS" --dtype bf16 "$M" || { fail "mkmodel"; rm -rf "$M"; }
    fi
  else
    stamp "reusing $M"
  fi
  if [ -d "$M" ]; then
    du -sh "$M"
    if have_time 60 "plan"; then
      for hm in 100G "$SSD_HOST_MEM"; do
        timeout 60 "$BIN" plan "$M" --device cuda --device-mem 16G --host-mem "$hm" --prompt 2048 \
          > "$OUTDIR/plan_$hm.log" 2>&1 || fail "plan --host-mem $hm"
        cat "$OUTDIR/plan_$hm.log"
      done
    fi
    bench dram "${T_DRAM:-200}" 100G --gen "${GEN:-16}" --reps 1 --seqs 1,8,32 --seq-prompt 32
    bench ssd "${T_SSD:-200}" "$SSD_HOST_MEM" --gen "${GEN_SSD:-6}" --reps 1
  fi
fi

# 3. the HF baseline
if [ "${HF:-0}" = 1 ] && [ -d "$M" ] && have_time "${T_HF:-240}" "HF baseline"; then
  stamp "HF transformers + accelerate, device_map=auto, 16 GiB GPU cap"
  timeout "${T_HF:-240}" python3 - "$M" <<'PY' 2>&1 | grep -v "it/s" | tee "$OUTDIR/hf_baseline.log" || rc=1
import sys, time, torch
from transformers import AutoModelForCausalLM
m = sys.argv[1]
t = time.time()
model = AutoModelForCausalLM.from_pretrained(m, dtype=torch.bfloat16, device_map="auto",
                                             max_memory={0: "16GiB", "cpu": "100GiB"})
print("HF load %.1f s; devices: %s" % (time.time() - t, sorted(set(str(v) for v in model.hf_device_map.values()))))
ids = torch.randint(0, 1000, (1, 32), device="cuda")
with torch.no_grad():
    out = model(ids, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    steps = 3
    t = time.time()
    for _ in range(steps):
        out = model(nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    dt = (time.time() - t) / steps
print("HF decode %.3f s/token (%.2f tok/s), %d layers, peak GPU memory %.1f GiB"
      % (dt, 1 / dt, model.config.num_hidden_layers, torch.cuda.max_memory_allocated() / 2**30))
PY
fi

# summary, markdown rows for bench/RESULTS.md
stamp "summary"
python3 - "$OUTDIR" "$LAYERS" "$SSD_HOST_MEM" <<'PY'
import os, re, sys
out, layers, ssd_hm = sys.argv[1], sys.argv[2], sys.argv[3]
def read(n):
    p = os.path.join(out, n)
    return open(p).read() if os.path.exists(p) else ""
print("| figure | measured | bound (same run) | fraction |")
print("|---|---|---|---|")
for name, label in (("dram", "rest in pinned DRAM (--host-mem 100G)"), ("ssd", "part from the SSD (--host-mem %s)" % ssd_hm)):
    t = read("bench_%s.log" % name)
    if not t:
        print("| %s | not run | | |" % label)
        continue
    bw = re.search(r"^bandwidth +H2D ([\d.]+) GB/s, SSD ([\d.]+) GB/s", t, re.M)
    d = re.search(r"^bound +decode ([\d.]+) ms/token predicted \((.+?): SSD ([\d.]+) ms, PCIe ([\d.]+) ms, compute ([\d.]+) ms\), measured ([\d.]+) ms/token: (\d+)%", t, re.M)
    by = re.search(r"^bytes +per decode step: file ([\d.]+) \(plan (\d+)\), to the device ([\d.]+) \(plan (\d+)\)", t, re.M)
    pf = re.search(r"^bound +prefill of (\d+) tokens ([\d.]+) s predicted \((.+?): streaming ([\d.]+) s, compute ([\d.]+) s\), measured ([\d.]+) s: (\d+)%", t, re.M)
    w = re.search(r"^weights +(.*)$", t, re.M)
    if w:
        print("| placement, %s | %s | | |" % (label, w.group(1)))
    if d:
        print("| decode, %s | %s ms/token | %s ms (%s; SSD %s ms, PCIe %s ms; H2D %s GB/s, SSD %s GB/s) | %s%% |" % (
            label, d.group(6), d.group(1), d.group(2), d.group(3), d.group(4), bw.group(1) if bw else "?",
            bw.group(2) if bw else "?", d.group(7)))
    if by:
        print("| bytes per decode step, %s | file %.3f GB, to the device %.3f GB | plan %.3f GB, %.3f GB | %s |" % (
            label, float(by.group(1)) / 1e9, float(by.group(3)) / 1e9, int(by.group(2)) / 1e9, int(by.group(4)) / 1e9,
            "equal" if float(by.group(1)) == float(by.group(2)) and float(by.group(3)) == float(by.group(4)) else "DIFFER"))
    if pf:
        print("| prefill %s tokens, %s | %s s | %s s = max(streaming %s s, compute %s s) (%s) | %s%% |" % (
            pf.group(1), label, pf.group(6), pf.group(2), pf.group(4), pf.group(5), pf.group(3), pf.group(7)))
    for m in re.finditer(r"^decode batch +(\d+) sequences x (\d+) steps \(prompt (\d+)\): ([\d.]+) ms/step, ([\d.]+) tok/s \(([\d.]+)x batch \d+\); bound ([\d.]+) ms/step \((.+?)\): (\d+)%", t, re.M):
        print("| decode %s sequences at once, %s | %s ms/step, %s tok/s (%sx batch 1) | %s ms/step (%s) | %s%% |" % (
            m.group(1), label, m.group(4), m.group(5), m.group(6), m.group(7), m.group(8).split(":")[0], m.group(9)))
    tk = re.search(r"^decode batch tokens: .*$", t, re.M)
    if tk:
        print("| %s | | | |" % tk.group(0))
h = read("hf_baseline.log")
m = re.search(r"HF decode ([\d.]+) s/token", h)
if m:
    print("| HF transformers + accelerate, device_map=auto, 16 GiB GPU cap | %.1f ms/token | | |" % (float(m.group(1)) * 1e3))
c = read("streaming_cli_cuda.log")
m = re.search(r"(\d+) checks, \d+ passed, (\d+) failed", c)
if m:
    print("| test_streaming_cli.py on CUDA (every placement mix, logits bit-identical) | %s checks, %s failed | | |" % m.groups())
print("(model: Llama-3-70B shape, %s of 80 layers, bf16; scale the per-step bytes and times by 80/%s for the full model)" % (layers, layers))
PY
stamp "done (rc $rc)"
exit $rc
