#!/usr/bin/env python3
"""Requests longer than the device KV pool through `strata serve --kv-stream`
(issue 13, item 6), on the default model (CPU), on a free loopback port:

  - server S: a pool of 16 blocks (256 tokens), --max-model-len 2048,
    --kv-stream; server R: the same without a small pool (it holds every
    request). A ~1100-token prompt and a short one, greedy: S answers both
    with R's texts and usage (the long one ran with its KV in host memory,
    the short one in the pool), and a streamed request and a short one sent
    together both finish with R's texts;
  - without --kv-stream the same pool refuses to start, naming --kv-stream;
    with --kv-dtype fp8 (scales streamed too) the long prompt answers;
  - a prompt past --max-model-len is still a 400 context_length_exceeded.
test_server.py's Server / raw are reused. About 20 s on 2 cores.
"""
import os
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import test_server as ts  # noqa: E402
import testlib  # noqa: E402
from testlib import BIN, check, sanitized_build  # noqa: E402

SAN = sanitized_build()
TIMEOUT = 600 if SAN else 120
LONG = ("A river starts as rain on a mountain, gathers in streams, and runs down through forests and fields, "
        "carving valleys over thousands of years until it reaches the sea. ") * 34 + "The river"
SHORT = "The capital of France is"


def complete(srv, prompt, max_tokens=8):
    st, obj, _ = ts.raw(srv, "POST", "/v1/completions",
                        {"model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                        timeout=TIMEOUT)
    if st != 200 or not isinstance(obj, dict):
        print("   %d %r" % (st, obj))
        return st, None, -1
    return st, obj["choices"][0]["text"], (obj.get("usage") or {}).get("prompt_tokens", -1)


def main():
    model = default_model.path()
    r = ts.Server(model, "--max-model-len", "2048", "--max-batch", "2", "--no-rooflines", tag="kv_stream_r")
    want_long = complete(r, LONG)
    want_short = complete(r, SHORT)
    r.stop()
    check(want_long[0] == 200 and want_long[2] > 1000, "reference: the long prompt (%d tokens) answers" % want_long[2])

    s = ts.Server(model, "--max-model-len", "2048", "--max-batch", "2", "--kv-blocks", "16", "--kv-stream",
                  "--no-rooflines", tag="kv_stream_s")
    got = complete(s, LONG)
    check(got == want_long, "the long prompt streamed answers as with a roomy pool (%r vs %r)" % (got, want_long))
    got = complete(s, SHORT)
    check(got == want_short, "the short prompt answers as with a roomy pool (%r vs %r)" % (got, want_short))
    res = {}

    def go(name, prompt):
        res[name] = complete(s, prompt)

    th = [threading.Thread(target=go, args=("long", LONG)), threading.Thread(target=go, args=("short", SHORT))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    check(res.get("long") == want_long and res.get("short") == want_short,
          "a streamed request beside a short one: both answer as alone (%r)" % res)
    st, obj, _ = ts.raw(s, "POST", "/v1/completions", {"model": "smol", "prompt": LONG * 2, "max_tokens": 4})
    check(st == 400 and "context_length_exceeded" in str(obj), "past --max-model-len: 400 (%d %r)" % (st, obj))
    rc = s.stop()
    check(rc == 0, "SIGTERM: exit 0 (%s)" % rc)

    p = subprocess.run([BIN, "serve", model, "--port", "0", "--max-model-len", "2048", "--kv-blocks", "16",
                        "--no-rooflines"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    check(p.returncode != 0 and "--kv-stream" in p.stderr, "a pool smaller than one sequence without --kv-stream: "
          "refused naming it (rc %d: %s)" % (p.returncode, p.stderr.strip()[-200:]))
    f8 = ts.Server(model, "--max-model-len", "2048", "--max-batch", "2", "--kv-blocks", "16", "--kv-stream",
                   "--kv-dtype", "fp8", "--no-rooflines", tag="kv_stream_fp8")
    st, text, n = complete(f8, LONG)
    check(st == 200 and n == want_long[2] and text, "fp8 KV streamed: the long prompt answers (%d, %r)" % (st, text))
    check(f8.stop() == 0, "fp8 server: SIGTERM, exit 0")
    return testlib.summary("test_server_kv_stream")


if __name__ == "__main__":
    sys.exit(main())
