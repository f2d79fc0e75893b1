#!/usr/bin/env python3
"""Hybrid execution (the CPU tier: FFN groups computed on the CPU from host
memory) through the command line, on the CPU backend, where the "device" is
the CPU backend too and the CPU tier is computed by the model's second CPU
backend: the same kernels, so every result must be bit-identical.

- `strata plan --cpu-layers N` under a budget that streams: the cpu row of
  the tier table holds N FFN groups (and only FFN groups), bytes per tier
  still add up to the model; `--cpu-layers 0` (off) and the default (auto:
  never on the CPU backend) hold none;
- `strata logits --device-mem X --cpu-layers N` writes the same bytes as the
  unbudgeted run: prefill chunks of 8 computing the CPU tier on the CPU
  (--cpu-max-tokens 8), the same chunks streaming it to the "device"
  (--cpu-max-tokens 2) and token by token (--chunk 1), on reference models
  and the default SmolLM2 GGUF when present;
- through the engine: `strata run` greedy output with the CPU tier equals the
  resident run's, text for text (SmolLM2); `strata bench` prints the hybrid
  line whose bytes computed on the CPU per decode step equal the plan's;
- split (--cpu-split 0.5: the "device" computes half of each CPU-tier
  group's intermediate rows from a streamed copy, the CPU the other half in
  place): `strata plan` says so, the logits equal the resident run's within
  1e-5 of the largest (the two halves' sums round differently; f32 KV, so
  that no bf16 rounding of K or V flips and amplifies that), `strata
  bench` reports the CPU's bytes and the bytes to the device per step as
  planned (the parts, not whole groups), and the pass the split balances
  (--cpu-pass-tokens);
- bad values of --cpu-layers / --cpu-split / --cpu-max-tokens / --cpu-pass-tokens are usage
  errors naming the option.
"""
import array
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testlib  # noqa: E402
from testlib import BIN, SRC, check  # noqa: E402

testlib.print_ok = False
TMP = testlib.tmp_dir("hybrid_cli")
BW = ["--h2d-bw", "10", "--ssd-bw", "1"]  # no probes: faster, deterministic plans
CTX = ["--ctx", "48", "--batch", "8"]


def run(args, timeout=600):
    return subprocess.run([BIN] + args, capture_output=True, text=True, timeout=timeout)


def parse_plan(text):
    info = {"tiers": {}}
    for line in text.splitlines():
        m = re.match(r"model\s+.*?(\d+) groups, .*?\((\d+) bytes\)", line)
        if m:
            info["groups"], info["model_bytes"] = int(m.group(1)), int(m.group(2))
        m = re.match(r"\s+(device|host|ssd|cpu|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+) \(", line)
        if m:
            info["tiers"][m.group(1)] = [int(x) for x in m.groups()[1:]]  # groups embed attn ffn output bytes
        m = re.match(r"\s+total\s+(\d+)\s.*?\s(\d+) \(", line)
        if m:
            info["total"] = (int(m.group(1)), int(m.group(2)))
        m = re.match(r"minimum\s+device .*?\((\d+) bytes\), host .*?\((\d+) bytes\)", line)
        if m:
            info["min_dev"], info["min_host"] = int(m.group(1)), int(m.group(2))
    return info


def logits(model, tokens, extra=()):
    out = os.path.join(TMP, "out.f32")
    if os.path.exists(out):
        os.remove(out)
    p = run(["logits", model, "--tokens", tokens, "--out", out, *CTX, *BW, *extra])
    if p.returncode != 0:
        return None, p
    with open(out, "rb") as f:
        return f.read(), p


def budget(name, model):
    """A device budget under which about three quarters of the weights stream."""
    p = run(["plan", model, *CTX, *BW, "--device-mem", "1T", "--host-mem", "1T"])
    info = parse_plan(p.stdout)
    if "min_dev" not in info:
        check(False, "%s: no minimum in the plan: %s" % (name, p.stdout + p.stderr))
        return None
    return str(info["min_dev"] + info["model_bytes"] // 4)


def check_model(name, model, tokens):
    dev = budget(name, model)
    if not dev:
        return
    ref, p = logits(model, tokens)
    check(ref is not None, "%s: resident run failed: %s" % (name, p.stderr[-1500:]))
    if ref is None:
        return
    n_cpu, nonres = 0, 0
    for cpu in ("0", None, "2"):
        extra = ["--device-mem", dev] + (["--cpu-layers", cpu] if cpu else [])
        p = run(["plan", model, *CTX, *BW, *extra])
        info = parse_plan(p.stdout)
        row = info["tiers"].get("cpu")
        ok = p.returncode == 0 and row is not None and "total" in info
        check(ok, "%s plan %s: no cpu row: %s" % (name, " ".join(extra), p.stdout + p.stderr))
        if not ok:
            continue
        if cpu == "0":  # the FFN groups the device does not hold: what the cpu tier may take
            nonres = info["tiers"]["host"][3] + info["tiers"]["ssd"][3]
        want = min(2, nonres) if cpu == "2" else 0
        check(row[0] == want and row[3] == want and row[1] == row[2] == row[4] == 0,
              "%s plan %s: the cpu tier holds %s (groups embed attn ffn output), want %d ffn groups"
              % (name, " ".join(extra), row[:5], want))
        total = sum(r[5] for t, r in info["tiers"].items() if t != "total")
        check(total == info["model_bytes"] and info["total"][1] == total,
              "%s plan %s: tier bytes add up to %d, model %d" % (name, " ".join(extra), total, info["model_bytes"]))
        if cpu == "2":
            n_cpu = row[0]
            check(n_cpu > 0, "%s plan: no FFN group streams at device %s" % (name, dev))
            check(re.search(r"split\s+per token: .* read by the CPU", p.stdout) is not None,
                  "%s plan: no split line: %s" % (name, p.stdout))
    if n_cpu == 0:
        return
    for extra in (["--cpu-layers", "2"], ["--cpu-layers", "2", "--cpu-max-tokens", "2"],
                  ["--cpu-layers", "2", "--chunk", "1"], ["--cpu-layers", "1000"]):
        got, p = logits(model, tokens, ["--device-mem", dev, *extra])
        check(got is not None, "%s %s: failed: %s" % (name, " ".join(extra), p.stderr[-1500:]))
        if got is not None:
            check(got == ref, "%s --device-mem %s %s: logits differ from the resident run (%d vs %d bytes)"
                  % (name, dev, " ".join(extra), len(got), len(ref)))
    print("%-16s logits with the cpu tier = resident (device %s)" % (name, dev), flush=True)
    split = ["--device-mem", dev, "--cpu-layers", "2", "--cpu-split", "0.5"]
    p = run(["plan", model, *CTX, *BW, *split])
    m = re.search(r"cpu split\s+each cpu-tier FFN group in decode: the device computes (\d+) of its intermediate rows",
                  p.stdout)
    check(p.returncode == 0 and m is not None and int(m.group(1)) > 0,
          "%s plan --cpu-split 0.5: no split line: %s" % (name, p.stdout + p.stderr))
    ref, p = logits(model, tokens, ["--kv-dtype", "f32"])
    got, p = logits(model, tokens, split + ["--kv-dtype", "f32"])
    check(got is not None and ref is not None, "%s --cpu-split 0.5: failed: %s" % (name, p.stderr[-1500:]))
    if got is not None and ref is not None and len(got) == len(ref):
        a, b = array.array("f", got), array.array("f", ref)
        top = max(abs(x) for x in b)
        diff = max(abs(x - y) for x, y in zip(a, b))
        check(diff <= 1e-5 * top, "%s --cpu-split 0.5: logits differ from the resident run by %g (largest %g)"
              % (name, diff, top))
        print("%-16s logits with the cpu tier split = resident within %.1e of the largest" % (name, diff / top),
              flush=True)


def check_engine(model):
    """strata run (the engine: scheduler and runner) and bench with the CPU tier."""
    dev = budget("smollm2", model)
    if not dev:
        return
    base = ["-p", "The capital of France is", "--temp", "0", "-n", "16", "--no-chat", "--ctx", "64"]
    ref = run(["run", model, *base])
    check(ref.returncode == 0 and ref.stdout.strip(), "run resident: %s" % ref.stderr[-1500:])
    for extra in (["--cpu-layers", "3"], ["--cpu-layers", "3", "--cpu-max-tokens", "2"]):
        got = run(["run", model, *base, "--device-mem", dev, *BW, *extra])
        check(got.returncode == 0, "run %s: %s" % (" ".join(extra), got.stderr[-1500:]))
        check(got.stdout == ref.stdout, "run %s: output %r differs from the resident run's %r"
              % (" ".join(extra), got.stdout, ref.stdout))
    p = run(["bench", model, "--prompt", "8", "--gen", "4", "--reps", "1", "--device-mem", dev, *BW,
             "--cpu-layers", "3"])
    check(p.returncode == 0, "bench --cpu-layers 3: %s" % p.stderr[-1500:])
    m = re.search(r"hybrid\s+per decode step: ([\d.]+ [KMG]?B) computed on the CPU from host memory "
                  r"\(plan ([\d.]+ [KMG]?B), (\d+) groups, (\d+) rows of each on the device\)", p.stdout)
    check(m is not None and m.group(1) == m.group(2) and m.group(3) == "3" and m.group(4) == "0",
          "bench: the hybrid line (CPU bytes per step = the plan's, 3 groups, none split): %s" % p.stdout[-3000:])
    m = re.search(r"bytes\s+per decode step: file ([\d.]+) \(plan (\d+)\), to the device ([\d.]+) \(plan (\d+)\)", p.stdout)
    check(m is not None and float(m.group(1)) == float(m.group(2)) and float(m.group(3)) == float(m.group(4)),
          "bench: bytes per decode step to the device (the cpu tier's not among them) = the plan's: %s"
          % (m.group(0) if m else p.stdout[-2000:]))
    p = run(["bench", model, "--prompt", "8", "--gen", "4", "--reps", "1", "--device-mem", dev, *BW,
             "--cpu-layers", "3", "--cpu-split", "0.5", "--cpu-pass-tokens", "3"])
    check(p.returncode == 0, "bench --cpu-split 0.5: %s" % p.stderr[-1500:])
    check(re.search(r"^weights .*cpu 3 groups .*rows of each on the device, balanced for passes of 3 tokens\)",
                    p.stdout, re.M) is not None,
          "bench --cpu-pass-tokens 3: the plan says which pass it balances: %s" % p.stdout[-2000:])
    m = re.search(r"hybrid\s+per decode step: ([\d.]+ [KMG]?B) computed on the CPU from host memory "
                  r"\(plan ([\d.]+ [KMG]?B), (\d+) groups, (\d+) rows of each on the device\)", p.stdout)
    check(m is not None and m.group(1) == m.group(2) and m.group(3) == "3" and int(m.group(4)) > 0,
          "bench --cpu-split 0.5: the hybrid line (CPU bytes = the plan's, 3 groups split): %s" % p.stdout[-3000:])
    m = re.search(r"bytes\s+per decode step: file ([\d.]+) \(plan (\d+)\), to the device ([\d.]+) \(plan (\d+)\)", p.stdout)
    check(m is not None and float(m.group(1)) == float(m.group(2)) and float(m.group(3)) == float(m.group(4)),
          "bench --cpu-split 0.5: bytes per decode step to the device (the split parts among them) = the plan's: %s"
          % (m.group(0) if m else p.stdout[-2000:]))
    check(re.search(r"bound\s+hybrid max\(PCIe bytes / H2D, CPU bytes / CPU rate\)", p.stdout) is not None,
          "bench: no hybrid bound line: %s" % p.stdout[-2000:])
    print("smollm2          run and bench with the cpu tier ok", flush=True)


def main():
    for name, tokens in (("llama3_f32", "1 5 9 13 2 7 11 3 8 4 6 10"), ("gqa_tied_bf16", "3 1 4 1 5 9 2 6 5 3 5")):
        check_model(name, os.path.join(SRC, "tests", "data", "models", name), tokens)
    smol = os.path.join(SRC, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.exists(smol):
        check_model("smollm2", smol, "1 504 3300 314 2 17 9 4444 12 800 77")
        check_engine(smol)
    else:
        print("(models/SmolLM2-135M-Instruct.Q4_1.gguf absent: the engine checks are skipped)")
    m0 = os.path.join(SRC, "tests", "data", "models", "llama3_f32")
    for bad, what in ((["--cpu-layers", "x"], "--cpu-layers"), (["--cpu-layers", "-2"], "--cpu-layers"),
                      (["--cpu-max-tokens", "0"], "--cpu-max-tokens"), (["--cpu-split", "1"], "--cpu-split"),
                      (["--cpu-split", "half"], "--cpu-split"), (["--cpu-pass-tokens", "0"], "--cpu-pass-tokens")):
        p = run(["plan", m0, *bad])
        check(p.returncode == 2 and what in p.stderr, "plan %s: usage error naming %s (rc %d: %s)"
              % (" ".join(bad), what, p.returncode, p.stderr))
    # a pass to balance that never computes on the CPU (above --cpu-max-tokens) is refused, naming both
    for extra, cap in (([], 8), (["--cpu-max-tokens", "3"], 3)):
        p = run(["plan", m0, "--cpu-pass-tokens", str(cap + 1), *extra])
        check(p.returncode != 0 and "--cpu-pass-tokens" in p.stderr and "--cpu-max-tokens" in p.stderr
              and "%d tokens to balance" % (cap + 1) in p.stderr and "the %d tokens" % cap in p.stderr,
              "plan --cpu-pass-tokens %d %s: refused naming both options (rc %d: %s)"
              % (cap + 1, " ".join(extra), p.returncode, p.stderr))
    p = run(["plan", m0, "--cpu-pass-tokens", "3", "--cpu-max-tokens", "3"])
    check(p.returncode == 0, "plan --cpu-pass-tokens 3 --cpu-max-tokens 3: accepted (rc %d: %s)"
          % (p.returncode, p.stderr))
    # a share no split of this model's 128 rows realizes is refused, not ignored
    p = run(["plan", m0, "--cpu-split", "0.001"])
    check(p.returncode != 0 and "cpu split of 0.001" in p.stderr and "128 intermediate rows" in p.stderr,
          "plan --cpu-split 0.001: refused naming the share and the rows (rc %d: %s)" % (p.returncode, p.stderr))
    return testlib.summary("test_hybrid_cli")


if __name__ == "__main__":
    sys.exit(main())
