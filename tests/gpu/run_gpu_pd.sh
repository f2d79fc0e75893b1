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
# TWO_GPU=1 (a machine with two GPUs): the prefill process on GPU 0, the decode process on
# GPU 1 (CUDA_VISIBLE_DEVICES), the single server on GPU 0; the GPU 0 -> GPU 1 copy
# bandwidth is measured too (PyTorch). The KV still crosses host memory (UCX 1.13 from
# Debian has no CUDA support): device -> pinned host -> UCX -> host tier -> device.
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
LONG_EVERY=${LONG_EVERY:-2.0}
DECODE_LEN=${DECODE_LEN:-256}
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
STRATA_SRC=$PWD build-gpu/test_pd_engine > "$OUT/engine.txt" 2>&1 || rc=1
tail -1 "$OUT/engine.txt"

M=/tmp/m8b
if [ ! -f $M/config.json ]; then
  stamp "mkmodel llama3-8b bf16"
  build-gpu/strata mkmodel --config llama3-8b --dtype bf16 $M > "$OUT/mk.log" 2>&1 || { tail "$OUT/mk.log"; exit 1; }
fi
cp -n tests/data/tokenizer/smollm2/tokenizer.json tests/data/tokenizer/smollm2/tokenizer_config.json "$M/"

PIDS=()
start() { # tag args... -> PORT
  local tag=$1
  shift
  build-gpu/strata "$@" --port 0 > "$OUT/$tag.out" 2> "$OUT/$tag.log" &
  PIDS+=($!)
  PORT=""
  for _ in $(seq 1 240); do
    PORT=$(sed -n 's/^listening on http:\/\/127\.0\.0\.1:\([0-9]*\)$/\1/p' "$OUT/$tag.out")
    [ -n "$PORT" ] && break
    sleep 0.5
  done
  [ -n "$PORT" ] || { echo "FAIL $tag did not start"; tail -20 "$OUT/$tag.log"; }
}
stop_all() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2> /dev/null; done; wait 2> /dev/null; PIDS=(); }
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

stamp "single server"
if [ "${TWO_GPU:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 start single serve $M "${COMMON[@]}" --kv-mem 16G --prefill-chunk 512
else
  start single serve $M "${COMMON[@]}" --kv-mem 16G --prefill-chunk 512
fi
SPORT=$PORT
python3 bench/pd_bench.py --url http://127.0.0.1:$SPORT --streams $STREAMS --decode-len $DECODE_LEN \
  --long-prompt $LONG --long-count $LONG_COUNT --long-every $LONG_EVERY --label single --json "$OUT/single.json" || rc=1
# greedy texts of the single server, for the P-D correctness check
python3 - "$SPORT" > "$OUT/single_texts.json" << 'EOF'
import http.client, json, sys
port = int(sys.argv[1]); out = []
for i in range(8):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": "Story %d: " % i + "the river and the mill " * (40 + 30 * i), "max_tokens": 16, "temperature": 0}
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    out.append(json.loads(c.getresponse().read())["choices"][0]["text"])
print(json.dumps(out))
EOF
stop_all

stamp "P-D: prefill + decode on this GPU, router"
if [ "${TWO_GPU:-0}" = 1 ]; then
  python3 -c "
import torch, time
a = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0'); b = torch.empty_like(a, device='cuda:1')
for _ in range(3): b.copy_(a)
torch.cuda.synchronize('cuda:0'); torch.cuda.synchronize('cuda:1'); t = time.time()
for _ in range(10): b.copy_(a)
torch.cuda.synchronize('cuda:0'); torch.cuda.synchronize('cuda:1')
print('GPU 0 -> GPU 1 copy: %.1f GB/s (peer access: %s)' % (10 * a.numel() / (time.time() - t) / 1e9, torch.cuda.can_device_access_peer(0, 1)))
" 2>&1 | tail -1
  CUDA_VISIBLE_DEVICES=0 start prefill serve $M "${COMMON[@]}" --kv-mem 16G --prefill-chunk 2048 --role prefill
  PPORT=$PORT
  CUDA_VISIBLE_DEVICES=1 start decode serve $M "${COMMON[@]}" --kv-mem 16G --prefill-chunk 512 --role decode
  DPORT=$PORT
else
  start prefill serve $M "${COMMON[@]}" --kv-mem 4G --prefill-chunk 2048 --role prefill
  PPORT=$PORT
  start decode serve $M "${COMMON[@]}" --kv-mem 12G --prefill-chunk 512 --role decode
  DPORT=$PORT
fi
build-gpu/strata router --port 0 --prefill http://127.0.0.1:$PPORT --decode http://127.0.0.1:$DPORT \
  > "$OUT/router.out" 2> "$OUT/router.log" &
PIDS+=($!)
for _ in $(seq 1 40); do RPORT=$(sed -n 's/^listening on http:\/\/127\.0\.0\.1:\([0-9]*\)$/\1/p' "$OUT/router.out"); [ -n "$RPORT" ] && break; sleep 0.25; done
python3 - "$RPORT" "$OUT/single_texts.json" << 'EOF'
import http.client, json, sys
port = int(sys.argv[1]); want = json.load(open(sys.argv[2])); same = 0
for i in range(8):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": "Story %d: " % i + "the river and the mill " * (40 + 30 * i), "max_tokens": 16, "temperature": 0}
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse(); got = json.loads(r.read())
    same += r.status == 200 and got["choices"][0]["text"] == want[i]
print("P-D on CUDA: %d of 8 greedy texts equal the single server's (random weights: close logits)" % same)
EOF
python3 bench/pd_bench.py --url http://127.0.0.1:$RPORT --streams $STREAMS --decode-len $DECODE_LEN \
  --long-prompt $LONG --long-count $LONG_COUNT --long-every $LONG_EVERY --label pd \
  --metrics http://127.0.0.1:$PPORT --metrics http://127.0.0.1:$DPORT --link-bw "$LINK" --json "$OUT/pd.json" || rc=1
curl -s http://127.0.0.1:$DPORT/metrics | grep -E '^strata_pd_(tickets|messages)' > "$OUT/decode_pd_metrics.txt"
cat "$OUT/decode_pd_metrics.txt"
curl -s http://127.0.0.1:$RPORT/metrics | grep -E '^strata_router_(retries|prefill_cancelled)' | head
stop_all
stamp done
exit $rc
