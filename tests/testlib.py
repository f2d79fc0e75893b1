"""Shared helpers of the Python tests (the counterpart of testutil.c): the
paths CTest passes in the environment, and one check() that prints, counts
and remembers failures. A test ends with `return testlib.summary("name")`."""
import os
import re
import socket
import time

SRC = os.environ.get("STRATA_SRC", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STRATA_BIN", os.path.join(SRC, "build", "strata"))
BUILD = os.environ.get("STRATA_BUILD", os.path.dirname(BIN))
TMP = os.environ.get("STRATA_TMP", "/tmp/strata-test")

failures = []      # what failed, in order
counts = {"checks": 0, "passed": 0}
print_ok = True    # False: only failures are printed (tests with hundreds of checks)


def check(cond, what):
    """Counts a check; prints it (failures always) and remembers a failure. Returns cond."""
    counts["checks"] += 1
    if cond:
        counts["passed"] += 1
        if print_ok:
            print("ok   ", what, flush=True)
    else:
        print("FAIL ", what, flush=True)
        failures.append(what)
    return bool(cond)


def tmp_dir(name):
    """$STRATA_TMP/name, created."""
    d = os.path.join(TMP, name)
    os.makedirs(d, exist_ok=True)
    return d


def sanitized_build():
    """Whether BUILD was configured with a sanitizer: STRATA_SANITIZE (AddressSanitizer + UBSan) or
    STRATA_TSAN (ThreadSanitizer). Slower, and resident memory means little there (ASan's quarantine,
    TSan's shadow): tests scale their loads down and skip memory checks."""
    try:
        with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
            return re.search(r"^STRATA_(SANITIZE|TSAN):BOOL=ON", f.read(), re.M) is not None
    except OSError:
        return False


def summary(name):
    """Prints the counts; 0 when every check passed, else 1 (the exit status)."""
    print("%s: %d checks, %d passed, %d failed" % (name, counts["checks"], counts["passed"], len(failures)),
          flush=True)
    for f in failures:
        print("  FAILED:", f)
    return 1 if failures else 0


# ---- raw HTTP exchanges (the server and the router under malformed requests) -------------------
def raw_exchange(port, data, timeout=10):
    """Sends bytes, reads until the server closes (or the timeout): -> (bytes, closed)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout)
    s.sendall(data)
    got, closed = b"", False
    t = time.time()
    try:
        while time.time() - t < timeout:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            got += chunk
    except socket.timeout:
        pass
    except OSError:
        closed = True
    s.close()
    return got, closed


def parse_answer(got):
    """-> (status, headers dict (lower-case names), body bytes, number of status lines) of a raw answer."""
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", lines[0]) if lines else None
    hdr = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        hdr[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    return (int(m.group(1)) if m else None), hdr, body, len(re.findall(rb"(?:^|\r\n)HTTP/1\.1 \d{3} ", got))
