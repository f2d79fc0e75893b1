#!/usr/bin/env python3
"""Graceful shutdown of `strata serve` (issue 17, item 2), on the default model
(CPU), on a free loopback port (--port 0).

Checks:
  - --shutdown-timeout 0: SIGTERM with a stream and a whole (non-streamed)
    request in flight: the stream ends with an OpenAI-style error event
    (`data: {"error": {...}}`) and then `data: [DONE]`; the whole request
    gets a 503 JSON error; the server exits 0, promptly;
  - a generous --shutdown-timeout: SIGTERM with a short stream in flight:
    /health turns 503, a new completion request during the drain gets a 503
    JSON error (code "server_shutting_down"), the stream completes normally
    (finish_reason "length", [DONE], no error event) and the server exits 0;
  - a second signal during the drain (SIGINT after SIGTERM) aborts the
    stream at once (error event, [DONE]), exit 0;
  - --shutdown-timeout is in --help and refuses a bad value (exit 2).
Every wait is bounded; about 10-20 s on 2 cores.
"""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import test_server as ts  # noqa: E402  (Server, raw)
import testlib  # noqa: E402
from testlib import BIN, TMP, check, failures  # noqa: E402

IO_TIMEOUT = 30  # seconds any one read or request may take


class Server(ts.Server):
    """test_server's server (a small batch and context here), and waits that never hang."""

    def __init__(self, model, tag, *extra):
        super().__init__(model, "--max-batch", "4", "--max-model-len", "256", "--no-rooflines", *extra,
                         tag="shutdown_" + tag)

    def wait(self, timeout):
        """The exit status, or None when it is still running after timeout seconds (then killed)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def finish(self, stream):
        """The end of a case: its stream closed, the server gone, its log shown on a failure."""
        if stream:
            stream.close()
        self.kill()
        if failures:
            print("---- server log (tail) ----\n" + self.tail())


def conn(srv):
    return http.client.HTTPConnection("127.0.0.1", srv.port, timeout=IO_TIMEOUT)


def post(srv, body):
    """(status, parsed JSON or text) of a whole POST /v1/completions."""
    status, obj, _ = ts.raw(srv, "POST", "/v1/completions", body, timeout=IO_TIMEOUT)
    return status, obj


def get(srv, path):
    status, obj, _ = ts.raw(srv, "GET", path, timeout=IO_TIMEOUT)
    return status, obj


def wait_draining(srv):
    """Once a signal is taken /health answers 503: its status after at most 10 s of polling."""
    health = None
    deadline = time.time() + 10
    while time.time() < deadline:
        health, _ = get(srv, "/health")
        if health == 503:
            break
        time.sleep(0.05)
    return health


class Stream:
    """A streamed completion: its SSE data lines, read as they come."""

    def __init__(self, srv, max_tokens):
        self.c = conn(srv)
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}
        self.c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.r = self.c.getresponse()
        self.status = self.r.status
        self.events = []  # the payloads of the data lines, in order
        self.eof = False

    def next_event(self):
        """Reads up to the next data line; its payload, or None at the end of the stream."""
        while True:
            line = self.r.readline()
            if not line:
                self.eof = True
                return None
            line = line.strip()
            if line.startswith(b"data: "):
                self.events.append(line[6:])
                return line[6:]

    def rest(self):
        """Reads to [DONE] or the end of the stream (socket errors end it too)."""
        try:
            while True:
                ev = self.next_event()
                if ev is None or ev == b"[DONE]":
                    return
        except (OSError, http.client.HTTPException) as e:
            self.events.append(("exception", repr(e)))

    def close(self):
        self.c.close()


def is_error_event(ev):
    try:
        j = json.loads(ev)
    except (ValueError, TypeError):
        return False
    return isinstance(j, dict) and isinstance(j.get("error"), dict) and isinstance(j["error"].get("message"), str)


def test_abort(model):
    """--shutdown-timeout 0: what is in flight is aborted, with an error event and [DONE]."""
    srv = Server(model, "abort", "--shutdown-timeout", "0")
    st = None
    whole = {}
    try:
        # a whole request in flight beside the stream
        def whole_req():
            try:
                whole["res"] = post(srv, {"prompt": "The history of", "max_tokens": 200, "ignore_eos": True})
            except Exception as e:  # noqa: BLE001
                whole["res"] = ("exception", repr(e))
        th = threading.Thread(target=whole_req, daemon=True)
        th.start()
        st = Stream(srv, 200)
        check(st.status == 200, "stream: 200")
        first = st.next_event()
        check(first is not None and first != b"[DONE]" and not is_error_event(first), "stream: a first chunk")
        # both in the engine before the signal (bounded)
        running = 0
        deadline = time.time() + 20
        while time.time() < deadline:
            _, text = get(srv, "/metrics")
            m = re.search(r"^strata_requests_running (\S+)$", text, re.M)
            running = float(m.group(1)) if m else 0
            if running >= 2:
                break
            time.sleep(0.02)
        check(running >= 2, "the stream and the whole request are running (%g)" % running)
        t = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        st.rest()
        th.join(IO_TIMEOUT)
        rc = srv.wait(30)
        el = time.time() - t
        ev = st.events
        check(len(ev) >= 3 and ev[-1] == b"[DONE]" and is_error_event(ev[-2]),
              "SIGTERM, --shutdown-timeout 0: the stream ends with an error event then [DONE] (%r)" % ev[-2:])
        if len(ev) >= 2 and is_error_event(ev[-2]):
            err = json.loads(ev[-2])["error"]
            check("shutting down" in err["message"] and err.get("code") == "server_shutting_down",
                  "the error event says the server is shutting down (%r)" % err)
        check(sum(1 for e in ev if is_error_event(e)) == 1, "one error event")
        res = whole.get("res")
        check(res is not None and res[0] == 503 and isinstance(res[1], dict) and "error" in res[1]
              and res[1]["error"].get("code") == "server_shutting_down",
              "the whole request in flight gets a 503 JSON error (%r)" % (res,))
        check(rc == 0, "the server exits 0 (status %s)" % rc)
        check(el < 15, "... in %.1f s" % el)
    finally:
        srv.finish(st)


def test_drain(model):
    """A generous --shutdown-timeout: new requests are refused, the running stream completes."""
    srv = Server(model, "drain", "--shutdown-timeout", "60")
    st = None
    try:
        st = Stream(srv, 100)
        first = st.next_event()
        check(st.status == 200 and first is not None and first != b"[DONE]", "stream: a first chunk")
        t = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        health = wait_draining(srv)
        check(health == 503, "draining: /health answers 503")
        status, body = post(srv, {"prompt": "Hello", "max_tokens": 4})
        check(status == 503 and isinstance(body, dict) and body.get("error", {}).get("code") == "server_shutting_down",
              "draining: a new completion request gets a 503 JSON error (%s %r)" % (status, body))
        check(srv.proc.poll() is None, "draining: the server still runs while the stream does")
        st.rest()
        rc = srv.wait(60)
        el = time.time() - t
        ev = st.events
        chunks = [json.loads(e) for e in ev[:-1] if not isinstance(e, tuple)]
        check(len(ev) >= 2 and ev[-1] == b"[DONE]" and not any(is_error_event(e) for e in ev),
              "the stream completes: [DONE] and no error event (%r)" % ev[-2:])
        check(any(c.get("choices", [{}])[0].get("finish_reason") == "length" for c in chunks),
              "... with finish_reason length")
        check(rc == 0, "the server exits 0 after the drain (status %s)" % rc)
        check(el < 40, "... in %.1f s" % el)
    finally:
        srv.finish(st)


def test_again(model):
    """A second signal during the drain aborts what runs at once."""
    srv = Server(model, "again", "--shutdown-timeout", "60")
    st = None
    try:
        st = Stream(srv, 200)
        first = st.next_event()
        check(st.status == 200 and first is not None and first != b"[DONE]", "stream: a first chunk")
        t = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        health = wait_draining(srv)
        check(health == 503, "draining: /health answers 503")
        srv.proc.send_signal(signal.SIGINT)
        st.rest()
        rc = srv.wait(30)
        el = time.time() - t
        ev = st.events
        check(len(ev) >= 2 and ev[-1] == b"[DONE]" and is_error_event(ev[-2]),
              "a second signal: the stream ends with an error event then [DONE] (%r)" % ev[-2:])
        check(rc == 0 and el < 15, "the server exits 0 (status %s) in %.1f s" % (rc, el))
    finally:
        srv.finish(st)


def test_option(model):
    r = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, timeout=30)
    check(r.returncode == 0 and "--shutdown-timeout" in r.stdout, "--shutdown-timeout is in serve --help")
    r = subprocess.run([BIN, "serve", model, "--shutdown-timeout", "-1"], capture_output=True, text=True, timeout=30)
    check(r.returncode == 2 and "--shutdown-timeout" in r.stderr, "--shutdown-timeout -1: exit 2")


def main():
    if not os.path.isfile(BIN):
        print("FAIL  no strata binary at %s" % BIN)
        return 1
    model = default_model.path()
    t0 = time.time()
    for name, fn in [("option", test_option), ("abort", test_abort), ("drain", test_drain),
                     ("again", test_again)]:
        t = time.time()
        try:
            fn(model)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            check(False, "%s: %r" % (name, e))
        print("   (%s: %.1f s)" % (name, time.time() - t), flush=True)
    print("test_server_shutdown: %.1f s" % (time.time() - t0))
    return testlib.summary("test_server_shutdown")


if __name__ == "__main__":
    sys.exit(main())
