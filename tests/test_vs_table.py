#!/usr/bin/env python3
"""bench/vs_table.py, the side-by-side table of a vs-llama-cpp.sh run:

  - logs as the nineteenth session's H100 run wrote them (strata's lines and
    llama.cpp's tables verbatim, q4_0): every row's figures and ratio exactly
    as bench/RESULTS.md has them;
  - strata's own CPU output, made now (`strata bench` on the default model,
    --seqs 1,2), beside llama.cpp tables written here: the ratios are the
    parsed strata figures over the given ones, the CPU's prefill (no mode in
    its line) in a "default" row, every batch both sides have;
  - a model whose llama.cpp logs are missing prints "-" and exits 1 naming
    it; a missing directory or no strata log exits 2.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import testlib  # noqa: E402
from testlib import BIN, SRC, check  # noqa: E402

TABLE = os.path.join(SRC, "bench", "vs_table.py")

STRATA_Q4 = """HBM          2976 GB/s (device-to-device copy of 1 GiB, bytes read + written, measured now)
prefill      512 tokens in 0.0249 s (chunks of 512): 20563 tok/s (fast: bf16 operands, ~1e-2 error); reached 40% of the floor
prefill      512 tokens in 0.0638 s (chunks of 512): 8024 tok/s (precise: hi+lo bf16 operands, ~1e-5 error); reached 16% of the floor
decode       128 tokens in 0.346 s: 370.19 tok/s, 2.701 ms/token (one sequence, greedy on the device; 129 passes replayed as graphs, 7 direct; KV bf16)
decode batch   1 sequences x 127 steps (prompt 512): 2.711 ms/step, 368.9 tok/s (1.00x batch 1); bound 1.444 ms/step (memory: 4297.9 MB of weights + KV / 2976.05 GB/s): 53%
decode batch   8 sequences x 127 steps (prompt 512): 4.791 ms/step, 1669.8 tok/s (4.53x batch 1); bound 1.622 ms/step (memory: 4826.4 MB of weights + KV / 2976.05 GB/s): 34%
decode batch  64 sequences x 127 steps (prompt 512): 10.884 ms/step, 5880.1 tok/s (15.94x batch 1); bound 3.042 ms/step (memory: 9054.3 MB of weights + KV / 2976.05 GB/s): 28%
decode batch tokens: 0 of 9 sequences generated the same tokens as in a smaller batch
"""
LLAMA_BENCH_Q4 = """| model                          |       size |     params | backend    | ngl |  fa |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | --: | --: | --------------: | -------------------: |
| llama 8B Q4_0                  |   4.21 GiB |     8.03 B | CUDA       |  99 |   1 |           pp512 |   11036.75 ± 1368.38 |
| llama 8B Q4_0                  |   4.21 GiB |     8.03 B | CUDA       |  99 |   1 |           tg128 |        330.60 ± 1.88 |

build: 0 (0)
"""
BATCHED_Q4 = """main: n_kv_max = 41216, n_batch = 2048, n_ubatch = 512, flash_attn = 1
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   512 |    128 |    1 |    640 |    0.069 |  7468.13 |    0.413 |   309.73 |    0.482 |  1328.31 |
|   512 |    128 |    8 |   5120 |    0.362 | 11308.76 |    0.815 |  1256.32 |    1.177 |  4349.02 |
|   512 |    128 |   64 |  40960 |    2.758 | 11883.11 |    1.875 |  4370.19 |    4.632 |  8842.74 |
"""


def write(d, name, text):
    with open(os.path.join(d, name), "w") as f:
        f.write(text)


def table(*args):
    return subprocess.run([sys.executable, TABLE] + list(args), capture_output=True, text=True, timeout=60)


def row(out, label):
    for line in out.splitlines():
        if line.startswith("| " + label):
            return [c.strip() for c in line.strip().strip("|").split("|")][1:]
    return None


def main():
    d = testlib.tmp_dir("vs_table")
    for f in os.listdir(d):  # a fresh directory: step 3 reads every log in it
        os.remove(os.path.join(d, f))
    # 1. the H100 run's logs
    write(d, "strata_q4_0.log", STRATA_Q4)
    write(d, "llama-bench_q4_0.log", LLAMA_BENCH_Q4)
    write(d, "llama-batched_q4_0.log", BATCHED_Q4)
    p = table(d)
    check(p.returncode == 0, "H100 logs: rc %d, %r" % (p.returncode, p.stderr))
    want = {
        "decode, 1 sequence": "370.2 / 330.6 ± 1.9 = **1.12**",
        "batch of 1": "368.9 / 309.7 = **1.19**",
        "batched decode, 8 sequences": "1670 / 1256 = **1.33**",
        "batched decode, 64 sequences": "5880 / 4370 = **1.35**",
        "prefill 512, fast": "20563 / 11037 ± 1368.4 = **1.86**",
        "prefill 512, precise": "8024 / 11037 ± 1368.4 = **0.73**",
        "strata's step vs its bound, 1 / 8 / 64": "53% / 34% / 28%",
    }
    for label, cell in want.items():
        got = row(p.stdout, label)
        check(got == [cell], "%s: %r (want %r)\n%s" % (label, got, cell, p.stdout))
    check(p.stdout.splitlines()[0] == "| tok/s, strata / llama.cpp | q4_0 |", "header: %r" % p.stdout[:80])

    # 2. strata's CPU output now, beside llama.cpp tables given here
    model = default_model.path()
    b = subprocess.run([BIN, "bench", model, "--device", "cpu", "--prompt", "16", "--gen", "4", "--seqs", "1,2",
                        "--seq-prompt", "16"], capture_output=True, text=True, timeout=300)
    check(b.returncode == 0, "strata bench: rc %d %r" % (b.returncode, b.stderr[-300:]))
    log = b.stdout + b.stderr
    write(d, "strata_smol.log", log)
    write(d, "llama-bench_smol.log", LLAMA_BENCH_Q4.replace("330.60 ± 1.88", "50.00 ± 0.50")
          .replace("11036.75 ± 1368.38", "100.00"))
    write(d, "llama-batched_smol.log", BATCHED_Q4.replace("309.73", "40.00").replace("|    8 |", "|    2 |").replace("1256.32", "60.00"))
    m = re.search(r"^decode\s+4 tokens in [0-9.]+ s: ([0-9.]+) tok/s", log, re.M)
    m2 = re.search(r"^decode batch\s+2 sequences .*?, ([0-9.]+) tok/s", log, re.M)
    m3 = re.search(r"^prefill\s+16 tokens in [0-9.]+ s: ([0-9.]+) tok/s", log, re.M)
    check(m and m2 and m3, "strata bench's lines: %r" % log[-600:])
    if m and m2 and m3:
        p = table(d, "smol")
        check(p.returncode == 0, "CPU log: rc %d %r" % (p.returncode, p.stderr))
        dec, b2, pre = float(m.group(1)), float(m2.group(1)), float(m3.group(1))
        got = row(p.stdout, "decode, 1 sequence")
        check(got == ["%.1f / 50.0 ± 0.5 = **%.2f**" % (dec, dec / 50)], "CPU decode: %r" % got)
        got = row(p.stdout, "batched decode, 2 sequences")
        check(got == ["%.1f / 60.0 = **%.2f**" % (b2, b2 / 60)], "CPU batch 2: %r\n%s" % (got, p.stdout))
        got = row(p.stdout, "prefill 16, default")
        check(got == ["%.1f / 100.0 = **%.2f**" % (pre, pre / 100)], "CPU prefill (no mode): %r" % got)
        check(row(p.stdout, "prefill 16, fast") is None, "no fast row for the CPU")

    # 3. both models; one without llama.cpp logs
    write(d, "strata_lost.log", STRATA_Q4)
    p = table(d)
    check(p.returncode == 1 and "lost" in p.stderr, "missing peer logs: rc %d %r" % (p.returncode, p.stderr))
    check(p.stdout.splitlines()[0] == "| tok/s, strata / llama.cpp | lost | q4_0 | smol |", "columns: %r" %
          p.stdout.splitlines()[:1])
    check(row(p.stdout, "decode, 1 sequence")[0] == "-", "a missing figure prints -")
    p = table(os.path.join(d, "nope"))
    check(p.returncode == 2 and "not a directory" in p.stderr, "no directory: %r" % p.stderr)
    e = testlib.tmp_dir("vs_table_empty")
    for f in os.listdir(e):
        os.remove(os.path.join(e, f))
    p = table(e)
    check(p.returncode == 2 and "no strata_" in p.stderr, "no logs: %r" % p.stderr)
    return testlib.summary("test_vs_table")


if __name__ == "__main__":
    sys.exit(main())
