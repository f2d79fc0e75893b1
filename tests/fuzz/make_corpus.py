#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses: tests/fuzz/corpus/<name>/.

    python3 tests/fuzz/make_corpus.py BUILD/strata

Everything is generated here (small hand-built models, tokenizers, requests),
or written by strata itself (`strata convert`: the project's GGUF writer), or
copied from the project's own test fixtures (tests/data). Deterministic: run
it again and the files come out the same (the GGUFs through strata's writer).
Crash inputs found by fuzzing are added to the corpus by hand (regress-*
files) and are not touched here.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")
SEP = b"\n--8<--\n"  # fuzzutil.h: FUZZ_SEP


def put(name, fname, data):
    d = os.path.join(CORPUS, name)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, fname), "wb") as f:
        f.write(data)


# ---- a tiny Llama model ------------------------------------------------------------
def tiny_tensors(hidden, inter, vocab, heads, kv_heads, head_dim, layers, tied):
    """(name, shape) of a Llama model, HF names."""
    t = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = "model.layers.%d." % i
        t += [(p + "input_layernorm.weight", [hidden]),
              (p + "self_attn.q_proj.weight", [heads * head_dim, hidden]),
              (p + "self_attn.k_proj.weight", [kv_heads * head_dim, hidden]),
              (p + "self_attn.v_proj.weight", [kv_heads * head_dim, hidden]),
              (p + "self_attn.o_proj.weight", [hidden, heads * head_dim]),
              (p + "post_attention_layernorm.weight", [hidden]),
              (p + "mlp.gate_proj.weight", [inter, hidden]),
              (p + "mlp.up_proj.weight", [inter, hidden]),
              (p + "mlp.down_proj.weight", [hidden, inter])]
    t.append(("model.norm.weight", [hidden]))
    if not tied:
        t.append(("lm_head.weight", [vocab, hidden]))
    return t


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def values(n, seed, dtype):
    """n deterministic small values as bytes of dtype (F32 or BF16)."""
    out = bytearray()
    x = seed * 2654435761 % 2**32 or 1
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        v = (x / 2**31 - 0.5) * 0.2
        b = struct.pack("<f", v)
        out += b if dtype == "F32" else b[2:]
    return bytes(out)


def safetensors(tensors, dtype, meta=True):
    """One safetensors file (no padding) of [(name, shape)]."""
    esize = 4 if dtype == "F32" else 2
    header, data, off = {}, bytearray(), 0
    if meta:
        header["__metadata__"] = {"format": "pt"}
    for i, (name, shape) in enumerate(tensors):
        nb = numel(shape) * esize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nb]}
        data += values(numel(shape), i + 1, dtype)
        off += nb
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + bytes(data)


def config(hidden, inter, vocab, heads, kv_heads, head_dim, layers, tied, **extra):
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
         "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": tied, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    c.update(extra)
    return json.dumps(c, indent=1)


SMALL = dict(hidden=8, inter=16, vocab=16, heads=2, kv_heads=1, head_dim=4, layers=1)


def safetensors_seeds():
    name = "safetensors"
    t = tiny_tensors(tied=False, **SMALL)
    put(name, "f32", config(tied=False, **SMALL).encode() + SEP + safetensors(t, "F32"))
    tt = tiny_tensors(tied=True, **SMALL)
    cfg = config(tied=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                 **SMALL)
    put(name, "bf16-tied-llama3", cfg.encode() + SEP + safetensors(tt, "BF16", meta=False))
    cfg = config(tied=False, eos_token_id=[2, 3],
                 rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}, **SMALL)
    half = len(t) // 2
    index = {"metadata": {"total_size": 0},
             "weight_map": {n: ("a.safetensors" if i < half else "b.safetensors") for i, (n, _) in enumerate(t)}}
    put(name, "sharded", cfg.encode() + SEP + json.dumps(index, indent=1).encode() + SEP +
        safetensors(t[:half], "F32") + SEP + safetensors(t[half:], "F32"))
    # refused ones
    body = safetensors(t, "F32")
    put(name, "header-too-long", config(tied=False, **SMALL).encode() + SEP + struct.pack("<Q", 1 << 40) + body[8:])
    bad = json.loads(body[8:8 + struct.unpack("<Q", body[:8])[0]])
    bad["model.norm.weight"]["data_offsets"] = [0, 32]  # overlaps the embedding
    bad["lm_head.weight"]["dtype"] = "I64"
    h = json.dumps(bad).encode()
    put(name, "overlap-dtype", config(tied=False, **SMALL).encode() + SEP + struct.pack("<Q", len(h)) + h +
        body[8 + struct.unpack("<Q", body[:8])[0]:])
    put(name, "config-only-bad", '{"model_type": "llama", "vocab_size": 16, "hidden_size": 8, '
        '"intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 3, "head_dim": null, '
        '"rms_norm_eps": 1e-50, "partial_rotary_factor": 0.5}')


# ---- GGUF ---------------------------------------------------------------------------
def gstr(s):
    s = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(s)) + s


def gguf_kv_only(kvs, version=3, n_tensors=0):
    """A GGUF header with key/values [(key, type, encoded value)] and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs))
    for k, t, v in kvs:
        out += gstr(k) + struct.pack("<I", t) + v
    return out


def gguf_seeds(strata):
    name = "gguf"
    tmp = tempfile.mkdtemp(prefix="strata-corpus-")
    try:
        dims = dict(hidden=32, inter=32, vocab=16, heads=2, kv_heads=1, head_dim=16, layers=1)
        d = os.path.join(tmp, "hf")
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(config(tied=True, **dims))
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(safetensors(tiny_tensors(tied=True, **dims), "F32"))
        for ty in ("q4_0", "q8_0", "f16"):
            out = os.path.join(tmp, ty + ".gguf")
            subprocess.run([strata, "convert", d, out, "--type", ty], check=True, stdout=subprocess.DEVNULL)
            with open(out, "rb") as f:
                put(name, "tiny-" + ty + ".gguf", f.read())
    finally:
        shutil.rmtree(tmp)
    # models with a tokenizer: the project's own tokenizer fixtures
    for fx in ("tiny_bpe_llama-bpe.gguf", "spm.gguf"):
        shutil.copy(os.path.join(ROOT, "tests", "data", "tokenizer", fx), os.path.join(CORPUS, name, fx))
    u32 = lambda v: struct.pack("<I", v)
    put(name, "bad-magic", b"GGUG" + u32(3) + bytes(16))
    put(name, "version1", gguf_kv_only([], version=1))
    put(name, "truncated-kv", gguf_kv_only([("general.architecture", 8, gstr("llama"))])[:-3])
    put(name, "nested-array", gguf_kv_only([("a", 9, u32(9) + struct.pack("<Q", 1) + u32(4) + struct.pack("<Q", 0))]))
    put(name, "many-types", gguf_kv_only([
        ("general.architecture", 8, gstr("llama")), ("general.alignment", 4, u32(64)),
        ("u8", 0, b"\x07"), ("i16", 3, struct.pack("<h", -3)), ("f64", 12, struct.pack("<d", 0.5)),
        ("b", 7, b"\x01"), ("i64", 11, struct.pack("<q", -1)),
        ("tokenizer.ggml.tokens", 9, u32(8) + struct.pack("<Q", 2) + gstr("a") + gstr("b")),
        ("tokenizer.ggml.scores", 9, u32(6) + struct.pack("<Q", 2) + struct.pack("<ff", 0.0, -1.0)),
        ("general.sampling.temp", 6, struct.pack("<f", 0.7))]))


# ---- tokenizer.json -------------------------------------------------------------------
def bytelevel_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


PAT_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PAT_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer_json(pre, normalizer=None, post=None, merges_as_pairs=False):
    m = bytelevel_chars()
    vocab = {}
    for b in range(256):
        vocab[m[b]] = len(vocab)
    merges = []
    for a, b in (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("1", "2"),
                 ("Ċ", "Ċ"), ("Ġ", "Ġ")):
        vocab[a + b] = len(vocab)
        merges.append([a, b] if merges_as_pairs else a + " " + b)
    added = [{"id": len(vocab) + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s}
             for i, (c, s) in enumerate((("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                                         ("<user_tok>", False)))]
    d = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
         "pre_tokenizer": pre, "post_processor": post, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                                                   "trim_offsets": True, "use_regex": True},
         "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                   "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                   "vocab": vocab, "merges": merges}}
    return json.dumps(d, ensure_ascii=False).encode()


def tokenizer_json_seeds():
    name = "tokenizer_json"
    bl = lambda regex: {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": regex}
    split = lambda pat: {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False}, bl(False)]}
    tpl = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                    {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [256 + 9],
                                                            "tokens": ["<|endoftext|>"]}}}
    put(name, "gpt2", tokenizer_json(bl(True)))
    put(name, "smollm-digits", tokenizer_json({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, bl(True)]}, merges_as_pairs=True))
    put(name, "llama3-split-nfc-template", tokenizer_json(split(PAT_LLAMA3), normalizer={"type": "NFC"},
                                                          post={"type": "Sequence", "processors": [bl(False), tpl]}))
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": {"content": "<|endoftext|>"},
           "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
           "chat_template": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                            "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"}
    put(name, "gpt2-split-config", tokenizer_json(split(PAT_GPT2)) + SEP + json.dumps(cfg).encode())
    put(name, "unknown-pretok", tokenizer_json({"type": "Whitespace"}))
    put(name, "bad-merge", json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1},
                                                 "merges": ["a c"]},
                                       "pre_tokenizer": bl(True)}).encode())
    put(name, "dup-id", b'{"model":{"vocab":{"a":0,"b":0},"merges":[]},"pre_tokenizer":{"type":"ByteLevel"},'
                        b'"added_tokens":[{"id":5,"content":"","special":true}]}')


# ---- tokenize, chat, openai ----------------------------------------------------------------
def tokenize_seeds():
    name = "tokenize"
    texts = [
        b"Hello world! The quick brown fox jumps over the lazy dog.",
        b"def f(x):\n    return x ** 2  # 12345\n\n\n\t\ttabs",
        "日本語のテキスト、中文，한국어 😀👍🏽 e\u0301 Å".encode(),
        b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<user_tok></s><s>",
        b"\xff\xfe bad \xc3 utf8 \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82",
        b"it's they'll I'M 1234567 3.14159   spaces   \r\n\r\n",
        b"|<|im_start|>|plain <|im_end|> text|<|im_end|>|",
    ]
    for i, t in enumerate(texts):
        for tok in range(6):
            flags = tok | (0x18 if i % 2 else 0) | (0x20 if i == 3 else 0) | (0x40 if i == 6 else 0)
            put(name, "t%d-%d" % (i, tok), bytes([flags]) + t)


def chat_seeds():
    name = "chat"
    tdir = os.path.join(ROOT, "tests", "data", "chat", "templates")
    conv = SEP.join([b"system:You are terse.", b"user:Hello <|im_end|> there", b"assistant:  Hi!  ",
                     b"user:\xe3\x80\x80again\xc2\xa0"])
    for fn in sorted(os.listdir(tdir)):
        with open(os.path.join(tdir, fn), "rb") as f:
            put(name, "detect-" + fn.replace(".jinja", ""), b"\x04" + f.read() + SEP + conv)
    put(name, "chatml-default-system", b"\x15" + conv)
    put(name, "llama3-date-tool", b"\x0e" + conv + SEP + b"tool:{\"x\": 1}")
    put(name, "llama2-alternating", b"\x03" + conv)
    put(name, "roles-forged", b"\x01" + b"<|im_end|>:x" + SEP + b"no colon <|im_start|>" + SEP + b":")


def openai_seeds():
    name = "openai"
    chat = {"model": "smollm2", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Say hi <|im_end|>"}],
            "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "repetition_penalty": 1.1, "seed": 42, "stop": ["\n", "END"], "stream": True,
            "stream_options": {"include_usage": True}}
    put(name, "chat-full", b"\x01" + json.dumps(chat).encode())
    parts = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None}, {"role": "tool", "content": "42"}],
             "n": 1, "logprobs": False, "tools": [], "response_format": {"type": "text"}}
    put(name, "chat-parts", b"\x01" + json.dumps(parts).encode())
    put(name, "chat-bad-role", b'\x01{"messages":[{"role":"robot","content":"x"}],"seed":-1}')
    put(name, "completion-text", b'\x00{"prompt":"Once upon a time","max_tokens":5,"stop":"."}')
    put(name, "completion-ids", b'\x00{"prompt":[1,2,3,49151],"ignore_eos":true,"temperature":0}')
    put(name, "completion-bad", b'\x00{"prompt":["a","b"],"presence_penalty":0.5,"best_of":2,"echo":true}')
    put(name, "not-json", b"\x00{\"prompt\": \"unterminated")
    put(name, "numbers", b'\x00{"prompt":"x","temperature":1e999,"top_p":1e-300,"seed":9007199254740993}')


def http_head_seeds():
    name = "http_head"
    put(name, "chat", b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:8080\r\nContent-Type: application/json"
                      b"\r\nAuthorization: Bearer k\r\nContent-Length: 57\r\n\r\n{\"messages\":[]}")
    put(name, "get-lf", b"\r\nGET /metrics HTTP/1.0\nAccept: */*\n\n")
    put(name, "chunked", b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    put(name, "pipelined", b"GET /health HTTP/1.1\r\nHost: a\r\n\r\nGET /health HTTP/1.1\r\nHost: a\r\n\r\n")
    put(name, "bad-content-length", b"POST / HTTP/1.1\r\nContent-Length: 12\r\ncontent-length: 13\r\n\r\n")
    put(name, "bad-line", b"GARBAGE\r\n\r\n")
    put(name, "bad-fold", b"GET / HTTP/1.1\r\nA: b\r\n\tc\r\n\r\n")
    put(name, "version", b"GET / HTTP/2.0\r\n\r\n")
    put(name, "partial", b"GET /v1/models HTTP/1.1\r\nHost: loc")
    put(name, "tls", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_corpus.py BUILD/strata")
    safetensors_seeds()
    gguf_seeds(sys.argv[1])
    tokenizer_json_seeds()
    tokenize_seeds()
    chat_seeds()
    openai_seeds()
    http_head_seeds()


if __name__ == "__main__":
    main()
