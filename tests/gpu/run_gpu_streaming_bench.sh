#!/usr/bin/env bash
# Issue 4 benchmark on the GPU machine (carry .deps): a Llama-3-70B-shaped bf16
# model with LAYERS layers (default 20 of 80) generated here by `strata mkmodel`,
# run with a 16 GiB device budget:
#   1. strata plan for the budgets below;
#   2. weights beyond the device budget in pinned DRAM (--host-mem 100G): decode
#      step vs non-resident bytes / H2D measured in the same run; prefill 2048;
#   3. a smaller host budget so part of the weights come from the SSD (O_DIRECT);
#   4. (HF=1) the baseline a user would try: transformers + accelerate,
#      device_map="auto" with a 16 GiB GPU cap, same model, a few decode steps.
# Logs go to $OUT. Exit status non-zero when a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
WORK=${WORK:-/tmp/strata-stream}; mkdir -p "$WORK"
LAYERS=${LAYERS:-20}
M=$WORK/llama3_70b_${LAYERS}l_bf16
rc=0
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "build"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > /tmp/cfg.log 2>&1 || { cat /tmp/cfg.log; exit 2; }
cmake --build build-gpu -j "$(nproc)" --target strata > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 2; }
free -g | head -2; df -h /tmp | tail -1

stamp "mkmodel llama3-70b, $LAYERS layers, bf16"
[ -d "$M" ] || timeout 200 build-gpu/strata mkmodel --config llama3-70b --layers "$LAYERS" --dtype bf16 "$M" || exit 2
du -sh "$M"

for hm in 100G ${SSD_HOST_MEM:-12G}; do
  stamp "plan --device-mem 16G --host-mem $hm"
  timeout 60 build-gpu/strata plan "$M" --device cuda --device-mem 16G --host-mem "$hm" --prompt 2048 2>&1 |
    tee "$OUTDIR/plan_$hm.log" || rc=1
  stamp "bench --device-mem 16G --host-mem $hm"
  timeout "${T_BENCH:-200}" build-gpu/strata bench "$M" --device cuda --device-mem 16G --host-mem "$hm" \
    --prompt 2048 --gen "${GEN:-16}" --reps 1 2>&1 | tee "$OUTDIR/bench_$hm.log" || rc=1
done

if [ "${HF:-0}" = 1 ]; then
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
stamp "done"
exit $rc
