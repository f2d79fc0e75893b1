#!/usr/bin/env python3
"""End to end on a GPU: `strata serve --device cuda` samples on the device
(the backend's sample op; the runner copies back token ids only) unless
--host-sample, which keeps the host sampler. Both draw with the same
per-request random state and the same id-order rule, so seeded requests must
give the same text both ways (a token may differ only where a uniform draw
lies within float rounding of a boundary: rare, reported).

Runs the default model (tests/default_model.py), one request at a time (same
batch shapes, same logits), over a mix of temperature / top_k / top_p / min_p
and a repetition-penalty request (host-sampled in both runs).
Usage: STRATA_BIN=build-gpu/strata python3 tests/gpu/check_device_sample.py
Prints PASS/FAIL lines; exit status 1 on failure, 2 when it cannot run."""
import http.client
import json
import os
import re
import select
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import default_model  # noqa: E402

BIN = os.environ.get("STRATA_BIN", "build-gpu/strata")

REQS = [
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.0, top_k=40, top_p=0.9),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.3, top_p=0.95, min_p=0.05),
    dict(temperature=1.0),
    dict(temperature=0.8, top_p=0.5),
    dict(temperature=1.0, repetition_penalty=1.2),
]
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "List three colors:"]


def start(model, extra_args):
    cmd = [BIN, "serve", model, "--device", "cuda", "--port", "0", "--max-batch", "4", "--no-rooflines", *extra_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        r, _, _ = select.select([p.stdout], [], [], 0.5)
        if r:
            m = re.match(rb"listening on http://127\.0\.0\.1:(\d+)$", p.stdout.readline().strip())
            if m:
                return p, int(m.group(1))
    p.kill()
    raise RuntimeError("the server did not start")


def complete(port, prompt, seed, extra):
    body = dict(prompt=prompt, max_tokens=48, seed=seed, **extra)  # no model name: the served one
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, data))
    return data["choices"][0]["text"]


def run(model, device_sample):
    p, port = start(model, [] if device_sample else ["--host-sample"])
    out = []
    t0 = time.time()
    try:
        for i, extra in enumerate(REQS):
            for j, prompt in enumerate(PROMPTS):
                out.append(complete(port, prompt, 1000 + 17 * i + j, extra))
    finally:
        p.terminate()
        p.wait()
    return out, time.time() - t0


def main():
    model = default_model.path()
    if not model or not os.path.exists(BIN):
        print("cannot run: model %r, binary %r" % (model, BIN))
        return 2
    dev, t_dev = run(model, True)
    host, t_host = run(model, False)
    n = len(dev)
    same = sum(a == b for a, b in zip(dev, host))
    distinct = len(set(dev))
    for k, (a, b) in enumerate(zip(dev, host)):
        if a != b:
            print("      differs: %r %r\n        device %r\n        host   %r" % (REQS[k // len(PROMPTS)],
                  PROMPTS[k % len(PROMPTS)], a[:80], b[:80]))
    # all but a rare boundary case identical; and sampling really samples
    ok = same >= n - 2 and distinct >= n // 2
    print("%s  serve on cuda, device sampling vs --host-sample: %d of %d seeded completions identical, "
          "%d distinct texts  (%.1f s vs %.1f s)" % ("PASS" if ok else "FAIL", same, n, distinct, t_dev, t_host))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
