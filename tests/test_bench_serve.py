#!/usr/bin/env python3
"""bench/bench_serve.py against `strata serve` on the default model (CPU),
briefly (a few seconds on 2 cores):

  - a benchmark run (--metrics, --json): every request completes with exactly
    --output-len tokens; throughput > 0; TTFT / TBT / end-to-end percentiles
    ordered (p50 <= p99) and TTFT within end-to-end; the server's counters
    agree with the client (generated tokens, decode-only steps no more than
    the tokens, mean batch within the concurrency, mean context within the
    prompt..prompt+output range);
  - /metrics publishes the model's step costs, equal to what the SmolLM2-135M
    shape gives (30 layers, 9 heads / 3 KV heads of 64, hidden 576, FFN 1536,
    vocab 49152, fp32 KV); no device rates on the CPU, so with none given the
    roofline is reported unknown, and with --mem-bw / --gemm-rate given it is
    max(bytes / bw, flops / rate) recomputed here from the raw counters;
  - --invariance: greedy requests sent together give the texts they give
    alone (the CPU backend is batch-invariant bit for bit).
"""
import json
import math
import os
import re
import select
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import testlib  # noqa: E402
from testlib import BIN, SRC, TMP, check, failures  # noqa: E402,F401

BENCH = os.path.join(SRC, "bench", "bench_serve.py")
N, CONC, PROMPT, OUTPUT = 12, 4, 48, 12

def start_server(model, log_path):
    log = open(log_path, "w")
    cmd = [BIN, "serve", model, "--port", "0", "--max-batch", "8", "--max-model-len", "256", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            m = re.match(rb"listening on http://127\.0\.0\.1:(\d+)$", proc.stdout.readline().strip())
            if m:
                return proc, "http://127.0.0.1:%s" % m.group(1).decode()
    proc.kill()
    proc.wait()
    raise RuntimeError("the server did not start; see %s" % log_path)


def bench(url, *extra):
    out = os.path.join(TMP, "bench_serve_%d.json" % len(extra))
    cmd = [sys.executable, BENCH, "--url", url] + list(extra) + ["--json", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout, end="")
    if r.stderr:
        print(r.stderr, end="")
    with open(out) as f:
        return r.returncode, r.stdout, json.load(f)


def main():
    os.makedirs(TMP, exist_ok=True)
    model = default_model.path()
    proc, url = start_server(model, os.path.join(TMP, "test_bench_serve.log"))
    try:
        common = ["-n", str(N), "-c", str(CONC), "--prompt-len", str(PROMPT), "--output-len", str(OUTPUT), "--metrics"]
        # 1. no rates: roofline unknown, everything else measured
        rc, text, rep = bench(url, *common)
        check(rc == 0, "bench_serve exits 0")
        check(rep["ok"] == N and rep["errors"] == 0, "%d requests ok, no errors (%d, %d)" % (N, rep["ok"], rep["errors"]))
        check(rep["output_tokens"] == N * OUTPUT and rep["prompt_tokens"] == N * PROMPT,
              "usage: %d output, %d prompt tokens" % (rep["output_tokens"], rep["prompt_tokens"]))
        check(rep["output_tok_s"] > 0 and rep["request_throughput"] > 0 and rep["wall_s"] > 0,
              "throughput %.1f tok/s > 0" % rep["output_tok_s"])
        for k in ("ttft_ms", "tbt_ms", "e2e_ms"):
            check(0 < rep[k]["p50"] <= rep[k]["p99"], "%s p50 %.2f <= p99 %.2f" % (k, rep[k]["p50"], rep[k]["p99"]))
        check(rep["ttft_ms"]["p99"] <= rep["e2e_ms"]["p99"] * 1.0001, "TTFT p99 within end-to-end p99")
        s = rep["server"]
        check(s["generation_tokens"] == N * OUTPUT, "server generated %d tokens" % s["generation_tokens"])
        check(s["engine_steps"] >= OUTPUT, "server ran %d steps (>= %d)" % (s["engine_steps"], OUTPUT))
        d = rep["decode"]
        check(d is not None and 0 < d["steps"] <= s["engine_steps"] and d["steps"] <= d["tokens"] <= N * OUTPUT,
              "decode-only steps counted (%s steps, %s tokens)" % (d and d["steps"], d and d["tokens"]))
        check(1 <= d["mean_batch"] <= CONC, "mean decode batch %.2f in [1, %d]" % (d["mean_batch"], CONC))
        check(PROMPT <= d["mean_context"] <= PROMPT + OUTPUT,
              "mean decode context %.1f in [%d, %d]" % (d["mean_context"], PROMPT, PROMPT + OUTPUT))
        check(d["tok_s"] > 0 and d["seconds"] > 0, "decode %.1f tok/s" % d["tok_s"])
        check(d["roofline_s"] is None and "roofline  unknown" in text, "no rates on the CPU: roofline unknown")

        # the model's step costs, from the SmolLM2-135M shape
        L, H, NH, NKV, HD, I, V = 30, 576, 9, 3, 64, 1536, 49152
        mat = L * (2 * H * NH * HD + 2 * H * NKV * HD + 3 * H * I) + V * H
        # bf16 K and V (the default --kv-dtype)
        check(d["kv_bytes_per_token"] == 2 * L * NKV * HD * 2, "KV bytes per token %d" % d["kv_bytes_per_token"])
        import urllib.request
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            met = r.read().decode()
        val = lambda k: float(re.search(r"^%s (\S+)$" % k, met, re.M).group(1))  # noqa: E731
        check(val("strata_model_flops_per_token") == 2 * mat, "FLOPs per token %g" % val("strata_model_flops_per_token"))
        check(val("strata_model_attention_flops_per_pair") == 4 * NH * HD * L, "attention FLOPs per pair")
        wb = val("strata_model_weight_bytes_per_step")
        check(0.5 * mat < wb < 1.0 * mat, "weight bytes per step %.1f MB (Q4_1: ~0.6-0.7 bytes per weight)" % (wb / 1e6))
        check("strata_device_read_bytes_per_second" not in met, "no device rates published on the CPU")

        # 2. rates given: the roofline is max(bytes / bw, flops / rate) of the decode-only steps
        bw, rate = 20e9, 1e11
        rc, text, rep = bench(url, *common, "--mem-bw", str(bw), "--gemm-rate", str(rate))
        d = rep["decode"]
        check(rc == 0 and rep["ok"] == N, "second run ok")
        want_bytes = d["steps"] * wb + d["kv_tokens"] * d["kv_bytes_per_token"]
        want_flops = d["tokens"] * 2 * mat + d["kv_tokens"] * 4 * NH * HD * L
        want = max(want_bytes / bw, want_flops / rate)
        check(math.isclose(d["roofline_s"], want, rel_tol=1e-9),
              "roofline %.4f s = max(%.3g B / bw, %.3g FLOP / rate)" % (d["roofline_s"], want_bytes, want_flops))
        check(math.isclose(d["fraction"], want / d["seconds"], rel_tol=1e-9) and d["fraction"] > 0,
              "fraction %.3f = roofline / measured" % d["fraction"])
        check("decode roofline" in text and "of the roofline" in text, "the report prints the roofline and fraction")

        # 3. batch invariance: 8 greedy requests together vs alone
        rc, text, rep = bench(url, "--invariance", "8", "--prompt-len", "40", "--output-len", "8")
        check(rc == 0 and rep["errors"] == 0 and rep["differ"] == 0 and rep["requests"] == 8,
              "invariance: %d of %d differ, %d errors" % (rep["differ"], rep["requests"], rep["errors"]))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return testlib.summary("test_bench_serve")


if __name__ == "__main__":
    sys.exit(main())
