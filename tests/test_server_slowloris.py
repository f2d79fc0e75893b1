#!/usr/bin/env python3
"""`strata serve` under slow and greedy clients (issue 17, item 1 and
"Connections"): the event-driven server (libmicrohttpd's epoll in a pool of
threads, connections suspended while the engine works), its deadlines and
its per-client cap, on the default model (CPU), loopback only.

Checks:
  - slow loris: 20 sockets that each send half a request head and keep it
    open (one trickling a byte every 0.4 s) against --max-connections 24 and
    --http-threads 2: /health answers within 1 s, several times, while they
    are open; the server closes every one of them at --header-timeout (2 s
    here: trickling does not extend it), not at the idle timeout; /metrics
    counts them (strata_http_connections_timed_out_total{phase="headers"},
    strata_http_connections_open);
  - keep-alive: a second request on the same connection within
    --idle-timeout is served; an idle keep-alive connection is closed at
    --idle-timeout; a later request whose request line arrived but whose
    headers trickle is closed at --header-timeout from its request line; a
    body that stalls is closed at --idle-timeout + 1 (libmicrohttpd's
    inactivity timeout);
  - a later request starting with bytes that never make a request line (TLS,
    half a line) is closed at --header-timeout from its bytes (+ the 1 s of
    the idle check), not at --idle-timeout; a later garbage line at once; an
    idle connection that sent nothing is still served past --header-timeout;
  - --max-connections-per-client 4: a fifth connection from 127.0.0.2 is
    closed at once while four are open; 127.0.0.1 has its own four (a fifth
    is closed too); a slot freed from 127.0.0.2 is usable again; /metrics
    counts the refusals;
  - streams do not pin threads: 40 concurrent stream=true requests against
    --http-threads 4 all deliver a first chunk while every one of them is
    still open (so at least 40 were in flight at once on 4 threads), /health
    answers within 1 s meanwhile, and all complete (finish_reason length,
    [DONE]); 40 concurrent whole (non-streamed) requests likewise run at once
    and complete;
  - the new options are in --help, and bad values exit 2.
Mid-stream disconnects (tests/test_server.py) and SIGTERM's drain
(tests/test_server_shutdown.py) are checked there. About 30-60 s on 2 cores.
"""
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import test_server as ts  # noqa: E402  (Server, raw, metrics, mval)
import testlib  # noqa: E402
from testlib import BIN, check, failures  # noqa: E402

IO_TIMEOUT = 60
SAN = testlib.sanitized_build()
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "


def health_time(srv, timeout=10):
    """(status, seconds) of one GET /health on a fresh connection."""
    t = time.time()
    try:
        st, _, _ = ts.raw(srv, "GET", "/health", timeout=timeout)
    except OSError:
        st = None
    return st, time.time() - t


def open_socket(port, source=None):
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0) if source else None)
    return s


def closed_by_peer(s, wait):
    """Whether the server closed s (EOF or reset) within `wait` seconds; what it sent is ignored."""
    s.settimeout(wait)
    t = time.time()
    try:
        while time.time() - t < wait:
            s.settimeout(max(0.01, wait - (time.time() - t)))
            if not s.recv(4096):
                return True
    except socket.timeout:
        return False
    except OSError:
        return True
    return False


class Loris:
    """A socket that sent half a request head; `trickle` adds a byte every 0.4 s (another thread)."""

    def __init__(self, port, trickle=False):
        self.s = open_socket(port)
        self.s.sendall(HALF_HEAD)
        self.t0 = time.time()
        self.closed_at = None
        self.trickle = trickle

    def watch(self, limit):
        """Waits (at most `limit` s from its start) for the server to close it: sets closed_at."""
        stop = self.t0 + limit
        while time.time() < stop and self.closed_at is None:
            if self.trickle:
                try:
                    self.s.sendall(b"x")
                except OSError:
                    self.closed_at = time.time()
                    break
            if closed_by_peer(self.s, min(0.4, max(0.01, stop - time.time()))):
                self.closed_at = time.time()

    def close(self):
        self.s.close()


def test_slowloris(model):
    H = 2
    srv = ts.Server(model, "--max-connections", "24", "--http-threads", "2", "--header-timeout", str(H),
                    "--idle-timeout", "30", "--max-batch", "4", "--no-rooflines", tag="loris")
    lorises = []
    try:
        m0 = ts.metrics(srv)
        lorises = [Loris(srv.port, trickle=(i == 0)) for i in range(20)]
        watchers = [threading.Thread(target=lo.watch, args=(H + 8,), daemon=True) for lo in lorises]
        for w in watchers:
            w.start()
        times = []
        for _ in range(5):
            st, dt = health_time(srv)
            times.append((st, dt))
            time.sleep(0.1)
        check(all(st == 200 and dt < 1.0 for st, dt in times),
              "20 slow-loris sockets open (--max-connections 24, 2 threads): /health answers within 1 s "
              "(%s)" % ", ".join("%s in %.3f s" % x for x in times))
        m1 = ts.metrics(srv)
        open_now = ts.mval(m1, "strata_http_connections_open")
        check(open_now >= 20, "/metrics: strata_http_connections_open counts them (%g)" % open_now)
        for w in watchers:
            w.join(H + 15)
        ages = [lo.closed_at - lo.t0 if lo.closed_at else None for lo in lorises]
        slack = 4.0 if SAN else 2.5
        check(all(a is not None and H - 0.3 <= a <= H + slack for a in ages),
              "every slow-loris socket is closed by the server at --header-timeout %d s (after %s s)"
              % (H, ", ".join("%.2f" % a if a is not None else "never" for a in ages)))
        check(ages[0] is not None and ages[0] <= H + slack,
              "... the one trickling a byte every 0.4 s too (%s s): the deadline is not an inactivity timeout"
              % ("%.2f" % ages[0] if ages[0] is not None else "never"))
        deadline = time.time() + 10
        while True:  # the count is taken as the watcher closes them; the gauge as libmicrohttpd lets them go
            m2 = ts.metrics(srv)
            n_to = ts.mval(m2, "strata_http_connections_timed_out_total", '{phase="headers"}') - \
                ts.mval(m0, "strata_http_connections_timed_out_total", '{phase="headers"}')
            n_open = ts.mval(m2, "strata_http_connections_open")
            if (n_to >= 20 and n_open <= 1) or time.time() > deadline:
                break
            time.sleep(0.1)
        check(n_to == 20, "/metrics: 20 connections timed out in their headers (%g)" % n_to)
        check(n_open <= 1, "/metrics: none of them is open any more (%g open, this scrape's included)" % n_open)
        st, dt = health_time(srv)
        check(st == 200 and dt < 1.0, "/health after they are gone: %s in %.3f s" % (st, dt))
    finally:
        for lo in lorises:
            lo.close()
        rc = srv.stop()
        check(rc == 0, "the server exits 0 (status %s)" % rc)
        if failures:
            print("---- server log (tail) ----\n" + srv.tail())


def test_keepalive(model):
    H, IDLE = 2, 3
    srv = ts.Server(model, "--header-timeout", str(H), "--idle-timeout", str(IDLE), "--no-rooflines",
                    "--max-batch", "4", tag="idle")
    try:
        m0 = ts.metrics(srv)
        # two requests on one connection, the second after a pause shorter than the idle timeout
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=IO_TIMEOUT)
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        ok1 = r.status == 200
        time.sleep(IDLE / 2)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        body = r.read()
        check(ok1 and r.status == 200 and b"choices" in body,
              "keep-alive: a second request %.1f s later on the same connection is served (%d)" % (IDLE / 2, r.status))
        # now idle: closed at the idle timeout
        t = time.time()
        closed = closed_by_peer(c.sock, IDLE + 5)
        dt = time.time() - t
        check(closed and IDLE - 0.3 <= dt <= IDLE + 3, "an idle keep-alive connection is closed at --idle-timeout "
              "%d s (after %.2f s: %s)" % (IDLE, dt, "closed" if closed else "still open"))
        c.close()
        # a later request on a keep-alive connection: its request line, then headers trickling
        s = open_socket(srv.port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        got = b""
        s.settimeout(IO_TIMEOUT)
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        s.sendall(b"GET /health HTTP/1.1\r\n")
        t = time.time()
        closed = False
        while time.time() - t < H + 5:
            try:
                s.sendall(b"X")
            except OSError:
                closed = True
                break
            if closed_by_peer(s, 0.4):
                closed = True
                break
        dt = time.time() - t
        s.close()
        check(got.startswith(b"HTTP/1.1 200") and closed and H - 0.3 <= dt <= H + 3,
              "keep-alive: a later request whose headers trickle is closed at --header-timeout %d s from its "
              "request line (after %.2f s)" % (H, dt))
        # a body that stalls: libmicrohttpd's inactivity timeout, --idle-timeout + 1
        s = open_socket(srv.port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        t = time.time()
        closed = closed_by_peer(s, IDLE + 6)
        dt = time.time() - t
        s.close()
        check(closed and IDLE + 0.7 <= dt <= IDLE + 4, "a request whose body stalls is closed at --idle-timeout + 1 "
              "= %d s (after %.2f s)" % (IDLE + 1, dt))
        m1 = ts.metrics(srv)
        n_idle = ts.mval(m1, "strata_http_connections_timed_out_total", '{phase="idle"}') - \
            ts.mval(m0, "strata_http_connections_timed_out_total", '{phase="idle"}')
        n_head = ts.mval(m1, "strata_http_connections_timed_out_total", '{phase="headers"}') - \
            ts.mval(m0, "strata_http_connections_timed_out_total", '{phase="headers"}')
        check(n_idle == 1 and n_head == 1, "/metrics: 1 idle and 1 header timeout (%g, %g)" % (n_idle, n_head))
    finally:
        rc = srv.stop()
        check(rc == 0, "the server exits 0 (status %s)" % rc)
        if failures:
            print("---- server log (tail) ----\n" + srv.tail())


def served_then(port, first=b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"):
    """A socket whose first request (a keep-alive /health) was answered: -> (socket, the answer)."""
    s = open_socket(port)
    s.sendall(first)
    got = b""
    s.settimeout(IO_TIMEOUT)
    while b"\r\n\r\n" not in got or not got.endswith(b"}"):
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return s, got


def test_later_garbage(model):
    """Item 8: the start of a later request on a keep-alive connection that libmicrohttpd cannot
    take as a request line (TLS bytes, a request line without its end) was held until the idle
    timeout; now it has --header-timeout from the check that saw its bytes (every H/2, at least
    1 s, on a quarter-second grid): closed within H + 1.25 + slack. A garbage line with its end is
    closed at once (libmicrohttpd, no answer). An idle connection that sent nothing is not taken
    for one: served after H + 1.5 s."""
    H, IDLE = 2, 30
    srv = ts.Server(model, "--header-timeout", str(H), "--idle-timeout", str(IDLE), "--no-rooflines",
                    "--max-batch", "4", tag="later")
    try:
        m0 = ts.metrics(srv)
        socks = []
        for what, data in [("TLS bytes", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"),
                           ("half a request line", b"GET /health HT")]:  # both at once
            s, got = served_then(srv.port)
            s.sendall(data)
            socks.append((what, s, got, time.time()))
        for what, s, got, t in socks:
            closed = closed_by_peer(s, max(0.1, t + IDLE - time.time()))
            dt = time.time() - t
            s.close()
            check(got.startswith(b"HTTP/1.1 200") and closed and H - 0.3 <= dt <= H + 1 + 2,
                  "a later request starting with %s (no line end) is closed at --header-timeout %d s from its "
                  "bytes, + the check interval (1.25 s at most), not at --idle-timeout %d s (after %.2f s: %s)"
                  % (what, H, IDLE, dt, "closed" if closed else "still open"))
        s, got = served_then(srv.port)
        s.sendall(b"GARBAGE\r\n\r\n")
        t = time.time()
        s.settimeout(5)
        rest = b""
        try:
            while True:
                c = s.recv(4096)
                if not c:
                    break
                rest += c
        except OSError:
            pass
        dt = time.time() - t
        s.close()
        check(got.startswith(b"HTTP/1.1 200") and dt < 1.5 and b"<html" not in rest.lower(),
              "a later garbage request line is closed at once, no HTML (after %.2f s, %r)" % (dt, rest[:80]))
        # an idle keep-alive connection past H + the check interval: still served
        s, got = served_then(srv.port)
        time.sleep(H + 1.5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        s.settimeout(IO_TIMEOUT)
        again = b""
        try:
            while True:
                c = s.recv(4096)
                if not c:
                    break
                again += c
        except OSError:
            pass
        s.close()
        check(again.startswith(b"HTTP/1.1 200"), "an idle keep-alive connection %.1f s after its answer (over "
              "--header-timeout, under --idle-timeout): its next request is served (%r)" % (H + 1.5, again[:40]))
        m1 = ts.metrics(srv)
        n_head = ts.mval(m1, "strata_http_connections_timed_out_total", '{phase="headers"}') - \
            ts.mval(m0, "strata_http_connections_timed_out_total", '{phase="headers"}')
        check(n_head == 2, "/metrics: 2 header timeouts (%g)" % n_head)
    finally:
        rc = srv.stop()
        check(rc == 0, "the server exits 0 (status %s)" % rc)
        if failures:
            print("---- server log (tail) ----\n" + srv.tail())


def test_per_client(model):
    CAP = 4
    srv = ts.Server(model, "--max-connections-per-client", str(CAP), "--header-timeout", "60", "--no-rooflines",
                    "--max-batch", "4", tag="perclient")
    socks = []
    try:
        m0 = ts.metrics(srv)
        for _ in range(CAP):
            s = open_socket(srv.port, "127.0.0.2")
            s.sendall(HALF_HEAD)
            socks.append(s)
        held = [not closed_by_peer(s, 0.3) for s in socks]
        check(all(held), "%d connections from 127.0.0.2 are held open (%s)" % (CAP, held))
        extra = open_socket(srv.port, "127.0.0.2")
        refused = closed_by_peer(extra, 3)
        extra.close()
        check(refused, "the connection %d from 127.0.0.2 is closed at once (--max-connections-per-client %d)"
              % (CAP + 1, CAP))
        st, dt = health_time(srv)
        check(st == 200 and dt < 1.0, "127.0.0.1 is still served (%s in %.3f s)" % (st, dt))
        # each address has its own count: 127.0.0.1 may open CAP at once beside 127.0.0.2's CAP (once the
        # server has seen the earlier ones from 127.0.0.1 close; a scrape counts itself)
        deadline = time.time() + 10
        while ts.mval(ts.metrics(srv), "strata_http_connections_open") > CAP + 1 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        mine = [http.client.HTTPConnection("127.0.0.1", srv.port, timeout=IO_TIMEOUT) for _ in range(CAP)]
        sts = []
        for c in mine:
            c.request("GET", "/health")
        for c in mine:
            r = c.getresponse()
            r.read()
            sts.append(r.status)
        check(all(x == 200 for x in sts), "%d keep-alive connections at once from 127.0.0.1 beside them: all served"
              % CAP)
        extra = open_socket(srv.port)
        refused = closed_by_peer(extra, 3)
        extra.close()
        for c in mine:
            c.close()
        check(refused, "... and a connection %d from 127.0.0.1 is closed at once too" % (CAP + 1))
        # free one slot of 127.0.0.2: a new connection from there is held again
        socks.pop().close()
        held_again = False
        deadline = time.time() + 5
        while time.time() < deadline and not held_again:
            s = open_socket(srv.port, "127.0.0.2")
            if closed_by_peer(s, 0.3):
                s.close()
                continue
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            s.settimeout(IO_TIMEOUT)
            held_again = s.recv(4096).startswith(b"HTTP/1.1 200")
            s.close()
        check(held_again, "once one of them closes, 127.0.0.2 is served again")
        m1 = ts.metrics(srv)
        n = ts.mval(m1, "strata_http_connections_refused_total") - ts.mval(m0, "strata_http_connections_refused_total")
        check(n >= 1, "/metrics: strata_http_connections_refused_total counts the refusal (%g)" % n)
    finally:
        for s in socks:
            s.close()
        rc = srv.stop()
        check(rc == 0, "the server exits 0 (status %s)" % rc)
        if failures:
            print("---- server log (tail) ----\n" + srv.tail())


class Stream:
    def __init__(self, port, i, max_tokens):
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=IO_TIMEOUT)
        body = {"prompt": "Item %d of the list is" % (i % 10), "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        self.c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.r = None
        self.events = []

    def first(self):
        self.r = self.c.getresponse()
        return self.r.status == 200 and self.next_event() is not None

    def next_event(self):
        while True:
            line = self.r.readline()
            if not line:
                return None
            line = line.strip()
            if line.startswith(b"data: "):
                self.events.append(line[6:])
                return line[6:]

    def rest(self):
        while True:
            ev = self.next_event()
            if ev is None or ev == b"[DONE]":
                return

    def finish(self):
        """(finish_reason, completion_tokens of the usage chunk)"""
        fr, n = None, None
        for ev in self.events:
            if ev == b"[DONE]":
                continue
            j = json.loads(ev)
            if j.get("choices") and j["choices"][0].get("finish_reason"):
                fr = j["choices"][0]["finish_reason"]
            if j.get("usage"):
                n = j["usage"]["completion_tokens"]
        return fr, n


def peak_running(srv, stop, out):
    """Polls strata_requests_running until stop is set; the peak in out[0]."""
    while not stop.is_set():
        try:
            out[0] = max(out[0], ts.mval(ts.metrics(srv), "strata_requests_running"))
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.05)


def test_many_streams(model):
    N, THREADS = 40, 4
    TOKENS = 24 if SAN else 48
    srv = ts.Server(model, "--http-threads", str(THREADS), "--max-batch", str(N), "--max-model-len", "256",
                    "--no-rooflines", tag="streams")
    streams = []
    try:
        stop, peak = threading.Event(), [0.0]
        poller = threading.Thread(target=peak_running, args=(srv, stop, peak), daemon=True)
        poller.start()
        t0 = time.time()
        streams = [Stream(srv.port, i, TOKENS) for i in range(N)]
        firsts = [s.first() for s in streams]
        t_first = time.time() - t0
        check(all(firsts), "%d streams against %d threads: every one delivers a first chunk (%.1f s)"
              % (N, THREADS, t_first))
        st, dt = health_time(srv)
        check(st == 200 and dt < 1.0, "/health within 1 s while %d streams run (%s in %.3f s)" % (N, st, dt))
        for s in streams:
            s.rest()
        stop.set()
        poller.join(5)
        t_all = time.time() - t0
        good = [bool(s.events) and s.events[-1] == b"[DONE]" and s.finish() == ("length", TOKENS) for s in streams]
        check(all(good), "all %d streams complete: %d tokens each (usage), finish_reason length, [DONE] (%.1f s; "
              "%d bad)" % (N, TOKENS, t_all, good.count(False)))
        check(peak[0] >= N * 3 // 4, "... at least %d of them were running at once in the engine (peak %g): the "
              "streams waiting for tokens hold none of the %d threads" % (N * 3 // 4, peak[0], THREADS))
        for s in streams:
            s.c.close()
        streams = []
        # whole answers: each waits suspended, not on a thread
        stop, peak = threading.Event(), [0.0]
        poller = threading.Thread(target=peak_running, args=(srv, stop, peak), daemon=True)
        poller.start()
        res = [None] * N

        def whole(i):
            try:
                status, obj, _ = ts.raw(srv, "POST", "/v1/completions",
                                        {"prompt": "Item %d of the list is" % (i % 10), "max_tokens": TOKENS // 2,
                                         "ignore_eos": True, "temperature": 0}, timeout=IO_TIMEOUT)
                res[i] = status == 200 and obj["usage"]["completion_tokens"] == TOKENS // 2
            except Exception as e:  # noqa: BLE001
                res[i] = repr(e)
        t0 = time.time()
        th = [threading.Thread(target=whole, args=(i,)) for i in range(N)]
        for t in th:
            t.start()
        for t in th:
            t.join(IO_TIMEOUT * 2)
        stop.set()
        poller.join(5)
        check(all(x is True for x in res) and peak[0] >= N * 3 // 4,
              "%d concurrent whole requests on %d threads: all complete, %g running at once at the peak (%.1f s)"
              % (N, THREADS, peak[0], time.time() - t0))
    finally:
        for s in streams:
            s.c.close()
        rc = srv.stop()
        check(rc == 0, "the server exits 0 (status %s)" % rc)
        if failures:
            print("---- server log (tail) ----\n" + srv.tail())


def test_options(model):
    h = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, timeout=30).stdout
    for opt in ("--header-timeout", "--idle-timeout", "--max-connections-per-client", "--http-threads"):
        check(opt in h, "serve --help documents %s" % opt)
    for args in (["--header-timeout", "0"], ["--idle-timeout", "-1"], ["--http-threads", "0"],
                 ["--max-connections-per-client", "-2"], ["--header-timeout", "x"]):
        r = subprocess.run([BIN, "serve", model] + args, capture_output=True, text=True, timeout=30)
        check(r.returncode == 2 and args[0] in r.stderr, "serve %s: exit 2 (%d)" % (" ".join(args), r.returncode))


def main():
    if not os.path.isfile(BIN):
        print("FAIL  no strata binary at %s" % BIN)
        return 1
    model = default_model.path()
    t0 = time.time()
    for name, fn in [("options", test_options), ("slow loris", test_slowloris), ("keep-alive", test_keepalive),
                     ("later garbage", test_later_garbage), ("per client", test_per_client), ("many streams", test_many_streams)]:
        t = time.time()
        try:
            fn(model)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            check(False, "%s: %r" % (name, e))
        print("   (%s: %.1f s)" % (name, time.time() - t), flush=True)
    print("test_server_slowloris: %.1f s" % (time.time() - t0))
    return testlib.summary("test_server_slowloris")


if __name__ == "__main__":
    sys.exit(main())
