"""Shared helpers of the Python tests (the counterpart of testutil.c): the
paths CTest passes in the environment, and one check() that prints, counts
and remembers failures. A test ends with `return testlib.summary("name")`."""
import os
import re

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
