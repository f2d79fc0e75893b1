#!/usr/bin/env python3
"""`strata mkmodel`: random models of a known shape.

For the tiny config: the HF directory's config.json and safetensors header
describe exactly the tensors a Llama of that config has (names, dtypes,
shapes, contiguous offsets, file size = header + tensor bytes, total bytes =
what the config implies); sharding writes an index whose shards hold every
tensor once; the bytes depend on the seed only (not on the thread count);
the model loads and `strata logits` gives finite, non-flat logits; the GGUF
forms (q8_0, q4_0) load and run too, with the byte count their blocks imply;
bad arguments fail with a message.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testlib  # noqa: E402
from testlib import BIN, check, failures  # noqa: E402,F401

testlib.print_ok = False
TMP = testlib.tmp_dir("mkmodel")


def run(args, ok=True):
    p = subprocess.run([BIN] + args, capture_output=True, text=True)
    if ok and p.returncode != 0:
        check(False, "strata %s: rc %d: %s" % (" ".join(args), p.returncode, p.stderr.strip()))
    return p


def expected_tensors(c, dtype_bytes):
    """name -> (shape, bytes) of a Llama with config c (2-byte or 4-byte elements)."""
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = [V, H]
    for l in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % l
        t[p + "input_layernorm.weight"] = [H]
        t[p + "post_attention_layernorm.weight"] = [H]
        t[p + "self_attn.q_proj.weight"] = [q, H]
        t[p + "self_attn.k_proj.weight"] = [kv, H]
        t[p + "self_attn.v_proj.weight"] = [kv, H]
        t[p + "self_attn.o_proj.weight"] = [H, q]
        t[p + "mlp.gate_proj.weight"] = [I, H]
        t[p + "mlp.up_proj.weight"] = [I, H]
        t[p + "mlp.down_proj.weight"] = [H, I]
    return {k: (v, int(np.prod(v)) * dtype_bytes) for k, v in t.items()}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return n, hdr


def check_hf_dir(d, dtype_name, dtype_bytes, tag):
    c = json.load(open(os.path.join(d, "config.json")))
    check(c["model_type"] == "llama" and c["architectures"] == ["LlamaForCausalLM"], tag + ": config.json kind")
    want = expected_tensors(c, dtype_bytes)
    idx = os.path.join(d, "model.safetensors.index.json")
    files = {}
    if os.path.exists(idx):
        wm = json.load(open(idx))
        for name, fn in wm["weight_map"].items():
            files.setdefault(fn, []).append(name)
        check(wm["metadata"]["total_size"] == sum(b for _, b in want.values()), tag + ": index total_size")
        check(sorted(wm["weight_map"]) == sorted(want), tag + ": index names")
    else:
        files["model.safetensors"] = None
    seen = {}
    for fn, names in files.items():
        path = os.path.join(d, fn)
        n, hdr = read_safetensors(path)
        check((8 + n) % 4096 == 0, tag + ": %s: data starts at a multiple of 4096 (%d)" % (fn, 8 + n))
        if names is not None:
            check(sorted(hdr) == sorted(names), tag + ": %s holds what the index says" % fn)
        end = 0
        for name, e in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            b, e2 = e["data_offsets"]
            check(b == end, tag + ": %s: %s starts at %d, previous ended at %d (no holes)" % (fn, name, b, end))
            end = e2
            seen[name] = (e["shape"], e2 - b, e["dtype"])
        check(os.path.getsize(path) == 8 + n + end, tag + ": %s: file size = header + tensor bytes" % fn)
    check(sorted(seen) == sorted(want), tag + ": tensor names: %s" % sorted(set(seen) ^ set(want)))
    for name, (shape, nbytes) in want.items():
        if name in seen:
            s, b, dt = seen[name]
            check(s == shape and b == nbytes and dt == dtype_name,
                  tag + ": %s is %s %s %d bytes, expected %s %s %d" % (name, dt, s, b, dtype_name, shape, nbytes))
    return c


def logits_ok(model, vocab, tag, tokens="1 5 9 200 311 7 42 100"):
    out = os.path.join(TMP, "out.f32")
    if os.path.exists(out):
        os.remove(out)
    p = run(["logits", model, "--tokens", tokens, "--out", out, "--device", "cpu"])
    if p.returncode != 0:
        return None
    n = len(tokens.split())
    a = np.fromfile(out, dtype="<f4")
    check(a.size == n * vocab, tag + ": %d logits, expected %d" % (a.size, n * vocab))
    if a.size != n * vocab:
        return None
    a = a.reshape(n, vocab)
    check(bool(np.isfinite(a).all()), tag + ": logits are finite")
    sd = float(a.std(axis=1).min())
    check(0.3 < sd < 50, tag + ": logits are not flat and not huge (min row std %.3g)" % sd)
    check(len(set(a.argmax(1).tolist())) > 1, tag + ": argmax varies with the position")
    return a


def main():
    # HF bf16, one file
    d = os.path.join(TMP, "tiny_bf16")
    p = run(["mkmodel", "--config", "tiny", d])
    check("tiny" in p.stdout and "bf16" in p.stdout, "summary line: %r" % p.stdout)
    c = check_hf_dir(d, "BF16", 2, "tiny bf16")
    a = logits_ok(d, c["vocab_size"], "tiny bf16")

    # same seed, other thread count: the same bytes; another seed: other bytes
    d2 = os.path.join(TMP, "tiny_bf16_t1")
    run(["mkmodel", "--config", "tiny", "--threads", "1", d2])
    same = open(os.path.join(d, "model.safetensors"), "rb").read() == open(os.path.join(d2, "model.safetensors"), "rb").read()
    check(same, "the bytes do not depend on the thread count")
    d3 = os.path.join(TMP, "tiny_bf16_s2")
    run(["mkmodel", "--config", "tiny", "--seed", "2", d3])
    check(open(os.path.join(d, "model.safetensors"), "rb").read() != open(os.path.join(d3, "model.safetensors"), "rb").read(),
          "another seed gives other bytes")

    # f32, 8 layers, sharded at 1 MB
    d4 = os.path.join(TMP, "tiny_f32_sharded")
    run(["mkmodel", "--config", "tiny", "--layers", "8", "--dtype", "f32", "--shard-mb", "1", d4])
    check(os.path.exists(os.path.join(d4, "model.safetensors.index.json")), "sharded: index written")
    shards = [f for f in os.listdir(d4) if f.startswith("model-") and f.endswith(".safetensors")]
    check(len(shards) > 2, "sharded: %d shards" % len(shards))
    c4 = check_hf_dir(d4, "F32", 4, "tiny f32 sharded")
    check(c4["num_hidden_layers"] == 8, "--layers 8 in config.json")
    logits_ok(d4, c4["vocab_size"], "tiny f32 sharded")

    # GGUF q8_0 and q4_0: loads, runs; tensor bytes as the blocks imply
    for dt, block_bytes in (("q8_0", 34), ("q4_0", 18)):
        g = os.path.join(TMP, "tiny_%s.gguf" % dt)
        p = run(["mkmodel", "--config", "tiny", "--dtype", dt, g])
        want = expected_tensors(c, 1)
        mat = sum(int(np.prod(s)) for s, _ in want.values() if len(s) == 2) // 32 * block_bytes
        vec = sum(int(np.prod(s)) for s, _ in want.values() if len(s) == 1) * 4
        check(("%d bytes of tensors" % (mat + vec)) in p.stdout, "%s: %d tensor bytes expected: %r" % (dt, mat + vec, p.stdout))
        check(os.path.getsize(g) > mat + vec, "%s: file holds the tensors" % dt)
        ins = run(["inspect", g])
        check(("%s " % dt) in ins.stdout and "2 layers" in ins.stdout, "%s: inspect: %r" % (dt, ins.stdout[:300]))
        b = logits_ok(g, c["vocab_size"], "tiny " + dt)
        if a is not None and b is not None and dt == "q8_0":
            # same seed, same values, quantized: the logits stay close to the bf16 model's
            # (not equal: GGUF's interleaved RoPE pairs make it another function of the weights)
            check(float(np.abs(a - b).max() / np.abs(a).max()) < 0.5, "q8_0 logits near the bf16 model's")

    # bf16 with an OUT ending in .gguf: one GGUF file (not an HF directory of that name); --format hf keeps a directory
    g = os.path.join(TMP, "tiny_bf16.gguf")
    p = run(["mkmodel", "--config", "tiny", g])
    check(os.path.isfile(g) and "bf16 gguf" in p.stdout, ".gguf name: a GGUF file: %r" % p.stdout)
    ins = run(["inspect", g])
    check("bf16 " in ins.stdout and "2 layers" in ins.stdout, "bf16 gguf: inspect: %r" % ins.stdout[:300])
    g2 = os.path.join(TMP, "hf_named.gguf")
    p = run(["mkmodel", "--config", "tiny", "--format", "hf", g2])
    check(os.path.isdir(g2) and os.path.isfile(os.path.join(g2, "config.json")), "--format hf wins over the name")

    # tied embeddings (smollm2-135m, 2 of its 30 layers): no lm_head
    d6 = os.path.join(TMP, "smol2")
    run(["mkmodel", "--config", "smollm2-135m", "--layers", "2", d6])
    c6 = check_hf_dir(d6, "BF16", 2, "smollm2 2 layers")
    check(c6["tie_word_embeddings"] is True and c6["vocab_size"] == 49152, "smollm2 config")
    logits_ok(d6, c6["vocab_size"], "smollm2 2 layers")
    d5 = os.path.join(TMP, "never_written")

    # usage errors
    for args, msg in ((["mkmodel", "--config", "nope", d5], "unknown config"),
                      (["mkmodel", "--config", "tiny", "--dtype", "q4_k", d5], "--dtype"),
                      (["mkmodel", "--config", "tiny", "--dtype", "q8_0", "--format", "hf", d5], "gguf"),
                      (["mkmodel", "--config", "tiny"], "usage")):
        p = run(args, ok=False)
        check(p.returncode == 2 and msg in (p.stderr + p.stdout), "%s: rc %d %r" % (" ".join(args), p.returncode, p.stderr))
    p = run(["mkmodel", "--config", "tiny", "/nonexistent-dir/x/y"], ok=False)
    check(p.returncode == 1 and "/nonexistent-dir/x/y" in p.stderr, "unwritable output: %r" % p.stderr)

    return testlib.summary("test_mkmodel")


if __name__ == "__main__":
    sys.exit(main())
