#!/usr/bin/env python3
"""Prefill/decode disaggregation end to end (docs/ARCHITECTURE.md "Prefill/decode
disaggregation"), CPU, every process on 127.0.0.1, the default model, greedy:

  - router + 1 prefill + 1 decode node give, over 32 requests (completions and chat,
    whole and streamed, 4 at a time, many sharing a long prefix, a few repeated),
    the same text, finish reason and prompt usage as a single `strata serve`; the
    KV really moved: the prefill node's sent bytes equal the decode node's received
    bytes (> 0), the decode node adopted tickets and computed only the last block
    of each prompt (its strata_prompt_tokens_total is far below the prompts'), the
    prefill node computed the rest;
  - router + 2 prefill + 2 decode: the same texts over the 32 requests (6 at a
    time), the second prefill and decode nodes used;
  - a decode node landing the KV in device memory (--pd-landing-mem, no host
    tier; on the CPU backend "device" memory is host memory, the same code path):
    the same texts, tickets adopted, the prompts not recomputed; out of landing
    memory: 503 naming --pd-landing-mem; option misuse refused;
  - kill -9 of a prefill node with 6 requests in flight: every request ends within
    the timeout, each with the single server's text (retried on the other prefill
    node or computed by the decode node) or a clean error; none hangs;
  - a decode node out of host blocks: /pd/reserve answers 503 kv_blocks_exhausted
    (the message names --kv-host-mem), and so does the router when it has no other;
  - protocol errors: /pd/prefill with another identity 409 kv_layout_mismatch, a bad
    address 502, a missing field 400; /pd routes on the wrong role 404; an unknown
    X-Strata-PD-Ticket runs as a plain request.
Malformed and truncated KV messages are tests/test_pd_xfer.c's.
"""
import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import testlib  # noqa: E402
from testlib import BIN, TMP, check, sanitized_build  # noqa: E402

SAN = sanitized_build()
NTOK = 4 if SAN else 10
MAX_LEN = 768
procs = []


class Proc:
    def __init__(self, args, tag):
        os.makedirs(TMP, exist_ok=True)
        self.log_path = os.path.join(TMP, "test_pd_%s.log" % tag)
        self.log = open(self.log_path, "w")
        env = dict(os.environ, STRATA_LOG="info")
        self.proc = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=self.log, env=env)
        procs.append(self)
        self.port = None
        deadline = time.time() + 120
        while time.time() < deadline and self.proc.poll() is None:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                m = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", self.proc.stdout.readline())
                if m:
                    self.port = int(m.group(1))
                    break
        if self.port is None:
            self.proc.kill()
            raise RuntimeError("%s did not start; log: %s" % (tag, self.tail()))
        self.url = "http://127.0.0.1:%d" % self.port

    def tail(self):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def node(model, role, tag, *extra):
    return Proc(["serve", model, "--port", "0", "--max-batch", "8", "--max-model-len", str(MAX_LEN),
                 "--model-name", "smol", "--role", role, "--pd-timeout", "30"] + list(extra), tag)


def router(prefills, decodes, tag, *extra):
    return Proc(["router", "--port", "0", "--prefill", ",".join(p.url for p in prefills),
                 "--decode", ",".join(d.url for d in decodes), "--pd-timeout", "30"] + list(extra), tag)


def raw(port, method, path, body=None, headers=None, timeout=180):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = data.decode("utf-8", "replace")
    return r.status, parsed, data


def metrics(port):
    _, text, _ = raw(port, "GET", "/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


SYSTEM = ("You are a careful assistant who answers in one short sentence. Facts to keep in mind: "
          "the river runs north past the old mill, the mill has three doors, the bridge was built "
          "in 1911, and the ferry leaves at nine every morning except on Sundays. ") * 2


def requests_set(n):
    out = []
    for i in range(n):
        kind = i % 4
        stream = i % 3 == 0
        if kind in (0, 1):
            prompt = SYSTEM + "Question %d: what about the %s?" % (i, ["river", "mill", "bridge", "ferry"][i % 4])
            if i % 8 == 5:
                prompt = SYSTEM  # a repeated prompt: a full prefix hit
            body = {"model": "smol", "prompt": prompt, "max_tokens": NTOK, "temperature": 0, "stream": stream}
            out.append(("/v1/completions", body))
        else:
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Tell me fact number %d." % (i % 5)}]
            body = {"model": "smol", "messages": msgs, "max_tokens": NTOK, "temperature": 0, "stream": stream}
            out.append(("/v1/chat/completions", body))
    return out


def answer(port, path, body, timeout=180):
    """-> (status, text, finish_reason, prompt_tokens or None)"""
    status, parsed, data = raw(port, "POST", path, body, timeout=timeout)
    if status != 200:
        return status, parsed, None, None
    if body.get("stream"):
        text, finish = "", None
        for line in data.decode().split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return 599, ev, None, None
            for ch in ev.get("choices", []):
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                finish = ch.get("finish_reason") or finish
        return status, text, finish, None
    ch = parsed["choices"][0]
    text = ch.get("text") if "text" in ch else ch["message"]["content"]
    return status, text, ch["finish_reason"], parsed["usage"]["prompt_tokens"]


def run_all(port, reqs, conc=4):
    res = [None] * len(reqs)
    idx = iter(range(len(reqs)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(idx, None)
            if i is None:
                return
            try:
                res[i] = answer(port, *reqs[i])
            except Exception as e:  # a hang ends in the timeout; a reset is an error
                res[i] = (0, repr(e), None, None)

    ts = [threading.Thread(target=worker) for _ in range(conc)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return res


def main():
    model = default_model.path()
    single = Proc(["serve", model, "--port", "0", "--max-batch", "8", "--max-model-len", str(MAX_LEN),
                   "--model-name", "smol"], "single")
    reqs = requests_set(32)
    want = [answer(single.port, p, b) for p, b in reqs]
    check(all(w[0] == 200 for w in want), "the single server answers every request")

    # ---- router + 1 prefill + 1 decode ----
    p1 = node(model, "prefill", "p1")
    d1 = node(model, "decode", "d1")
    r1 = router([p1], [d1], "r1")
    got = run_all(r1.port, reqs)
    same = [g == w for g, w in zip(got, want)]
    check(all(same), "router + 1P + 1D: 32 requests give the single server's text, finish and usage "
          "(%d differ: %s)" % (same.count(False), [(i, got[i], want[i]) for i, s in enumerate(same) if not s][:2]))
    mp, md = metrics(p1.port), metrics(d1.port)
    sent = mp.get('strata_pd_kv_bytes_total{direction="sent"}', 0)
    recv = md.get('strata_pd_kv_bytes_total{direction="received"}', 0)
    check(sent > 0 and sent == recv, "the KV moved: prefill sent %d bytes, decode received %d" % (sent, recv))
    adopted = md.get('strata_pd_tickets_total{result="adopted"}', 0)
    check(adopted >= 4, "the decode node adopted %d tickets" % adopted)
    dprompt, pprompt = md.get("strata_prompt_tokens_total", -1), mp.get("strata_prompt_tokens_total", -1)
    total_prompt = sum(w[3] or 0 for w in want)
    check(0 <= dprompt < total_prompt / 4 and pprompt > 0,
          "the decode node computed %d prompt tokens (the requests' prompts: over %d), the prefill node %d"
          % (dprompt, total_prompt, pprompt))
    check(md.get('strata_pd_messages_rejected_total', -1) == 0, "no KV message was rejected")

    # ---- protocol errors ----
    st, body, _ = raw(d1.port, "POST", "/pd/reserve", {"route": "/v1/completions",
                                                       "request": {"prompt": SYSTEM, "max_tokens": 2}})
    check(st == 200 and body["ticket"] == "0" and body["blocks"] == 0 and body["cached_blocks"] > 0,
          "a prompt the decode node holds needs no transfer: %s" % {k: body.get(k) for k in ("blocks", "cached_blocks")}
          if isinstance(body, dict) else body)
    st, body, _ = raw(d1.port, "POST", "/pd/reserve", {"route": "/v1/completions",
                                                       "request": {"prompt": "Tell me", "max_tokens": -3}})
    st2, body2, _ = raw(single.port, "POST", "/v1/completions", {"prompt": "Tell me", "max_tokens": -3})
    check(st == st2 == 400 and body == body2, "an invalid request gets the single server's error from /pd/reserve")
    st, res, _ = raw(d1.port, "POST", "/pd/reserve", {"route": "/v1/completions",
                                                      "request": {"prompt": "A prompt nobody sent before. " * 12}})
    check(st == 200 and res["blocks"] > 0 and res["ticket"] != "0", "a new prompt: a ticket and blocks to push (%s)"
          % {k: res.get(k) for k in ("ticket", "blocks", "cached_blocks")})
    good = {"ticket": res["ticket"], "attempt": 1, "tokens": res["tokens"], "block_tokens": res["block_tokens"],
            "from_block": res["cached_blocks"], "blocks": max(res["blocks"], 1), "identity": res["identity"],
            "address": res["address"]}
    st, body, _ = raw(p1.port, "POST", "/pd/prefill", dict(good, identity="0123456789abcdef"))
    check(st == 409 and body["error"]["code"] == "kv_layout_mismatch", "another identity: 409 kv_layout_mismatch")
    st, body, _ = raw(p1.port, "POST", "/pd/prefill", dict(good, address="zz"))
    check(st == 400, "a malformed address: 400 (%d)" % st)
    st, body, _ = raw(p1.port, "POST", "/pd/prefill", dict(good, address="00" * 40))
    check(st == 502 and body["error"]["code"] == "kv_transfer_failed", "an unreachable address: 502 (%d %s)" % (st, body))
    st, body, _ = raw(p1.port, "POST", "/pd/prefill", {k: v for k, v in good.items() if k != "tokens"})
    check(st == 400 and "tokens" in body["error"]["message"], "a missing field: 400 naming it")
    st, body, _ = raw(d1.port, "POST", "/pd/cancel", {"ticket": res["ticket"]})
    check(st == 200, "cancel: 200")
    st, body, _ = raw(p1.port, "POST", "/pd/reserve", {"route": "/v1/completions", "request": {"prompt": "x"}})
    check(st == 404 and "--role decode" in body["error"]["message"], "/pd/reserve on a prefill node: 404")
    st, body, _ = raw(single.port, "POST", "/pd/prefill", good)
    check(st == 404, "/pd/prefill on a single server: 404")
    st, body, _ = raw(d1.port, "POST", "/v1/completions", reqs[0][1] if not reqs[0][1]["stream"] else
                      dict(reqs[1][1]), headers={"X-Strata-PD-Ticket": "987654321"})
    check(st == 200, "an unknown ticket runs as a plain request")

    # ---- router + 2 prefill + 2 decode ----
    p2 = node(model, "prefill", "p2")
    d2 = node(model, "decode", "d2")
    r2 = router([p1, p2], [d1, d2], "r2")
    got = run_all(r2.port, reqs, conc=6)
    same = [g == w for g, w in zip(got, want)]
    check(all(same), "router + 2P + 2D: 32 requests give the single server's texts (%d differ)" % same.count(False))
    used_p = [metrics(p.port).get('strata_pd_prefills_total{result="ok"}', 0) for p in (p2,)]
    used_d = [metrics(d.port).get("strata_generation_tokens_total", 0) for d in (d2,)]
    check(used_p[0] > 0 and used_d[0] > 0, "the second prefill and decode nodes served requests (%s %s)" % (used_p, used_d))

    # ---- a decode node landing the KV in device memory (--pd-landing-mem), no host tier ----
    d4 = node(model, "decode", "d4", "--pd-landing-mem", "48M", "--kv-host-mem", "0")
    r4 = router([p2], [d4], "r4")
    got = run_all(r4.port, reqs)
    same = [g == w for g, w in zip(got, want)]
    check(all(same), "router + 1P + 1D landing in device memory: 32 requests give the single server's texts "
          "(%d differ)" % same.count(False))
    md = metrics(d4.port)
    adopted = md.get('strata_pd_tickets_total{result="adopted"}', 0)
    recv = md.get('strata_pd_kv_bytes_total{direction="received"}', 0)
    dprompt = md.get("strata_prompt_tokens_total", -1)
    check(adopted >= 4 and recv > 0 and 0 <= dprompt < total_prompt / 4,
          "landing: %d tickets adopted, %d bytes received, %d prompt tokens computed on the decode node"
          % (adopted, recv, dprompt))
    host_blocks = sum(v for k, v in md.items() if k.startswith('strata_kv_blocks{tier="host"'))
    check(host_blocks == 0 and 'strata_kv_transfer_bytes_total{direction="host_to_device"}' in md and
          md['strata_kv_transfer_bytes_total{direction="host_to_device"}'] == 0,
          "landing: no host tier (%d host blocks), nothing loaded from host memory" % host_blocks)
    d5 = node(model, "decode", "d5", "--pd-landing-mem", "2M", "--kv-host-mem", "0")
    st, body, _ = raw(d5.port, "POST", "/pd/reserve", {"route": "/v1/completions",
                                                       "request": {"prompt": SYSTEM * 3, "max_tokens": 2}})
    check(st == 503 and body["error"]["code"] == "kv_blocks_exhausted" and "--pd-landing-mem" in body["error"]["message"],
          "a decode node out of landing memory: 503 kv_blocks_exhausted naming --pd-landing-mem (%d %s)" % (st, body))
    p = subprocess.run([BIN, "serve", model, "--pd-landing-mem", "8M"], capture_output=True, text=True)
    check(p.returncode == 2 and "--pd-landing-mem is for --role decode" in p.stderr,
          "--pd-landing-mem without --role decode: exit 2, named")
    p = subprocess.run([BIN, "serve", model, "--role", "decode", "--pd-landing-mem", "1K", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode != 0 and "holds no block" in p.stderr, "--pd-landing-mem smaller than a block: refused, named")

    # ---- kill -9 of a prefill node under load ----
    long_reqs = []
    for i in range(6):
        long_reqs.append(("/v1/completions", {"model": "smol", "prompt": SYSTEM * 2 + " Variant %d?" % i,
                                              "max_tokens": NTOK, "temperature": 0}))
    want_long = [answer(single.port, p, b) for p, b in long_reqs]
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", run_all(r2.port, long_reqs, conc=6)))
    t0 = time.time()
    th.start()
    time.sleep(0.3)
    p1.proc.send_signal(signal.SIGKILL)
    th.join(timeout=240)
    check(not th.is_alive(), "kill -9 of a prefill node: every request ended (%.1f s)" % (time.time() - t0))
    res = box.get("r") or []
    ok = [g == w for g, w in zip(res, want_long)]
    clean = all(g == w or g[0] >= 400 for g, w in zip(res, want_long))  # the text, or an HTTP / SSE error
    check(len(res) == 6 and clean and ok.count(True) >= 1,
          "each got the single server's text or a clean error (%d of 6 the text)" % ok.count(True))

    # ---- a decode node out of host blocks ----
    d3 = node(model, "decode", "d3", "--kv-host-mem", "1M")
    st, body, _ = raw(d3.port, "POST", "/pd/reserve", {"route": "/v1/completions",
                                                       "request": {"prompt": SYSTEM * 3, "max_tokens": 2}})
    check(st == 503 and body["error"]["code"] == "kv_blocks_exhausted" and "--kv-host-mem" in body["error"]["message"],
          "a decode node out of host blocks: 503 kv_blocks_exhausted naming --kv-host-mem (%d %s)" % (st, body))
    r3 = router([p2], [d3], "r3")
    st, body, _ = raw(r3.port, "POST", "/v1/completions", {"prompt": SYSTEM * 3, "max_tokens": 2})
    check(st == 503, "the router with no decode node that can hold the prompt: 503 (%d)" % st)

    for p in procs:
        if p is not p1:
            rc = p.stop()
            check(rc == 0, "%s exits 0 on SIGTERM (%s)" % (os.path.basename(p.log_path), rc))
    return testlib.summary("test_pd")


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
