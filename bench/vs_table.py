#!/usr/bin/env python3
"""The side-by-side table of one run of ../shared/peer/vs-llama-cpp.sh, with ratios.

  python3 bench/vs_table.py OUT_DIR [MODEL_NAME...]

OUT_DIR holds what `vs-llama-cpp.sh run` wrote for each model file NAME.gguf (its
OUT=, default /tmp/out): strata_NAME.log (`strata bench ... --seqs ...`),
llama-bench_NAME.log (`llama-bench -p P -n G`) and llama-batched_NAME.log
(`llama-batched-bench -npl ...`). NAMEs default to every strata_*.log there, in
name order. Prints one markdown table, a column per model, tok/s as
"strata / llama.cpp = ratio" (ratio = strata / llama.cpp, two decimals):

  decode, 1 sequence           strata's `decode` line / llama-bench tg (± its spread)
  batch of 1 / batched S_TG 1  strata's `decode batch 1` / llama-batched-bench S_TG at B = 1
  batched decode, B sequences  strata's `decode batch B` / S_TG at B, for every B both have
  prefill P, fast / precise    strata's `prefill` lines by mode (the CPU's has none: default)
                               / llama-bench pp (± its spread)
  step vs its bound            strata's `decode batch` fractions of its measured bound

A figure missing from a log (a failed run, a B one side lacks) prints as "-", and
the script exits 1 when any model has no strata or no llama.cpp decode figure
at all, so a broken run is not mistaken for a table.
"""
import os
import re
import sys

NUM = r"([0-9]+(?:\.[0-9]+)?)"


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def parse_strata(text):
    """{'decode': tok/s, 'batch': {B: (tok/s, bound %)}, 'prefill MODE': tok/s, 'prompt': P}; MODE is
    fast or precise as the line says, default where it says neither (the CPU)"""
    r = {"batch": {}}
    m = re.search(r"^decode\s+\d+ tokens in [0-9.]+ s: " + NUM + " tok/s", text, re.M)
    if m:
        r["decode"] = float(m.group(1))
    for m in re.finditer(r"^decode batch\s+(\d+) sequences x \d+ steps.*?, " + NUM + r" tok/s .*?: (\d+)%\s*$",
                         text, re.M):
        r["batch"][int(m.group(1))] = (float(m.group(2)), int(m.group(3)))
    for m in re.finditer(r"^prefill\s+(\d+) tokens in [0-9.]+ s(?: \([^)]*\))?: " + NUM +
                         r" tok/s(?: \((fast|precise))?", text, re.M):
        r["prompt"] = int(m.group(1))
        r["prefill " + (m.group(3) or "default")] = float(m.group(2))
    return r


def parse_llama_bench(text):
    """{'pp': (tok/s, spread), 'tg': (tok/s, spread)} from llama-bench's markdown rows"""
    r = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        m = re.fullmatch(r"(pp|tg)\d+", cells[-2])
        v = re.fullmatch(NUM + r"(?:\s*±\s*" + NUM + ")?", cells[-1])
        if m and v:
            r[m.group(1)] = (float(v.group(1)), float(v.group(2) or 0.0))
    return r


def parse_batched(text):
    """{B: S_TG tok/s} from llama-batched-bench's rows (PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S)"""
    r = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and all(re.fullmatch(NUM, c) for c in cells):
            r[int(cells[2])] = float(cells[7])
    return r


def pair(a, b, spread=None):
    if a is None or b is None or b <= 0:
        return "-"
    pm = " ± %.1f" % spread if spread else ""
    fmt = "%.1f" if max(a, b) < 1000 else "%.0f"
    return ("%s / %s%s = **%.2f**" % (fmt % a, fmt % b, pm, a / b))


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    out = argv[1]
    if not os.path.isdir(out):
        print("vs_table: %s is not a directory" % out, file=sys.stderr)
        return 2
    names = argv[2:] or sorted(f[len("strata_"):-len(".log")] for f in os.listdir(out)
                                if f.startswith("strata_") and f.endswith(".log"))
    if not names:
        print("vs_table: no strata_*.log in %s" % out, file=sys.stderr)
        return 2
    cols, bad = [], []
    for n in names:
        s = parse_strata(read(os.path.join(out, "strata_%s.log" % n)))
        lb = parse_llama_bench(read(os.path.join(out, "llama-bench_%s.log" % n)))
        bb = parse_batched(read(os.path.join(out, "llama-batched_%s.log" % n)))
        if "decode" not in s or "tg" not in lb:
            bad.append(n)
        cols.append((n, s, lb, bb))
    seqs = sorted({b for _, s, _, bb in cols for b in s["batch"] if b in bb and b > 1})
    prompts = {s["prompt"] for _, s, _, _ in cols if "prompt" in s}
    prompt = "%d" % prompts.pop() if len(prompts) == 1 else "P"  # P: the columns' prompts differ
    rows = []
    rows.append(("decode, 1 sequence (bench decode / tg)",
                 [pair(s.get("decode"), lb.get("tg", (None,))[0], lb.get("tg", (0, 0))[1]) for _, s, lb, _ in cols]))
    rows.append(("batch of 1 / batched S_TG 1",
                 [pair(s["batch"].get(1, (None,))[0], bb.get(1)) for _, s, _, bb in cols]))
    for b in seqs:
        rows.append(("batched decode, %d sequences" % b,
                     [pair(s["batch"].get(b, (None,))[0], bb.get(b)) for _, s, _, bb in cols]))
    for mode in ("fast", "default", "precise"):
        if any(("prefill " + mode) in s for _, s, _, _ in cols):
            rows.append(("prefill %s, %s (bench / pp)" % (prompt, mode),
                         [pair(s.get("prefill " + mode), lb.get("pp", (None,))[0], lb.get("pp", (0, 0))[1])
                          for _, s, lb, _ in cols]))
    bs = sorted({b for _, s, _, _ in cols for b in s["batch"]})
    rows.append(("strata's step vs its bound, %s" % " / ".join(str(b) for b in bs),
                 [" / ".join(("%d%%" % s["batch"][b][1]) if b in s["batch"] else "-" for b in bs)
                  for _, s, _, _ in cols]))
    print("| tok/s, strata / llama.cpp | " + " | ".join(n for n, _, _, _ in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for label, cells in rows:
        print("| %s | %s |" % (label, " | ".join(cells)))
    if bad:
        print("vs_table: no decode figure from strata or llama.cpp for %s" % ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
