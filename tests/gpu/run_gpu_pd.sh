#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU (issue #14's benchmark), from the repo
# root with .deps carried (scripts/device-debs.sh):
#   1. builds strata, test_pd_xfer and test_pd_engine (CUDA build) and runs both
#      (UCX on this machine; the engine's P-D bit for bit on the CPU backend);
#   2. a Llama-3-8B-shaped bf16 model (mkmodel, with the SmolLM2 tokenizer copied in);
#   3. correctness on CUDA: 8 greedy requests through router + prefill + decode (both
#      processes on this GPU) against a single server: texts compared (reported);
#   4. the copy bandwidth host -> host measured now, for the transfer rate's fraction, and
#      the transport alone between two processes (bench_pd_xfer, beside memcpy);
#   5. bench/pd_bench.py against a single server, then against the router with a
#      prefill and a decode process sharing the GPU: decode TBT p50/p99 of $STREAMS
#      streams idle and while $LONG_COUNT prompts of $LONG tokens arrive, the ratio,
#      the long prompts' TTFT, the KV moved and its rate.
# Configurations ($CONFIGS), each under the same load at every long-prompt spacing of
# $RATES (seconds):
#   single   one server;
#   pd_host  router + prefill + decode, the KV through host memory (Debian's UCX: device ->
#            pinned host -> UCX -> host tier -> device);
#   pd_d2d   the same with the UCX of PyPI's libucx-cu12 (.deps/ucx-cu12.tar.xz): the prefill
#            node sends from GPU memory, the decode node lands it in GPU memory
#            (--pd-landing-mem), UCX moving it GPU to GPU;
#   indep    (TWO_GPU=1) two independent servers behind `strata router` without prefill nodes.
# TWO_GPU=1 (a machine with two GPUs): prefill (or the first server) on GPU 0, decode (or the
# second server) on GPU 1 (CUDA_VISIBLE_DEVICES), the single server on GPU 0; the GPU 0 ->
# GPU 1 copy bandwidth is measured too (PyTorch). At the end: goodput, the fastest long-prompt
# rate whose decode TBT p99 stays within TBT_TARGET_X x the single server's idle p99.
# Logs: $OUT (default /tmp/pd).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device-env.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pd}
mkdir -p "$OUT"
STREAMS=${STREAMS:-8}
LONG=${LONG:-8000}
LONG_COUNT=${LONG_COUNT:-6}
DECODE_LEN=${DECODE_LEN:-256}
RATES=${RATES:-2.0}
CONFIGS=${CONFIGS:-single pd_host pd_d2d indep}
TBT_TARGET_X=${TBT_TARGET_X:-3}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
rc=0
stamp build
(cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSTRATA_TESTING=ON > "$OUT/cfg.log" 2>&1 &&
  cmake --build build-gpu -j 16 --target strata test_pd_xfer test_pd_engine bench_pd_xfer > "$OUT/build.log" 2>&1) ||
  { tail -30 "$OUT/cfg.log" "$OUT/build.log"; exit 1; }
stamp "test_pd_xfer, test_pd_engine"
STRATA_SRC=$PWD build-gpu/test_pd_xfer > "$OUT/xfer.txt" 2>&1 || rc=1
tail -2 "$OUT/xfer.txt"
if [ -n "${STRATA_UCX_CUDA_LIB:-}" ]; then
  stamp "test_pd_xfer with the CUDA UCX; its transports"
  LD_LIBRARY_PATH=$STRATA_UCX_CUDA_LIB:$LD_LIBRARY_PATH STRATA_SRC=$PWD build-gpu/test_pd_xfer > "$OUT/xfer_cuda.txt" 2>&1 || rc=1
  tail -1 "$OUT/xfer_cuda.txt"
  LD_LIBRARY_PATH=$STRATA_UCX_CUDA_LIB:$LD_LIBRARY_PATH /tmp/ucx-cu12/ucx_info -v | head -2
  LD_LIBRARY_PATH=$STRATA_UCX_CUDA_LIB:$LD_LIBRARY_PATH /tmp/ucx-cu12/ucx_info -d | grep -E "Transport:" | sort | uniq -c | tr '\n' ' '; echo
fi
STRATA_SRC=$PWD build-gpu/test_pd_engine > "$OUT/engine.txt" 2>&1 || rc=1
tail -1 "$OUT/engine.txt"

M=/tmp/m8b
if [ ! -f $M/config.json ]; then
  stamp "mkmodel llama3-8b bf16"
  build-gpu/strata mkmodel --config llama3-8b --dtype bf16 $M > "$OUT/mk.log" 2>&1 || { tail "$OUT/mk.log"; exit 1; }
fi
cp -n tests/data/tokenizer/smollm2/tokenizer.json tests/data/tokenizer/smollm2/tokenizer_config.json "$M/"

PIDS=()
TAGS=()
start() { # tag args... -> PORT
  local tag=$1
  shift
  build-gpu/strata "$@" --port 0 > "$OUT/$tag.out" 2> "$OUT/$tag.log" &
  PIDS+=($!)
  TAGS+=("$tag")
  PORT=""
  for _ in $(seq 1 240); do
    PORT=$(sed -n 's/^listening on http:\/\/127\.0\.0\.1:\([0-9]*\)$/\1/p' "$OUT/$tag.out")
    [ -n "$PORT" ] && break
    sleep 0.5
  done
  [ -n "$PORT" ] || { echo "FAIL $tag did not start"; tail -20 "$OUT/$tag.log"; }
}
stop_all() { # SIGTERM to every process; a non-zero exit is reported (and fails the run)
  local i
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2> /dev/null; done
  for i in "${!PIDS[@]}"; do
    wait "${PIDS[$i]}" 2> /dev/null
    local r=$?
    [ $r -ne 0 ] && { echo "FAIL ${TAGS[$i]:-process} exited $r on SIGTERM"; tail -5 "$OUT/${TAGS[$i]}.log" 2> /dev/null; rc=1; }
  done
  PIDS=()
  TAGS=()
}
trap stop_all EXIT
COMMON=(--device cuda --max-model-len 8192 --max-batch 16 --model-name m)

stamp "copy bandwidth (host -> host, 1 GiB)"
LINK=$(python3 -c "
import time
a = bytearray(1 << 30); b = bytearray(1 << 30); mv = memoryview(b)
best = 0
for _ in range(3):
    t = time.time(); mv[:] = a; dt = time.time() - t; best = max(best, len(a) / dt / 1e9)
print('%.2f' % best)")
echo "host memcpy: $LINK GB/s"
stamp "the transport alone: bench_pd_xfer (two processes, 32 layer messages of 100 blocks x 64 KiB)"
timeout -s KILL 60 build-gpu/bench_pd_xfer 32 100 65536 4 | tail -1

gpu() { [ "${TWO_GPU:-0}" = 1 ] && echo "$1" || echo 0; }
bench_rates() { # label url [pd_bench args...]
  local label=$1 url=$2
  shift 2
  local seed=0
  for ev in $RATES; do # a seed per rate: every run's prompts are new to the servers (no prefix-cache hits)
    seed=$((seed + 1))
    python3 bench/pd_bench.py --url "$url" --streams $STREAMS --decode-len $DECODE_LEN --long-prompt $LONG \
      --long-count $LONG_COUNT --long-every "$ev" --seed $seed --label "$label@$ev" --json "$OUT/$label@$ev.json" "$@" || rc=1
  done
}
greedy() { # port -> the 8 greedy texts as JSON (null where a request failed)
  python3 - "$1" << 'PY'
import http.client, json, sys
port = int(sys.argv[1]); out = []
for i in range(8):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": "Story %d: " % i + "the river and the mill " * (40 + 30 * i), "max_tokens": 16, "temperature": 0}
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse(); got = json.loads(r.read())
    out.append(got["choices"][0]["text"] if r.status == 200 else None)
print(json.dumps(out))
PY
}
same_texts() { # label file (against the single server's, when that configuration ran)
  [ -f "$OUT/single_texts.json" ] || return 0
  python3 - "$OUT/single_texts.json" "$2" "$1" << 'PY'
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
print("%s on CUDA: %d of 8 greedy texts equal the single server's" % (sys.argv[3], sum(x == y and x is not None for x, y in zip(a, b))))
PY
}
router_start() { # args...
  build-gpu/strata router --port 0 "$@" > "$OUT/router.out" 2> "$OUT/router.log" &
  PIDS+=($!)
  TAGS+=(router)
  RPORT=""
  for _ in $(seq 1 40); do RPORT=$(sed -n 's/^listening on http:\/\/127\.0\.0\.1:\([0-9]*\)$/\1/p' "$OUT/router.out"); [ -n "$RPORT" ] && break; sleep 0.25; done
}

if [ "${TWO_GPU:-0}" = 1 ]; then
  python3 -c "
import torch, time
a = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0'); b = torch.empty_like(a, device='cuda:1')
for _ in range(3): b.copy_(a)
torch.cuda.synchronize('cuda:0'); torch.cuda.synchronize('cuda:1'); t = time.time()
for _ in range(10): b.copy_(a)
torch.cuda.synchronize('cuda:0'); torch.cuda.synchronize('cuda:1')
print('GPU 0 -> GPU 1 copy: %.1f GB/s (peer access: %s)' % (10 * a.numel() / (time.time() - t) / 1e9, torch.cuda.can_device_access_peer(0, 1)))
" 2>&1 | tail -1 | tee "$OUT/gpu_copy.txt"
fi

for cfg in $CONFIGS; do
  case $cfg in
  single)
    stamp "single server"
    CUDA_VISIBLE_DEVICES=0 start single serve $M "${COMMON[@]}" --kv-mem 16G --prefill-chunk 512
    greedy $PORT > "$OUT/single_texts.json"
    bench_rates single http://127.0.0.1:$PORT
    ;;
  indep)
    [ "${TWO_GPU:-0}" = 1 ] || continue
    stamp "two independent servers (GPUs 0 and 1) behind the router"
    CUDA_VISIBLE_DEVICES=0 start s1 serve $M "${COMMON[@]}" --kv-mem 16G --prefill-chunk 512
    P1=$PORT
    CUDA_VISIBLE_DEVICES=1 start s2 serve $M "${COMMON[@]}" --kv-mem 16G --prefill-chunk 512
    router_start --decode http://127.0.0.1:$P1,http://127.0.0.1:$PORT
    greedy $RPORT > "$OUT/indep_texts.json"
    same_texts indep "$OUT/indep_texts.json"
    bench_rates indep http://127.0.0.1:$RPORT
    ;;
  pd_host | pd_d2d)
    LAND=()
    LINK_CFG=$LINK
    if [ $cfg = pd_d2d ]; then
      [ -n "${STRATA_UCX_CUDA_LIB:-}" ] || { echo "pd_d2d: no .deps/ucx-cu12.tar.xz (scripts/device-debs.sh)"; continue; }
      export LD_LIBRARY_PATH=$STRATA_UCX_CUDA_LIB:$LD_LIBRARY_PATH
      LAND=(--pd-landing-mem 4G)
      [ -f "$OUT/gpu_copy.txt" ] && LINK_CFG=$(sed -n 's/.*copy: \([0-9.]*\) GB.*/\1/p' "$OUT/gpu_copy.txt")
    fi
    stamp "$cfg: router + prefill (GPU $(gpu 0)) + decode (GPU $(gpu 1))"
    if [ "${TWO_GPU:-0}" = 1 ]; then PKV=16G DKV=16G; else PKV=4G DKV=12G; fi
    CUDA_VISIBLE_DEVICES=$(gpu 0) STRATA_LOG=info start prefill serve $M "${COMMON[@]}" --kv-mem $PKV --prefill-chunk 2048 --role prefill
    PPORT=$PORT
    CUDA_VISIBLE_DEVICES=$(gpu 1) STRATA_LOG=info start decode serve $M "${COMMON[@]}" --kv-mem $DKV --prefill-chunk 512 --role decode "${LAND[@]}"
    DPORT=$PORT
    grep -h "node: KV" "$OUT/prefill.log" "$OUT/decode.log"
    router_start --prefill http://127.0.0.1:$PPORT --decode http://127.0.0.1:$DPORT
    greedy $RPORT > "$OUT/${cfg}_texts.json"
    same_texts $cfg "$OUT/${cfg}_texts.json"
    bench_rates $cfg http://127.0.0.1:$RPORT --metrics http://127.0.0.1:$PPORT --metrics http://127.0.0.1:$DPORT \
      --link-bw "$LINK_CFG"
    curl -s http://127.0.0.1:$DPORT/metrics | grep -E '^strata_pd_(tickets|messages)|^strata_prompt_tokens_total' | tr '\n' ' '; echo
    curl -s http://127.0.0.1:$RPORT/metrics | grep -E '^strata_router_(retries|prefill_cancelled)' | tr '\n' ' '; echo
    grep -ihE "warn|error" "$OUT/prefill.log" "$OUT/decode.log" | grep -v "^$" | head -5
    [ $cfg = pd_d2d ] && export LD_LIBRARY_PATH=${LD_LIBRARY_PATH#"$STRATA_UCX_CUDA_LIB":}
    ;;
  esac
  stop_all
done

stamp "goodput: the fastest long-prompt rate with loaded TBT p99 <= $TBT_TARGET_X x the single server's idle p99"
python3 - "$OUT" "$TBT_TARGET_X" "$LONG" << 'PY'
import glob, json, os, sys
out, x, n = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "*@*.json")))]
single = [r for r in rows if r["label"].startswith("single@")]
if not single:
    sys.exit(0)
target = x * min(r["idle_tbt_p99"] for r in single)
print("TBT p99 target: %.1f ms" % (1e3 * target))
print("| config | a %s-token prompt every (s) | TBT p50 idle / loaded (ms) | TBT p99 idle / loaded (ms) | p99 loaded/idle "
      "| long TTFT p50 / max (s) | errors | within target |" % n)
print("|---|---|---|---|---|---|---|---|")
best = {}
for r in rows:
    cfg, ev = r["label"].split("@")
    ok = r["loaded_tbt_p99"] <= target and r["errors"] == 0
    best[cfg] = max(best.get(cfg, 0.0), 1.0 / float(ev) if ok else 0.0)
    print("| %s | %s | %.1f / %.1f | %.1f / %.1f | %.2fx | %.2f / %.2f | %d | %s |" % (
        cfg, ev, 1e3 * r["idle_tbt_p50"], 1e3 * r["loaded_tbt_p50"], 1e3 * r["idle_tbt_p99"], 1e3 * r["loaded_tbt_p99"],
        r["tbt_p99_ratio"], r["long_ttft_p50"], r["long_ttft_max"], r["errors"], "yes" if ok else "no"))
for cfg, g in best.items():
    print("goodput %s: %.2f long prompts/s within the target" % (cfg, g))
PY
stamp done
exit $rc
