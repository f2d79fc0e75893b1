#!/usr/bin/env python3
"""Independent check of `strata convert` against gguf-py (llama.cpp's reference
GGUF reader and quantizers).

Builds a tiny HF-format Llama directory with numpy (config.json + a
model.safetensors written by hand), converts it with `$STRATA_BIN convert DIR
out.gguf --type X` for each output type, reads the result with
gguf.GGUFReader and asserts: metadata keys/values, tensor names/shapes/types,
data offsets aligned, and that gguf.quants.dequantize(data) equals the source
weights (with llama.cpp's Q/K permutation applied to the source): exactly for
f32 and bf16/f16 vs numpy's rounding, within each block format's error bound
for q8_0/q4_0/q4_1, and byte-for-byte equal to gguf.quants.quantize(source)
for every type gguf-py can quantize.

Env: STRATA_BIN (the built strata tool), STRATA_TMP (scratch dir).
"""
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
except ImportError:  # pragma: no cover
    print("test_gguf_pyref: gguf-py is not installed (pip install gguf); cannot run")
    sys.exit(1)

FAILS = []
CHECKS = 0


def check(cond, msg):
    global CHECKS
    CHECKS += 1
    if not cond:
        FAILS.append(msg)
        print("FAIL:", msg, file=sys.stderr)


# ---- the tiny model -----------------------------------------------------------
HID, NH, NKV, HD, FFN, VOC, NL = 64, 4, 2, 16, 128, 96, 2
THETA, EPS, CTX = 500000.0, 1e-5, 131072
R_FACTOR, R_LOW, R_HIGH, R_ORIG = 8.0, 1.0, 4.0, 8192
BOS, EOS = 1, [2, 7]


def to_bf16_exact(x):
    """Rounds float32 values to the nearest bf16 (RNE), returned as float32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def make_weights(rng):
    w = {}
    def mat(name, r, c):
        w[name] = (rng.standard_normal((r, c)) * 0.3).astype(np.float32)
    def vec(name, n):
        w[name] = (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)
    mat("model.embed_tokens.weight", VOC, HID)
    for l in range(NL):
        p = f"model.layers.{l}."
        vec(p + "input_layernorm.weight", HID)
        mat(p + "self_attn.q_proj.weight", NH * HD, HID)
        mat(p + "self_attn.k_proj.weight", NKV * HD, HID)
        mat(p + "self_attn.v_proj.weight", NKV * HD, HID)
        mat(p + "self_attn.o_proj.weight", HID, NH * HD)
        vec(p + "post_attention_layernorm.weight", HID)
        mat(p + "mlp.gate_proj.weight", FFN, HID)
        mat(p + "mlp.up_proj.weight", FFN, HID)
        mat(p + "mlp.down_proj.weight", HID, FFN)
    vec("model.norm.weight", HID)
    mat("lm_head.weight", VOC, HID)
    # a block whose max is exactly representable, a zero block, equal values:
    # the edge cases of the block quantizers
    w["model.layers.0.mlp.gate_proj.weight"][0, :32] = 0.0
    w["model.layers.0.mlp.gate_proj.weight"][1, :32] = 0.25
    w["model.layers.0.mlp.gate_proj.weight"][2, :32] = np.linspace(-1, 1, 32)
    # stored as BF16 in the safetensors file (values made bf16-exact)
    w["model.layers.1.mlp.up_proj.weight"] = to_bf16_exact(w["model.layers.1.mlp.up_proj.weight"])
    return w


BF16_SOURCE = {"model.layers.1.mlp.up_proj.weight"}


def write_hf_dir(d, w):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOC, "hidden_size": HID, "intermediate_size": FFN,
        "num_hidden_layers": NL, "num_attention_heads": NH, "num_key_value_heads": NKV,
        "head_dim": HD, "max_position_embeddings": CTX, "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "rope_scaling": {"rope_type": "llama3", "factor": R_FACTOR, "low_freq_factor": R_LOW,
                         "high_freq_factor": R_HIGH, "original_max_position_embeddings": R_ORIG},
        "tie_word_embeddings": False, "bos_token_id": BOS, "eos_token_id": EOS,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    header, blobs, off = {}, [], 0
    for name, a in w.items():
        if name in BF16_SOURCE:
            raw = (a.view(np.uint32) >> 16).astype("<u2").tobytes()
            dt = "BF16"
        else:
            raw = a.astype("<f4").tobytes()
            dt = "F32"
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's Q/K permutation (rotate-half -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf):
    table = [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
             ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
             ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
             ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
             ("mlp.down_proj", "ffn_down")]
    if hf.startswith("model.layers."):
        rest = hf[len("model.layers."):]
        layer, stem = rest.split(".", 1)
        for h, g in table:
            if stem == h + ".weight":
                return f"blk.{layer}.{g}.weight"
        raise KeyError(hf)
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def expected_source(w):
    """GGUF name -> the float32 array the file should hold (Q/K permuted)."""
    out = {}
    for name, a in w.items():
        if name.endswith("q_proj.weight"):
            a = permute(a, NH)
        elif name.endswith("k_proj.weight"):
            a = permute(a, NKV)
        out[gguf_name(name)] = a
    return out


def llama3_rope_divisors():
    """llama.cpp convert_hf_to_gguf's rope_freqs for llama3 scaling (float32 base freqs)."""
    base = np.float32(THETA)
    freqs = 1.0 / (base ** (np.arange(0, HD, 2, dtype=np.float32) / np.float32(HD)))
    low_wavelen, high_wavelen = R_ORIG / R_LOW, R_ORIG / R_HIGH
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(R_FACTOR)
        else:
            smooth = (R_ORIG / wavelen - R_LOW) / (R_HIGH - R_LOW)
            out.append(1.0 / ((1 - smooth) / R_FACTOR + smooth))
    return np.array(out, dtype=np.float64)


# ---- per-type error bounds of the block quantizers ------------------------------
def f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float64)


def block_error_ok(qt, src, deq, raw):
    """Checks |deq - src| per 32-block against the format's bound; returns (ok, worst ratio)."""
    s = src.reshape(-1, 32).astype(np.float64)
    e = np.abs(deq.reshape(-1, 32).astype(np.float64) - s).max(axis=1)
    rb = raw.reshape(-1)
    if qt == QT.Q8_0:
        blocks = rb.reshape(-1, 34)
        d16 = blocks[:, :2].copy().view(np.float16).astype(np.float64).reshape(-1)
        d = np.abs(s).max(axis=1) / 127
        # rounding to the nearest step of d, plus d stored as f16 (|q| <= 127)
        bound = d / 2 + np.abs(d16 - d) * 127
    elif qt == QT.Q4_0:
        blocks = rb.reshape(-1, 18)
        d16 = blocks[:, :2].copy().view(np.float16).astype(np.float64).reshape(-1)
        imax = np.abs(s).argmax(axis=1)
        d = s[np.arange(len(s)), imax] / -8
        # the extreme value -8*d would need q=16 and is clipped to 15: one full step
        bound = np.abs(d) + np.abs(d16 - d) * 8
    elif qt == QT.Q4_1:
        blocks = rb.reshape(-1, 20)
        d16 = blocks[:, :2].copy().view(np.float16).astype(np.float64).reshape(-1)
        m16 = blocks[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(-1)
        mn, mx = s.min(axis=1), s.max(axis=1)
        d = (mx - mn) / 15
        bound = d / 2 + np.abs(d16 - d) * 15 + np.abs(m16 - mn)
    else:
        raise ValueError(qt)
    bound = bound * (1 + 1e-6) + 1e-7
    ratio = float((e / np.maximum(bound, 1e-30)).max())
    return bool((e <= bound).all()), ratio


def field_value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def explain_mismatch(qt, src, got, want):
    """Describes block mismatches between our bytes and gguf-py's."""
    bs = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_1: 20}.get(qt)
    if bs is None:
        n = int((got.reshape(-1) != want.reshape(-1)).sum())
        return f"{n} bytes differ"
    g = got.reshape(-1, bs)
    w = want.reshape(-1, bs)
    bad = np.nonzero((g != w).any(axis=1))[0]
    return f"{len(bad)} of {len(g)} blocks differ (first: block {bad[0]})"


def check_reader_on_gguf_py_file(strata, work, w):
    """The other direction: a llama GGUF written by gguf-py's GGUFWriter (the
    way llama.cpp's converter lays it out: Q/K permuted, q8_0 / q4_0 / f16 /
    f32 tensors, rope_freqs, a tokenizer) is read by strata and re-written as
    f32; its values must be gguf-py's dequantization of the original, with no
    second Q/K permutation, and the tokenizer keys must travel unchanged."""
    path = os.path.join(work, "by_gguf_py.gguf")
    gw = gguf.GGUFWriter(path, "llama")
    gw.add_context_length(4096)
    gw.add_embedding_length(HID)
    gw.add_block_count(NL)
    gw.add_feed_forward_length(FFN)
    gw.add_head_count(NH)
    gw.add_head_count_kv(NKV)
    gw.add_layer_norm_rms_eps(EPS)
    gw.add_rope_freq_base(THETA)
    gw.add_rope_dimension_count(HD)
    gw.add_file_type(7)
    tokens = [f"<t{i}>" for i in range(VOC)]
    gw.add_tokenizer_model("gpt2")
    gw.add_token_list(tokens)
    gw.add_token_types([1] * VOC)
    gw.add_bos_token_id(BOS)
    gw.add_eos_token_id(EOS[0])
    gw.add_eot_token_id(EOS[1])
    src = expected_source(w)
    kinds = [QT.Q8_0, QT.Q4_0, QT.F16, QT.Q4_1, QT.BF16]
    stored = {}
    for i, (name, a) in enumerate(src.items()):
        if a.ndim == 1:
            gw.add_tensor(name, a.astype(np.float32))
            stored[name] = a.astype(np.float32)
            continue
        qt = kinds[i % len(kinds)]
        q = quants.quantize(a, qt)
        gw.add_tensor(name, q, raw_dtype=qt)
        stored[name] = quants.dequantize(q, qt).reshape(a.shape).astype(np.float32)
    rf = llama3_rope_divisors().astype(np.float32)
    gw.add_tensor("rope_freqs.weight", rf)
    stored["rope_freqs.weight"] = rf
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()

    out = os.path.join(work, "by_gguf_py_f32.gguf")
    r = subprocess.run([strata, "convert", path, out, "--type", "f32"], capture_output=True, text=True)
    check(r.returncode == 0, f"gguf-py file: strata convert failed: {r.stderr.strip()}")
    if r.returncode != 0:
        return
    rd = gguf.GGUFReader(out)
    check(field_value(rd, "tokenizer.ggml.tokens") == tokens, "gguf-py file: tokens not copied")
    check(field_value(rd, "tokenizer.ggml.model") == "gpt2", "gguf-py file: tokenizer model")
    check(field_value(rd, "tokenizer.ggml.token_type") == [1] * VOC, "gguf-py file: token types")
    check(field_value(rd, "tokenizer.ggml.bos_token_id") == BOS, "gguf-py file: bos")
    check(field_value(rd, "tokenizer.ggml.eos_token_id") == EOS[0], "gguf-py file: eos")
    check(field_value(rd, "tokenizer.ggml.eot_token_id") == EOS[1], "gguf-py file: eot")
    check(field_value(rd, "llama.context_length") == 4096, "gguf-py file: context length")
    check(field_value(rd, "llama.attention.key_length") == HD, "gguf-py file: key length")
    tensors = {t.name: t for t in rd.tensors}
    check(set(tensors) == set(stored), f"gguf-py file: names {sorted(set(tensors) ^ set(stored))}")
    n_same = 0
    for name, a in stored.items():
        t = tensors.get(name)
        if t is None:
            continue
        check(t.tensor_type == QT.F32, f"gguf-py file: {name} is {t.tensor_type.name}")
        got = np.asarray(t.data, dtype=np.float32).reshape(a.shape)
        same = np.array_equal(got, a)
        n_same += same
        check(same, f"gguf-py file: {name} values differ after strata's read + f32 write")
    print(f"  gguf-py-written file -> strata -> f32: {n_same}/{len(stored)} tensors equal")


def gguf_version():
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:
        return "?"


def main():
    strata = os.environ.get("STRATA_BIN")
    if not strata or not os.path.exists(strata):
        print("test_gguf_pyref: STRATA_BIN is not set to the built strata binary", file=sys.stderr)
        return 1
    tmp_root = os.environ.get("STRATA_TMP") or tempfile.gettempdir()
    os.makedirs(tmp_root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gguf_pyref-", dir=tmp_root)
    hf = os.path.join(work, "hf")
    os.makedirs(hf)
    rng = np.random.default_rng(20261121)
    w = make_weights(rng)
    write_hf_dir(hf, w)
    want = expected_source(w)
    want_divs = llama3_rope_divisors()

    types = [("f32", QT.F32), ("f16", QT.F16), ("bf16", QT.BF16),
             ("q8_0", QT.Q8_0), ("q4_0", QT.Q4_0), ("q4_1", QT.Q4_1)]
    byte_equal = {}
    for tname, qt in types:
        out = os.path.join(work, f"out_{tname}.gguf")
        r = subprocess.run([strata, "convert", hf, out, "--type", tname], capture_output=True, text=True)
        check(r.returncode == 0, f"{tname}: strata convert failed ({r.returncode}): {r.stderr.strip()}")
        if r.returncode != 0:
            continue
        check("tensors" in r.stdout and "bytes" in r.stdout, f"{tname}: summary line: {r.stdout!r}")
        rd = gguf.GGUFReader(out)

        # metadata
        expect_kv = {
            "general.architecture": "llama", "general.alignment": 32,
            "llama.vocab_size": VOC, "llama.context_length": CTX, "llama.embedding_length": HID,
            "llama.block_count": NL, "llama.feed_forward_length": FFN,
            "llama.attention.head_count": NH, "llama.attention.head_count_kv": NKV,
            "llama.attention.key_length": HD, "llama.attention.value_length": HD,
            "llama.rope.dimension_count": HD,
            "tokenizer.ggml.bos_token_id": BOS, "tokenizer.ggml.eos_token_id": EOS[0],
            "tokenizer.ggml.eot_token_id": EOS[1],
            "general.file_type": {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}[tname],
        }
        for k, v in expect_kv.items():
            check(field_value(rd, k) == v, f"{tname}: {k} = {field_value(rd, k)!r}, want {v!r}")
        check(field_value(rd, "llama.attention.layer_norm_rms_epsilon") == float(np.float32(EPS)),
              f"{tname}: rms eps {field_value(rd, 'llama.attention.layer_norm_rms_epsilon')}")
        check(field_value(rd, "llama.rope.freq_base") == float(np.float32(THETA)),
              f"{tname}: freq_base {field_value(rd, 'llama.rope.freq_base')}")
        check(rd.fields["llama.block_count"].types[0] == gguf.GGUFValueType.UINT32, f"{tname}: block_count type")
        check(rd.fields["llama.rope.freq_base"].types[0] == gguf.GGUFValueType.FLOAT32, f"{tname}: freq_base type")
        check("llama.rope.scaling.type" not in rd.fields, f"{tname}: llama3 scaling must not be a scaling.type")
        check(rd.data_offset % 32 == 0, f"{tname}: data section at {rd.data_offset}")

        # tensors
        tensors = {t.name: t for t in rd.tensors}
        check(set(tensors) == set(want) | {"rope_freqs.weight"},
              f"{tname}: tensor names {sorted(set(tensors) ^ (set(want) | {'rope_freqs.weight'}))} differ")
        rf = tensors.get("rope_freqs.weight")
        if rf is not None:
            check(rf.tensor_type == QT.F32 and list(rf.shape) == [HD // 2], f"{tname}: rope_freqs {rf.tensor_type} {rf.shape}")
            got = np.asarray(rf.data, dtype=np.float64).reshape(-1)
            check(np.allclose(got, want_divs, rtol=1e-6, atol=0), f"{tname}: rope_freqs {got} vs {want_divs}")
            check((got == 1).any() and (got == R_FACTOR).any() and ((got > 1) & (got < R_FACTOR)).any(),
                  f"{tname}: rope_freqs does not cover the three llama3 regions: {got}")
        all_equal = True
        worst = 0.0
        for name, src in want.items():
            t = tensors.get(name)
            if t is None:
                continue
            is_mat = src.ndim == 2
            want_type = qt if is_mat else QT.F32
            check(t.tensor_type == want_type, f"{tname}: {name} type {t.tensor_type.name}, want {want_type.name}")
            check(list(t.shape) == list(reversed(src.shape)), f"{tname}: {name} ne {list(t.shape)} vs {src.shape}")
            check(t.data_offset % 32 == 0, f"{tname}: {name} at {t.data_offset}")
            deq = quants.dequantize(t.data, t.tensor_type).reshape(src.shape).astype(np.float32)
            if want_type == QT.F32:
                check(np.array_equal(deq, src), f"{tname}: {name} f32 data differs")
                continue
            if want_type == QT.F16:
                # 1e-3 relative in f16's normal range (RNE gives <= 2^-11); below
                # 2^-14 values are subnormal and the error is absolute (<= 2^-25)
                err = np.abs(deq.astype(np.float64) - src)
                normal = np.abs(src) >= 2.0 ** -14
                rel = err[normal] / np.abs(src[normal])
                check(float(rel.max(initial=0)) <= 1e-3 and float(err[~normal].max(initial=0)) <= 2.0 ** -25,
                      f"{tname}: {name} f16 rel err {rel.max(initial=0):.3g}, "
                      f"subnormal abs err {err[~normal].max(initial=0):.3g}")
            elif want_type == QT.BF16:
                check(np.array_equal(deq, to_bf16_exact(src)), f"{tname}: {name} bf16 data differs")
            else:
                raw = np.asarray(t.data).view(np.uint8)
                ok, ratio = block_error_ok(want_type, src, deq, raw)
                worst = max(worst, ratio)
                check(ok, f"{tname}: {name} error above the {tname} bound (worst/bound = {ratio:.3f})")
            # byte equality with gguf-py's quantizer
            try:
                ref = quants.quantize(src, want_type)
            except NotImplementedError:
                all_equal = None
                continue
            got_b = np.asarray(t.data).view(np.uint8).reshape(-1)
            ref_b = np.ascontiguousarray(ref).view(np.uint8).reshape(-1)
            same = got_b.shape == ref_b.shape and np.array_equal(got_b, ref_b)
            if not same:
                all_equal = False
                check(False, f"{tname}: {name} bytes differ from gguf.quants.quantize: "
                             + explain_mismatch(want_type, src, got_b, ref_b))
        byte_equal[tname] = all_equal
        extra = f", worst error/bound {worst:.3f}" if worst else ""
        print(f"  {tname}: {len(tensors)} tensors, byte-equal to gguf-py: {all_equal}{extra}")

    check_reader_on_gguf_py_file(strata, work, w)

    print(f"test_gguf_pyref: {CHECKS - len(FAILS)}/{CHECKS} checks passed; gguf-py {gguf_version()}; "
          + ", ".join(f"{k}={'bytes equal' if v else 'DIFF' if v is False else 'n/a'}" for k, v in byte_equal.items()))
    if not FAILS:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
