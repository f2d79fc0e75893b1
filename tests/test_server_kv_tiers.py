#!/usr/bin/env python3
"""The KV cache's host and SSD tiers (src/kv/kv_tiers.h) end to end through
`strata serve` (and once `strata run`), on the default model (CPU), on a free
loopback port (--port 0). The device pool is made tiny (--kv-blocks: one
request's worth) so that a second long prompt evicts the first one's blocks
from the device; greedy completions (temperature 0, max_tokens 8).

Checks:
  - server A, --kv-ssd-dir D: P1, P2 (evicts P1 from the device), P1 again:
    the third answer is the first's text, its usage cached_tokens is P1's
    whole-block prefix ((prompt_tokens - 1) // 16 * 16), all of it from the
    host tier (/metrics strata_prefix_cache_hit_tokens_total{tier="host"});
    device -> host bytes cover both prompts' blocks, host -> device bytes are
    exactly the hit blocks; host blocks cached; the startup line names the
    host and SSD tiers (0 found); SIGTERM: exit 0;
  - server B on the same D: its startup line (and the SSD store's log) finds
    every block A's host tier held; P1: the same text, the same cached_tokens,
    all from the SSD tier (ssd -> host and host -> device bytes exactly the
    hit blocks);
  - server C on D with --kv-dtype f32 (another identity): nothing found, no
    hit, the other identity's file is warned about and left as it was (same
    size); a file of its own beside it;
  - a full disk (--test-fault kv-ssd-write:2 on D2): every request answers
    200 with A's texts, the host tier still hits, the store warns once that
    the write of a slot failed (No space left on device), the SSD tier holds
    one block fewer than the host tier; a restart on D2 finds that many and
    P1's SSD hit stops at the failed block (block 1: 16 tokens);
  - bad options: --kv-ssd-dir with --kv-host-mem 0 and --kv-host-mem beyond
    the machine exit non-zero naming the option, --kv-offload sometimes exits
    2 naming it;
  - `strata run --kv-ssd-dir D3` twice: the same output, D3 holds a
    strata-kv-*.blocks file after the first, and the second run's stats line
    says its whole-block prefix was cached.
test_server.py's Server / raw / metrics are reused (as test_server_shutdown.py
does). About 7 s on 2 cores; a sanitizer build runs the same requests (~45 s).
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import default_model  # noqa: E402
import test_server as ts  # noqa: E402  (Server, raw, metrics, mval)
import testlib  # noqa: E402
from testlib import BIN, check, failures, sanitized_build  # noqa: E402

SAN = sanitized_build()
BLOCK = 16                     # tokens per KV block (asserted from /metrics)
KV_BLOCKS = 20                 # the device pool: one request of up to 320 tokens
MAX_MODEL_LEN = KV_BLOCKS * BLOCK
MAX_TOKENS = 8
CMD_TIMEOUT = 300 if SAN else 60

# ~280 and ~300 tokens of plain text (completions: no chat template); P2 differs from its first token
P1 = ("The history of the lighthouse begins with simple fires lit on hilltops to guide sailors home. "
      "Over the centuries these beacons grew into towers of stone, and keepers tended lamps of oil, then of gas, "
      "and finally of electricity. ") * 6 + "In one sentence, the lighthouse is"
P2 = ("Bread baking is an old craft: flour, water, salt and yeast are mixed, kneaded and left to rise, "
      "then shaped and baked in a hot oven until the crust turns golden brown and sounds hollow. ") * 7 \
    + "The best bread is"
RUN_PROMPT = ("The history of the lighthouse begins with simple fires lit on hilltops to guide sailors home. "
              "Over the centuries these beacons grew into towers of stone, and keepers tended lamps.")

TIERS_LINE = re.compile(r"strata: KV tiers: device [\d.]+ GiB, host [\d.]+ GiB \((\d+) blocks, (\w+) offload\)"
                        r"(?:, SSD [\d.]+ GiB in (.*) \((\d+) blocks, (\d+) found from earlier runs\)|, no SSD tier)$",
                        re.M)
FOUND_LOG = re.compile(r"KV cache on SSD: (\S+): (\d+) blocks found in (\d+) slots")


class Server(ts.Server):
    """test_server's server with one sequence, the tiny device pool and the tier options."""

    def __init__(self, model, tag, *extra):
        super().__init__(model, "--max-batch", "1", "--max-model-len", str(MAX_MODEL_LEN), "--kv-blocks",
                         str(KV_BLOCKS), "--no-rooflines", *extra, tag="kv_tiers_" + tag)
        self.n_fail0 = len(failures)

    def log_text(self):
        """The whole stderr so far (Server.tail gives only its end)."""
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def finish(self, what):
        """SIGTERM: exit 0; the log shown when something failed."""
        alive = self.proc.poll() is None
        rc = self.stop()
        check(alive and rc == 0, "%s: SIGTERM, the server exits 0 (status %s)" % (what, rc))
        if len(failures) > self.n_fail0:
            print("---- server %s log (tail) ----\n%s" % (what, self.tail()))


def complete(srv, prompt):
    """-> (status, text, prompt_tokens, cached_tokens); a greedy completion of MAX_TOKENS tokens."""
    st, obj, _ = ts.raw(srv, "POST", "/v1/completions",
                        {"model": "smol", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
                        timeout=CMD_TIMEOUT)
    if st != 200 or not isinstance(obj, dict):
        print("   %d %r" % (st, obj))
        return st, None, -1, -1
    u = obj.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", -1)
    return st, obj["choices"][0]["text"], u.get("prompt_tokens", -1), cached


def prefix(prompt_tokens):
    """The whole blocks before a prompt's last token: what the prefix cache can hold of it."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def hit(m, tier):
    return ts.mval(m, "strata_prefix_cache_hit_tokens_total", '{tier="%s"}' % tier)


def blocks(m, tier, state):
    return ts.mval(m, "strata_kv_blocks", '{tier="%s",state="%s"}' % (tier, state))


def held(m, tier):
    """Blocks a tier holds: cached, and used (being written to the SSD tier: its completion is polled at the
    engine's next step, which an idle server does not take)."""
    return blocks(m, tier, "cached") + blocks(m, tier, "used")


def xfer(m, direction):
    return ts.mval(m, "strata_kv_transfer_bytes_total", '{direction="%s"}' % direction)


def block_bytes(m):
    """Bytes of one block in the host tier: K and V of BLOCK tokens, rounded up to 4096 (kv_tiers.h)."""
    b = int(ts.mval(m, "strata_model_kv_bytes_per_token")) * BLOCK
    return (b + 4095) // 4096 * 4096


def tiers_line(srv):
    """The startup line's groups (host blocks, offload, SSD dir, SSD blocks, found), or None."""
    m = TIERS_LINE.search(srv.log_text())
    return m.groups() if m else None


def found_in_log(srv):
    """Blocks the SSD store's scan found (its info line), or -1."""
    m = FOUND_LOG.search(srv.log_text())
    return int(m.group(2)) if m else -1


def block_files(d):
    return {os.path.basename(p): os.path.getsize(p) for p in glob.glob(os.path.join(d, "strata-kv-*.blocks"))}


# ---- 1: host tier (server A) --------------------------------------------------------------
def test_host_tier(model, d):
    """-> {"texts": (P1's, P2's), "pt1": P1's prompt tokens, "host_held": blocks} for the later checks."""
    srv = Server(model, "A", "--kv-ssd-dir", d)
    out = {}
    try:
        line = tiers_line(srv)
        check(line is not None and int(line[0]) > 0 and line[1] == "eager" and line[2] == d
              and int(line[3]) > 0 and line[4] == "0",
              "A: the startup line names the host tier (eager) and the SSD tier in D, 0 found: %r" % (line,))
        m0 = ts.metrics(srv)
        check(ts.mval(m0, "strata_kv_block_size_tokens") == BLOCK and ts.mval(m0, "strata_kv_blocks_total") == KV_BLOCKS,
              "A: %d blocks of %d tokens on the device" % (KV_BLOCKS, BLOCK))
        bb = block_bytes(m0)
        s1, t1, pt1, c1 = complete(srv, P1)
        s2, t2, pt2, c2 = complete(srv, P2)
        check(s1 == 200 and s2 == 200 and t1 and t2 and c1 == 0 and c2 == 0,
              "A: P1 (%d tokens) and P2 (%d tokens) answered, nothing cached: %r, %r" % (pt1, pt2, t1, t2))
        check(pt2 + MAX_TOKENS > (KV_BLOCKS - 1) * BLOCK,
              "A: P2 and its answer need all %d device blocks (%d tokens): P1 is evicted from the device"
              % (KV_BLOCKS, pt2 + MAX_TOKENS))
        m1 = ts.metrics(srv)
        s3, t3, pt3, c3 = complete(srv, P1)
        m2 = ts.metrics(srv)
        want = prefix(pt1)
        check(s3 == 200 and t3 == t1, "A: P1 again: the same text %r (first %r)" % (t3, t1))
        check(pt3 == pt1 and c3 == want, "A: P1 again: cached_tokens %d == its whole-block prefix %d (of %d)"
              % (c3, want, pt3))
        dh = hit(m2, "host") - hit(m1, "host")
        check(dh == want and hit(m2, "device") == 0 and hit(m2, "ssd") == 0,
              "A: the hit came from the host tier: host %d (want %d), device %d, ssd %d tokens"
              % (dh, want, hit(m2, "device"), hit(m2, "ssd")))
        n_prompt_blocks = (pt1 - 1) // BLOCK + (pt2 - 1) // BLOCK
        check(xfer(m1, "device_to_host") >= n_prompt_blocks * bb > 0,
              "A: device -> host %d bytes >= both prompts' %d blocks of %d bytes"
              % (xfer(m1, "device_to_host"), n_prompt_blocks, bb))
        h2d = xfer(m2, "host_to_device") - xfer(m1, "host_to_device")
        check(xfer(m1, "host_to_device") == 0 and h2d == want // BLOCK * bb,
              "A: host -> device %d bytes == the %d hit blocks" % (h2d, want // BLOCK))
        check(blocks(m2, "host", "cached") > 0 and held(m2, "host") >= n_prompt_blocks,
              "A: host tier: %d blocks cached, %d held (>= the prompts' %d)"
              % (blocks(m2, "host", "cached"), held(m2, "host"), n_prompt_blocks))
        check(xfer(m2, "host_to_ssd") > 0 and blocks(m2, "ssd", "cached") > 0,
              "A: written through to the SSD tier: %d bytes, %d blocks"
              % (xfer(m2, "host_to_ssd"), blocks(m2, "ssd", "cached")))
        check(ts.mval(m2, "strata_kv_swaps_total") == 0, "A: no swaps (one sequence at a time)")
        out = {"texts": (t1, t2), "pt1": pt1, "host_held": int(held(m2, "host"))}
    finally:
        srv.finish("A")
    return out


# ---- 2: SSD tier after a restart (server B) ------------------------------------------------
def test_ssd_restart(model, d, a):
    srv = Server(model, "B", "--kv-ssd-dir", d)
    try:
        line = tiers_line(srv)
        check(line is not None and line[2] == d and int(line[4]) > 0,
              "B: the startup line says blocks were found from earlier runs: %r" % (line,))
        found = found_in_log(srv)
        check(found == a["host_held"], "B: the SSD store found %d blocks == those A's host tier held (%d)"
              % (found, a["host_held"]))
        m0 = ts.metrics(srv)
        bb = block_bytes(m0)
        check(blocks(m0, "ssd", "cached") == found and blocks(m0, "host", "cached") == 0,
              "B: at start: %d SSD blocks cached, %d host" % (blocks(m0, "ssd", "cached"), blocks(m0, "host", "cached")))
        st, t, pt, c = complete(srv, P1)
        m1 = ts.metrics(srv)
        want = prefix(a["pt1"])
        check(st == 200 and t == a["texts"][0], "B: P1: A's text %r" % t)
        check(pt == a["pt1"] and c == want, "B: P1: cached_tokens %d == %d" % (c, want))
        check(hit(m1, "ssd") == want and hit(m1, "host") == 0 and hit(m1, "device") == 0,
              "B: the hit came from the SSD tier: ssd %d, host %d, device %d tokens"
              % (hit(m1, "ssd"), hit(m1, "host"), hit(m1, "device")))
        check(xfer(m1, "ssd_to_host") == want // BLOCK * bb and xfer(m1, "host_to_device") == want // BLOCK * bb,
              "B: ssd -> host %d and host -> device %d bytes == the %d hit blocks of %d bytes"
              % (xfer(m1, "ssd_to_host"), xfer(m1, "host_to_device"), want // BLOCK, bb))
    finally:
        srv.finish("B")


# ---- 3: another identity in the same directory (server C) ----------------------------------
def test_other_identity(model, d, a):
    before = block_files(d)
    check(len(before) == 1 and all(v > 0 for v in before.values()), "D holds one block file: %r" % before)
    srv = Server(model, "C", "--kv-ssd-dir", d, "--kv-dtype", "f32")
    try:
        line = tiers_line(srv)
        check(line is not None and line[4] == "0", "C (--kv-dtype f32): the startup line says 0 found: %r" % (line,))
        check(found_in_log(srv) == 0, "C: the SSD store found %d blocks (want 0)" % found_in_log(srv))
        check(re.search(r"holds 1 strata-kv-\*\.blocks file of other model identities: ignored", srv.log_text()),
              "C: the other identity's file is warned about")
        st, t, pt, c = complete(srv, P1)
        m1 = ts.metrics(srv)
        check(st == 200 and t and pt == a["pt1"] and c == 0, "C: P1 answered, nothing cached (%d): %r" % (c, t))
        check(hit(m1, "ssd") == 0 and hit(m1, "host") == 0 and xfer(m1, "ssd_to_host") == 0,
              "C: no SSD or host hit (ssd %d, host %d tokens)" % (hit(m1, "ssd"), hit(m1, "host")))
    finally:
        srv.finish("C")
    after = block_files(d)
    check(all(after.get(k) == v for k, v in before.items()),
          "C: B's block file is still there, the same size: %r -> %r" % (before, after))
    check(len(after) == 2, "C: its own block file beside it: %r" % sorted(after))


# ---- 4: a full disk ----------------------------------------------------------------------------
def test_full_disk(model, d2, a):
    srv = Server(model, "F", "--kv-ssd-dir", d2, "--test-fault", "kv-ssd-write:2")
    host_held = -1
    try:
        r = [complete(srv, p) for p in (P1, P2, P1)]
        check(all(x[0] == 200 for x in r), "full disk: every request answered 200 (%r)" % [x[0] for x in r])
        check([x[1] for x in r] == [a["texts"][0], a["texts"][1], a["texts"][0]],
              "full disk: the texts of the run without the fault: %r" % [x[1] for x in r])
        check(r[2][3] == prefix(a["pt1"]), "full disk: P1 again still hits the host tier: cached_tokens %d == %d"
              % (r[2][3], prefix(a["pt1"])))
        m = ts.metrics(srv)
        host_held = int(held(m, "host"))
        check(held(m, "ssd") == host_held - 1,
              "full disk: the SSD tier holds one block fewer (%d) than the host tier (%d)" % (held(m, "ssd"), host_held))
        log = srv.log_text()
        warn = re.findall(r"KV cache on SSD: writing the block of slot \d+ failed: .*", log)
        check(len(warn) == 1 and "No space left on device" in warn[0],
              "full disk: the store warns once that a slot's write failed (No space left on device): %r" % warn)
    finally:
        srv.finish("full disk")
    # a restart finds every block but the one whose write failed; P1's chain breaks there (block 1)
    srv = Server(model, "F2", "--kv-ssd-dir", d2)
    try:
        found = found_in_log(srv)
        check(found == host_held - 1, "full disk, restart: %d blocks found == %d - 1" % (found, host_held))
        st, t, pt, c = complete(srv, P1)
        check(st == 200 and t == a["texts"][0] and c == BLOCK,
              "full disk, restart: P1 answers A's text, cached_tokens %d == %d (the 2nd write, block 1, failed)"
              % (c, BLOCK))
    finally:
        srv.finish("full disk, restart")


# ---- 5: bad options ----------------------------------------------------------------------------
def serve_fails(model, *args):
    """-> (exit status, stderr) of a serve that must not start (None when it ran on)."""
    try:
        r = subprocess.run([BIN, "serve", model, "--port", "0", "--no-rooflines"] + list(args), capture_output=True,
                           text=True, timeout=CMD_TIMEOUT)
        return r.returncode, r.stderr
    except subprocess.TimeoutExpired as e:
        return None, str(e.stderr)


def test_bad_options(model, d):
    """d: a directory that must not be made."""
    rc, err = serve_fails(model, "--kv-ssd-dir", d, "--kv-host-mem", "0")
    last = err.strip().splitlines()[-1:] if err else []
    check(rc not in (0, None) and "--kv-ssd-dir" in err,
          "--kv-ssd-dir with --kv-host-mem 0: exit %s naming --kv-ssd-dir: %r" % (rc, last))
    rc, err = serve_fails(model, "--kv-host-mem", "100000G")
    last = err.strip().splitlines()[-1:] if err else []
    check(rc not in (0, None) and "--kv-host-mem" in err,
          "--kv-host-mem 100000G: exit %s naming --kv-host-mem: %r" % (rc, last))
    rc, err = serve_fails(model, "--kv-offload", "sometimes")
    last = err.strip().splitlines()[:1] if err else []
    check(rc == 2 and "--kv-offload" in err, "--kv-offload sometimes: exit %s naming --kv-offload: %r" % (rc, last))
    check(not os.path.exists(d), "no SSD directory was made by the refused servers")


# ---- 6: strata run -------------------------------------------------------------------------------
STATS = re.compile(r"^prompt: (\d+) tokens in .*?(?:, cached: (\d+))?$", re.M)


def test_run(model, d3):
    cmd = [BIN, "run", model, "--kv-ssd-dir", d3, "-p", RUN_PROMPT, "-n", str(MAX_TOKENS), "--temp", "0"]
    outs = []
    for i in (1, 2):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT)
        stats = STATS.search(r.stderr)
        computed = int(stats.group(1)) if stats else -1
        cached = int(stats.group(2) or 0) if stats else -1
        outs.append((r.returncode, r.stdout, computed, cached))
        if i == 1:
            files = block_files(d3)
            check(r.returncode == 0 and len(files) == 1 and all(v > 0 for v in files.values()),
                  "run 1: exit %d, %s holds a strata-kv-*.blocks file: %r" % (r.returncode, d3, files))
        if r.returncode != 0 or not stats:
            print("   run %d stderr: %s" % (i, r.stderr[-2000:]))
    (rc1, o1, p1, c1), (rc2, o2, p2, c2) = outs
    check(rc1 == 0 and rc2 == 0 and o1.strip() and o1 == o2, "run twice: the same output %r / %r" % (o1, o2))
    n = p1 + c1
    check(c1 == 0 and p2 + c2 == n and c2 == prefix(n) > 0,
          "run 2: cached %d of %d prompt tokens == the whole-block prefix %d (run 1 cached %d)" % (c2, n, prefix(n), c1))


def main():
    if not os.path.isfile(BIN):
        print("FAIL  no strata binary at %s" % BIN)
        return 1
    model = default_model.path()
    shutil.rmtree(os.path.join(testlib.TMP, "kv_tiers"), ignore_errors=True)
    d, d2, d3 = (testlib.tmp_dir(os.path.join("kv_tiers", x)) for x in ("D", "D2", "D3"))
    t0 = time.time()
    print("KV tiers through strata serve on %s%s" % (model, " (sanitizer build)" if SAN else ""), flush=True)
    a = {}  # server A's answers, which the later servers must repeat

    def after_a(fn, *args):
        if a:
            fn(model, *args, a)
        else:
            check(False, "skipped: server A's checks did not complete")

    cases = [("host tier (A)", lambda: a.update(test_host_tier(model, d))),
             ("SSD tier after a restart (B)", lambda: after_a(test_ssd_restart, d)),
             ("another identity (C)", lambda: after_a(test_other_identity, d)),
             ("full disk", lambda: after_a(test_full_disk, d2)),
             ("bad options", lambda: test_bad_options(model, os.path.join(testlib.TMP, "kv_tiers", "Dbad"))),
             ("strata run", lambda: test_run(model, d3))]
    for name, fn in cases:
        t = time.time()
        try:
            fn()
        except Exception as e:
            import traceback
            traceback.print_exc()
            check(False, "%s: %r" % (name, e))
        print("   (%s: %.1f s)" % (name, time.time() - t), flush=True)
    print("test_server_kv_tiers: %.1f s" % (time.time() - t0))
    if not failures:  # the block files (tens of MB); the logs stay
        shutil.rmtree(os.path.join(testlib.TMP, "kv_tiers"), ignore_errors=True)
    return testlib.summary("test_server_kv_tiers")


if __name__ == "__main__":
    sys.exit(main())
