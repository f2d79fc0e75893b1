#!/usr/bin/env python3
"""Speculative decoding end to end on the default model (CPU): `strata run`
and `strata serve` with --spec lookup and with a draft model (the default
model drafting for itself), `strata bench --verify`, and the options' errors.

Checks:
  - `strata run --temp 0`: the text of each prompt (one that repeats itself,
    so lookup finds drafts, and a chat question) is the same with --spec
    lookup and with --draft MODEL as without; the stats line reports drafts
    accepted (lookup: some; the model drafting for itself: all but those of
    the last step past the end of the turn);
  - `strata serve --spec lookup`: greedy completions (several at once) give
    the texts of a server without it; /metrics counts accepted and rejected
    drafts; a sampled completion (temperature 0.8, seeded)
    answers 200 with its max_tokens;
  - `strata bench --verify 1,4`: a line per draft count with the pass's time
    and its ratio to a one-token decode step;
  - errors (exit 2, naming the option): --spec draft without --draft,
    --spec-k without --spec, --spec lookup with --draft, --spec-k 33, --spec
    on bench; a --draft path that does not exist: exit 1 naming it.
About 40 s on 2 cores.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import test_server as ts  # noqa: E402  (Server, raw, metrics, mval)
import testlib  # noqa: E402
from testlib import BIN, check, sanitized_build  # noqa: E402

SAN = sanitized_build()
TIMEOUT = 600 if SAN else 180
N = 24 if SAN else 40

PROMPTS = [
    "Repeat after me three times: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is the capital of France?",
]
STATS = re.compile(r"generated: (\d+) tokens.*?(?:, drafts: (\d+) of (\d+) accepted)?, load", re.S)


def run(model, prompt, *extra):
    p = subprocess.run([BIN, "run", model, "-p", prompt, "--temp", "0", "-n", str(N), "--seed", "1", *extra],
                       capture_output=True, text=True, timeout=TIMEOUT)
    return p.returncode, p.stdout, p.stderr


def drafts(stderr):
    m = re.search(r"drafts: (\d+) of (\d+) accepted", stderr)
    return (int(m.group(1)), int(m.group(2))) if m else None


def test_run(model):
    for i, prompt in enumerate(PROMPTS):
        rc, plain, err = run(model, prompt)
        check(rc == 0 and plain.strip(), "run: prompt %d plain: exit %d, %d chars" % (i, rc, len(plain)))
        check(drafts(err) is None, "run: prompt %d plain: no drafts in the stats line" % i)
        for name, extra in (("lookup", ["--spec", "lookup"]), ("draft", ["--draft", model])):
            rc, out, err = run(model, prompt, *extra)
            check(rc == 0 and out == plain, "run --spec %s: prompt %d: the plain text (%r vs %r)"
                  % (name, i, out[-60:], plain[-60:]))
            d = drafts(err)
            check(d is not None and d[1] > 0, "run --spec %s: prompt %d: drafts reported (%s)" % (name, i, d))
            if d and name == "draft":
                # the model drafting for itself: every draft is its argmax; only the drafts of the last step
                # past the end of turn (at most --spec-k, 7) go unused
                check(d[1] - d[0] <= 7, "run --draft (itself): every draft accepted but past the end (%d of %d)" % d)
            if d and name == "lookup" and i == 0:
                check(d[0] > 0, "run --spec lookup: the repeating prompt has drafts accepted (%d of %d)" % d)


def completions(srv, n):
    cl = srv.client()
    out = []
    for prompt in PROMPTS:
        r = cl.completions.create(model="smol", prompt=prompt, max_tokens=n, temperature=0)
        out.append(r.choices[0].text)
    return out


def test_serve(model):
    plain = ts.Server(model, "--no-rooflines", tag="spec_plain")
    try:
        want = completions(plain, N)
    finally:
        check(plain.stop() == 0, "serve (plain): exit 0")
    srv = ts.Server(model, "--no-rooflines", "--spec", "lookup", tag="spec_lookup")
    try:
        got = completions(srv, N)
        for i in range(len(PROMPTS)):
            check(got[i] == want[i], "serve --spec lookup: prompt %d: the plain server's text (%r vs %r)"
                  % (i, got[i][-50:], want[i][-50:]))
        cl = srv.client()
        r = cl.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=N, temperature=0.8, seed=7)
        check(r.usage.completion_tokens == N or r.choices[0].finish_reason == "stop",
              "serve --spec lookup: a sampled completion: %d tokens, %s" % (r.usage.completion_tokens,
                                                                             r.choices[0].finish_reason))
        m = ts.metrics(srv)
        acc = ts.mval(m, "strata_spec_draft_tokens_total", '{result="accepted"}')
        rej = ts.mval(m, "strata_spec_draft_tokens_total", '{result="rejected"}')
        check(acc is not None and rej is not None and acc + rej > 0,
              "serve --spec lookup: /metrics counts the drafts verified: accepted %s, rejected %s" % (acc, rej))
    finally:
        check(srv.stop() == 0, "serve --spec lookup: exit 0")


def check_op_times(out):
    """--op-times: a table per timed run (a prefill, the decode steps, each --verify pass), its
    op rows adding up to its 'all ops' line, 'all ops' + 'outside' = the step."""
    heads = re.findall(r"^op time +(a prefill of 16 tokens|4 decode steps|8 passes of (\d+) tokens) again", out, re.M)
    check([h for h, _ in heads] == ["a prefill of 16 tokens", "4 decode steps", "8 passes of 2 tokens",
                                    "8 passes of 5 tokens"], "bench --op-times: four tables (%s)" % heads)
    tables = re.split(r"^op time +[^\n]* again with op times[^\n]*\n", out, flags=re.M)[1:]
    for t, n in zip(tables, ["16", "1", "2", "5"]):
        rows = re.findall(r"^op time +(\w+) .* n=(\d+) +[\d.]+ calls/step +[\d.]+ us/call +([\d.]+) ms/step", t, re.M)
        tot = re.search(r"^op time +all ops ([\d.]+) ms/step, outside the ops (-?[\d.]+) ms/step \(of ([\d.]+)\)", t, re.M)
        check(tot is not None and any(op.startswith("matmul") and k == n for op, k, _ in rows),
              "bench --op-times: matmul rows of n=%s and a total (%s)" % (n, rows))
        if tot:
            a, o, step = (float(x) for x in tot.groups())
            check(a > 0 and abs(a + o - step) <= 0.002 + 1e-3 * step, "op times: %g + %g = %g" % (a, o, step))
            check(abs(sum(float(ms) for _, _, ms in rows) - a) <= 0.01 * a + 0.01,
                  "op times: the rows add up to all ops (%g)" % a)


def test_bench(model):
    p = subprocess.run([BIN, "bench", model, "--prompt", "16", "--gen", "4", "--reps", "1", "--verify", "1,4",
                        "--device", "cpu", "--op-times"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    check_op_times(p.stdout)
    lines = re.findall(r"^verify +(\d+) drafts \+ 1 token in one pass, (\d+) logit rows to the host: ([\d.]+) ms "
                       r"= ([\d.]+)x a one-token decode step", p.stdout, re.M)
    check(p.returncode == 0 and [(k, r) for k, r, _, _ in lines] == [("1", "2"), ("4", "5")],
          "bench --verify 1,4: two lines (%s; exit %d)" % (lines, p.returncode))
    check(all(float(t) > 0 and float(x) > 0 for _, _, t, x in lines), "bench --verify: times and ratios > 0")


def test_errors(model):
    cases = [
        (["run", model, "-p", "x", "--spec", "draft"], 2, "--spec draft needs the draft model"),
        (["run", model, "-p", "x", "--spec-k", "4"], 2, "--spec-k and --spec-cost set the drafts"),
        (["run", model, "-p", "x", "--spec", "lookup", "--spec-cost", "0"], 2, "--spec-cost"),
        (["run", model, "-p", "x", "--spec", "lookup", "--draft", model], 2, "but --spec says lookup"),
        (["run", model, "-p", "x", "--spec", "lookup", "--spec-k", "33"], 2, "--spec-k"),
        (["run", model, "-p", "x", "--spec", "maybe"], 2, "--spec takes lookup, draft or off"),
        (["serve", model, "--spec", "draft"], 2, "--spec draft needs the draft model"),
        (["bench", model, "--spec", "lookup"], 2, "is an option of run and serve"),
        (["run", model, "-p", "x", "--draft", "/nonexistent/draft.gguf"], 1, "/nonexistent/draft.gguf"),
    ]
    for args, want_rc, want_msg in cases:
        p = subprocess.run([BIN] + args, capture_output=True, text=True, timeout=TIMEOUT)
        check(p.returncode == want_rc and want_msg in p.stderr,
              "%s: exit %d (want %d) naming %r: %s" % (" ".join(args[2:]), p.returncode, want_rc, want_msg,
                                                      p.stderr.strip()[-160:]))


def main():
    model = default_model.path()
    test_errors(model)
    test_run(model)
    test_bench(model)
    test_serve(model)
    return testlib.summary("test_spec_cli")


if __name__ == "__main__":
    sys.exit(main())
