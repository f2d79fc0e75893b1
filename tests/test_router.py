#!/usr/bin/env python3
"""`strata router` (src/disagg/router.c) against fake prefill and decode nodes
written here (http.server on free loopback ports) that speak the protocol of
docs/ARCHITECTURE.md "Prefill/decode disaggregation" and record what they
receive. No model is loaded.

Checks:
  - the answer through the router is byte for byte the fake decode node's
    (whole JSON and a server-sent-event stream, whose first chunk arrives
    before the node sent its last: no buffering), with its Content-Type and
    Cache-Control; a 400 of /pd/reserve reaches the client verbatim;
  - /pd/reserve's body ({"route", "request"}), the generation's
    X-Strata-PD-Ticket, the node key forwarded (Authorization: Bearer);
  - 503 kv_blocks_exhausted on D1 -> served by D2 (retries{stage="reserve"});
  - /pd/prefill's fields: tokens cut to (cached + blocks) * block_tokens,
    from_block, blocks, attempt 1, identity, address; "blocks": 0 -> no
    prefill request;
  - prefix affinity: a prompt sharing 8 leading blocks with an earlier one goes
    to the same prefill node although it reports more queued tokens, an
    unrelated prompt to the other;
  - a prefill node refusing connections (a closed port) -> the next gets
    attempt 2; all down -> /pd/cancel on D, the answer still arrives,
    prefill_cancelled_total counts it; a prefill node killed (kill -9 of its
    process) mid-request -> attempt 2 elsewhere;
  - D dying before its answer (connection reset) -> /pd/cancel there and the
    request served by D2 (retries{stage="decode"}); D dying mid-stream -> the
    chunks so far, an error event and [DONE]; a D that never answers -> an
    error within --pd-timeout + 30 s;
  - a 5xx from a prefill node: attempt 2 on the next, all failing: cancelled; a 4xx
    (409): cancelled, not retried;
  - /health, /metrics, /v1/models through, 401 without the key, 405 / 404 / 415 /
    413 / malformed JSON answered as the server does; $STRATA_API_KEY and
    --metrics-public;
  - 24 concurrent clients: every answer whole, spread over the decode nodes by load;
  - a client leaving mid-stream closes the decode node's request and cancels its ticket;
  - SIGTERM with a stream in flight: the stream ends with an error event and
    [DONE], exit 0, promptly;
  - without --prefill: whole requests balanced over plain servers, no reserve,
    no ticket header, a failing server's request served by the other;
  - malformed heads (first or later on a keep-alive connection) and chunked
    bodies: one JSON error each (not libmicrohttpd's HTML, a bad
    Content-Length's head not twice), Connection: close, counted under route
    "other"; a garbage request line closed at once.
About 35 s (the hanging node's bound runs beside the rest).
"""
import http.client
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testlib  # noqa: E402
from testlib import BIN, TMP, check  # noqa: E402

KEY = "router-test-key"
BT = 16  # block_tokens of the fake decode nodes
WHOLE = (b'{"id":"cmpl-7","object":"text_completion","created":1,"model":"smol","choices":[{"index":0,'
         b'"text":" hello world","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,'
         b'"completion_tokens":2,"total_tokens":7}}')
CHUNKS = [b'data: {"id":"cmpl-7","choices":[{"index":0,"text":"%s"}]}\n\n' % w for w in
          (b" one", b" two", b" three", b" four", b" five")] + [b"data: [DONE]\n\n"]
MODELS = b'{"object":"list","data":[{"id":"smol","object":"model","created":1,"owned_by":"strata"}]}'
BAD = (b'{"error":{"message":"\'max_tokens\' must be at least 1, got 0","type":"invalid_request_error",'
       b'"param":"max_tokens","code":"invalid_value"}}')
EXHAUSTED = (b'{"error":{"message":"no KV blocks free","type":"server_error","param":null,'
             b'"code":"kv_blocks_exhausted"}}')


# ---- fake nodes ---------------------------------------------------------------------------------
def tokens_of(req):
    """The fake tokenizer: a prompt of ids is itself, text one id per character."""
    if "messages" in req:
        return [ord(c) for m in req["messages"] for c in str(m.get("content", ""))]
    p = req.get("prompt", "")
    return list(p) if isinstance(p, list) else [ord(c) for c in p]


class FakeNode:
    """A prefill or decode node. mode: behaviour switches the tests flip; records: what came in."""

    def __init__(self, role, name, printer=None):
        self.role, self.name, self.printer = role, name, printer
        self.lock = threading.Lock()
        self.records = []  # (path, headers, parsed body or None)
        self.health = {"status": "ok", "role": role, "running": 0, "waiting": 0, "kv_blocks_free": 100,
                       "kv_blocks_total": 100, "queued_prompt_tokens": 0}
        self.mode = {}
        self.tickets = 0
        self.stop = threading.Event()
        node = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                node.handle(self, "GET")

            def do_POST(self):
                node.handle(self, "POST")

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.srv.handle_error = lambda request, address: None  # resets and broken pipes are the point here
        self.port = self.srv.server_address[1]
        self.url = "http://127.0.0.1:%d" % self.port
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.srv.shutdown()
        self.srv.server_close()

    def recs(self, path=None):
        with self.lock:
            return [r for r in self.records if path is None or r[0] == path]

    def clear(self):
        with self.lock:
            self.records = []

    def wait_for(self, path, n=1, timeout=5.0):
        end = time.time() + timeout
        while time.time() < end:
            if len(self.recs(path)) >= n:
                return True
            time.sleep(0.02)
        return False

    # ---- replies
    @staticmethod
    def send(h, status, body, ctype="application/json"):
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def reset(h):
        """Dies: the connection is reset (RST), nothing more is sent."""
        try:
            h.wfile.flush()
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.connection.close()
        except OSError:
            pass
        h.close_connection = True

    def handle(self, h, method):
        n = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        path = h.path
        with self.lock:
            self.records.append((path, dict(h.headers), body))
        if self.printer:
            self.printer(path, body)
        if path == "/health":
            return self.send(h, 200, json.dumps(self.health).encode())
        if self.role == "prefill" and path == "/pd/prefill":
            m = self.mode.get("prefill", "ok")
            if m == "slow":
                self.stop.wait(30)
            if m == "409":
                return self.send(h, 409, b'{"error":{"message":"identity","type":"invalid_request_error",'
                                         b'"param":null,"code":"kv_layout_mismatch"}}')
            if m == "500":
                return self.send(h, 500, b'{"error":{"message":"transfer failed","type":"server_error",'
                                         b'"param":null,"code":null}}')
            time.sleep(0.05)
            return self.send(h, 200, json.dumps({"blocks": body["blocks"], "bytes": 1000, "seconds": 0.05}).encode())
        if self.role == "decode" and path == "/pd/reserve":
            req = body["request"]
            if req.get("max_tokens") == 0:
                return self.send(h, 400, BAD)
            if self.mode.get("reserve") == "exhausted":
                return self.send(h, 503, EXHAUSTED)
            toks = tokens_of(req)
            full = (len(toks) - 1) // BT
            cached = min(self.mode.get("cached", 0), full)
            blocks = 0 if self.mode.get("blocks0") else full - cached
            with self.lock:
                self.tickets += 1
                ticket = "%d%03d" % (self.port, self.tickets)
            return self.send(h, 200, json.dumps({
                "ticket": ticket, "tokens": toks, "block_tokens": BT, "cached_blocks": cached, "blocks": blocks,
                "layers": 2, "layer_bytes": 4096, "identity": "id-" + self.name, "address": "addr-" + self.name}).encode())
        if self.role == "decode" and path == "/pd/cancel":
            return self.send(h, 200, b"{}")
        if self.role == "decode" and path == "/v1/models":
            return self.send(h, 200, MODELS)
        if self.role == "decode" and path in ("/v1/completions", "/v1/chat/completions"):
            if body and body.get("max_tokens") == 0:
                return self.send(h, 400, BAD)
            m = self.mode.get("gen", "ok")
            if m == "reset":
                return self.reset(h)
            if m == "hang":
                self.stop.wait(60)
                return self.reset(h)
            if not (body and body.get("stream")):
                return self.send(h, 200, WHOLE)
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-cache")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            delay = self.mode.get("delay", 0.1)
            for i, c in enumerate(CHUNKS):
                if m == "reset_mid" and i == 2:
                    return self.reset(h)
                try:
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
                    h.wfile.flush()
                except OSError:
                    with self.lock:
                        self.records.append(("!aborted", {}, body))
                    return
                if self.stop.wait(delay):
                    return
            h.wfile.write(b"0\r\n\r\n")
            return
        return self.send(h, 404, b'{"error":{"message":"no route","type":"invalid_request_error","param":null,'
                                 b'"code":"not_found"}}')


def fake_prefill_process():
    """`test_router.py --fake-prefill`: a prefill node in a process of its own (to be killed with
    SIGKILL); prints its port, then each /pd/prefill body, and never answers one."""
    def printer(path, body):
        if path == "/pd/prefill":
            print("prefill " + json.dumps(body), flush=True)
    node = FakeNode("prefill", "sub", printer)
    node.mode["prefill"] = "slow"
    print("port %d" % node.port, flush=True)
    while True:
        time.sleep(3600)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


# ---- the router ---------------------------------------------------------------------------------
class Router:
    def __init__(self, prefill, decode, *extra, tag="main"):
        os.makedirs(TMP, exist_ok=True)
        self.log_path = os.path.join(TMP, "test_router_%s.log" % tag)
        self.log = open(self.log_path, "w")
        cmd = [BIN, "router", "--port", "0", "--decode", ",".join(decode)]
        if prefill:
            cmd += ["--prefill", ",".join(prefill)]
        self.proc = subprocess.Popen(cmd + list(extra), stdout=subprocess.PIPE, stderr=self.log,
                                     env=dict(os.environ, STRATA_LOG="info"))
        line = b""
        end = time.time() + 10
        while time.time() < end and b"\n" not in line:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                c = self.proc.stdout.read1(256) if hasattr(self.proc.stdout, "read1") else self.proc.stdout.read(1)
                if not c:
                    break
                line += c
        m = re.search(rb"listening on http://([^:]+):(\d+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError("router did not start: %r\n%s" % (line, self.tail()))
        self.port = int(m.group(2))

    def tail(self, n=30):
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def stop(self, sig=signal.SIGTERM, timeout=10):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def request(port, method, path, body=None, headers=None, timeout=60):
    """(status, headers (lower-case names), body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = dict(headers or {})
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h.setdefault("Content-Type", "application/json")
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    out = r.read()
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hd, out


def stream(port, path, body, headers=None, timeout=60):
    """(status, headers, [(seconds since the request, line)], whole body)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = dict(headers or {}, **{"Content-Type": "application/json"})
    t0 = time.time()
    c.request("POST", path, body=json.dumps(body).encode(), headers=h)
    r = c.getresponse()
    lines = []
    data = b""
    while True:
        try:
            ln = r.readline()
        except (OSError, http.client.HTTPException):
            break
        if not ln:
            break
        data += ln
        lines.append((time.time() - t0, ln))
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hd, lines, data


def metrics(port, headers=None):
    st, _, body = request(port, "GET", "/metrics", headers=headers)
    out = {}
    for ln in body.decode().splitlines():
        if ln and not ln.startswith("#"):
            name, v = ln.rsplit(" ", 1)
            out[name] = float(v)
    return out


def both_prefill_up(r):
    """Wait until the router has seen its two prefill nodes up (its start polls them with a 1 s timeout,
    which a loaded machine's fake nodes can miss; the next poll then comes a health interval later)."""
    return wait_until(lambda: json.loads(request(r.port, "GET", "/health")[2]).get("prefill_up") == 2, 35)


def wait_until(pred, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def error_shape(body):
    try:
        e = json.loads(body)["error"]
        return set(e) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        return False


AUTH = {"Authorization": "Bearer " + KEY}


# ---- the tests ----------------------------------------------------------------------------------
def test_main(P1, P2, D1, D2):
    r = Router([P1.url, P2.url], [D1.url, D2.url], "--api-key", KEY, tag="main")
    port = r.port
    try:
        # D2 busier: D1 is the choice
        D2.health["running"] = 5
        time.sleep(1.3)
        # whole answer, byte for byte
        body = {"model": "smol", "prompt": "x" * 40, "max_tokens": 2}
        st, hd, out = request(port, "POST", "/v1/completions", body, AUTH)
        dst, dhd, dout = request(D1.port, "POST", "/v1/completions", body)
        check(st == 200 and out == WHOLE and out == dout, "whole answer: the decode node's bytes (%d, %r)" % (st, out[:60]))
        check(hd.get("content-type") == dhd.get("content-type") == "application/json", "whole answer: Content-Type")
        rv = D1.recs("/pd/reserve")
        check(len(rv) == 1 and rv[0][2] == {"route": "/v1/completions", "request": body},
              "/pd/reserve body: route and the client's request (%r)" % (rv[0][2] if rv else None,))
        check(rv and rv[0][1].get("Authorization") == "Bearer " + KEY, "the key is forwarded to the nodes")
        gen = [x for x in D1.recs("/v1/completions") if "X-Strata-PD-Ticket" in x[1]]
        check(len(gen) == 1 and gen[0][1]["X-Strata-PD-Ticket"] == "%d001" % D1.port,
              "generation carries X-Strata-PD-Ticket = the reserved ticket")
        check(not D2.recs("/pd/reserve"), "the busier decode node got nothing")
        # prefill fields: 40 tokens -> 2 full blocks (the last token's block is D's), cached 0
        check(P1.wait_for("/pd/prefill"), "a prefill request went out")
        pf = (P1.recs("/pd/prefill") + P2.recs("/pd/prefill"))
        if check(len(pf) == 1, "one prefill request (%d)" % len(pf)):
            b = pf[0][2]
            check(b["ticket"] == "%d001" % D1.port and b["attempt"] == 1 and b["from_block"] == 0 and
                  b["blocks"] == 2 and b["block_tokens"] == BT and b["tokens"] == [ord("x")] * 32 and
                  b["identity"] == "id-D1" and b["address"] == "addr-D1",
                  "prefill body: ticket, attempt 1, from_block 0, blocks 2, 32 tokens, identity, address")
        # cached blocks: tokens cut to (cached + blocks) * block_tokens
        D1.mode["cached"] = 2
        P1.clear(), P2.clear()
        toks = list(range(1000, 1000 + 100))  # 6 full blocks before the last token
        st, _, out = request(port, "POST", "/v1/completions", {"prompt": toks, "max_tokens": 2}, AUTH)
        check(st == 200 and out == WHOLE, "completions with token ids: 200")
        wait_until(lambda: P1.recs("/pd/prefill") or P2.recs("/pd/prefill"))
        pf = P1.recs("/pd/prefill") + P2.recs("/pd/prefill")
        check(len(pf) == 1 and pf[0][2]["tokens"] == toks[:96] and pf[0][2]["from_block"] == 2 and
              pf[0][2]["blocks"] == 4 and pf[0][2]["attempt"] == 1,
              "cached 2: tokens cut to 6 blocks (96), from_block 2, blocks 4 (%r)" %
              ({k: v for k, v in pf[0][2].items() if k != "tokens"} if pf else None,))
        D1.mode.pop("cached")
        # blocks 0: no prefill
        D1.mode["blocks0"] = True
        P1.clear(), P2.clear()
        st, _, out = request(port, "POST", "/v1/completions", {"prompt": "y" * 50, "max_tokens": 2}, AUTH)
        time.sleep(0.3)
        check(st == 200 and out == WHOLE and not P1.recs("/pd/prefill") and not P2.recs("/pd/prefill"),
              "blocks 0: answered, no /pd/prefill")
        D1.mode.pop("blocks0")
        # stream, byte for byte, not buffered
        sbody = {"prompt": "z" * 20, "max_tokens": 5, "stream": True}
        st, hd, lines, data = stream(port, "/v1/completions", sbody, AUTH)
        dst, dhd, dlines, ddata = stream(D1.port, "/v1/completions", sbody)
        check(st == 200 and data == b"".join(CHUNKS) and data == ddata, "stream: the decode node's bytes")
        check(hd.get("content-type") == "text/event-stream" and hd.get("cache-control") == "no-cache",
              "stream: Content-Type and Cache-Control passed (%r, %r)" % (hd.get("content-type"), hd.get("cache-control")))
        check(lines and lines[0][0] < 0.35 and lines[-1][0] > 0.45,
              "stream: the first chunk at %.2f s, the last at %.2f s (flushed as they come)" %
              (lines[0][0] if lines else -1, lines[-1][0] if lines else -1))
        # each event as soon as the node sent it: the router's arrival times after its first event
        # against the node's own (0.1 s apart), within 80 ms: an event held back until the next one
        # comes lags 0.1 s (50 ms flaked at 51 ms on a loaded 2-core machine: two streams' jitter)
        ta = [t for t, ln in lines if ln.startswith(b"data:")]
        td = [t for t, ln in dlines if ln.startswith(b"data:")]
        lag = max(abs((a - ta[0]) - (d - td[0])) for a, d in zip(ta, td)) if len(ta) == len(td) == 6 else 99
        check(lag < 0.08, "stream: every event relayed at once (largest lag %.3f s)" % lag)
        # chat
        st, _, out = request(port, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi " * 20}]}, AUTH)
        check(st == 200 and out == WHOLE, "chat completions through")
        check(D1.recs("/pd/reserve")[-1][2]["route"] == "/v1/chat/completions", "reserve names the chat route")
        # a validation error verbatim
        st, hd, out = request(port, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, AUTH)
        check(st == 400 and out == BAD and hd.get("content-type") == "application/json",
              "reserve's 400 passed on verbatim (%d %r)" % (st, out[:80]))
        # exhausted on D1 -> D2
        D1.mode["reserve"] = "exhausted"
        n2 = len(D2.recs("/v1/completions"))
        st, _, out = request(port, "POST", "/v1/completions", {"prompt": "q" * 30}, AUTH)
        check(st == 200 and out == WHOLE and len(D2.recs("/v1/completions")) == n2 + 1,
              "D1 503 kv_blocks_exhausted -> served by D2")
        D1.mode.pop("reserve")
        m = metrics(port, AUTH)
        check(m.get('strata_router_retries_total{stage="reserve"}') == 1, "retries{reserve} = 1")
        # /v1/models through
        st, hd, out = request(port, "GET", "/v1/models", headers=AUTH)
        check(st == 200 and out == MODELS, "/v1/models passed through")
        # keys and the server's own answers
        st, hd, out = request(port, "POST", "/v1/completions", {"prompt": "a"})
        check(st == 401 and error_shape(out) and hd.get("www-authenticate") == "Bearer", "no key: 401 JSON error")
        st, _, out = request(port, "POST", "/v1/completions", {"prompt": "a"}, {"Authorization": "Bearer nope"})
        check(st == 401 and b"Incorrect API key" in out, "a wrong key: 401")
        st, _, out = request(port, "GET", "/health")
        check(st == 401, "/health needs the key")
        st, _, out = request(port, "GET", "/v1/completions", headers=AUTH)
        check(st == 405 and error_shape(out), "GET on completions: 405")
        st, _, out = request(port, "GET", "/nope", headers=AUTH)
        check(st == 404 and error_shape(out), "unknown route: 404")
        st, _, out = request(port, "POST", "/v1/completions", b"prompt=a", dict(AUTH, **{"Content-Type": "text/plain"}))
        check(st == 415 and error_shape(out), "text/plain body: 415")
        st, _, out = request(port, "POST", "/v1/completions", b"{bad", AUTH)
        check(st == 400 and b"invalid_json" in out and error_shape(out), "malformed JSON: 400 invalid_json")
        st, _, out = request(port, "POST", "/v1/completions", b"[1]", AUTH)
        check(st == 400 and b"must be a JSON object, got array" in out, "not an object: 400")
        st, _, out = request(port, "POST", "/v1/completions", b'{"prompt":"' + b"a" * (1 << 20) + b'"}', AUTH)
        check(st == 413 and error_shape(out), "a body over 1 MiB: 413")
        st, _, out = request(port, "GET", "/health", headers=AUTH)
        check(st == 200 and json.loads(out) == {"status": "ok", "decode_up": 2, "prefill_up": 2},
              "/health: decode_up 2, prefill_up 2 (%r)" % out)

        # prefix affinity: equal loads; A goes to some P; that P then reports 64 queued tokens:
        # B (A's 8 leading blocks) still goes there (8 * 16 - 64 > 0), C (unrelated) to the other
        P1.clear(), P2.clear()
        A = list(range(5000, 5000 + 10 * BT + 1))
        st, _, _ = request(port, "POST", "/v1/completions", {"prompt": A}, AUTH)
        wait_until(lambda: P1.recs("/pd/prefill") or P2.recs("/pd/prefill"))
        pa = P1 if P1.recs("/pd/prefill") else P2
        other = P2 if pa is P1 else P1
        pa.health["queued_prompt_tokens"] = 64
        check(wait_until(lambda: metrics(port, AUTH).get(
            'strata_router_node_queued_prompt_tokens{node="%s"}' % pa.url) == 64, 3),
              "/metrics: the node's queued_prompt_tokens (64)")
        check(wait_until(lambda: metrics(port, AUTH).get(
            'strata_router_node_inflight{role="prefill",node="%s"}' % pa.url) == 0, 3),
              "/metrics: A's prefill no longer in flight")
        pa.clear(), other.clear()
        B = A[:8 * BT] + list(range(9000, 9000 + 3 * BT + 1))
        st, _, _ = request(port, "POST", "/v1/completions", {"prompt": B}, AUTH)
        check(wait_until(lambda: pa.recs("/pd/prefill") or other.recs("/pd/prefill")) and
              len(pa.recs("/pd/prefill")) == 1 and not other.recs("/pd/prefill"),
              "affinity: the prompt sharing 8 blocks goes to the same prefill node")
        pa.clear(), other.clear()
        C = list(range(20000, 20000 + 10 * BT + 1))
        st, _, _ = request(port, "POST", "/v1/completions", {"prompt": C}, AUTH)
        check(wait_until(lambda: pa.recs("/pd/prefill") or other.recs("/pd/prefill")) and
              len(other.recs("/pd/prefill")) == 1 and not pa.recs("/pd/prefill"),
              "affinity: an unrelated prompt goes to the less loaded node")
        pa.health["queued_prompt_tokens"] = 0

        # a 5xx from a prefill node: the next one with attempt 2; both failing: cancelled on D
        P1.mode["prefill"] = P2.mode["prefill"] = "500"
        P1.clear(), P2.clear(), D1.clear()
        st, _, out = request(port, "POST", "/v1/completions", {"prompt": "e" * 40}, AUTH)
        check(st == 200 and out == WHOLE, "prefill nodes answering 500: the answer arrives")
        tk = "%d%03d" % (D1.port, D1.tickets)
        check(D1.wait_for("/pd/cancel") and D1.recs("/pd/cancel")[0][2] == {"ticket": tk},
              "both prefill nodes 500: the ticket cancelled on D")
        check(sorted(x[2]["attempt"] for x in P1.recs("/pd/prefill") + P2.recs("/pd/prefill")) == [1, 2] and
              len(P1.recs("/pd/prefill")) == 1, "500: attempt 1 on one prefill node, attempt 2 on the other")
        # a 4xx (409 kv_layout_mismatch): not retried elsewhere, cancelled
        P1.mode["prefill"] = P2.mode["prefill"] = "409"
        P1.clear(), P2.clear(), D1.clear()
        st, _, out = request(port, "POST", "/v1/completions", {"prompt": "o" * 40}, AUTH)
        tk = "%d%03d" % (D1.port, D1.tickets)
        check(st == 200 and D1.wait_for("/pd/cancel") and D1.recs("/pd/cancel")[0][2] == {"ticket": tk},
              "409 from the prefill node: the ticket cancelled on D, the answer arrives")
        time.sleep(0.2)
        check(len(P1.recs("/pd/prefill") + P2.recs("/pd/prefill")) == 1, "409: not retried on another prefill node")
        P1.mode.pop("prefill"), P2.mode.pop("prefill")
        m = metrics(port, AUTH)
        check(m.get('strata_router_retries_total{stage="prefill"}') == 1 and
              m.get("strata_router_prefill_cancelled_total") == 2,
              "retries{prefill} = 1, prefill_cancelled_total = 2 (%r, %r)" %
              (m.get('strata_router_retries_total{stage="prefill"}'), m.get("strata_router_prefill_cancelled_total")))
        wait_until(lambda: json.loads(request(port, "GET", "/health", headers=AUTH)[2]).get("prefill_up") == 2, 3)

        # D1 dies before its answer -> cancel there, served by D2
        D1.mode["gen"] = "reset"
        D1.clear(), D2.clear()
        st, _, out = request(port, "POST", "/v1/completions", {"prompt": "r" * 40}, AUTH)
        check(st == 200 and out == WHOLE and len(D2.recs("/v1/completions")) == 1,
              "D1 reset before answering: served by D2 (%d)" % st)
        tk = D1.recs("/pd/reserve") and "%d%03d" % (D1.port, D1.tickets)
        check(D1.wait_for("/pd/cancel") and D1.recs("/pd/cancel")[0][2] == {"ticket": tk},
              "D1's ticket cancelled there")
        m = metrics(port, AUTH)
        check(m.get('strata_router_retries_total{stage="decode"}') == 1, "retries{decode} = 1")
        check("decode node %s is down" % D1.url in r.tail(100), "D1 taken down (logged)")
        D1.mode.pop("gen")
        check(wait_until(lambda: json.loads(request(port, "GET", "/health", headers=AUTH)[2]).get("decode_up") == 2, 3),
              "D1 up again after a poll")
        # D1 dies mid-stream -> error event + [DONE]
        D1.mode["gen"] = "reset_mid"
        st, hd, lines, data = stream(port, "/v1/completions", sbody, AUTH)
        events = [x for x in data.split(b"\n\n") if x.strip()]
        check(st == 200 and data.startswith(CHUNKS[0] + CHUNKS[1]) and len(events) == 4 and
              events[2].startswith(b"data: {\"error\"") and error_shape(events[2][6:]) and
              events[3] == b"data: [DONE]", "D1 dies mid-stream: 2 chunks, an error event, [DONE] (%r)" % data[-200:])
        D1.mode.pop("gen")
        wait_until(lambda: json.loads(request(port, "GET", "/health", headers=AUTH)[2]).get("decode_up") == 2, 3)
        m = metrics(port, AUTH)
        check(m.get('strata_router_requests_total{route="/v1/completions",code="200"}', 0) >= 8 and
              m.get('strata_router_requests_total{route="/v1/completions",code="400"}') == 3 and
              m.get('strata_router_requests_total{route="/v1/completions",code="401"}') == 2,
              "requests_total by route and code")
        check(m.get('strata_router_node_kv_blocks_free{node="%s"}' % D1.url) == 100 and
              m.get('strata_router_node_inflight{role="decode",node="%s"}' % D1.url) == 0 and
              m.get('strata_router_node_up{role="prefill",node="%s"}' % P1.url) == 1,
              "/metrics: kv_blocks_free, inflight, node_up")
        # 24 clients at once, streamed and whole: every answer whole, spread over both decode nodes
        D2.health["running"] = 0
        time.sleep(1.2)
        D1.clear(), D2.clear()
        outs = [None] * 24

        def one(i):
            if i % 2:
                outs[i] = stream(port, "/v1/completions", dict(sbody, prompt="c%d" % i * 20), AUTH)[3]
            else:
                outs[i] = request(port, "POST", "/v1/completions", {"prompt": "c%d" % i * 20}, AUTH)[2]
        ts = [threading.Thread(target=one, args=(i,)) for i in range(24)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        check(all(o == (b"".join(CHUNKS) if i % 2 else WHOLE) for i, o in enumerate(outs)),
              "24 concurrent requests: every answer byte for byte")
        n1, n2 = len(D1.recs("/pd/reserve")), len(D2.recs("/pd/reserve"))
        check(n1 + n2 == 24 and n1 >= 6 and n2 >= 6, "24 concurrent requests over both decode nodes (%d + %d)" % (n1, n2))
        check(wait_until(lambda: all(v == 0 for k, v in metrics(port, AUTH).items()
                                     if k.startswith("strata_router_node_inflight")), 3), "nothing left in flight")
        D2.health["running"] = 5
        time.sleep(1.2)
        # a client leaving mid-stream: the upstream request is closed, the ticket cancelled
        D1.mode["delay"] = 0.3
        D1.clear()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("POST", "/v1/completions", body=json.dumps(dict(sbody, prompt="leave" * 8)).encode(),
                  headers=dict(AUTH, **{"Content-Type": "application/json"}))
        resp = c.getresponse()
        first = resp.readline()
        resp.close()
        c.close()
        check(first == CHUNKS[0].split(b"\n")[0] + b"\n", "a client that leaves got the first chunk")
        check(D1.wait_for("!aborted", 1, 3), "the client left: the decode node's stream was closed")
        check(D1.wait_for("/pd/cancel", 1, 3) and D1.recs("/pd/cancel")[0][2] == {"ticket": "%d%03d" % (D1.port, D1.tickets)},
              "the client left: its ticket cancelled")
        check(wait_until(lambda: metrics(port, AUTH).get('strata_router_node_inflight{role="decode",node="%s"}' %
                                                         D1.url) == 0, 3), "the client left: nothing in flight")
        # SIGTERM with a stream in flight
        D1.mode["delay"] = 0.5
        res = {}

        def client():
            res["r"] = stream(port, "/v1/completions", sbody, AUTH, timeout=20)
        t = threading.Thread(target=client)
        t.start()
        time.sleep(0.7)
        t0 = time.time()
        rc = r.stop()
        el = time.time() - t0
        t.join(10)
        check(rc == 0 and el < 5, "SIGTERM: exit 0 in %.2f s (rc %r)" % (el, rc))
        data = res.get("r", (0, 0, 0, b""))[3]
        check(data.startswith(CHUNKS[0]) and b'"error"' in data and data.endswith(b"data: [DONE]\n\n"),
              "SIGTERM: the stream in flight ends with an error event and [DONE] (%r)" % data[-120:])
        D1.mode.pop("delay")
    finally:
        if r.proc.poll() is None:
            r.stop(signal.SIGKILL)
        if testlib.failures:
            print(r.tail())


def test_prefill_failover(D1):
    """P1 refusing connections -> P2 gets attempt 2; then no P left -> /pd/cancel on D. The polls
    are slow here (--health-interval 30), so that the closed ports are found by the requests."""
    P1 = FakeNode("prefill", "P1b")
    P2 = FakeNode("prefill", "P2b")
    P2.health["queued_prompt_tokens"] = 1000  # P1 first
    r = Router([P1.url, P2.url], [D1.url], "--health-interval", "30", tag="failover")
    try:
        check(both_prefill_up(r), "failover: both prefill nodes seen up first")
        P1.close()  # a closed port from now on
        D1.clear()
        st, _, out = request(r.port, "POST", "/v1/completions", {"prompt": "f" * 40})
        check(st == 200 and out == WHOLE, "P1 closed: the answer arrives")
        check(P2.wait_for("/pd/prefill"), "P2 got the prefill")
        pf = P2.recs("/pd/prefill")
        check(pf and pf[0][2]["attempt"] == 2 and pf[0][2]["ticket"] == "%d%03d" % (D1.port, D1.tickets),
              "P1 refused: P2 gets attempt 2 of the ticket")
        m = metrics(r.port)
        check(m.get('strata_router_retries_total{stage="prefill"}') == 1, "retries{prefill} = 1")
        check(not D1.recs("/pd/cancel"), "no cancel while a prefill node did it")
        # every prefill node down: cancel on D, and the answer still arrives
        P2.close()
        st, _, out = request(r.port, "POST", "/v1/completions", {"prompt": "g" * 40})
        check(st == 200 and out == WHOLE, "no prefill node: the answer arrives")
        check(D1.wait_for("/pd/cancel") and D1.recs("/pd/cancel")[0][2] == {"ticket": "%d%03d" % (D1.port, D1.tickets)},
              "no prefill node: /pd/cancel of the ticket on D")
        st, _, out = request(r.port, "POST", "/v1/completions", {"prompt": "h" * 40, "stream": True})
        check(st == 200 and out == b"".join(CHUNKS) and D1.wait_for("/pd/cancel", 2),
              "all prefill nodes known down: cancelled at once, the stream arrives")
        m = metrics(r.port)
        check(m.get("strata_router_prefill_cancelled_total") == 2, "prefill_cancelled_total = 2 (%r)" %
              m.get("strata_router_prefill_cancelled_total"))
        st, _, out = request(r.port, "GET", "/health")
        check(st == 200 and json.loads(out) == {"status": "ok", "decode_up": 1, "prefill_up": 0},
              "/health: prefill_up 0 (%r)" % out)
        check(r.stop() == 0, "router exits 0")
    finally:
        if r.proc.poll() is None:
            r.stop(signal.SIGKILL)
        if testlib.failures:
            print(r.tail())


def test_prefill_killed(D1):
    """A prefill node killed (SIGKILL of its process) mid-request: attempt 2 elsewhere."""
    sub = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--fake-prefill"], stdout=subprocess.PIPE)
    line = sub.stdout.readline().decode()
    psub = "http://127.0.0.1:%s" % line.split()[1]
    P2 = FakeNode("prefill", "P2k")
    P2.health["queued_prompt_tokens"] = 1000  # the subprocess first
    r = Router([psub, P2.url], [D1.url], tag="killed")
    try:
        check(both_prefill_up(r), "killed: both prefill nodes seen up first")
        D1.clear()
        res = {}
        t = threading.Thread(target=lambda: res.update(r=request(r.port, "POST", "/v1/completions",
                                                                 {"prompt": "k" * 40})))
        t.start()
        rl, _, _ = select.select([sub.stdout], [], [], 5)
        got = sub.stdout.readline().decode() if rl else ""
        check(got.startswith("prefill ") and json.loads(got[8:])["attempt"] == 1, "the prefill process got attempt 1")
        sub.kill()
        sub.wait()
        check(P2.wait_for("/pd/prefill", 1, 5) and P2.recs("/pd/prefill")[0][2]["attempt"] == 2 and
              P2.recs("/pd/prefill")[0][2]["ticket"] == json.loads(got[8:] or "{}").get("ticket"),
              "killed prefill node: the other gets attempt 2 of the same ticket")
        t.join(10)
        check(res.get("r", (0,))[0] == 200 and res["r"][2] == WHOLE, "the answer arrives")
        check(not D1.recs("/pd/cancel"), "no cancel")
        check(r.stop() == 0, "router exits 0")
    finally:
        if sub.poll() is None:
            sub.kill()
        if r.proc.poll() is None:
            r.stop(signal.SIGKILL)
        P2.close()
        if testlib.failures:
            print(r.tail())


def start_hang():
    """A decode node that never answers the generation, behind a router with --pd-timeout 1: the
    client must get an error within 1 + 30 s (plus slack). Runs beside the other tests."""
    D = FakeNode("decode", "Dh")
    D.mode["gen"] = "hang"
    P = FakeNode("prefill", "Ph")
    os.environ["STRATA_API_KEY"] = KEY  # the key from the environment, probes open
    try:
        r = Router([P.url], [D.url], "--pd-timeout", "1", "--metrics-public", tag="hang")
    finally:
        del os.environ["STRATA_API_KEY"]
    res = {}

    def go():
        t0 = time.time()
        try:
            res["r"] = request(r.port, "POST", "/v1/completions", {"prompt": "w" * 40, "stream": True}, AUTH,
                               timeout=60)
        except Exception as e:  # noqa: BLE001
            res["r"] = (0, {}, repr(e).encode())
        res["t"] = time.time() - t0
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return D, P, r, t, res


def finish_hang(D, P, r, t, res):
    st, _, out = request(r.port, "GET", "/health")
    check(st == 200, "--metrics-public: /health without the key")
    st, _, out = request(r.port, "GET", "/metrics")
    check(st == 200 and b"strata_router_node_up" in out, "--metrics-public: /metrics without the key")
    st, _, out = request(r.port, "GET", "/v1/models")
    check(st == 401 and error_shape(out), "$STRATA_API_KEY: /v1/models needs the key")
    check(D.recs("/pd/reserve") and D.recs("/pd/reserve")[0][1].get("Authorization") == "Bearer " + KEY,
          "$STRATA_API_KEY forwarded to the nodes")
    t.join(45)
    st, _, out = res.get("r", (0, {}, b""))
    check(st == 503 and error_shape(out) and res.get("t", 99) < 36,
          "a decode node that never answers: 503 JSON error after %.1f s (%d %r)" % (res.get("t", -1), st, out[:100]))
    check(r.stop() == 0, "router exits 0")
    D.close()
    P.close()


def test_balance(D1, D2):
    """No --prefill: whole requests balanced over the servers; no reserve, no ticket, answers byte for byte."""
    for n in (D1, D2):
        n.clear()
        n.mode.clear()
        n.health["running"] = 0
    r = Router([], [D1.url, D2.url], tag="balance")
    try:
        D1.mode["delay"] = D2.mode["delay"] = 0.3
        body = {"model": "smol", "prompt": "x" * 40, "max_tokens": 4, "stream": True}
        out = [None] * 8

        def one(i):
            out[i] = stream(r.port, "/v1/completions", body)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        check(all(o is not None and o[0] == 200 and o[3] == b"".join(CHUNKS) for o in out),
              "balancing: 8 concurrent streams, every one byte for byte")
        g1, g2 = len(D1.recs("/v1/completions")), len(D2.recs("/v1/completions"))
        check(g1 + g2 == 8 and g1 >= 2 and g2 >= 2, "balancing: 8 requests over both servers (%d + %d)" % (g1, g2))
        check(not D1.recs("/pd/reserve") and not D2.recs("/pd/reserve"), "balancing: no /pd/reserve")
        check(all("X-Strata-PD-Ticket" not in rec[1] for n in (D1, D2) for rec in n.recs("/v1/completions")),
              "balancing: no ticket header")
        D1.mode["gen"] = "reset"  # D1 fails before a byte: the request goes to D2
        st, _, b = request(r.port, "POST", "/v1/completions", {"prompt": "y", "max_tokens": 2})
        check(st == 200 and b == WHOLE, "balancing: a server failing before its answer -> the other (%d)" % st)
    finally:
        D1.mode.clear()
        D2.mode.clear()
        r.stop()


OK_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
PROTOCOL = [  # (what, bytes sent on a new connection, status, error code); libmicrohttpd parses every head here
    ("a bad Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
     b"application/json\r\nContent-Length: abc\r\n\r\n{}", 400, "bad_request"),
    ("a Content-Length of 23 digits", b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
     + b"9" * 23 + b"\r\n\r\n", 413, "request_too_large"),
    ("a header without a colon", b"GET /health HTTP/1.1\r\nHost: localhost\r\nNoColon\r\n\r\n", 400, "bad_request"),
    ("HTTP/2.0 in the request line", b"GET /health HTTP/2.0\r\nHost: localhost\r\n\r\n", 505,
     "http_version_not_supported"),
    ("headers of 40 KB", b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", 431,
     "header_too_large"),
    ("a malformed chunked body", b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
     b"application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, "bad_request"),
    ("a later head with a bad Content-Length", OK_HEAD + b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
     b"Content-Type: application/json\r\nContent-Length: abc\r\n\r\n{}", 400, "bad_request"),
    ("a later head with HTTP/2.0", OK_HEAD + b"GET /health HTTP/2.0\r\nHost: localhost\r\n\r\n", 505,
     "http_version_not_supported"),
]


def test_protocol(D1):
    """Item 8 in the router: what libmicrohttpd refuses itself (a malformed head, first or later on a
    keep-alive connection, or chunked body) gets the server's JSON error (http/mhd_pages.c, shared),
    once (a bad Content-Length's status line and headers were written twice), Connection: close,
    counted in /metrics under route other; a garbage request line is closed at once."""
    r = Router([], [D1.url], tag="protocol")
    try:
        m0 = metrics(r.port)
        want = {}
        for what, data, status, code in PROTOCOL:
            want[status] = want.get(status, 0) + 1
            got, closed = testlib.raw_exchange(r.port, data, timeout=5)
            if data.startswith(OK_HEAD):  # the first request's answer: 200, then the one under test
                st0, hdr0, body0, _ = testlib.parse_answer(got)
                n0 = len(got) - len(body0) + int(hdr0.get("content-length", 0))
                check(st0 == 200, "router, %s: the first request is served (%r)" % (what, got[:120]))
                got = got[n0:]
            st, hdr, body, n_status = testlib.parse_answer(got)
            try:
                obj = json.loads(body)
            except ValueError:
                obj = None
            check(st == status and n_status == 1 and hdr.get("content-type") == "application/json"
                  and hdr.get("connection") == "close" and error_shape(body) and obj["error"]["code"] == code
                  and int(hdr.get("content-length", -1)) == len(body) and b"<html" not in got and closed,
                  "router, %s -> one JSON %d %s, then the connection is closed (%r)" % (what, status, code, got[:300]))
        t = time.time()
        got, closed = testlib.raw_exchange(r.port, b"GARBAGE\r\n\r\n", timeout=5)
        check(closed and time.time() - t < 1.5 and b"<html" not in got.lower(),
              "router, a garbage request line: closed at once, no HTML (%r)" % got[:80])
        m1 = {}
        ok = wait_until(lambda: m1.update(metrics(r.port)) or all(
            m1.get('strata_router_requests_total{route="other",code="%d"}' % st, 0)
            - m0.get('strata_router_requests_total{route="other",code="%d"}' % st, 0) == n for st, n in want.items()))
        check(ok, "router /metrics counts each under route other (want %s: %s)"
              % (want, {k: v for k, v in m1.items() if 'route="other"' in k}))
    finally:
        check(r.stop() == 0, "router (protocol): exit 0 after SIGTERM")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--fake-prefill":
        fake_prefill_process()
        return 0
    t0 = time.time()
    hang = start_hang()
    P1, P2 = FakeNode("prefill", "P1"), FakeNode("prefill", "P2")
    D1, D2 = FakeNode("decode", "D1"), FakeNode("decode", "D2")
    try:
        test_main(P1, P2, D1, D2)
        D1.mode.clear()
        test_prefill_failover(D1)
        test_prefill_killed(D1)
        D1.mode.clear()
        test_balance(D1, D2)
        test_protocol(D1)
        # usage errors
        p = subprocess.run([BIN, "router", "--prefill", P1.url], capture_output=True, text=True)
        check(p.returncode == 2 and "--decode is required" in p.stderr, "no --decode: exit 2, named")
        p = subprocess.run([BIN, "router", "--prefill", "ftp://x", "--decode", D1.url], capture_output=True, text=True)
        check(p.returncode == 2 and "--prefill" in p.stderr and "ftp://x" in p.stderr, "a bad URL: exit 2, named")
        p = subprocess.run([BIN, "router", "--help"], capture_output=True, text=True)
        check(p.returncode == 0 and "--pd-timeout" in p.stdout and "--node-api-key" in p.stdout, "--help")
        finish_hang(*hang)
    finally:
        for n in (P1, P2, D1, D2):
            n.close()
    print("%.1f s" % (time.time() - t0))
    return testlib.summary("test_router")


if __name__ == "__main__":
    sys.exit(main())
