#!/usr/bin/env python3
"""Soak benchmark (not in CI): many concurrent streaming clients against
`strata serve` for a long time, reporting errors, the server's resident
memory over time and latency percentiles (issue 17: 256 clients for 10
minutes on the default model: 0 errors, RSS flat after warm-up, p99 latencies
reported).

  python3 bench/soak.py                          # 256 clients, 600 s, the default model, CPU
  python3 bench/soak.py -c 32 --duration 60 --serve-args "--kv-mem 64M --kv-host-mem 64M"   # a short run
  python3 bench/soak.py --url http://127.0.0.1:8080 --pid 1234   # a server already running

Without --url it starts `strata serve` itself (--bin, default build/strata;
--model, default models/SmolLM2-135M-Instruct.Q4_1.gguf; --serve-args passed
on, e.g. "--kv-mem 64M --max-batch 64") on a free loopback port, with a
connection cap above the client count, and stops it at the end with SIGTERM
(its exit status is checked: 0).

Each client loops until the duration is over: a streamed /v1/completions
request (stream_options.include_usage) with a prompt of its own (random token
ids: --prompt-len, distinct for every request, so the prefix cache and its
tiers see a soak of distinct prompts), --output-len tokens (ignore_eos), on
one keep-alive connection (a new one after an error). Errors: any status but
200, an error event, a stream without [DONE] or usage, a token count other
than asked, a broken connection. Latencies from the moment a request is
sent: TTFT (to the first text chunk), TBT (between text chunks), end to end;
p50 / p99 / max of each over all requests (the warm-up included).

RSS (VmRSS of the server, from /proc) is sampled every --rss-every seconds;
the report lists it over time, its least-squares slope after the warm-up
(MiB/min), and compares the last sample of the duration (under load) with the
first one after the warm-up (--warmup seconds, default 20% of the duration):
"RSS flat" when it grew by at most --max-rss-growth MiB. The KV pools are
touched as they fill (the device pool on the CPU, the host tier: by default 1/8
of the machine's memory), so RSS is flat only once they are full: give a
warm-up that fills them, or small budgets (--serve-args "--kv-mem 64M
--kv-host-mem 64M"; RSS against the budgets themselves is tests/test_server_rss.py). Exit status 1 on
any error, a growth above that, or a server that did not exit 0; --json
writes the figures.
"""
import argparse
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import Target, pct, stream_one  # noqa: E402

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(args):
    log = open(args.log, "w")
    cmd = [args.bin, "serve", args.model, "--port", "0", "--max-connections", str(max(1024, 2 * args.clients)),
           "--http-threads", "4"] + args.serve_args.split()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            m = re.match(rb"listening on (http://\S+)$", proc.stdout.readline().strip())
            if m:
                return proc, m.group(1).decode()
    proc.kill()
    proc.wait()
    sys.exit("soak: the server did not start; its log: %s" % args.log)


def rss_mib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def rss_slope(points):
    """Least-squares slope of [(seconds, MiB)] in MiB per minute (nan with fewer than 2 points)."""
    pts = [(t, m) for t, m in points if m == m]
    if len(pts) < 2:
        return float("nan")
    n = float(len(pts))
    mt = sum(t for t, _ in pts) / n
    mm = sum(m for _, m in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 60.0 * sum((t - mt) * (m - mm) for t, m in pts) / var if var > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start strata serve)")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for its RSS")
    ap.add_argument("--bin", default=os.path.join(SRC, "build", "strata"))
    ap.add_argument("--model", default=os.path.join(SRC, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--serve-args", default="", help="more options for strata serve (one string)")
    ap.add_argument("--log", default="/tmp/strata-soak-server.log", help="the started server's log")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("-c", "--clients", type=int, default=256)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds")
    ap.add_argument("--warmup", type=float, default=None, help="seconds (default: 20%% of the duration)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--vocab-lo", type=int, default=100)
    ap.add_argument("--vocab-hi", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-every", type=float, default=None, help="seconds (default: duration / 20)")
    ap.add_argument("--max-rss-growth", type=float, default=16.0, help="MiB after the warm-up")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else 0.2 * args.duration
    every = args.rss_every if args.rss_every else max(1.0, args.duration / 20)

    proc = None
    if args.url:
        url, pid = args.url, args.pid
    else:
        proc, url = start_server(args)
        pid = proc.pid
    target = Target(url, args.api_key, args.timeout)
    st, body = target.get("/v1/models")
    if st != 200:
        sys.exit("soak: GET /v1/models: %d %r" % (st, body[:200]))
    model = json.loads(body)["data"][0]["id"]
    print("soak: %d streaming clients for %.0f s against %s (model %s), prompts of %d tokens, %d out; warm-up %.0f s"
          % (args.clients, args.duration, url, model, args.prompt_len, args.output_len, warmup), flush=True)

    lock = threading.Lock()
    stop_at = time.time() + args.duration
    t_start = time.time()
    results, errors, counter = [], {}, [0]

    def client(k):
        rng = random.Random(args.seed * 1000003 + k)
        conn = target.conn()
        while time.time() < stop_at:
            with lock:
                counter[0] += 1
                i = counter[0]
            payload = {"model": model, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.8,
                       "seed": i, "stream": True, "stream_options": {"include_usage": True},
                       "prompt": [rng.randint(args.vocab_lo, args.vocab_hi) for _ in range(args.prompt_len)]}
            try:
                r = stream_one(target, conn, "/v1/completions", payload)
                if "error" not in r and r["tokens"] != args.output_len:
                    r = {"error": "%d tokens instead of %d" % (r["tokens"], args.output_len)}
            except Exception as e:  # noqa: BLE001  a broken connection: count it, reconnect
                r = {"error": type(e).__name__}
                conn.close()
                conn = target.conn()
            with lock:
                if "error" in r:
                    kind = re.sub(r"\d+", "N", r["error"])[:120]
                    errors[kind] = errors.get(kind, 0) + 1
                else:
                    r["t"] = time.time() - t_start
                    results.append(r)
        conn.close()

    rss = []  # (seconds, MiB, requests done)

    def sampler():
        while True:
            now = time.time()
            with lock:
                done = len(results)
            rss.append((now - t_start, rss_mib(pid) if pid else float("nan"), done))
            if now >= stop_at:
                return
            time.sleep(min(every, max(0.0, stop_at - now)) or 0.01)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    st_thread = threading.Thread(target=sampler, daemon=True)
    st_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st_thread.join()
    wall = time.time() - t_start
    rss.append((wall, rss_mib(pid) if pid else float("nan"), len(results)))

    rc_server = None
    if proc:
        proc.send_signal(signal.SIGTERM)
        try:
            rc_server = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc_server = proc.wait()

    n_err = sum(errors.values())
    ttft = [r["ttft"] for r in results]
    tbt = [x for r in results for x in r["tbts"]]
    e2e = [r["e2e"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    print("\nrequests     %d completed, %d errors in %.1f s; %.1f requests/s, %.1f output tokens/s"
          % (len(results), n_err, wall, len(results) / wall, tokens / wall))
    for kind, n in sorted(errors.items(), key=lambda kv: -kv[1]):
        print("  error      %6d x %s" % (n, kind))
    for name, xs in (("TTFT", ttft), ("TBT", tbt), ("end to end", e2e)):
        print("%-12s p50 %8.1f ms   p99 %8.1f ms   max %8.1f ms   (%d samples)"
              % (name, 1e3 * pct(xs, 50), 1e3 * pct(xs, 99), 1e3 * max(xs) if xs else float("nan"), len(xs)))
    print("RSS over time (server pid %s):" % pid)
    for t, m, done in rss:
        print("  %7.1f s  %8.1f MiB  %7d requests done" % (t, m, done))
    after_warm = [m for t, m, _ in rss if t >= warmup]
    base = after_warm[0] if after_warm else float("nan")
    # under load: the last sample of the duration (the one after every client ended comes after the drain)
    end = [m for t, m, _ in rss if t <= args.duration + 0.5][-1]
    growth = end - base
    peak = max((m for _, m, _ in rss if m == m), default=float("nan"))
    slope = rss_slope([(t, m) for t, m, _ in rss if warmup <= t <= args.duration + 0.5])
    flat = growth <= args.max_rss_growth if pid else True
    print("RSS          after the warm-up (%.0f s) %.1f MiB, at the end of the duration %.1f MiB, growth %+.1f MiB, "
          "slope after the warm-up %+.2f MiB/min, peak %.1f MiB, after the last request %.1f MiB: %s"
          % (warmup, base, end, growth, slope, peak, rss[-1][1],
             "flat (within %.0f MiB)" % args.max_rss_growth if flat else "GREW (more than %.0f MiB)"
             % args.max_rss_growth))
    if proc:
        print("server       exit status %d after SIGTERM; log %s" % (rc_server, args.log))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"clients": args.clients, "duration_s": wall, "completed": len(results), "errors": errors,
                       "output_tokens": tokens,
                       "ttft_ms": {"p50": 1e3 * pct(ttft, 50), "p99": 1e3 * pct(ttft, 99)},
                       "tbt_ms": {"p50": 1e3 * pct(tbt, 50), "p99": 1e3 * pct(tbt, 99)},
                       "e2e_ms": {"p50": 1e3 * pct(e2e, 50), "p99": 1e3 * pct(e2e, 99)},
                       "rss_mib": rss, "rss_growth_mib": growth, "rss_slope_mib_per_min": slope,
                       "server_exit": rc_server}, f, indent=1)
    ok = n_err == 0 and flat and len(results) > 0 and rc_server in (None, 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
