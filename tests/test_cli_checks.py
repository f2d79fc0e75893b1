#!/usr/bin/env python3
"""The CLI's first impression and its checks of model metadata (issue 17,
items 3, 7 and 10):

  - `strata --version` / `strata version` print the version of CMakeLists.txt;
  - GGUF hyperparameters out of range (rms_norm_eps NaN / -1, a rope dimension
    count other than the head size, an eos id outside the vocabulary, a
    context of 1): `strata logits` exits non-zero, names the key, writes no
    logits (so no NaNs); the unmodified file gives finite logits;
  - `strata run --ctx N` above the model's max_position_embeddings: exit 2
    naming both numbers; with linear RoPE scaling up to the scaled length:
    a warning, and it runs;
  - `--chat-template` other than the model's template: a warning naming both
    (run and serve);
  - memory budgets above the machine's MemAvailable are refused (item 3):
    `serve --kv-mem` on the CPU backend, `run` / `bench --host-mem`, `serve` /
    `run --kv-host-mem` (against what can be pinned);
  - sampling defaults: a GGUF's general.sampling.* keys and a HF directory's
    generation_config.json replace the built-in defaults, options on the
    command line win, and a line on stderr says what was taken.
GGUF variants are written here by rewriting the header of the tiny random
model (`strata mkmodel`) or of the default model (SmolLM2-135M-Instruct).
"""
import math
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import testlib  # noqa: E402
from testlib import BIN, SRC, check  # noqa: E402

TMP = testlib.tmp_dir("cli_checks")
T_U32, T_I32, T_F32, T_STR = 4, 5, 6, 8
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def run(args, **kw):
    p = subprocess.run([BIN] + args, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kw)
    return p


def serve_start_stderr(model, extra):
    """Starts `strata serve` on a free port, waits for its listening line and stops it: -> its stderr
    (None when it did not start)."""
    err = open(os.path.join(TMP, "serve.err"), "w+")
    proc = subprocess.Popen([BIN, "serve", model, "--port", "0", "--max-batch", "1", "--max-model-len", "256"]
                            + extra, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    started = False
    deadline = time.time() + 60
    while not started and proc.poll() is None and time.time() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            started = proc.stdout.readline().startswith(b"listening on ")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    err.seek(0)
    return err.read() if started else None


# ---- a GGUF header rewriter: replace or add keys, tensor data copied as is ----
def _skip_value(b, pos, t):
    if t in SCALAR:
        return pos + SCALAR[t]
    if t == T_STR:
        n = struct.unpack_from("<Q", b, pos)[0]
        return pos + 8 + n
    assert t == 9, "value type %d" % t
    et, n = struct.unpack_from("<IQ", b, pos)
    pos += 12
    if et in SCALAR:
        return pos + n * SCALAR[et]
    for _ in range(n):
        pos = _skip_value(b, pos, et)
    return pos


def _value(t, v):
    if t == T_U32:
        return struct.pack("<I", v & 0xFFFFFFFF)
    if t == T_I32:
        return struct.pack("<i", v)
    if t == T_F32:
        return struct.pack("<f", v)
    if t == T_STR:
        e = v.encode()
        return struct.pack("<Q", len(e)) + e
    raise ValueError(t)


def gguf_rewrite(src, dst, changes):
    """Copies GGUF src to dst with keys replaced or added: changes = {key: (type, value)}."""
    with open(src, "rb") as f:
        head = f.read(64 << 20)
    magic, ver, n_t, n_kv = struct.unpack_from("<4sIQQ", head, 0)
    assert magic == b"GGUF"
    pos = 24
    kvs = []  # (key, raw bytes of type + value)
    align = 32
    for _ in range(n_kv):
        kl = struct.unpack_from("<Q", head, pos)[0]
        key = head[pos + 8:pos + 8 + kl].decode()
        vpos = pos + 8 + kl
        t = struct.unpack_from("<I", head, vpos)[0]
        end = _skip_value(head, vpos + 4, t)
        if key == "general.alignment":
            align = struct.unpack_from("<I", head, vpos + 4)[0]
        kvs.append((key, head[vpos:end]))
        pos = end
    ti_start = pos
    for _ in range(n_t):
        nl = struct.unpack_from("<Q", head, pos)[0]
        pos += 8 + nl
        nd = struct.unpack_from("<I", head, pos)[0]
        pos += 4 + 8 * nd + 4 + 8
    infos = head[ti_start:pos]
    data_off = (pos + align - 1) // align * align
    out = {k: raw for k, raw in kvs}
    order = [k for k, _ in kvs]
    for k, (t, v) in changes.items():
        if k not in out:
            order.append(k)
        out[k] = struct.pack("<I", t) + _value(t, v)
    hdr = bytearray(struct.pack("<4sIQQ", b"GGUF", ver, n_t, len(order)))
    for k in order:
        e = k.encode()
        hdr += struct.pack("<Q", len(e)) + e + out[k]
    hdr += infos
    hdr += b"\0" * ((-len(hdr)) % align)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.write(hdr)
        fi.seek(data_off)
        shutil.copyfileobj(fi, fo, 16 << 20)


def f32s(path):
    with open(path, "rb") as f:
        d = f.read()
    return struct.unpack("<%df" % (len(d) // 4), d)


# ---- the checks ----
def test_version():
    with open(os.path.join(SRC, "CMakeLists.txt")) as f:
        m = re.search(r"project\(strata VERSION ([0-9.]+)", f.read())
    check(m is not None, "CMakeLists.txt defines the version in project()")
    want = m.group(1) if m else "?"
    for arg in ("--version", "version"):
        p = run([arg])
        check(p.returncode == 0 and p.stdout == "strata %s\n" % want,
              "strata %s prints 'strata %s' (rc %d, out %r, err %r)" % (arg, want, p.returncode, p.stdout,
                                                                        p.stderr[-200:]))
    p = run(["--help"])
    check("--version" in p.stdout, "strata --help mentions --version")


def test_bad_metadata():
    tiny = os.path.join(TMP, "tiny.gguf")
    p = run(["mkmodel", "--config", "tiny", "--dtype", "q8_0", tiny])
    if not check(p.returncode == 0, "mkmodel tiny q8_0 (%s)" % p.stderr.strip()[-300:]):
        return
    out = os.path.join(TMP, "logits.f32")
    good = os.path.join(TMP, "tiny_same.gguf")
    gguf_rewrite(tiny, good, {})  # the rewriter itself changes nothing that matters
    for path in (tiny, good):
        if os.path.exists(out):
            os.remove(out)
        p = run(["logits", path, "--tokens", "1 2 3", "--out", out, "--threads", "2"])
        ok = p.returncode == 0 and os.path.exists(out)
        vals = f32s(out) if ok else []
        check(ok and len(vals) == 3 * 512 and all(math.isfinite(v) for v in vals),
              "logits of %s: rc 0, 3 x 512 finite values (rc %d: %s)" % (os.path.basename(path), p.returncode,
                                                                         p.stderr.strip()[-300:]))
    eps = "llama.attention.layer_norm_rms_epsilon"
    cases = [
        ("eps_nan", {eps: (T_F32, float("nan"))}, eps),
        ("eps_neg", {eps: (T_F32, -1.0)}, eps),
        ("eps_big", {eps: (T_F32, 3.0)}, eps),
        ("rope63", {"llama.rope.dimension_count": (T_U32, 63)}, "llama.rope.dimension_count"),
        ("rope1000", {"llama.rope.dimension_count": (T_U32, 1000)}, "llama.rope.dimension_count"),
        ("eos1e9", {"tokenizer.ggml.eos_token_id": (T_U32, 1000000000)}, "tokenizer.ggml.eos_token_id"),
        ("ctx1", {"llama.context_length": (T_U32, 1)}, "llama.context_length"),
        ("kv3", {"llama.attention.head_count_kv": (T_U32, 3)}, "llama.attention.head_count_kv"),
    ]
    for name, ch, key in cases:
        bad = os.path.join(TMP, "tiny_%s.gguf" % name)
        gguf_rewrite(tiny, bad, ch)
        if os.path.exists(out):
            os.remove(out)
        p = run(["logits", bad, "--tokens", "1 2 3", "--out", out, "--threads", "2"])
        nans = os.path.exists(out) and any(not math.isfinite(v) for v in f32s(out))
        check(p.returncode != 0 and key in p.stderr and bad in p.stderr and not nans and
              not (os.path.exists(out) and os.path.getsize(out) > 0),
              "logits on %s: rc %d != 0, the message names the file and '%s', no logits written (%s)"
              % (name, p.returncode, key, p.stderr.strip()[-300:]))


def stats_seed(err):
    m = re.search(r"^prompt: .*stop: \w+(, seed: (\d+))?", err, re.M)
    return (m is not None), (m.group(2) if m and m.group(2) else None)


def test_run_checks():
    model = default_model.path()
    th = ["--threads", "2"]
    q = "What is the capital of France?"
    # --ctx beyond the model's positions
    p = run(["run", model, "--ctx", "100000", "-p", q, "-n", "1"] + th)
    check(p.returncode == 2 and "100000" in p.stderr and "8192" in p.stderr and p.stdout == "",
          "run --ctx 100000 on the 8192-position model: exit 2 naming both numbers (rc %d: %s)"
          % (p.returncode, p.stderr.strip()[-300:]))
    p = run(["run", model, "--ctx", "8192", "-p", q, "-n", "1", "--temp", "0"] + th)
    check(p.returncode == 0 and "warning" not in p.stderr,
          "run --ctx 8192 (the model's own length): accepted, no warning (rc %d: %s)"
          % (p.returncode, p.stderr.strip()[-300:]))

    # --chat-template against the model's own (chatml)
    p = run(["run", model, "--chat-template", "llama3", "-p", q, "-n", "2", "--temp", "0"] + th)
    check(p.returncode == 0 and re.search(r"warning: .*llama3.*chatml", p.stderr) is not None,
          "--chat-template llama3 on a ChatML model: a warning naming both (rc %d: %s)"
          % (p.returncode, p.stderr.strip()[-300:]))
    p = run(["run", model, "--chat-template", "chatml", "-p", q, "-n", "2", "--temp", "0"] + th)
    check(p.returncode == 0 and "warning" not in p.stderr,
          "--chat-template chatml on a ChatML model: no warning (%s)" % p.stderr.strip()[-300:])
    for tpl, warned in (("llama3", True), ("chatml", False)):  # strata serve: the same warning
        err = serve_start_stderr(model, ["--chat-template", tpl] + th)
        check(err is not None and (re.search(r"serve: warning: .*llama3.*chatml", err) is not None) == warned,
              "serve --chat-template %s on a ChatML model: %s (%s)" % (tpl, "a warning naming both" if warned
                                                                      else "no warning", (err or "")[-300:]))

    # the reference: greedy
    g = run(["run", model, "-p", q, "-n", "12", "--temp", "0"] + th)
    check(g.returncode == 0 and "sampling from" not in g.stderr,
          "greedy run; the default model carries no sampling keys (%s)" % g.stderr.strip()[-300:])

    # a GGUF that recommends greedy decoding and has linear RoPE scaling x2
    a = os.path.join(TMP, "smol_greedy_linear.gguf")
    gguf_rewrite(model, a, {"general.sampling.temp": (T_F32, 0.0),
                            "llama.rope.scaling.type": (T_STR, "linear"),
                            "llama.rope.scaling.factor": (T_F32, 2.0)})
    p = run(["run", a, "-p", q, "-n", "12"] + th)
    has_stats, seed = stats_seed(p.stderr)
    check(p.returncode == 0 and re.search(r"^strata: sampling from .*general\.sampling\.\*: temperature 0$",
                                          p.stderr, re.M) is not None and has_stats and seed is None,
          "general.sampling.temp 0: said on stderr, the run is greedy (no seed in the stats) (%s)"
          % p.stderr.strip()[-400:])
    p2 = run(["run", a, "-p", q, "-n", "12", "--temp", "0.8", "--seed", "5"] + th)
    has_stats, seed = stats_seed(p2.stderr)
    check(p2.returncode == 0 and seed == "5" and "sampling from" not in p2.stderr,
          "--temp given: the model's temperature is not taken (seed 5 in the stats) (%s)" % p2.stderr.strip()[-300:])
    p = run(["run", a, "--ctx", "12000", "-p", q, "-n", "1"] + th)
    check(p.returncode == 0 and re.search(r"warning: --ctx 12000 .*8192.*linear RoPE scaling.*16384", p.stderr),
          "--ctx 12000 with linear scaling x2: a warning, and it runs (rc %d: %s)" % (p.returncode,
                                                                                     p.stderr.strip()[-300:]))
    p = run(["run", a, "--ctx", "20000", "-p", q, "-n", "1"] + th)
    check(p.returncode == 2 and "20000" in p.stderr and "16384" in p.stderr,
          "--ctx 20000 beyond the scaled 16384: exit 2 naming both (rc %d: %s)" % (p.returncode,
                                                                                 p.stderr.strip()[-300:]))
    os.remove(a)

    # top_k 1 from the file: whatever the temperature and seed, the greedy answer
    b = os.path.join(TMP, "smol_topk1.gguf")
    gguf_rewrite(model, b, {"general.sampling.temp": (T_F32, 0.9), "general.sampling.top_k": (T_I32, 1)})
    p = run(["run", b, "-p", q, "-n", "12", "--seed", "7"] + th)
    has_stats, seed = stats_seed(p.stderr)
    check(p.returncode == 0 and "temperature 0.9, top-k 1" in p.stderr and seed == "7" and p.stdout == g.stdout,
          "general.sampling.top_k 1 (temp 0.9): the greedy answer %r, got %r (%s)" % (g.stdout, p.stdout,
                                                                                   p.stderr.strip()[-300:]))
    p = run(["run", b, "-p", q, "-n", "12", "--seed", "7", "--top-k", "0", "-q"] + th)
    check(p.returncode == 0 and "sampling from" not in p.stderr,
          "-q: no sampling line; --top-k given: the file's top_k not taken (%s)" % p.stderr.strip()[-300:])
    os.remove(b)

    # a HF directory's generation_config.json (the reference model with a byte-level tokenizer of its
    # 256 tokens written here)
    d = os.path.join(TMP, "hf_genconf")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(os.path.join(SRC, "tests", "data", "models", "gqa_f32"), d)
    write_byte_tokenizer(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write('{"bos_token_id": 1, "do_sample": true, "temperature": 0.2, "top_p": 0.9, "top_k": 20}\n')
    p = run(["run", d, "-p", "hi", "-n", "1"] + th)
    check("sampling from %s/generation_config.json: temperature 0.2, top-k 20, top-p 0.9" % d in p.stderr,
          "generation_config.json: temperature, top-k, top-p taken (%s)" % p.stderr.strip()[-300:])
    p = run(["run", d, "-p", "hi", "-n", "1", "--temp", "0.5"] + th)
    check("sampling from %s/generation_config.json: top-k 20, top-p 0.9\n" % d in p.stderr,
          "generation_config.json with --temp given: only top-k, top-p taken (%s)" % p.stderr.strip()[-300:])
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write('{"temperature": -1}\n')
    p = run(["run", d, "-p", "hi", "-n", "1"] + th)
    check(re.search(r"warning: .*generation_config\.json.*'temperature'", p.stderr) is not None and
          "sampling from" not in p.stderr,
          "a bad generation_config.json: a warning naming the file and the key (%s)" % p.stderr.strip()[-300:])


def write_byte_tokenizer(path):
    """A byte-level BPE tokenizer.json whose 256 tokens are the bytes (GPT-2's byte-to-unicode
    mapping), no merges: enough for a model with a 256-token vocabulary to run."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": byte_level,
           "post_processor": None, "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                     "merges": []}}
    with open(path, "w") as f:
        json.dump(tok, f)


def mem_available():
    """MemAvailable of /proc/meminfo in bytes (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def test_memory_budgets():
    """Budgets above what the machine has are refused (issue 17, item 3): on the
    CPU backend --kv-mem (the KV cache is host memory), on any backend --host-mem
    (pinned host memory); quickly, naming the option, the size and MemAvailable."""
    if mem_available() is None:
        print("ok    (no MemAvailable in /proc/meminfo: budget checks not run)")
        return
    model = default_model.path()
    twice = "%dM" % (2 * mem_available() // (1 << 20))  # what starts today on a big enough machine
    cases = [(["serve", model, "--device", "cpu", "--port", "0", "--no-rooflines", "--kv-mem", "100T"], "--kv-mem"),
             (["serve", model, "--device", "cpu", "--port", "0", "--no-rooflines", "--kv-mem", twice], "--kv-mem"),
             (["run", model, "--host-mem", "100T", "-p", "hi", "-n", "1"], "--host-mem"),
             (["bench", model, "--host-mem", "100T"], "--host-mem")]
    for args, opt in cases:
        try:
            p = run(args, timeout=60)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired:
            rc, err = None, "(still running after 60 s)"
        last = err.strip().splitlines()[-1:] if err.strip() else []
        check(rc in (1, 2) and opt in err and "MemAvailable" in err and re.search(r"\d+(\.\d+)? [KMGTP]iB", err),
              "%s %s: exit %s naming %s, the size and MemAvailable: %r" % (args[0], " ".join(args[2:]), rc, opt,
                                                                            last))
    # the KV cache's host tier (pinned host memory): its own check, against what can be pinned
    for args in (["serve", model, "--device", "cpu", "--port", "0", "--no-rooflines", "--kv-host-mem", "100T"],
                 ["run", model, "--kv-host-mem", "100T", "-p", "hi", "-n", "1"]):
        try:
            p = run(args, timeout=60)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired:
            rc, err = None, "(still running after 60 s)"
        last = err.strip().splitlines()[-1:] if err.strip() else []
        check(rc in (1, 2) and "--kv-host-mem" in err and "available" in err and
              re.search(r"\d+(\.\d+)? [KMGTP]iB", err), "%s --kv-host-mem 100T: exit %s naming the option, the size "
              "and what is available: %r" % (args[0], rc, last))
    # below one sequence: raised to one, and the warning says so (the size asked, the blocks given)
    err = serve_start_stderr(model, ["--device", "cpu", "--no-rooflines", "--kv-mem", "1K"])
    check(err is not None and re.search(r"kv_mem \(--kv-mem\) 1024 bytes holds 0 blocks of 16 tokens, less than one "
                                        r"sequence of max_model_len 256: raised to 16 blocks \(\d+\.\d\d MiB\)", err),
          "serve --kv-mem 1K: starts, warning that it was raised: %r" % (err or "")[-400:])
    # within the machine: accepted (the model loads and runs a token)
    p = run(["run", model, "--host-mem", "64M", "-p", "hi", "-n", "1", "--temp", "0"], timeout=120)
    check(p.returncode == 0, "run --host-mem 64M: runs (exit %s)" % p.returncode)


def main():
    test_version()
    test_bad_metadata()
    test_run_checks()
    test_memory_budgets()
    return testlib.summary("test_cli_checks")


if __name__ == "__main__":
    sys.exit(main())
