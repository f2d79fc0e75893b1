#!/usr/bin/env python3
"""Faults injected into weight streaming and allocations (issue 17, Deliver:
Faults), through --test-fault, a hidden option of test builds
(cmake -DSTRATA_TESTING=ON):

  - slow reads (slow-read:MS: every weight read from the file lands MS ms
    late, its buffer holding a poison pattern until then): `strata logits`
    with every group streamed writes the bytes of the resident run, and
    `strata run` with streamed weights answers as without the fault;
  - read errors reach `strata run` too (read-error:N): exit 1, the message
    names the file and the offset (the option was ignored there before);
  - device and pinned host allocation failures (device-alloc:N,
    host-alloc:N: the Nth allocation of the backend fails): for every N up to
    the number of allocations `strata run` makes (sampled past the first 40
    in a sanitizer build; streamed weights, and resident ones for host-alloc),
    exit 1 with one clean message naming the kind of allocation, its size and
    what it was for (the weights, the KV pool, an activation buffer, ...: more
    than the tool, engine and runner labels), no crash, no sanitizer report
    (the ASan build checks leaks at exit); past the last allocation it runs;
  - `strata logits` (the tools' own loading path) and `strata serve` fail the
    same way.
"""
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import testlib  # noqa: E402
from testlib import BIN, SRC, check, sanitized_build  # noqa: E402

TMP = testlib.tmp_dir("faults")
SAN = sanitized_build()
BW = ["--h2d-bw", "10", "--ssd-bw", "1"]  # no probes: deterministic plans
# the default model with every layer streamed: the least device budget for a
# 128-token context (printed by the budget error below 40 MB), 8 MB of pinned host
STREAM = ["--ctx", "128", "--batch", "16", "--device-mem", "41M", "--host-mem", "8M", "--threads", "2"] + BW
SAN_MARKS = ("Sanitizer", "runtime error", "LeakSanitizer", "Segmentation", "Aborted", "core dumped")


def run(args, timeout=120):
    return subprocess.run([BIN] + args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def clean_failure(p, want):
    """exit 1, the wanted text on the last line of stderr, no sanitizer report or crash."""
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    return p.returncode == 1 and want in last and not any(m in p.stderr for m in SAN_MARKS), last


def faults_available():
    """Whether the binary is a test build (a build without it does not know --test-fault at all)."""
    p = run(["run", "nonexistent-model", "--test-fault", "read-error:1"])
    return "unknown option '--test-fault'" not in p.stderr


def test_slow_reads(model):
    # logits on a reference model, every group from the file (the plan's minimum budgets)
    m = os.path.join(SRC, "tests", "data", "models", "gqa_f32")
    toks = " ".join(str((i * 37 + 5) % 200) for i in range(20))
    ref, out = os.path.join(TMP, "ref.f32"), os.path.join(TMP, "slow.f32")
    p = run(["logits", m, "--tokens", toks, "--out", ref, "--ctx", "48", "--batch", "8"])
    check(p.returncode == 0, "logits, resident: %s" % p.stderr[-300:])
    p = run(["plan", m, "--ctx", "48", "--batch", "8", "--device-mem", "1T", "--host-mem", "1T"] + BW)
    mm = re.search(r"minimum\s+device .*?\((\d+) bytes\), host .*?\((\d+) bytes\)", p.stdout)
    check(mm is not None, "plan prints the minimum budgets: %s" % p.stdout[-300:])
    if not mm:
        return
    budget = ["--device-mem", mm.group(1), "--host-mem", mm.group(2)] + BW
    for fault in ("slow-read:15", "slow-read:1"):
        t = time.time()
        p = run(["logits", m, "--tokens", toks, "--out", out, "--ctx", "48", "--batch", "8", "--chunk", "4",
                 "--test-fault", fault] + budget)
        same = p.returncode == 0 and open(out, "rb").read() == open(ref, "rb").read()
        check(same, "logits with every weight group streamed and %s: the resident run's bytes (%.1f s)%s"
              % (fault, time.time() - t, "" if p.returncode == 0 else ": " + p.stderr[-300:]))
    # strata run (the engine through the public API) with streamed weights
    q = ["-p", "What is the capital of France?", "-n", "8", "--temp", "0", "-q"]
    base = run(["run", model] + q + STREAM)
    slow = run(["run", model] + q + STREAM + ["--test-fault", "slow-read:10"])
    check(base.returncode == 0 and base.stdout and slow.returncode == 0 and slow.stdout == base.stdout,
          "strata run, streamed weights, slow-read:10: the same answer %r (got %r, rc %d %s)"
          % (base.stdout, slow.stdout, slow.returncode, slow.stderr[-200:]))


def test_read_error_run(model):
    p = run(["run", model, "-p", "hi", "-n", "4", "-q", "--test-fault", "read-error:3"] + STREAM)
    ok, last = clean_failure(p, "failed: Input/output error")
    check(ok and "offset" in last and model in last,
          "strata run --test-fault read-error:3: exit 1 naming the file and offset (rc %d: %r)" % (p.returncode, last))


GENERIC = ("strata model", "strata run", "strata logits", "strata serve", "engine", "runner", "weights")


def unnamed(last, what):
    """Whether the message of a failed allocation does not say what it was for: only generic
    labels (the tool, engine, runner) before "device allocation #N (M bytes) failed"."""
    head = last.split(what)[0].rstrip(": ")
    return all(part.strip() in GENERIC for part in head.split(": "))


def alloc_sweep(model, kind, limit, unnamed_out=None, extra=STREAM):
    """strata run with the Nth allocation of `kind` failing, N = 1, 2, ...: -> (allocations, bad cases);
    the messages that do not name what the allocation was for go to unnamed_out."""
    bad, n, step = [], 1, 1
    while n <= limit:
        p = run(["run", model, "-p", "hi", "-n", "2", "--temp", "0", "-q", "--test-fault", "%s:%d" % (kind, n)]
                + extra)
        if p.returncode == 0:
            return n - 1, bad
        what = "device allocation #%d" % n if kind == "device-alloc" else "pinned host allocation #%d" % n
        ok, last = clean_failure(p, what)
        if not ok or "injected fault" not in last or len(p.stderr.strip().splitlines()) > 3:
            bad.append((n, p.returncode, p.stderr[-400:]))
        elif unnamed_out is not None and unnamed(last, what):
            unnamed_out.append(last)
        if SAN and n >= 40:
            step = 5  # sanitizer build: every 5th past the first 40 (each start takes ~1 s there)
        n += step
    return None, bad


def test_alloc_failures(model):
    resident = ["--ctx", "256", "--threads", "2"] + BW
    for kind, limit, extra in (("device-alloc", 400, STREAM), ("host-alloc", 100, STREAM),
                               ("host-alloc", 100, resident)):
        t = time.time()
        nameless = []
        total, bad = alloc_sweep(model, kind, limit, nameless, extra)
        where = "streamed" if extra is STREAM else "resident"
        check(total is not None and total >= 1 and not bad,
              "strata run --test-fault %s:N (%s weights): every failure exits 1 with one clean message (%s "
              "allocations, %.1f s)%s" % (kind, where, total, time.time() - t, "" if not bad else ": %r" % bad[:3]))
        check(not nameless, "strata run --test-fault %s:N (%s weights): every message names what the allocation "
              "was for (%d do not: %r)" % (kind, where, len(nameless), nameless[:3]))
    # what failed is named where the weights manager allocates
    p = run(["run", model, "-p", "hi", "-n", "2", "-q", "--test-fault", "host-alloc:1"] + STREAM)
    ok, last = clean_failure(p, "pinned host allocation #1")
    check(ok and "pinned staging buffers" in last, "host-alloc:1: names the staging buffers (%r)" % last)
    p = run(["run", model, "-p", "hi", "-n", "2", "-q", "--test-fault", "device-alloc:1"] + STREAM)
    ok, last = clean_failure(p, "device allocation #1")
    check(ok and "matmul probe" in last, "device-alloc:1 (the start-up probe): named as such (%r)" % last)
    # the tools' own loading path (logits, bench) and the server
    m = os.path.join(SRC, "tests", "data", "models", "gqa_f32")
    for n in (1, 2, 3, 5, 8):
        p = run(["logits", m, "--tokens", "1 2 3", "--out", os.path.join(TMP, "x.f32"), "--ctx", "48", "--batch",
                 "8", "--device-mem", "400K", "--host-mem", "1M", "--test-fault", "device-alloc:%d" % n] + BW)
        ok, last = clean_failure(p, "device allocation #%d" % n)
        check(ok or p.returncode == 0, "strata logits --test-fault device-alloc:%d: exit 1, clean (rc %d: %r)"
              % (n, p.returncode, last))
    p = run(["serve", model, "--port", "0", "--max-model-len", "128", "--prefill-chunk", "16", "--max-batch", "2",
             "--device-mem", "60M", "--host-mem", "8M", "--threads", "2", "--test-fault", "device-alloc:9"] + BW,
            timeout=60)
    ok, last = clean_failure(p, "device allocation #9")
    check(ok, "strata serve --test-fault device-alloc:9: exit 1, clean (rc %d: %r)" % (p.returncode, last))


def main():
    if not os.path.isfile(BIN):
        print("FAIL  no strata binary at %s" % BIN)
        return 1
    if not faults_available():
        print("test_faults: strata built without -DSTRATA_TESTING=ON: nothing to check")
        return 0
    model = default_model.path()
    t0 = time.time()
    for name, fn in (("slow reads", test_slow_reads), ("read error in run", test_read_error_run),
                     ("allocation failures", test_alloc_failures)):
        t = time.time()
        fn(model)
        print("   (%s: %.1f s)" % (name, time.time() - t), flush=True)
    print("test_faults: %.1f s" % (time.time() - t0))
    return testlib.summary("test_faults")


if __name__ == "__main__":
    sys.exit(main())
