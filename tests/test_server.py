#!/usr/bin/env python3
"""`strata serve` end to end, with the official `openai` Python client (PyPI),
on the default model (SmolLM2-135M-Instruct Q4_1 GGUF, CPU), on a free
loopback port chosen by the server (--port 0; the test reads the
"listening on http://HOST:PORT" line).

Checks:
  - chat and completions, streamed and not: for greedy requests the streamed
    text equals the whole answer, and so do finish_reason and usage
    (stream_options.include_usage); max_tokens gives finish_reason "length";
    seeded sampling repeats; /v1/models, /health;
  - stop strings (string and array), streamed and not;
  - 16 concurrent greedy requests (threads) give exactly the texts of the same
    requests run one at a time, and /metrics saw several running at once;
  - every bad request gets its 4xx with an OpenAI-style error JSON
    {"error": {"message", "type", "param", "code"}} and the server keeps
    serving: malformed JSON, not an object, wrong types, out-of-range values
    (max_tokens < 1, temperature outside [0, 2], top_p outside (0, 1]),
    n != 1, missing fields, a prompt longer than the context (400 naming both
    lengths), a body over --max-body (413), unknown route (404), wrong method
    (405); with --api-key: a missing or wrong key (401), the right key works,
    /health and /metrics need it too (tests/test_server_hardening.py: the rest
    of issue 17's hostile-client checks);
  - a client that disconnects mid-stream (and one that leaves a non-streamed
    request) has its request aborted: strata_requests_running returns to 0;
  - /metrics parses (Prometheus text format) and counts requests, tokens,
    TTFT / TBT histograms;
  - load: 64 concurrent streaming clients for a fixed number of requests,
    twice; no errors, and the server's VmRSS after the second round is within
    a small tolerance of the first;
  - SIGTERM stops the server cleanly (exit status 0), and so does SIGINT with
    a stream in flight; usage errors exit 2, a port in use exits 1.
Sized for about a minute on 2 cores; a sanitizer build (detected from
CMakeCache.txt) runs fewer and shorter requests.
"""
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402

try:
    import openai
except ImportError:
    print("FAIL  the openai package is missing (scripts/install-deps.sh installs it)")
    sys.exit(1)

import testlib  # noqa: E402
from testlib import BIN, BUILD, SRC, TMP, check, failures, sanitized_build  # noqa: E402,F401

MAX_MODEL_LEN = 512
MAX_BODY = 65536

SAN = sanitized_build()
N_CONC = 16
CONC_TOKENS = 4 if SAN else 16
LOAD_CLIENTS = 64
LOAD_REQUESTS = 64
LOAD_TOKENS = 2 if SAN else 8


# ---- the server process ---------------------------------------------------------------------
class Server:
    def __init__(self, model, *extra, tag="main"):
        os.makedirs(TMP, exist_ok=True)
        self.log_path = os.path.join(TMP, "test_server_%s.log" % tag)
        self.log = open(self.log_path, "w")
        cmd = [BIN, "serve", model, "--port", "0", "--max-batch", str(N_CONC), "--max-model-len",
               str(MAX_MODEL_LEN), "--max-body", str(MAX_BODY), "--model-name", "smol"] + list(extra)
        env = dict(os.environ, STRATA_LOG="info")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.port = None
        deadline = time.time() + 60
        line = b""
        while time.time() < deadline and self.proc.poll() is None:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                m = re.match(rb"listening on http://127\.0\.0\.1:(\d+)$", line.strip())
                if m:
                    self.port = int(m.group(1))
                    break
        if self.port is None:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the server did not start (%r); log: %s" % (line, self.tail()))
        self.url = "http://127.0.0.1:%d" % self.port

    def tail(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def rss_kb(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return -1

    def stop(self, sig=signal.SIGTERM):
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc


def raw(srv, method, path, body=None, headers=None, timeout=120):
    """-> (status, parsed JSON or text, headers)"""
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = data.decode("utf-8", "replace")
    return r.status, parsed, dict(r.getheaders())


def error_shape(obj):
    if not isinstance(obj, dict) or set(obj) != {"error"}:
        return False
    e = obj["error"]
    return (isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and isinstance(e["message"], str)
            and e["message"] != "" and isinstance(e["type"], str) and (e["param"] is None or isinstance(e["param"], str))
            and (e["code"] is None or isinstance(e["code"], str)))


LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def metrics(srv):
    """{(name, labels): value}; raises on a line that is not Prometheus text."""
    status, text, hdr = raw(srv, "GET", "/metrics")
    assert status == 200 and hdr.get("Content-Type", "").startswith("text/plain"), (status, hdr)
    out, types = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = LINE.match(line)
        if not m:
            raise ValueError("not a metric line: %r" % line)
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in types and base not in types:
            raise ValueError("no # TYPE for %s" % name)
        out[(name, labels)] = value
    return out


def mval(m, name, labels=""):
    return m.get((name, labels), 0.0)


def http_count(m, route, code):
    return mval(m, "strata_http_requests_total", '{route="%s",code="%d"}' % (route, code))


# ---- helpers over the openai client ------------------------------------------------------------
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def extensions(kw):
    """Server extensions beyond the OpenAI schema go through extra_body."""
    if "ignore_eos" in kw:
        kw = dict(kw)
        kw["extra_body"] = {"ignore_eos": kw.pop("ignore_eos")}
    return kw


def chat(cl, messages, **kw):
    r = cl.chat.completions.create(model="smol", messages=messages, **extensions(kw))
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def chat_stream(cl, messages, **kw):
    text, finish, usage, n_chunks, first_role = [], None, None, 0, None
    for ch in cl.chat.completions.create(model="smol", messages=messages, stream=True, **extensions(kw)):
        n_chunks += 1
        if ch.usage is not None:
            usage = ch.usage
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        if first_role is None:
            first_role = d.role
        if d.content:
            text.append(d.content)
        if ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    return "".join(text), finish, usage, n_chunks, first_role


def comp(cl, prompt, **kw):
    r = cl.completions.create(model="smol", prompt=prompt, **extensions(kw))
    return r.choices[0].text, r.choices[0].finish_reason, r.usage


def comp_stream(cl, prompt, **kw):
    text, finish, usage = [], None, None
    for ch in cl.completions.create(model="smol", prompt=prompt, stream=True, **extensions(kw)):
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices:
            text.append(ch.choices[0].text or "")
            if ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
    return "".join(text), finish, usage


def usage_eq(a, b):
    return (a is not None and b is not None and a.prompt_tokens == b.prompt_tokens
            and a.completion_tokens == b.completion_tokens and a.total_tokens == b.total_tokens)


# ---- the checks ---------------------------------------------------------------------------------
def test_basic(srv):
    cl = srv.client()
    m0 = metrics(srv)
    text, finish, usage = chat(cl, FRANCE, temperature=0, max_tokens=40)
    check("Paris" in text and finish == "stop", "greedy chat answer names Paris: %r (%s)" % (text, finish))
    check(usage.prompt_tokens > 10 and usage.completion_tokens > 0
          and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, "chat usage %s" % usage)
    stext, sfinish, susage, n_chunks, role = chat_stream(cl, FRANCE, temperature=0, max_tokens=40,
                                                         stream_options={"include_usage": True})
    check(stext == text and sfinish == finish, "streamed chat == whole answer (%d chunks)" % n_chunks)
    check(n_chunks >= 4 and role == "assistant", "stream: role chunk first, one chunk per piece")
    check(usage_eq(susage, usage), "stream_options.include_usage: the same usage")
    # completions, greedy, streamed and not, max_tokens -> length
    prompt = "The three primary colors are"
    ctext, cfinish, cusage = comp(cl, prompt, temperature=0, max_tokens=12, ignore_eos=True)
    check(cfinish == "length" and cusage.completion_tokens == 12 and len(ctext) > 0,
          "completion: max_tokens 12 -> length, %r" % ctext)
    sctext, scfinish, scusage = comp_stream(cl, prompt, temperature=0, max_tokens=12, ignore_eos=True,
                                            stream_options={"include_usage": True})
    check(sctext == ctext and scfinish == cfinish and usage_eq(scusage, cusage), "streamed completion == whole")
    # top_p below the float range keeps the most likely token only (it once rounded to 0, read as "off")
    ttext = comp(cl, prompt, temperature=1.5, top_p=1e-300, seed=7, max_tokens=12, ignore_eos=True)[0]
    check(ttext == ctext, "top_p 1e-300 samples as greedy: %r" % ttext)
    # seeded sampling repeats; max_completion_tokens is accepted
    a = chat(cl, FRANCE, temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)[0]
    b = chat(cl, FRANCE, temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)[0]
    r = cl.chat.completions.create(model="smol", messages=FRANCE, max_completion_tokens=3, temperature=0)
    check(a == b, "seeded sampling repeats: %r" % a)
    check(r.usage.completion_tokens <= 3, "max_completion_tokens")
    # token-id prompt: same as its text
    ids_text = comp(cl, [504, 3458, 282], temperature=0, max_tokens=4, ignore_eos=True)
    check(ids_text[2].prompt_tokens == 3 and ids_text[1] == "length", "completions with a token-id prompt")
    # models, health
    models = cl.models.list()
    check([x.id for x in models.data] == ["smol"], "/v1/models lists the served model")
    st, body, _ = raw(srv, "GET", "/health")
    check(st == 200 and isinstance(body, dict) and body.get("status") == "ok" and body.get("role") == "both" and
          set(body) == {"status", "role", "running", "waiting", "kv_blocks_free", "kv_blocks_total",
                        "queued_prompt_tokens"} and body["kv_blocks_total"] > 0 and body["running"] == 0,
          "/health: ok, the role and the load figures (%s)" % body)
    m1 = metrics(srv)
    check(http_count(m1, "/v1/chat/completions", 200) - http_count(m0, "/v1/chat/completions", 200) == 5,
          "/metrics counts the chat requests by status")
    gen = mval(m1, "strata_generation_tokens_total") - mval(m0, "strata_generation_tokens_total")
    check(gen >= usage.completion_tokens * 2 + 24, "/metrics counts generated tokens (%d)" % gen)
    check(mval(m1, "strata_time_to_first_token_seconds_count") >= 8
          and mval(m1, "strata_time_to_first_token_seconds_bucket", '{le="+Inf"}')
          == mval(m1, "strata_time_to_first_token_seconds_count"), "TTFT histogram")
    check(mval(m1, "strata_time_between_tokens_seconds_count") > 20, "TBT histogram")
    check(mval(m1, "strata_requests_running") == 0 and mval(m1, "strata_requests_waiting") == 0
          and mval(m1, "strata_kv_blocks_used") == 0 and mval(m1, "strata_kv_blocks_total") > 0,
          "running / waiting / KV gauges at rest")
    check(("strata_prefix_cache_hit_rate", "") in m1 and mval(m1, "strata_prompt_tokens_total") > 0,
          "prefix-cache hit rate and prompt tokens exported")


def test_stop(srv):
    cl = srv.client()
    full = chat(cl, FRANCE, temperature=0, max_tokens=40)[0]
    if not check("Paris" in full, "stop: the reference answer holds 'Paris'"):
        return
    want = full[:full.index("Paris")]
    text, finish, _ = chat(cl, FRANCE, temperature=0, max_tokens=40, stop="Paris")
    check(text == want and finish == "stop", "stop string: %r (%s)" % (text, finish))
    stext, sfinish, _, _, _ = chat_stream(cl, FRANCE, temperature=0, max_tokens=40, stop=["zzz", "Paris"])
    check(stext == want and sfinish == "stop", "stop array, streamed: %r" % stext)
    ctext = comp(cl, "1, 2, 3, 4,", temperature=0, max_tokens=20, ignore_eos=True)[0]
    if " 6" in ctext:
        t2, f2, _ = comp(cl, "1, 2, 3, 4,", temperature=0, max_tokens=20, ignore_eos=True, stop=[" 6"])
        check(t2 == ctext[:ctext.index(" 6")] and f2 == "stop", "completion stop string: %r" % t2)


def test_concurrent(srv):
    cl = srv.client()
    msgs = [[{"role": "user", "content": "Write one sentence about the number %d." % i}] for i in range(N_CONC)]
    alone = [chat(cl, m, temperature=0, max_tokens=CONC_TOKENS, ignore_eos=True)[0] for m in msgs]
    results = [None] * N_CONC
    peak = [0]
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], mval(metrics(srv), "strata_requests_running"))
            except Exception:
                pass
            time.sleep(0.05)

    def one(i):
        try:
            results[i] = chat(cl, msgs[i], temperature=0, max_tokens=CONC_TOKENS, ignore_eos=True)[0]
        except Exception as e:  # recorded as a mismatch
            results[i] = "error: %r" % e

    poller = threading.Thread(target=poll)
    poller.start()
    th = [threading.Thread(target=one, args=(i,)) for i in range(N_CONC)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    done.set()
    poller.join()
    same = sum(1 for a, b in zip(alone, results) if a == b)
    check(same == N_CONC, "16 concurrent greedy requests == the same run one at a time (%d/%d)" % (same, N_CONC))
    for i, (a, b) in enumerate(zip(alone, results)):
        if a != b:
            print("   #%d alone %r\n   #%d concurrent %r" % (i, a, i, b))
    check(peak[0] >= 4, "several requests ran at once (peak running %d)" % peak[0])


def test_bad_requests(srv):
    cl = srv.client()
    m0 = metrics(srv)
    C, P = "/v1/chat/completions", "/v1/completions"
    ok_chat = {"model": "smol", "messages": FRANCE, "max_tokens": 2}
    ok_comp = {"model": "smol", "prompt": "hi", "max_tokens": 2}
    cases = [
        ("malformed JSON", P, '{"prompt": "x",', 400, None),
        ("truncated JSON", C, '{"messages": [{"role": "user", "content": "hi"}', 400, None),
        ("body not an object", P, "[1, 2]", 400, None),
        ("empty body", P, "", 400, None),
        ("max_tokens string", P, dict(ok_comp, max_tokens="5"), 400, "max_tokens"),
        ("max_tokens negative", P, dict(ok_comp, max_tokens=-1), 400, "max_tokens"),
        ("max_tokens 0", C, dict(ok_chat, max_tokens=0), 400, "max_tokens"),
        ("max_tokens fractional", P, dict(ok_comp, max_tokens=2.5), 400, "max_tokens"),
        ("max_completion_tokens negative", C, dict(ok_chat, max_completion_tokens=-3), 400, "max_completion_tokens"),
        ("temperature above 2", C, dict(ok_chat, temperature=2.5), 400, "temperature"),
        ("temperature negative", P, dict(ok_comp, temperature=-0.1), 400, "temperature"),
        ("temperature string", P, dict(ok_comp, temperature="hot"), 400, "temperature"),
        ("top_p 0", C, dict(ok_chat, top_p=0), 400, "top_p"),
        ("top_p above 1", P, dict(ok_comp, top_p=1.5), 400, "top_p"),
        ("n = 2", C, dict(ok_chat, n=2), 400, "n"),
        ("n = 0", P, dict(ok_comp, n=0), 400, "n"),
        ("seed string", P, dict(ok_comp, seed="x"), 400, "seed"),
        ("stream not a boolean", P, dict(ok_comp, stream="yes"), 400, "stream"),
        ("stop a number", P, dict(ok_comp, stop=5), 400, "stop"),
        ("stop empty string", C, dict(ok_chat, stop=""), 400, "stop"),
        ("stream_options without stream", C, dict(ok_chat, stream_options={"include_usage": True}), 400,
         "stream_options"),
        ("messages missing", C, {"model": "smol"}, 400, "messages"),
        ("messages a string", C, dict(ok_chat, messages="hi"), 400, "messages"),
        ("messages empty", C, dict(ok_chat, messages=[]), 400, "messages"),
        ("message without role", C, dict(ok_chat, messages=[{"content": "hi"}]), 400, "messages[0].role"),
        ("bad role", C, dict(ok_chat, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        ("content a number", C, dict(ok_chat, messages=[{"role": "user", "content": 5}]), 400,
         "messages[0].content"),
        ("prompt missing", P, {"model": "smol"}, 400, "prompt"),
        ("prompt a number", P, dict(ok_comp, prompt=5), 400, "prompt"),
        ("prompt id out of vocabulary", P, dict(ok_comp, prompt=[1, 10 ** 9]), 400, None),
        ("model a number", P, dict(ok_comp, model=5), 400, "model"),
        ("logprobs", C, dict(ok_chat, logprobs=True), 400, "logprobs"),
        ("presence_penalty", P, dict(ok_comp, presence_penalty=0.5), 400, "presence_penalty"),
    ]
    for what, path, body, status, param in cases:
        st, obj, _ = raw(srv, "POST", path, body)
        good = st == status and error_shape(obj) and (param is None or obj["error"]["param"] == param)
        check(good, "%s -> %d%s" % (what, status, "" if good else " (got %d %r)" % (st, obj)))
    # a prompt longer than the context: 400 naming both lengths
    long_prompt = "hello " * (MAX_MODEL_LEN + 50)
    st, obj, _ = raw(srv, "POST", P, dict(ok_comp, prompt=long_prompt))
    msg = obj["error"]["message"] if error_shape(obj) else ""
    n = re.search(r"prompt has (\d+) tokens", msg)
    check(st == 400 and obj["error"]["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in msg
          and n and int(n.group(1)) > MAX_MODEL_LEN, "prompt over the context -> 400 naming the lengths: %r" % msg)
    st, obj, _ = raw(srv, "POST", C, dict(ok_chat, messages=[{"role": "user", "content": long_prompt}]))
    check(st == 400 and error_shape(obj) and obj["error"]["code"] == "context_length_exceeded", "long chat -> 400")
    # body over --max-body
    big = json.dumps(dict(ok_comp, prompt="a" * (MAX_BODY + 10)))
    st, obj, _ = raw(srv, "POST", P, big)
    check(st == 413 and error_shape(obj), "body over the limit -> 413 (%d)" % st)
    # routes and methods
    for method, path, status in [("GET", "/v2/nothing", 404), ("POST", "/v1/embeddings", 404),
                                 ("GET", "/v1/chat/completions", 405), ("POST", "/health", 405),
                                 ("DELETE", "/v1/models", 405), ("PUT", "/v1/completions", 405)]:
        st, obj, hdr = raw(srv, method, path, "{}" if method != "GET" else None)
        check(st == status and error_shape(obj) and (status != 405 or "Allow" in hdr),
              "%s %s -> %d (got %d)" % (method, path, status, st))
    # the openai client sees the errors as exceptions with the status
    try:
        cl.chat.completions.create(model="smol", messages=FRANCE, temperature=3)
        check(False, "openai client: temperature 3 raises")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "temperature" in str(e), "openai client: BadRequestError for temperature 3")
    try:
        cl.completions.create(model="smol", prompt="x", n=3)
        check(False, "openai client: n=3 raises")
    except openai.BadRequestError as e:
        check(e.status_code == 400, "openai client: BadRequestError for n=3")
    # and it still serves
    text = chat(cl, FRANCE, temperature=0, max_tokens=20)[0]
    check("Paris" in text, "still serving after the bad requests")
    m1 = metrics(srv)
    check(http_count(m1, "/v1/completions", 400) - http_count(m0, "/v1/completions", 400) >= 15
          and http_count(m1, "/v1/completions", 413) - http_count(m0, "/v1/completions", 413) == 1
          and http_count(m1, "other", 404) - http_count(m0, "other", 404) == 2,
          "/metrics counts 400, 413 and 404 answers")


def wait_idle(srv, timeout=30):
    deadline = time.time() + timeout
    m = metrics(srv)
    while time.time() < deadline:
        m = metrics(srv)
        if mval(m, "strata_requests_running") == 0 and mval(m, "strata_requests_waiting") == 0:
            return True, m
        time.sleep(0.05)
    return False, m


def test_disconnect(srv):
    m0 = metrics(srv)
    body = json.dumps({"model": "smol", "prompt": "Tell me a long story about a dragon.", "max_tokens": 400,
                       "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    deadline = time.time() + 60
    while got.count(b"data: ") < 3 and time.time() < deadline:
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    check(got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got and got.count(b"data: ") >= 3,
          "a stream started")
    check(mval(metrics(srv), "strata_requests_running") == 1, "it is running")
    s.close()
    idle, m1 = wait_idle(srv)
    check(idle, "the client went away mid-stream: running back to 0")
    check(mval(m1, "strata_requests_finished_total", '{reason="abort"}')
          - mval(m0, "strata_requests_finished_total", '{reason="abort"}') == 1
          and mval(m1, "strata_http_stream_disconnects_total") - mval(m0, "strata_http_stream_disconnects_total") == 1,
          "the request was aborted, the disconnect counted")
    gen = mval(m1, "strata_generation_tokens_total") - mval(m0, "strata_generation_tokens_total")
    check(gen < 300, "generation stopped early (%d of 400 tokens)" % gen)
    # a non-streamed request whose client leaves
    body = json.dumps({"model": "smol", "prompt": "Tell me a long story.", "max_tokens": 400,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.time() + 30
    while mval(metrics(srv), "strata_requests_running") < 1 and time.time() < deadline:
        time.sleep(0.02)
    s.close()
    idle, m2 = wait_idle(srv)
    check(idle and mval(m2, "strata_requests_finished_total", '{reason="abort"}')
          - mval(m1, "strata_requests_finished_total", '{reason="abort"}') == 1,
          "a non-streamed request whose client left is aborted too")


def load_round(srv, n_requests):
    cl = srv.client()
    lock = threading.Lock()
    state = {"next": 0, "errors": [], "texts": {}}

    def worker():
        while True:
            with lock:
                i = state["next"]
                if i >= n_requests:
                    return
                state["next"] += 1
            try:
                text, finish, usage = comp_stream(cl, "Item %d of the list is" % (i % 10), temperature=0,
                                                  max_tokens=LOAD_TOKENS, ignore_eos=True,
                                                  stream_options={"include_usage": True})
                if finish != "length" or usage is None or usage.completion_tokens != LOAD_TOKENS:
                    raise RuntimeError("finish %s usage %s" % (finish, usage))
                with lock:
                    state["texts"].setdefault(i % 10, set()).add(text)
            except Exception as e:
                with lock:
                    state["errors"].append(repr(e))

    t0 = time.time()
    th = [threading.Thread(target=worker) for _ in range(LOAD_CLIENTS)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return time.time() - t0, state


def test_load(srv):
    rss = []
    m0 = metrics(srv)
    for rnd in (1, 2):
        dt, state = load_round(srv, LOAD_REQUESTS)
        idle, _ = wait_idle(srv)
        time.sleep(0.3)
        rss.append(srv.rss_kb())
        same = all(len(v) == 1 for v in state["texts"].values())
        check(not state["errors"] and idle and same,
              "load round %d: %d streaming requests from %d clients in %.1f s, no errors, greedy texts agree%s"
              % (rnd, LOAD_REQUESTS, LOAD_CLIENTS, dt, "" if not state["errors"] else ": %s" % state["errors"][:3]))
    m1 = metrics(srv)
    check(http_count(m1, "/v1/completions", 200) - http_count(m0, "/v1/completions", 200) == 2 * LOAD_REQUESTS,
          "/metrics counted every load request")
    growth = rss[1] - rss[0]
    tol = max(8 * 1024, rss[0] // 20)  # 8 MiB or 5%
    if SAN:  # ASan's quarantine holds freed memory, TSan's shadow grows: RSS says nothing there (the normal build checks it)
        print("resident memory after round 1 %d KiB, after round 2 %d KiB: not asserted in a sanitizer build"
              % (rss[0], rss[1]))
    else:
        check(growth <= tol, "resident memory after round 1 %d KiB, after round 2 %d KiB (growth %d KiB, tolerance %d)"
              % (rss[0], rss[1], growth, tol))


def test_api_key(model):
    srv = Server(model, "--api-key", "sekrit", "--max-batch", "2", tag="key")
    sock = None
    try:
        try:
            srv.client("wrong").chat.completions.create(model="smol", messages=FRANCE, max_tokens=2)
            check(False, "wrong API key raises")
        except openai.AuthenticationError as e:
            check(e.status_code == 401, "wrong API key -> 401")
        st, obj, hdr = raw(srv, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        check(st == 401 and error_shape(obj) and obj["error"]["code"] == "invalid_api_key", "missing API key -> 401")
        st, obj, _ = raw(srv, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit-not"})
        check(st == 401 and error_shape(obj), "/v1/models with a wrong key -> 401")
        text = chat(srv.client("sekrit"), FRANCE, temperature=0, max_tokens=20)[0]
        check("Paris" in text, "the right API key works")
        st, _, _ = raw(srv, "GET", "/health")
        st2, _, _ = raw(srv, "GET", "/metrics")
        check(st == 401 and st2 == 401, "/health and /metrics need the key (--metrics-public opens them)")
        st, _, _ = raw(srv, "GET", "/health", headers={"Authorization": "Bearer sekrit"})
        check(st == 200, "/health with the key")
        # usage errors, and a port already taken
        r = subprocess.run([BIN, "serve"], capture_output=True, text=True, timeout=60)
        check(r.returncode == 2 and "no MODEL" in r.stderr, "serve without a model: exit 2")
        r = subprocess.run([BIN, "serve", model, "--port", "70000"], capture_output=True, text=True, timeout=60)
        check(r.returncode == 2 and "--port" in r.stderr, "serve --port 70000: exit 2")
        r = subprocess.run([BIN, "serve", model, "--port", str(srv.port), "--max-batch", "1"], capture_output=True,
                           text=True, timeout=60)
        check(r.returncode == 1 and "cannot listen" in r.stderr and str(srv.port) in r.stderr,
              "serve on a port in use: exit 1, %r" % r.stderr.strip().splitlines()[-1:])
        # SIGINT with a stream in flight: the server aborts it and exits cleanly
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                           "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sekrit\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data: ") < 2:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
        check(got.count(b"data: ") >= 2, "a stream is in flight")
    finally:
        t = time.time()
        rc = srv.stop(signal.SIGINT)
        check(rc == 0 and time.time() - t < 20,
              "SIGINT with a stream in flight: the server exits 0 in %.1f s" % (time.time() - t))
    if sock is None:
        return
    sock.settimeout(10)
    rest = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    except OSError:
        pass
    sock.close()
    check(b"[DONE]" not in rest or b"cancelled" in rest, "the in-flight stream was ended, not completed")


def run_cases(srv, cases):
    """Runs each (name, fn(srv)) on one server (an exception fails the case, a dead server ends the
    run), then stops it with SIGTERM: it must exit 0. Prints each case's time, and the log on a failure."""
    try:
        for name, fn in cases:
            t = time.time()
            try:
                fn(srv)
            except Exception as e:
                import traceback
                traceback.print_exc()
                check(False, "%s: %r" % (name, e))
            print("   (%s: %.1f s)" % (name, time.time() - t), flush=True)
            if srv.proc.poll() is not None:
                check(False, "the server died during '%s'" % name)
                break
    finally:
        alive = srv.proc.poll() is None
        rc = srv.stop()
        check(alive and rc == 0, "SIGTERM: the server exits 0 (status %s)" % rc)
        if failures:
            print("---- server log (tail) ----\n" + srv.tail())


def main():
    if not os.path.isfile(BIN):
        print("FAIL  no strata binary at %s" % BIN)
        return 1
    model = default_model.path()
    t0 = time.time()
    print("strata serve on %s%s" % (model, " (sanitizer build: smaller load)" if SAN else ""), flush=True)
    run_cases(Server(model), [("basic", test_basic), ("stop", test_stop), ("concurrent", test_concurrent),
                              ("bad requests", test_bad_requests), ("disconnect", test_disconnect),
                              ("load", test_load)])
    test_api_key(model)
    print("test_server: %.1f s" % (time.time() - t0))
    return testlib.summary("test_server")


if __name__ == "__main__":
    sys.exit(main())
