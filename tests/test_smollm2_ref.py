#!/usr/bin/env python3
"""The default model against HF transformers loading the same GGUF file
(tests/data/smollm2, made by tools/ref/make_smollm2_refs.py on the GPU machine):
logits of a 64-token English prompt. HF dequantizes the Q4_1/Q8_0 weights to
float32; strata dequantizes inside its matmul, so the two should agree to float
rounding, far inside the quantization error.

One forward path: HF's 32 greedy tokens of the raw prompt come out of `strata
run`, of `strata logits` (the argmax at every position of prompt + those tokens,
one pass and --chunk 1) and of `strata serve` (a temperature-0 completion), all
with the default bf16 KV cache."""
import http.client
import json
import os
import re
import select
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402

SRC = os.environ.get("STRATA_SRC", ".")
BIN = os.environ.get("STRATA_BIN", "build/strata")
TMP = os.path.join(os.environ.get("STRATA_TMP", "/tmp/strata-test"), "smollm2_ref")
REL_TOL = 1e-4
BF16_KV_TOL = 2e-2
DEV = ["--device", os.environ["STRATA_DEVICE"]] if os.environ.get("STRATA_DEVICE") else []


def serve_completion(gguf, prompt, n):
    """A temperature-0 completion of n tokens from a `strata serve` started here."""
    log = open(os.path.join(TMP, "serve.log"), "wb")
    proc = subprocess.Popen([BIN, "serve", gguf, "--port", "0", "--no-rooflines", *DEV], stdout=subprocess.PIPE,
                            stderr=log)
    try:
        port, deadline = None, time.time() + 120
        while port is None and time.time() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                m = re.match(rb"listening on http://127\.0\.0\.1:(\d+)$", proc.stdout.readline().strip())
                port = int(m.group(1)) if m else None
        if port is None:
            return None
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0}  # no "model": the served one
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = json.loads(r.read())
        return data["choices"][0]["text"] if r.status == 200 else None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def main():
    os.makedirs(TMP, exist_ok=True)
    gguf = default_model.path()
    ref = json.load(open(os.path.join(SRC, "tests", "data", "smollm2", "smollm2_refs.json")))
    pos = ref["logits_pos"]
    ids = ref["prompt_ids"]
    rows = np.fromfile(os.path.join(SRC, "tests", "data", "smollm2", "smollm2_logits.f32"), dtype="<f4")
    rows = rows.reshape(len(pos), -1)
    vocab = rows.shape[1]
    out = os.path.join(TMP, "logits.f32")
    fails = 0
    checks = 0
    # the KV cache in f32 against HF's float32 run (REL_TOL), and in the default
    # bf16 within BF16_KV_TOL, the same argmax everywhere
    for kv, extra in (("f32", ()), ("f32", ("--chunk", "16")), ("bf16", ())):
        p = subprocess.run([BIN, "logits", gguf, "--tokens", " ".join(map(str, ids)), "--out", out, "--kv-dtype", kv,
                            *DEV, *extra], capture_output=True, text=True)
        checks += 1
        if p.returncode != 0:
            print("FAIL: strata logits %s: %s" % (" ".join(extra), p.stderr))
            fails += 1
            continue
        a = np.fromfile(out, dtype="<f4").reshape(len(ids), vocab)
        rel = float(np.abs(a[pos] - rows).max() / np.abs(rows).max())
        diff = np.nonzero(a.argmax(1) != np.array(ref["argmax"]))[0].tolist()
        tol = REL_TOL if kv == "f32" else BF16_KV_TOL
        print("smollm2 Q4_1 %-12s kv %-4s rel error %.3g (bound %.0e), argmax differs at %d of %d positions"
              % (" ".join(extra) or "one pass", kv, rel, tol, len(diff), len(ids)))
        checks += 2
        if not rel < tol:
            print("FAIL: rel error %.3g" % rel)
            fails += 1
        if diff:
            print("FAIL: argmax differs at", diff)
            fails += 1
    # 32 greedy tokens, token for token as HF's generate(do_sample=False): the
    # prompt ids must be HF's, and the streamed text must be the decode of HF's ids
    for name, extra in (("raw", ["--no-chat"]), ("chat", ["--chat"])):
        g = ref["greedy"][name]
        prompt = "Once upon a time, in a small village" if name == "raw" else "What is the capital of France?"
        if name == "raw":
            p = subprocess.run([BIN, "tokenize", gguf, prompt], capture_output=True, text=True)
            checks += 1
            got = [int(x) for x in p.stdout.split()]
            if got != g["prompt_ids"]:
                print("FAIL: prompt ids %s != HF %s" % (got, g["prompt_ids"]))
                fails += 1
        p = subprocess.run([BIN, "run", gguf, "-p", prompt, "-n", "32", "--temp", "0", *DEV, *extra],
                           capture_output=True, text=True)
        want = g["text"].replace("<|im_end|>", "")
        checks += 1
        ok = p.returncode == 0 and p.stdout.strip() == want.strip()
        m = __import__("re").search(r"prompt: (\d+) tokens.*generated: (\d+) tokens", p.stderr)
        n_prompt_ok = m is not None and int(m.group(1)) == len(g["prompt_ids"]) and int(m.group(2)) == len(g["tokens"])
        checks += 1
        print("greedy %-4s HF: %r\n           ours: %r  (%s; prompt/generated token counts %s)"
              % (name, want, p.stdout, "same" if ok else "DIFFERENT", "match" if n_prompt_ok else "DIFFER"))
        if not ok:
            print("FAIL: greedy %s differs: %s" % (name, p.stderr[-300:]))
            fails += 1
        if not n_prompt_ok:
            print("FAIL: greedy %s token counts differ from HF (%d prompt, %d generated): %s"
                  % (name, len(g["prompt_ids"]), len(g["tokens"]), p.stderr[-300:]))
            fails += 1
    # the same greedy tokens through `strata logits` (teacher-forced: the argmax
    # after each prefix is the next HF token) and `strata serve`
    g = ref["greedy"]["raw"]
    seq = g["prompt_ids"] + g["tokens"]
    n_p = len(g["prompt_ids"])
    for extra in ((), ("--chunk", "1")):
        p = subprocess.run([BIN, "logits", gguf, "--tokens", " ".join(map(str, seq)), "--out", out, *DEV, *extra],
                           capture_output=True, text=True)
        checks += 1
        am = (np.fromfile(out, dtype="<f4").reshape(len(seq), vocab).argmax(1).tolist() if p.returncode == 0 else [])
        got = am[n_p - 1:len(seq) - 1]
        same = got == g["tokens"]
        print("greedy raw via strata logits %-10s: %s" % (" ".join(extra) or "one pass",
                                                         "HF's 32 tokens" if same else "DIFFERENT: %s" % got))
        if not same:
            print("FAIL: strata logits %s greedy tokens differ from HF's: %s" % (" ".join(extra), p.stderr[-300:]))
            fails += 1
    checks += 1
    text = serve_completion(gguf, g["text_in"], len(g["tokens"]))
    want = g["text"].replace("<|im_end|>", "")
    print("greedy raw via strata serve: %r (%s)" % (text, "same" if text == want else "DIFFERENT"))
    if text != want:
        print("FAIL: strata serve greedy completion differs from HF's: %r" % text)
        fails += 1
    # strata inspect: architecture, tensor table, tokenizer kind, chat template
    p = subprocess.run([BIN, "inspect", gguf], capture_output=True, text=True)
    for want in ("llama: 30 layers, hidden 576", "bpe/smollm, 49152 tokens", "template detected: chatml",
                 "model.layers.0.mlp.down_proj.weight                  q4_1  [576, 1536] 552960 B",
                 "tensors     272"):
        checks += 1
        if want not in p.stdout:
            print("FAIL: strata inspect output lacks %r:\n%s" % (want, p.stdout[:600]))
            fails += 1
    print("%d passed, %d failed" % (checks - fails, fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
