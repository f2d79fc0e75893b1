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
  - a prompt past --max-model-len is still a 400 context_length_exceeded;
  - the SSD tier: server D streams with --kv-segment 4096, --kv-stream-mem of
    one segment (4096 tokens x 23040 bytes of bf16 KV) and --kv-ssd-dir, and
    answers a ~4170-token prompt (its first segment goes to the unlinked file
    there, read back by every later pass; the default passes of 258 tokens
    cut at the segment's boundary) with the text and usage of a server
    whose pool holds it; the log names the file; none is left behind;
  - a request past --kv-stream-mem (1M, less than a segment) fails with a 500
    naming --kv-stream-mem, and the server goes on answering.
test_server.py's Server / raw are reused. About 60 s on 2 cores (most of it
the two ~4170-token prefills).
"""
import os
import shutil
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
# ~4170 tokens: past one segment of 4096
LONGER = ("In the old harbour town the fishermen mend their nets at dawn, the bakers light their ovens, and the "
          "gulls circle over the boats that come back with the tide. ") * 119 + "In the harbour"
# the default model's KV per token: 30 layers x K and V x 3 kv heads x 64 x 2 bytes (bf16)
KV_TOKEN = 30 * 2 * 3 * 64 * 2
SEG = 4096


def complete_usage(srv, prompt, max_tokens=8):
    """-> (status, text, usage) of a greedy completion"""
    st, obj, _ = ts.raw(srv, "POST", "/v1/completions",
                        {"model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                        timeout=TIMEOUT)
    if st != 200 or not isinstance(obj, dict):
        print("   %d %r" % (st, obj))
        return st, None, None
    return st, obj["choices"][0]["text"], obj.get("usage")


def complete(srv, prompt, max_tokens=8):
    """-> (status, text, prompt tokens) of a greedy completion"""
    st, text, usage = complete_usage(srv, prompt, max_tokens)
    return st, text, (usage or {}).get("prompt_tokens", -1)


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

    # the SSD tier: the host holds one segment of 4096 tokens (--kv-stream-mem), so the ~4170-token prompt's
    # first segment goes to the file once its keys are all stored; the default passes (258 tokens: 256 +
    # --max-batch 2) are cut at the segment's boundary by the scheduler: a pass that wrote into both segments
    # would need both on the host
    r2 = ts.Server(model, "--max-model-len", "8192", "--max-batch", "1", "--no-rooflines", tag="kv_stream_r2")
    want = complete_usage(r2, LONGER)
    r2.stop()
    check(want[0] == 200 and want[2] and SEG < want[2]["prompt_tokens"] < 2 * SEG,
          "reference: the longer prompt answers (%r)" % (want[2],))
    ssd = os.path.join(ts.TMP, "kv_stream_ssd")
    shutil.rmtree(ssd, ignore_errors=True)
    d = ts.Server(model, "--max-model-len", "8192", "--max-batch", "2", "--kv-blocks", "16",
                  "--kv-stream", "--kv-segment", str(SEG), "--kv-stream-mem", str(SEG * KV_TOKEN), "--kv-ssd-dir",
                  ssd, "--no-rooflines", tag="kv_stream_ssd")
    got = complete_usage(d, LONGER)
    check(got == want, "a segment in the SSD file: the answer and usage of a roomy pool (%r vs %r)" % (got, want))
    check(d.stop() == 0, "SSD server: SIGTERM, exit 0")
    with open(d.log_path, errors="replace") as fh:
        log = fh.read()
    check("kv_stream: segments past --kv-stream-mem go to %s/strata-kv-stream-" % ssd in log,
          "the streamed sequence reached the SSD tier (log: %s)" % log[-600:])
    left = [f for f in (os.listdir(ssd) if os.path.isdir(ssd) else []) if f.startswith("strata-kv-stream-")]
    check(left == [], "no stream file is left in %s (%r)" % (ssd, left))

    # past --kv-stream-mem (less than one segment, no SSD tier): the request fails naming the option, and the
    # server answers the next one
    f = ts.Server(model, "--max-model-len", "2048", "--max-batch", "2", "--kv-blocks", "16", "--kv-stream",
                  "--kv-stream-mem", "1M", "--no-rooflines", tag="kv_stream_full")
    st, obj, _ = ts.raw(f, "POST", "/v1/completions",
                        {"model": "smol", "prompt": LONG, "max_tokens": 4, "temperature": 0}, timeout=TIMEOUT)
    msg = obj.get("error", {}).get("message", "") if isinstance(obj, dict) else str(obj)
    check(st == 500 and "does not fit" in msg and "allowed (--kv-stream-mem" in msg,
          "a context past --kv-stream-mem: 500 naming it (%d %r)" % (st, msg))
    check(complete(f, SHORT) == want_short, "then a short prompt answers")
    check(f.stop() == 0, "that server: SIGTERM, exit 0")
    return testlib.summary("test_server_kv_stream")


if __name__ == "__main__":
    sys.exit(main())
