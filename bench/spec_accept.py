#!/usr/bin/env python3
"""Acceptance of speculative drafts on a real model, on tasks where the answer
repeats its input (editing, summarizing, code), and what it implies.

  python3 bench/spec_accept.py [--bin build/strata] [--model MODEL] [--spec lookup|draft:PATH]
                               [--n 200] [--spec-cost C] [--verify-ms K:MS,...] [--step-ms MS]

Runs `strata run MODEL --temp 0 -n N` per task, once plain and once with the
drafts, checks the two texts are equal (greedy output must not change), and
reads the stats lines: G tokens generated, A of D drafts accepted. With one
sequence every decode pass yields 1 + the drafts it accepted, so the passes
are G - A (less the prefill's token) and the tokens per pass G / (G - A).
Given the measured cost of a pass with k drafts (`strata bench --verify`) on
another model and machine (--verify-ms 4:520.1,8:523.4 and --step-ms, the
one-token step), it prints the implied tok/s: tokens per pass / cost of a pass
with the mean drafts per pass — labelled as implied, not measured.
"""
import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

EDIT_TEXT = ("The lighthouse stood on the edge of the cliff for more then two hundred years. Every night the keeper "
             "climbed the the narrow stairs, lit the lamp and watched the ships pass safely into the harbour. "
             "When the storm of 1893 destroyed the old pier, the lighthouse was the only building that survived, "
             "and the town decided to keep it as a museum.")
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
SUMMARY_TEXT = ("Bread baking is an old craft. Flour, water, salt and yeast are mixed and kneaded until the dough is "
                "smooth. The dough is left to rise for several hours, shaped into loaves and baked in a hot oven "
                "until the crust turns golden brown. Good bread needs time: a slow rise gives the yeast time to "
                "develop flavour, and a hot oven gives the loaf its crust.")

TASKS = [
    ("edit", "Correct the spelling mistakes in this paragraph and write it out again in full:\n\n" + EDIT_TEXT),
    ("edit-2", "Rewrite this paragraph exactly, but in the present tense:\n\n" + EDIT_TEXT),
    ("code", "Add a docstring and comments to this Python function and show the whole function:\n\n" + CODE),
    ("code-2", "Rename the variable `total` to `running_sum` in this function and show the result:\n\n" + CODE),
    ("summary", "Summarize this text in three sentences:\n\n" + SUMMARY_TEXT),
    ("qa", "What is the capital of France? Answer in one sentence."),
]

STATS = re.compile(r"generated: (\d+) tokens in ([\d.]+) s")
DRAFTS = re.compile(r"drafts: (\d+) of (\d+) accepted")


def run(args, prompt, extra):
    cmd = [args.bin, "run", args.model, "-p", prompt, "--temp", "0", "-n", str(args.n), "--seed", "1",
           "--device", args.device] + extra
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit("strata run failed (%d): %s" % (p.returncode, p.stderr[-500:]))
    g = STATS.search(p.stderr)
    d = DRAFTS.search(p.stderr)
    return p.stdout, int(g.group(1)), float(g.group(2)), (int(d.group(1)), int(d.group(2))) if d else (0, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "strata"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--spec", default="lookup", help="lookup, or draft:PATH")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--spec-cost", type=float, default=0,
                    help="one draft's cost in one-token steps, fixed (default: measured as it runs); the cost of "
                         "the machine the implied speed is for, e.g. 0.01 for a model streamed over PCIe")
    ap.add_argument("--verify-ms", default="", help="K:MS,... measured verification pass costs")
    ap.add_argument("--step-ms", type=float, default=0, help="the measured one-token step")
    args = ap.parse_args()
    extra = ["--spec", "lookup"] if args.spec == "lookup" else ["--draft", args.spec.split(":", 1)[1]]
    if args.spec_cost > 0:
        extra += ["--spec-cost", str(args.spec_cost)]
    cost = {}
    for kv in filter(None, args.verify_ms.split(",")):
        k, ms = kv.split(":")
        cost[int(k)] = float(ms)
    tot_g = tot_a = tot_d = 0
    print("%-8s %6s %8s %8s %8s %10s %9s %9s" % ("task", "tokens", "drafted", "accepted", "accept", "tok/pass",
                                                  "plain s", "spec s"))
    for name, prompt in TASKS:
        plain, g0, t0, _ = run(args, prompt, [])
        spec, g, t, (a, d) = run(args, prompt, extra)
        if spec != plain or g != g0:
            print("%s: the text with drafts differs from plain decoding" % name)
            return 1
        passes = g - 1 - a  # the first token comes from the prefill
        print("%-8s %6d %8d %8d %7.1f%% %10.2f %9.2f %9.2f" % (name, g, d, a, 100.0 * a / d if d else 0,
                                                             (g - 1) / passes if passes else 0, t0, t))
        tot_g += g - 1
        tot_a += a
        tot_d += d
    passes = tot_g - tot_a
    tpp = tot_g / passes
    print("all      %6d %8d %8d %7.1f%% %10.2f   (greedy text identical to plain decoding in every task)" %
          (tot_g, tot_d, tot_a, 100.0 * tot_a / max(tot_d, 1), tpp))
    mean_k = tot_d / max(passes, 1)
    print("mean drafts per pass %.2f; tokens per pass %.2f (measured on %s)" % (mean_k, tpp, os.path.basename(args.model)))
    if cost and args.step_ms > 0:
        ks = sorted(cost)
        # the pass cost at the mean draft count, interpolated between the measured k (flat beyond)
        k0 = max([k for k in ks if k <= mean_k] or [ks[0]])
        k1 = min([k for k in ks if k >= mean_k] or [ks[-1]])
        c = cost[k0] if k0 == k1 else cost[k0] + (cost[k1] - cost[k0]) * (mean_k - k0) / (k1 - k0)
        print("implied: a pass of %.1f drafts costs %.1f ms (measured %s; one-token step %.1f ms) -> %.2f tok/s "
              "(plain %.2f tok/s): implied from the acceptance above, not measured" %
              (mean_k, c, ", ".join("k=%d: %.1f ms" % (k, cost[k]) for k in ks), args.step_ms,
               tpp / c * 1e3, 1e3 / args.step_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
