#!/usr/bin/env python3
"""`strata serve`'s resident memory under a soak of distinct prompts (issue
17, Deliver: Memory): on the default model with a small device KV cache
(--kv-mem) and host tier (--kv-host-mem), two clients send distinct prompts
of ~110 tokens (no prefix shared beyond the template) until both tiers have
filled and evict; then RSS (VmRSS) is sampled after every request of the
measured phase. Checks:

  - every request answers 200, and /metrics shows both tiers full (blocks
    cached up to their size, none free), i.e. the soak churned them;
  - RSS grows by at most max(6 MiB, 3%) over the measured phase (after the
    warm-up): the prefix cache, its tiers and the per-request state do not
    grow with the number of distinct prompts;
  - the anonymous RSS (RssAnon: heap, KV, activations; not the mapped model
    nor the shared libraries, file-backed, tens of MB more in a CUDA build)
    stays within the configured budgets: --kv-mem + --kv-host-mem + the
    engine's activations and buffers (a fixed allowance, printed).
A sanitizer build (ASan's quarantine, TSan's shadow: RSS means nothing there)
runs a short soak and checks the answers only. About 25 s on 2 cores.
"""
import http.client
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import testlib  # noqa: E402
from testlib import check, sanitized_build  # noqa: E402
import test_server as ts  # noqa: E402  (Server, metrics)

SAN = sanitized_build()
KV_MEM = 8 << 20        # ~350 tokens of the default model's bf16 KV (23 KiB per token)
KV_HOST = 6 << 20
MAX_LEN = 256           # one sequence's worth of KV fits in KV_MEM (the pool holds at least one)
WARMUP = 2 if SAN else 8   # prompts per client before measuring (both tiers full after ~4 in all)
MEASURED = 2 if SAN else 10  # prompts per client measured
ALLOWANCE = 128 << 20   # activations, buffers, heap (a CPU-only build: ~25 MiB anonymous in all), the CUDA runtime's own (a CUDA build on a machine without a GPU: ~95 MiB more)


def rss_anon_kb(pid):
    """Anonymous resident memory (heap, KV, activations): RssAnon of /proc/PID/status. File-backed pages (the
    mapped model, the shared libraries: the CUDA runtime's tens of MB in a CUDA build) are not in it."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return -1


def prompt(i):
    r = random.Random(i)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(r.choice(letters) for _ in range(r.randint(3, 7))) for _ in range(30)]
    return "Note %d. %s." % (i, " ".join(words))


def main():
    model = default_model.path()
    t0 = time.time()
    srv = ts.Server(model, "--kv-mem", str(KV_MEM), "--kv-host-mem", str(KV_HOST), "--max-batch", "2",
                    "--max-model-len", str(MAX_LEN), "--threads", "2", tag="rss")
    rss, anon, errors, lock = [], [], [], threading.Lock()
    counter = {"next": 0, "done": 0}

    def client(n):
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
        for _ in range(n):
            with lock:
                i = counter["next"]
                counter["next"] += 1
            body = json.dumps({"prompt": prompt(i), "max_tokens": 1, "temperature": 0})
            try:
                c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = c.getresponse()
                data = r.read()
                if r.status != 200:
                    raise RuntimeError("%d %r" % (r.status, data[:200]))
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e))
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
            with lock:
                counter["done"] += 1
                if measuring[0]:
                    rss.append(srv.rss_kb())
                    anon.append(rss_anon_kb(srv.proc.pid))
        c.close()

    try:
        measuring = [False]
        for phase, n in (("warm-up", WARMUP), ("measured", MEASURED)):
            measuring[0] = phase == "measured"
            if measuring[0]:
                base = srv.rss_kb()
            th = [threading.Thread(target=client, args=(n,)) for _ in range(2)]
            for t in th:
                t.start()
            for t in th:
                t.join()
        m = ts.metrics(srv)
        check(not errors, "%d distinct prompts answered (%s)" % (counter["done"], errors[:3]))

        def blocks(tier, state):
            return int(m.get(("strata_kv_blocks", '{tier="%s",state="%s"}' % (tier, state)), -1))
        dev, host = (blocks("device", "cached"), blocks("device", "free")), (blocks("host", "cached"),
                                                                          blocks("host", "free"))
        # the prompts' tokens are many times both tiers: the device holds cached blocks (a few may be
        # free after the last request's end), the host tier is full
        check(dev[0] > 0 and dev[1] <= max(2, (dev[0] + dev[1]) // 4) and host[0] > 0 and host[1] == 0,
              "both KV tiers filled and evict: device cached %d free %d, host cached %d free %d"
              % (dev[0], dev[1], host[0], host[1]))
        top, end = max(rss), rss[-1]
        growth = top - base
        tol = max(6 * 1024, base * 3 // 100)
        budget = (KV_MEM + KV_HOST + ALLOWANCE) // 1024
        print("RSS (KiB): after warm-up %d, measured phase max %d, end %d; growth %d (tolerance %d); anonymous "
              "max %d, budget %d" % (base, top, end, growth, tol, max(anon), budget))
        if SAN:
            print("resident memory not asserted in a sanitizer build")
        else:
            check(growth <= tol, "RSS growth over %d distinct prompts after warm-up: %d KiB (at most %d)"
                  % (len(rss), growth, tol))
            check(max(anon) <= budget, "anonymous RSS %d KiB within --kv-mem + --kv-host-mem + %d MiB (%d KiB; "
                  "the mapped model and libraries are file-backed)" % (max(anon), ALLOWANCE >> 20, budget))
    finally:
        rc = srv.stop()
        check(rc == 0, "SIGTERM: the server exits 0 (%s)" % rc)
        if testlib.failures:
            print("---- server log (tail) ----\n" + srv.tail())
    print("test_server_rss: %.1f s" % (time.time() - t0))
    return testlib.summary("test_server_rss")


if __name__ == "__main__":
    sys.exit(main())
