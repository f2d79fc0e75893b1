#!/usr/bin/env python3
"""Prefill/decode interference benchmark: the time between tokens (TBT) of running
decodes, alone and while a stream of long prompts arrives, against one OpenAI-compatible
URL (a single `strata serve`, or `strata router` in front of prefill and decode nodes).

  python3 bench/pd_bench.py --url http://127.0.0.1:8080 --streams 8 --decode-len 256 \
      --long-prompt 8000 --long-every 2.0 --long-count 6 [--metrics URL ...]

Phase "idle": --streams requests (prompts of --short-prompt random token ids, ignore_eos,
--decode-len tokens, streamed) run together; every gap between two text chunks of a
stream is a TBT sample. Phase "loaded": the same streams again, and while they decode,
--long-count requests with prompts of --long-prompt random ids (max_tokens 1) arrive
every --long-every seconds (each one's time to its token is its TTFT). The report: TBT
p50 / p99 / max of each phase and loaded p99 / idle p99 (the interference: 1.0 is none),
the long prompts' TTFT.

--metrics URL (repeatable): /metrics of P-D nodes read before and after the loaded phase;
the KV moved (strata_pd_kv_bytes_total), its per-layer message times
(strata_pd_layer_seconds) and the rate bytes / summed message time, printed beside
--link-bw (GB/s: the copy bandwidth the caller measured in the same run, e.g. pinned
host memory to host memory) when given. Output: text, and --json FILE.
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
    return xs[k]


def stream_request(host, port, body, out, key):
    """POSTs a streamed completion; out gets t0, chunk times, status."""
    t0 = time.time()
    c = http.client.HTTPConnection(host, port, timeout=900)
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = "Bearer " + key
    c.request("POST", "/v1/completions", json.dumps(body), h)
    r = c.getresponse()
    out["status"] = r.status
    times = []
    buf = b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if ev.startswith(b"data: ") and ev != b"data: [DONE]":
                try:
                    j = json.loads(ev[6:])
                except ValueError:
                    continue
                if "error" in j:
                    out["error"] = j["error"]
                elif any(ch.get("text") for ch in j.get("choices", [])):
                    times.append(time.time())
    c.close()
    out["t0"] = t0
    out["times"] = times


def ids(rng, n, lo, hi):
    return [rng.randrange(lo, hi) for _ in range(n)]


def run_phase(args, host, port, rng, loaded):
    outs = [dict() for _ in range(args.streams)]
    ths = []
    for i in range(args.streams):
        body = {"prompt": ids(rng, args.short_prompt, args.vocab_lo, args.vocab_hi), "max_tokens": args.decode_len,
                "ignore_eos": True, "temperature": 0, "stream": True}
        th = threading.Thread(target=stream_request, args=(host, port, body, outs[i], args.api_key))
        th.start()
        ths.append(th)
    longs = []
    if loaded:
        time.sleep(args.warmup)
        for k in range(args.long_count):
            o = {}
            body = {"prompt": ids(rng, args.long_prompt, args.vocab_lo, args.vocab_hi), "max_tokens": 1,
                    "temperature": 0, "stream": True}
            th = threading.Thread(target=stream_request, args=(host, port, body, o, args.api_key))
            th.start()
            longs.append((th, o))
            time.sleep(args.long_every)
    for th in ths:
        th.join()
    for th, _ in longs:
        th.join()
    tbt = []
    for o in outs:
        t = o.get("times", [])
        # the gaps after the first token (TTFT excluded), while the long prompts arrive
        tbt += [b - a for a, b in zip(t, t[1:])]
    ttft = [o["times"][0] - o["t0"] for _, o in longs if o.get("times")]
    errors = sum(1 for o in outs if o.get("status") != 200 or "error" in o) + \
        sum(1 for _, o in longs if o.get("status") != 200 or "error" in o)
    return tbt, ttft, errors


def read_metrics(url):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--short-prompt", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=256)
    ap.add_argument("--long-prompt", type=int, default=8000)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--long-count", type=int, default=6)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of decoding before the first long prompt")
    ap.add_argument("--vocab-lo", type=int, default=100)
    ap.add_argument("--vocab-hi", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--metrics", action="append", default=[])
    ap.add_argument("--link-bw", type=float, default=0.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    u = urllib.parse.urlparse(args.url)
    rng = random.Random(args.seed)
    idle, _, e1 = run_phase(args, u.hostname, u.port, rng, False)
    before = [read_metrics(m) for m in args.metrics]
    t0 = time.time()
    loaded, ttft, e2 = run_phase(args, u.hostname, u.port, rng, True)
    wall = time.time() - t0
    after = [read_metrics(m) for m in args.metrics]
    res = {"label": args.label, "idle_tbt_p50": pct(idle, 50), "idle_tbt_p99": pct(idle, 99),
           "loaded_tbt_p50": pct(loaded, 50), "loaded_tbt_p99": pct(loaded, 99), "loaded_tbt_max": max(loaded or [0]),
           "long_ttft_p50": pct(ttft, 50), "long_ttft_max": max(ttft or [0]), "errors": e1 + e2,
           "samples_idle": len(idle), "samples_loaded": len(loaded), "wall_s": wall}
    res["tbt_p99_ratio"] = res["loaded_tbt_p99"] / res["idle_tbt_p99"] if res["idle_tbt_p99"] > 0 else float("nan")
    print("%s TBT idle p50 %.2f ms p99 %.2f ms | loaded (%d x %d-token prompts, one per %.1f s) p50 %.2f ms "
          "p99 %.2f ms max %.1f ms | p99 loaded / idle %.2fx | long-prompt TTFT p50 %.2f s max %.2f s | errors %d"
          % (args.label, 1e3 * res["idle_tbt_p50"], 1e3 * res["idle_tbt_p99"], args.long_count, args.long_prompt,
             args.long_every, 1e3 * res["loaded_tbt_p50"], 1e3 * res["loaded_tbt_p99"], 1e3 * res["loaded_tbt_max"],
             res["tbt_p99_ratio"], res["long_ttft_p50"], res["long_ttft_max"], res["errors"]))
    for url, b, a in zip(args.metrics, before, after):
        for d in ("sent", "received"):
            by = a.get('strata_pd_kv_bytes_total{direction="%s"}' % d, 0) - b.get('strata_pd_kv_bytes_total{direction="%s"}' % d, 0)
            s = a.get('strata_pd_layer_seconds_sum{direction="%s"}' % d, 0) - b.get('strata_pd_layer_seconds_sum{direction="%s"}' % d, 0)
            n = a.get('strata_pd_layer_seconds_count{direction="%s"}' % d, 0) - b.get('strata_pd_layer_seconds_count{direction="%s"}' % d, 0)
            if by <= 0:
                continue
            busy = a.get("strata_pd_send_busy_seconds_total", 0) - b.get("strata_pd_send_busy_seconds_total", 0)
            if d == "sent" and busy > 0:
                s = busy  # the sender's busy time: the union of its messages in flight
            rate = by / s / 1e9 if s > 0 else float("nan")
            res.setdefault("kv", []).append({"node": url, "direction": d, "bytes": by, "messages": n,
                                             "message_seconds": s, "rate_gbs": rate})
            print("  %s KV %s: %.2f GB in %d layer messages (%.2f MB each), %.3f s %s: %.2f GB/s%s"
                  % (url, d, by / 1e9, n, by / max(n, 1) / 1e6, s,
                     "with a message in flight" if d == "sent" else "of summed message times (they overlap)", rate,
                     " = %.0f%% of the %.1f GB/s copy bandwidth measured in this run" % (100 * rate / args.link_bw, args.link_bw)
                     if args.link_bw > 0 else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
