#!/usr/bin/env python3
"""Serving benchmark: N streamed requests with given prompt / output lengths at
a given concurrency against an OpenAI-compatible server (`strata serve`, or
any other), reporting throughput, time to first token (TTFT) and time between
tokens (TBT) percentiles.

  python3 bench/bench_serve.py --url http://127.0.0.1:8080 -n 64 -c 16 \
      --prompt-len 128 --output-len 64

Requests go to /v1/completions with a prompt of exactly --prompt-len token ids
(random ids drawn from --vocab-lo..--vocab-hi with a fixed --seed, a different
prompt per request, so no two share a prefix unless --shared-prefix says so)
and "ignore_eos": true with max_tokens = --output-len, so every request
produces exactly that many tokens (the server's usage is checked). With
--chat, /v1/chat/completions gets a user message of --prompt-len words
instead (token counts then come from usage).

Measures, per request, from the moment it is sent: TTFT = until the first
chunk carrying text; TBT = the gaps between later text chunks; end-to-end.
Throughput = output tokens (from usage) / wall time of the whole run.
Plain HTTP (http.client) on threads, one connection per worker, no
dependencies beyond Python 3. With --metrics it also reads the server's
/metrics before and after (strata's names) and reports prompt / generated
tokens computed and the mean batch (generated tokens per engine step).
"""
import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Target:
    def __init__(self, url, api_key, timeout):
        u = urllib.parse.urlparse(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.base = u.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = "Bearer " + api_key
        self.timeout = timeout

    def conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get(self, path):
        c = self.conn()
        c.request("GET", self.base + path, headers=self.headers)
        r = c.getresponse()
        body = r.read()
        c.close()
        return r.status, body


def stream_one(target, conn, path, payload):
    """Sends one streamed request on conn. -> dict(ttft, tbts, e2e, tokens, error)"""
    body = json.dumps(payload).encode()
    t0 = time.perf_counter()
    conn.request("POST", target.base + path, body=body, headers=target.headers)
    r = conn.getresponse()
    if r.status != 200:
        return {"error": "HTTP %d: %s" % (r.status, r.read()[:200].decode("utf-8", "replace"))}
    ttft, last, tbts, usage, done = None, None, [], None, False
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        obj = json.loads(data)
        if "error" in obj:
            return {"error": "stream error: %s" % obj["error"].get("message")}
        if obj.get("usage"):
            usage = obj["usage"]
        text = ""
        for ch in obj.get("choices") or []:
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
        if text:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                tbts.append(now - last)
            last = now
    e2e = time.perf_counter() - t0
    if not done:
        return {"error": "the stream ended without [DONE]"}
    if usage is None:
        return {"error": "no usage in the stream"}
    return {"ttft": ttft if ttft is not None else e2e, "tbts": tbts, "e2e": e2e,
            "tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


def make_payloads(args, model):
    rng = random.Random(args.seed)
    shared = [rng.randint(args.vocab_lo, args.vocab_hi) for _ in range(args.shared_prefix)]
    words = ["alpha", "river", "stone", "light", "window", "garden", "music", "paper", "cloud", "forest"]
    out = []
    for i in range(args.num_requests):
        p = {"model": model, "max_tokens": args.output_len, "ignore_eos": True, "temperature": args.temperature,
             "seed": args.seed + i, "stream": True, "stream_options": {"include_usage": True}}
        if args.chat:
            text = " ".join(rng.choice(words) for _ in range(args.prompt_len))
            p["messages"] = [{"role": "user", "content": "%d: %s" % (i, text)}]
        else:
            n = args.prompt_len - len(shared)
            p["prompt"] = shared + [rng.randint(args.vocab_lo, args.vocab_hi) for _ in range(max(n, 1))]
        out.append(p)
    return out


def read_metrics(target):
    st, body = target.get("/metrics")
    if st != 200:
        return {}
    m = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                m[k] = float(v)
            except ValueError:
                pass
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (with or without /v1)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    ap.add_argument("-n", "--num-requests", type=int, default=32)
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (--chat: words)")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    ap.add_argument("--shared-prefix", type=int, default=0, help="leading prompt tokens all requests share")
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-lo", type=int, default=100)
    ap.add_argument("--vocab-hi", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) first")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--metrics", action="store_true", help="read the server's /metrics before and after")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    if args.prompt_len < 1 or args.output_len < 1 or args.num_requests < 1 or args.concurrency < 1:
        ap.error("lengths, -n and -c must be >= 1")
    if args.shared_prefix >= args.prompt_len and not args.chat:
        ap.error("--shared-prefix must be below --prompt-len")

    target = Target(args.url, args.api_key, args.timeout)
    model = args.model
    if not model:
        st, body = target.get("/v1/models")
        if st != 200:
            sys.exit("bench_serve: GET /v1/models -> %d: %s" % (st, body[:200]))
        model = json.loads(body)["data"][0]["id"]
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    payloads = make_payloads(args, model)

    if args.warmup:
        c = target.conn()
        for i in range(args.warmup):
            w = dict(payloads[i % len(payloads)], max_tokens=min(4, args.output_len))
            res = stream_one(target, c, path, w)
            if "error" in res:
                sys.exit("bench_serve: warm-up request failed: %s" % res["error"])
        c.close()

    m0 = read_metrics(target) if args.metrics else {}
    results = [None] * len(payloads)
    lock = threading.Lock()
    nxt = [0]

    def worker():
        conn = target.conn()
        while True:
            with lock:
                i = nxt[0]
                if i >= len(payloads):
                    break
                nxt[0] += 1
            try:
                results[i] = stream_one(target, conn, path, payloads[i])
            except Exception as e:  # a broken connection: report it, reconnect
                results[i] = {"error": repr(e)}
                conn.close()
                conn = target.conn()
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(min(args.concurrency, len(payloads)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m1 = read_metrics(target) if args.metrics else {}

    ok = [r for r in results if r and "error" not in r]
    errors = [r["error"] for r in results if r and "error" in r]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    tbt = [x for r in ok for x in r["tbts"]]
    e2e = [r["e2e"] for r in ok]
    wrong_len = sum(1 for r in ok if r["tokens"] != args.output_len)
    rep = {
        "model": model, "endpoint": path, "requests": len(payloads), "ok": len(ok), "errors": len(errors),
        "concurrency": args.concurrency, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "wall_s": wall, "request_throughput": len(ok) / wall, "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + in_tokens) / wall, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms": {"mean": 1e3 * statistics.mean(ttft) if ttft else None, "p50": 1e3 * pct(ttft, 50),
                    "p99": 1e3 * pct(ttft, 99)},
        "tbt_ms": {"mean": 1e3 * statistics.mean(tbt) if tbt else None, "p50": 1e3 * pct(tbt, 50),
                   "p99": 1e3 * pct(tbt, 99)},
        "e2e_ms": {"p50": 1e3 * pct(e2e, 50), "p99": 1e3 * pct(e2e, 99)},
    }
    if m1:
        d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
        steps = d("strata_engine_steps_total")
        rep["server"] = {"prompt_tokens_computed": d("strata_prompt_tokens_total"),
                         "generation_tokens": d("strata_generation_tokens_total"), "engine_steps": steps,
                         "tokens_per_step": d("strata_generation_tokens_total") / steps if steps else None,
                         "prefix_cache_hits": d("strata_prefix_cache_hits_total")}

    print("bench_serve: %s %s, %d requests (prompt %d, output %d tokens) at concurrency %d"
          % (model, path, len(payloads), args.prompt_len, args.output_len, args.concurrency))
    print("  completed        %d ok, %d errors%s" % (len(ok), len(errors),
                                                    ("  (first: %s)" % errors[0]) if errors else ""))
    if wrong_len:
        print("  WARNING          %d requests did not produce %d tokens" % (wrong_len, args.output_len))
    print("  wall time        %.2f s" % wall)
    print("  throughput       %.2f req/s, output %.1f tok/s, prompt+output %.1f tok/s"
          % (rep["request_throughput"], rep["output_tok_s"], rep["total_tok_s"]))
    if ok:
        print("  TTFT             p50 %.1f ms, p99 %.1f ms (mean %.1f)"
              % (rep["ttft_ms"]["p50"], rep["ttft_ms"]["p99"], rep["ttft_ms"]["mean"]))
    if tbt:
        print("  TBT              p50 %.1f ms, p99 %.1f ms (mean %.1f)"
              % (rep["tbt_ms"]["p50"], rep["tbt_ms"]["p99"], rep["tbt_ms"]["mean"]))
    if ok:
        print("  end to end       p50 %.1f ms, p99 %.1f ms" % (rep["e2e_ms"]["p50"], rep["e2e_ms"]["p99"]))
    if "server" in rep:
        s = rep["server"]
        print("  server           %d prompt tokens computed, %d generated in %d steps (%.2f per step), "
              "%d prefix-cache hits" % (s["prompt_tokens_computed"], s["generation_tokens"], s["engine_steps"],
                                        s["tokens_per_step"] or 0, s["prefix_cache_hits"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 1 if errors or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
