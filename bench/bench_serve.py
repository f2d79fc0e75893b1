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

Decode roofline (--metrics, against strata serve): the server counts its
decode-only steps (every sequence of the batch runs one token, no prompt
chunk): how many, their tokens, the keys they attended over (context lengths
summed) and their wall time; it publishes the model's step costs (weight
bytes per forward pass, KV bytes per token, FLOPs per token and per
(query, key) pair) and, on CUDA, the HBM bandwidth and GEMM rate it measured
at start-up. Over the run's decode-only steps:
    bytes = steps x weight bytes + keys x KV bytes per token
    flops = tokens x FLOPs per token + keys x FLOPs per pair
    roofline time = max(bytes / bandwidth, flops / GEMM rate)
and the decode throughput measured (tokens / wall time of those steps) is
printed beside tokens / roofline time, with the fraction. --mem-bw and
--gemm-rate give the rates instead (e.g. for a CPU server, which measures none).

--invariance N (greedy batch invariance): N greedy requests with prompts of
different lengths sent all at once, then each alone; reports how many texts
differ (the engine's rule: none). Exit status 1 when more than --max-differ do.
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


def si(x):
    """12.3 G, 4.19 T, ...: x with an SI prefix (3 significant digits)."""
    for k, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= k:
            return "%.3g %s" % (x / k, p)
    return "%.3g " % x


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
    ttft, last, tbts, usage, done, pieces = None, None, [], None, False, []
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
            pieces.append(text)
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
    return {"ttft": ttft if ttft is not None else e2e, "tbts": tbts, "e2e": e2e, "text": "".join(pieces),
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


def run_all(target, path, payloads, concurrency):
    """Sends payloads from `concurrency` worker threads (one connection each).
    -> (results in payload order, wall seconds)"""
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
    threads = [threading.Thread(target=worker) for _ in range(min(concurrency, len(payloads)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


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


def settled_metrics(target, timeout=5.0):
    """/metrics once the engine is idle: the counters of a step are updated
    just after its last callbacks, so a read right after the last answer may
    miss that step; reads until nothing runs and the step count is stable."""
    m = read_metrics(target)
    t_end = time.time() + timeout
    while time.time() < t_end:
        time.sleep(0.05)
        m2 = read_metrics(target)
        if m2.get("strata_requests_running", 0) == 0 and \
                m2.get("strata_engine_steps_total") == m.get("strata_engine_steps_total"):
            return m2
        m = m2
    return m


def decode_roofline(m0, m1, mem_bw=None, gemm_rate=None):
    """The decode-only steps between two /metrics reads beside their roofline
    (module docstring). None when the server does not publish the counters."""
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
    if "strata_decode_steps_total" not in m1 or "strata_model_weight_bytes_per_step" not in m1:
        return None
    steps, toks, keys, secs = (d("strata_decode_steps_total"), d("strata_decode_tokens_total"),
                               d("strata_decode_kv_tokens_total"), d("strata_decode_seconds_total"))
    w = m1["strata_model_weight_bytes_per_step"]
    kvb = m1.get("strata_model_kv_bytes_per_token", 0.0)
    fpt = m1.get("strata_model_flops_per_token", 0.0)
    fpp = m1.get("strata_model_attention_flops_per_pair", 0.0)
    bw = mem_bw or m1.get("strata_device_read_bytes_per_second", 0.0)
    rate = gemm_rate or m1.get("strata_gemm_flops_per_second", 0.0)
    r = {"steps": steps, "tokens": toks, "kv_tokens": keys, "seconds": secs,
         "mean_batch": toks / steps if steps else None, "mean_context": keys / toks if toks else None,
         "ms_per_step": 1e3 * secs / steps if steps else None,
         "tok_s": toks / secs if secs > 0 else None,
         "bytes": steps * w + keys * kvb, "flops": toks * fpt + keys * fpp,
         "mem_bw": bw or None, "gemm_rate": rate or None,
         "weight_bytes_per_step": w, "kv_bytes_per_token": kvb}
    r["mem_s"] = r["bytes"] / bw if bw else None
    r["flop_s"] = r["flops"] / rate if rate else None
    parts = [x for x in (r["mem_s"], r["flop_s"]) if x is not None]
    r["roofline_s"] = max(parts) if parts else None
    r["bound"] = None if not parts else ("memory" if r["mem_s"] is not None and r["roofline_s"] == r["mem_s"]
                                         else "compute")
    r["roofline_tok_s"] = toks / r["roofline_s"] if r["roofline_s"] and toks else None
    r["fraction"] = r["roofline_s"] / secs if r["roofline_s"] and secs > 0 else None
    return r


def invariance(args, target, model, path):
    """N greedy requests together, then each alone. -> (report dict, exit status)"""
    rng = random.Random(args.seed + 7)
    payloads = []
    for i in range(args.invariance):
        n = max(1, args.prompt_len // 2 + (args.prompt_len - args.prompt_len // 2) * i // max(args.invariance - 1, 1))
        payloads.append({"model": model, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0,
                         "seed": i, "stream": True, "stream_options": {"include_usage": True},
                         "prompt": [rng.randint(args.vocab_lo, args.vocab_hi) for _ in range(n)]})
    together, wall = run_all(target, path, payloads, len(payloads))
    alone, _ = run_all(target, path, payloads, 1)
    errors = [r["error"] for r in together + alone if "error" in r]
    differ = [i for i in range(len(payloads)) if "error" not in together[i] and "error" not in alone[i]
              and together[i]["text"] != alone[i]["text"]]
    rep = {"requests": len(payloads), "output_len": args.output_len, "errors": len(errors), "differ": len(differ),
           "differ_ids": differ, "together_wall_s": wall}
    print("bench_serve: batch invariance, %s: %d greedy requests (prompts %d..%d tokens, %d output tokens) sent "
          "together, then each alone" % (model, len(payloads), len(payloads[0]["prompt"]),
                                         len(payloads[-1]["prompt"]), args.output_len))
    print("  errors           %d%s" % (len(errors), ("  (first: %s)" % errors[0]) if errors else ""))
    print("  differ           %d of %d%s" % (len(differ), len(payloads),
                                             ("  (requests %s)" % differ[:12]) if differ else ""))
    for i in differ[:3]:
        a, b = together[i]["text"], alone[i]["text"]
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        print("  request %-3d      first difference at character %d of %d" % (i, k, len(b)))
    return rep, 1 if errors or len(differ) > args.max_differ else 0


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
    ap.add_argument("--mem-bw", type=float, default=None,
                    help="memory bandwidth for the roofline, bytes/s (default: the server's measurement)")
    ap.add_argument("--gemm-rate", type=float, default=None,
                    help="GEMM rate for the roofline, FLOP/s (default: the server's measurement)")
    ap.add_argument("--invariance", type=int, default=0, metavar="N",
                    help="instead of the benchmark: N greedy requests together vs each alone (prompts of "
                         "--prompt-len/2 .. --prompt-len tokens, --output-len tokens each)")
    ap.add_argument("--max-differ", type=int, default=0, help="--invariance: differing requests allowed")
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
    if args.invariance > 0:
        rep, rc = invariance(args, target, model, "/v1/completions")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rep, f, indent=2)
        return rc
    payloads = make_payloads(args, model)

    if args.warmup:
        c = target.conn()
        for i in range(args.warmup):
            w = dict(payloads[i % len(payloads)], max_tokens=min(4, args.output_len))
            res = stream_one(target, c, path, w)
            if "error" in res:
                sys.exit("bench_serve: warm-up request failed: %s" % res["error"])
        c.close()

    m0 = settled_metrics(target) if args.metrics else {}
    results, wall = run_all(target, path, payloads, args.concurrency)
    m1 = settled_metrics(target) if args.metrics else {}

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
                         "prefix_cache_hits": d("strata_prefix_cache_hits_total"),
                         "step_seconds": d("strata_engine_step_seconds_total"),
                         "forward_seconds": d("strata_engine_forward_seconds_total"),
                         "preemptions": d("strata_preemptions_total")}
        rep["decode"] = decode_roofline(m0, m1, args.mem_bw, args.gemm_rate)

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
        if s["engine_steps"] and s["step_seconds"] > 0:
            print("  step time        %.2f ms per step: forward passes %.2f ms (%.0f%%), the rest (scheduling, "
                  "sampling on the host, streaming) %.2f ms"
                  % (1e3 * s["step_seconds"] / s["engine_steps"], 1e3 * s["forward_seconds"] / s["engine_steps"],
                     100 * s["forward_seconds"] / s["step_seconds"],
                     1e3 * (s["step_seconds"] - s["forward_seconds"]) / s["engine_steps"]))
        if s["preemptions"]:
            print("  WARNING          %d preemptions (the KV cache was too small for the batch)" % s["preemptions"])
    dr = rep.get("decode")
    if dr and dr["steps"]:
        print("  decode           %.1f tok/s in %d decode-only steps (mean batch %.1f, mean context %.0f, "
              "%.2f ms/step)" % (dr["tok_s"] or 0, dr["steps"], dr["mean_batch"], dr["mean_context"],
                                 dr["ms_per_step"]))
        if dr["roofline_s"]:
            terms = []
            if dr["mem_s"] is not None:
                terms.append("%sB per step (weights %sB + KV %sB per token x %.0f tokens) / %sB/s = %.3f ms"
                             % (si(dr["bytes"] / dr["steps"]), si(dr["weight_bytes_per_step"]),
                                si(dr["kv_bytes_per_token"]), dr["kv_tokens"] / dr["steps"], si(dr["mem_bw"]),
                                1e3 * dr["mem_s"] / dr["steps"]))
            if dr["flop_s"] is not None:
                terms.append("%sFLOP per step / %sFLOP/s = %.3f ms" % (si(dr["flops"] / dr["steps"]),
                                                                      si(dr["gemm_rate"]),
                                                                      1e3 * dr["flop_s"] / dr["steps"]))
            print("  decode roofline  %.1f tok/s (%s-bound): max(%s)" % (dr["roofline_tok_s"], dr["bound"],
                                                                        ", ".join(terms)))
            print("  decode fraction  %.1f%% of the roofline" % (100.0 * dr["fraction"]))
        else:
            print("  decode roofline  unknown (the server measured no rates; --mem-bw / --gemm-rate give them)")
    elif dr is not None:
        print("  decode           no decode-only steps in the run")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 1 if errors or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
