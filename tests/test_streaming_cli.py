#!/usr/bin/env python3
"""Weight streaming through the command line:

- `strata logits --device-mem X --host-mem Y` writes the same bytes as the
  unbudgeted (fully resident) run, for budgets from the least the plan
  accepts (everything streams, mostly from the file) up to room for all, on
  reference models and the default SmolLM2 GGUF when present; token by token
  (--chunk 1) too; `--gpu-mem` is the same option;
- `strata plan` prints bytes per tier that add up to the model's bytes (and
  groups to the group count), a minimum that works, predicted decode and
  prefill times with their bound;
- a budget below the minimum fails with the figure; bad sizes are usage
  errors; an injected read error (--test-fault, a hidden option of test
  builds: cmake -DSTRATA_TESTING=ON) fails cleanly, naming the file;
- `strata bench` with streamed weights: the bytes read from the file and
  copied to the device per decode step equal the plan's to the byte, and
  `--seqs 1,4` decodes 4 sequences at once through the batched forward (on
  the CPU: the same tokens as each sequence in the smaller batch).

STRATA_BIN (default build/strata) and STRATA_DEVICE (cpu, cuda: passed as
--device to every command) select what runs; on CUDA the device budgets are
the ones `strata plan` reports on CUDA (its backend reserve is measured for
the model and batch), so every placement mix streams there too.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testlib  # noqa: E402
from testlib import BIN, SRC, check, failures  # noqa: E402,F401

testlib.print_ok = False
TMP = testlib.tmp_dir("streaming_cli")
BW = ["--h2d-bw", "10", "--ssd-bw", "1"]  # no probes: faster, deterministic plans



# STRATA_DEVICE=cuda: the same checks on the GPU (resident vs streamed bytes equal)
DEV = ["--device", os.environ["STRATA_DEVICE"]] if os.environ.get("STRATA_DEVICE") else []


def run(args, env=None):
    e = dict(os.environ)
    if env:
        e.update(env)
    if args and args[0] in ("logits", "plan", "bench"):
        args = args + DEV
    return subprocess.run([BIN] + args, capture_output=True, text=True, env=e)


def logits_bytes(model, tokens, extra=(), env=None):
    out = os.path.join(TMP, "out.f32")
    if os.path.exists(out):
        os.remove(out)
    p = run(["logits", model, "--tokens", tokens, "--out", out, "--ctx", "48", "--batch", "8", *extra], env)
    if p.returncode != 0:
        return None, p
    with open(out, "rb") as f:
        return f.read(), p


def plan(model, extra=()):
    p = run(["plan", model, "--ctx", "48", "--batch", "8", *BW, *extra])
    return p


def parse_plan(text):
    info = {"tiers": {}}
    for line in text.splitlines():
        m = re.match(r"model\s+.*?(\d+) groups, .*?\((\d+) bytes\)", line)
        if m:
            info["groups"], info["model_bytes"] = int(m.group(1)), int(m.group(2))
        m = re.match(r"\s+(device|host|ssd|total)\s+(\d+)\s.*?\s(\d+) \(", line)
        if m:
            info["tiers"][m.group(1)] = (int(m.group(2)), int(m.group(3)))
        m = re.match(r"minimum\s+device .*?\((\d+) bytes\), host .*?\((\d+) bytes\)", line)
        if m:
            info["min_dev"], info["min_host"] = int(m.group(1)), int(m.group(2))
        # the bound's names (plan.h st_wbound_name); "PCIe (H2D)" holds a parenthesis itself
        m = re.match(r"decode\s+([\d.]+) ms/token predicted, bound: (none|SSD read|PCIe \(H2D\)|compute|CPU compute) \(",
                     line)
        if m:
            info["decode_ms"], info["decode_bound"] = float(m.group(1)), m.group(2)
        m = re.match(r"prefill\s+(\d+) tokens: ([\d.]+) s predicted .*bound: (none|SSD read|PCIe \(H2D\)|compute|CPU "
                     r"compute) \(", line)
        if m:
            info["prefill_s"], info["prefill_bound"] = float(m.group(2)), m.group(3)
        m = re.match(r"per token\s+(\d+) bytes read from SSD", line)
        if m:
            info["ssd_per_token"] = int(m.group(1))
    return info


def check_plan_text(name, text, streaming):
    info = parse_plan(text)
    t = info["tiers"]
    check(set(t) == {"device", "host", "ssd", "total"}, "%s plan: tier lines missing: %s" % (name, text))
    if set(t) != {"device", "host", "ssd", "total"}:
        return info
    check(sum(t[k][1] for k in ("device", "host", "ssd")) == t["total"][1] == info.get("model_bytes"),
          "%s plan: tier bytes %s do not add up to the model's %s" % (name, t, info.get("model_bytes")))
    check(sum(t[k][0] for k in ("device", "host", "ssd")) == t["total"][0] == info.get("groups"),
          "%s plan: group counts %s" % (name, t))
    check(info.get("decode_ms", -1) > 0 and info.get("decode_bound") in ("SSD read", "PCIe (H2D)", "compute"),
          "%s plan: no decode prediction: %s" % (name, text))
    check(info.get("prefill_s", -1) > 0 and info.get("prefill_bound") in ("SSD read", "PCIe (H2D)", "compute"),
          "%s plan: no prefill prediction" % name)
    if streaming:
        check(t["device"][1] < info["model_bytes"], "%s plan: nothing streams at a small budget" % name)
    return info


def check_model(name, model, tokens):
    ref, p = logits_bytes(model, tokens)
    check(ref is not None, "%s: resident run failed: %s" % (name, p.stderr))
    if ref is None:
        return
    p = plan(model, ["--device-mem", "1T", "--host-mem", "1T"])
    check(p.returncode == 0, "%s: plan failed: %s" % (name, p.stderr))
    info = parse_plan(p.stdout)
    min_dev, min_host = info.get("min_dev"), info.get("min_host")
    if not min_dev:
        check(False, "%s: no minimum in the plan: %s" % (name, p.stdout))
        return
    total = info["model_bytes"]
    # budgets: the least; the least plus half the model split across tiers;
    # everything on the device
    budgets = [
        (min_dev, min_host, "--device-mem"),
        (min_dev + total // 3, min_host + total // 3, "--gpu-mem"),
        (min_dev + 2 * total, 1 << 30, "--device-mem"),
    ]
    for dev, host, opt in budgets:
        extra = [opt, str(dev), "--host-mem", str(host), *BW]
        p = plan(model, [opt, str(dev), "--host-mem", str(host)])
        check(p.returncode == 0, "%s: plan at %d/%d failed: %s" % (name, dev, host, p.stderr))
        if p.returncode == 0:
            check_plan_text("%s at %d/%d" % (name, dev, host), p.stdout, dev == min_dev)
        for chunk in ((), ("--chunk", "1")):
            got, p = logits_bytes(model, tokens, extra + list(chunk))
            check(got is not None, "%s %s: failed: %s" % (name, " ".join(extra + list(chunk)), p.stderr))
            if got is not None:
                check(got == ref, "%s %s: logits differ from the resident run" % (name, " ".join(extra + list(chunk))))
    # below the minimum: an error with the figure
    p = run(["logits", model, "--tokens", tokens, "--out", os.path.join(TMP, "x.f32"), "--ctx", "48", "--batch", "8",
             "--device-mem", str(min_dev - 4096), "--host-mem", str(1 << 30), *BW])
    check(p.returncode == 1 and "at least" in p.stderr and "device budget" in p.stderr,
          "%s: below the minimum: rc %d, %r" % (name, p.returncode, p.stderr))
    # an injected read error while streaming everything from the file (test builds only)
    p = run(["logits", model, "--tokens", tokens, "--out", os.path.join(TMP, "x.f32"), "--ctx", "48", "--batch", "8",
             "--device-mem", str(min_dev), "--host-mem", str(min_host), *BW, "--test-fault", "read-error:3"])
    if p.returncode == 2 and "'--test-fault'" in p.stderr:
        print("%-14s injected read error: skipped (strata built without -DSTRATA_TESTING=ON)" % name, flush=True)
    else:
        check(p.returncode == 1 and "failed" in p.stderr and "offset" in p.stderr,
              "%s: injected read error: rc %d, %r" % (name, p.returncode, p.stderr))
    print("%-14s ok: budgets %s" % (name, [(d, h) for d, h, _ in budgets]), flush=True)


def check_bench(name, model):
    """bench with streamed weights: exact bytes per step; batched decode."""
    base = ["--prompt", "8", "--gen", "4", "--reps", "1", "--seqs", "1,4", "--seq-prompt", "8", *BW]
    # the context and batch bench uses: 8 + 4 tokens (+ 1), chunks of 8
    p = run(["plan", model, "--ctx", "13", "--batch", "8", *BW, "--device-mem", "1T", "--host-mem", "1T"])
    info = parse_plan(p.stdout)
    min_dev, min_host, total = info.get("min_dev"), info.get("min_host"), info.get("model_bytes")
    if not min_dev:
        check(False, "%s bench: no minimum in the plan: %s" % (name, p.stdout + p.stderr))
        return
    extra = 8 << 10  # the paged pool of --seqs, which the plan above does not count
    for _ in range(6):
        dev, host = min_dev + total // 4 + extra, min_host + total // 4
        p = run(["bench", model, "--device-mem", str(dev), "--host-mem", str(host), *base])
        if p.returncode == 0 or "device budget" not in p.stderr:
            break
        extra *= 2
    check(p.returncode == 0, "%s bench at %d/%d: rc %d %s" % (name, dev, host, p.returncode, p.stderr[-2000:]))
    if p.returncode != 0:
        return
    out = p.stdout
    m = re.search(r"bytes\s+per decode step: file ([\d.]+) \(plan (\d+)\), to the device ([\d.]+) \(plan (\d+)\)", out)
    check(m is not None, "%s bench: nothing streamed at device %d: %s" % (name, dev, out))
    if m:
        check(float(m.group(1)) == float(m.group(2)) and float(m.group(3)) == float(m.group(4)),
              "%s bench: bytes per decode step differ from the plan: %s" % (name, m.group(0)))
    for b in (1, 4):
        check(re.search(r"decode batch\s+%d sequences x 3 steps .* tok/s .*bound [\d.]+ ms/step" % b, out) is not None,
              "%s bench: no batch-%d decode line: %s" % (name, b, out))
    m = re.search(r"decode batch tokens: (\d+) of (\d+) sequences", out)
    check(m is not None and int(m.group(2)) == 1, "%s bench: no token comparison: %s" % (name, out))
    if m and os.environ.get("STRATA_DEVICE", "cpu") == "cpu":
        check(m.group(1) == m.group(2), "%s bench: batch 4 tokens differ from batch 1: %s" % (name, m.group(0)))
    print("%-14s bench ok: %s" % (name, m.group(0) if m else ""), flush=True)


def main():
    toks = " ".join(str((i * 37 + 5) % 200) for i in range(20))
    for name in ("gqa_f32", "gqa_sharded_f32", "gqa_tied_bf16", "llama3_bf16"):
        check_model(name, os.path.join(SRC, "tests", "data", "models", name), toks)
    smol = os.path.join(SRC, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.exists(smol):
        check_model("smollm2", smol, " ".join(str((i * 997 + 11) % 49152) for i in range(12)))
    else:
        print("(SmolLM2 GGUF absent: not checked)")

    for name in ("gqa_f32", "llama3_bf16"):
        check_bench(name, os.path.join(SRC, "tests", "data", "models", name))

    m0 = os.path.join(SRC, "tests", "data", "models", "gqa_f32")
    for bad in ("12Q", "-5G", "G", "1.5.2M"):
        p = run(["logits", m0, "--tokens", "1", "--out", os.path.join(TMP, "x.f32"), "--device-mem", bad])
        check(p.returncode == 2 and "not a size" in p.stderr, "--device-mem %s: rc %d, %r" % (bad, p.returncode, p.stderr))
    p = run(["plan", m0, "--host-mem", "1.5G", "--device-mem", "2g", *BW])
    check(p.returncode == 0 and "budget 2.15 GB" in p.stdout and "budget 1.61 GB" in p.stdout,
          "sizes with suffixes: %r %r" % (p.stdout, p.stderr))
    p = run(["plan", m0])
    check(p.returncode == 0 and "no budget" in p.stdout, "plan without budgets: %r" % p.stderr)
    check_plan_text("gqa_f32 unbudgeted", p.stdout, False)

    return testlib.summary("test_streaming_cli")


if __name__ == "__main__":
    sys.exit(main())
