#!/usr/bin/env python3
"""End-to-end: `strata logits` against reference logits from HF transformers
(tests/data/refs, made by tools/ref/make_refs.py), from the safetensors form
and from GGUF conversions (f32, f16, q8_0) made by `strata convert`; and
with --pos-offset (RoPE positions from 2^24 - 5, 2^26 + 3 and 2^31 - n: RoPE
sees only distances, so the logits are HF's at position 0 within the same
tolerance, and those of offset 0 within POS_TOL).

Error measure: rel = max|ours - ref| / max|ref| over the whole [n, vocab] array.
"""
import json
import os
import subprocess
import sys

import numpy as np

SRC = os.environ.get("STRATA_SRC", ".")
BIN = os.environ.get("STRATA_BIN", "build/strata")
TMP = os.path.join(os.environ.get("STRATA_TMP", "/tmp/strata-test"), "logits_ref")
os.makedirs(TMP, exist_ok=True)
# STRATA_REF_DATA: another directory with models/ and refs/ (the GPU run's big
# model); STRATA_DEVICE: --device for every strata call; STRATA_NO_GGUF=1 skips
# the GGUF conversions (for models too big to convert quickly).
DATA = os.environ.get("STRATA_REF_DATA") or os.path.join(SRC, "tests", "data")
DEVICE = os.environ.get("STRATA_DEVICE")
NO_GGUF = os.environ.get("STRATA_NO_GGUF") == "1"
# chunked (token-by-token) vs one-pass logits: identical math on the CPU; on CUDA
# the one-pass prefill runs split-bf16 tensor-core GEMMs while decode runs exact
# fp32 GEMVs, so they agree to the tensor cores' own accumulation (~3e-5).
CHUNK_TOL = 1e-4 if DEVICE == "cuda" else 1e-5

# Tolerances (rel as above) against the HF float32 reference.
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
# GGUF conversions of the same weights, against HF's float32 reference. f32/f16
# are storage-exact or nearly; for the quantized types the bound is loose (these
# random models amplify weight rounding), and the sharp check is the second one:
# logits from the quantized file equal those of the same file dequantized to f32
# (`strata convert q.gguf f.gguf --type f32`) within 1e-4, i.e. the in-matmul
# dequantization adds no error beyond the quantization itself.
# q4_0 on these untrained models is too coarse for a meaningful bound against
# HF (rel ~0.6); it gets the exact dequantization check only.
GGUF_TOL = {"f32": 1e-4, "f16": 5e-3, "q8_0": 0.15, "q4_0": None}
QUANT_VS_DEQUANT_TOL = 1e-4
# The KV cache stored in bf16 (the default) or fp8 e4m3 (a scale per token and
# kv head), against the f32-KV logits of the same model: within the bound, and
# the same argmax wherever the top-2 margin exceeds twice the bound (these
# random models have near-ties that any rounding flips); errors in the table.
KV_TOL = {"bf16": 2e-2, "fp8": 0.25}
# --pos-offset N against offset 0 (same model, same path): only the rounding
# of the rotated q and k differs (~1e-6 on the CPU). On CUDA the f32 models'
# split-bf16 prefill adds its own ~1e-5; bf16 models run bf16 operands, where
# such a change can flip roundings.
POS_TOL = {"float32": 1e-4, "bfloat16": 2e-2} if DEVICE == "cuda" else {"float32": 1e-5, "bfloat16": 1e-5}

failures = []
rows = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def run(args, expect_ok=True):
    p = subprocess.run([BIN] + args, capture_output=True, text=True)
    if expect_ok and p.returncode != 0:
        failures.append("strata %s failed: %s" % (" ".join(args), p.stderr.strip()))
        print("FAIL:", failures[-1], flush=True)
    return p


def logits(model, tokens_file, vocab, n, extra=(), kv="f32"):
    # the KV cache in f32 for the checks against the f32 reference; the
    # default bf16 (and fp8) KV get their own checks below (KV_TOL)
    out = os.path.join(TMP, "out.f32")
    if os.path.exists(out):
        os.remove(out)
    dev = ("--device", DEVICE) if DEVICE else ()
    p = run(["logits", model, "--tokens-file", tokens_file, "--out", out, "--kv-dtype", kv, *dev, *extra])
    if p.returncode != 0:
        return None
    a = np.fromfile(out, dtype="<f4")
    if a.size != n * vocab:
        failures.append("%s: %d floats written, expected %d" % (model, a.size, n * vocab))
        return None
    return a.reshape(n, vocab)


def rel(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def main():
    man = json.load(open(os.path.join(DATA, "refs", "manifest.json")))
    for name, e in sorted(man["models"].items()):
        mdir = os.path.join(DATA, "models", name)
        tok = os.path.join(DATA, "refs", name + ".tokens")
        n, vocab = e["n_tokens"], e["vocab"]
        ref = np.fromfile(os.path.join(DATA, "refs", name + ".logits.f32"), dtype="<f4").reshape(n, vocab)
        ours = logits(mdir, tok, vocab, n)
        if ours is None:
            continue
        r = rel(ours, ref)
        same_argmax = bool((ours.argmax(1) == ref.argmax(1)).all())
        rows.append((name, "safetensors", e["dtype"], r, TOL[e["dtype"]], same_argmax))
        check(r < TOL[e["dtype"]], "%s: rel error %.3g >= %.3g" % (name, r, TOL[e["dtype"]]))
        check(same_argmax, "%s: argmax differs at positions %s" %
              (name, np.nonzero(ours.argmax(1) != ref.argmax(1))[0].tolist()))
        if e["dtype"] == "bfloat16":
            hb = np.fromfile(os.path.join(DATA, "refs", name + ".hfbf16.logits.f32"), dtype="<f4").reshape(n, vocab)
            rb = rel(ours, hb)
            rows.append((name, "vs HF bf16 compute", e["dtype"], rb, 0.1, True))
            check(rb < 0.1, "%s: rel error vs HF's bf16 run %.3g" % (name, rb))

        # the KV cache in bf16 and fp8
        for kv, tol in KV_TOL.items():
            k = logits(mdir, tok, vocab, n, kv=kv)
            if k is None:
                continue
            rk = rel(k, ours)
            top2 = np.sort(ours, axis=1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) > 2 * tol * np.abs(ours).max()
            agree = bool((k.argmax(1) == ours.argmax(1))[clear].all())
            rows.append((name, "kv " + kv + " vs kv f32", e["dtype"], rk, tol, agree))
            check(rk < tol, "%s: --kv-dtype %s: rel error %.3g >= %.3g" % (name, kv, rk, tol))
            check(agree, "%s: --kv-dtype %s: argmax differs" % (name, kv))

        # chunked prefill and token-by-token decode through the KV cache
        for chunk in ("1", "7"):
            c = logits(mdir, tok, vocab, n, ("--chunk", chunk))
            if c is None:
                continue
            rc = rel(c, ours)
            rows.append((name, "chunk " + chunk + " vs whole", e["dtype"], rc, CHUNK_TOL, True))
            check(rc < CHUNK_TOL, "%s: --chunk %s differs from one pass by %.3g" % (name, chunk, rc))
            check(bool((c.argmax(1) == ours.argmax(1)).all()), "%s: --chunk %s argmax differs" % (name, chunk))

        # RoPE positions far out: HF's logits of position 0 still hold (RoPE is
        # relative), which float32 angles miss by ~1 (tests/test_rope_positions.c)
        # (the big model of STRATA_REF_DATA: one offset, each run loads it again)
        for off in (2**26 + 3,) if os.environ.get("STRATA_REF_DATA") else (2**24 - 5, 2**26 + 3, 2**31 - n):
            p = run(["logits", mdir, "--tokens-file", tok, "--out", os.path.join(TMP, "off.f32"),
                     "--kv-dtype", "f32", "--pos-offset", str(off)] + (["--device", DEVICE] if DEVICE else []))
            if p.returncode != 0:
                continue
            c = np.fromfile(os.path.join(TMP, "off.f32"), dtype="<f4").reshape(n, vocab)
            check("note: RoPE positions %d .. %d" % (off, off + n - 1) in p.stderr,
                  "%s: --pos-offset %d: no note about max_position_embeddings: %r" % (name, off, p.stderr))
            ro, rh = rel(c, ours), rel(c, ref)
            top2 = np.sort(ours, axis=1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) > 2 * POS_TOL[e["dtype"]] * np.abs(ours).max()
            agree = bool((c.argmax(1) == ours.argmax(1))[clear].all())
            rows.append((name, "pos-offset %d vs 0" % off, e["dtype"], ro, POS_TOL[e["dtype"]], agree))
            rows.append((name, "pos-offset %d vs HF" % off, e["dtype"], rh, TOL[e["dtype"]], True))
            check(ro < POS_TOL[e["dtype"]], "%s: --pos-offset %d differs from offset 0 by %.3g" % (name, off, ro))
            check(agree, "%s: --pos-offset %d: argmax differs" % (name, off))
            check(rh < TOL[e["dtype"]], "%s: --pos-offset %d: rel error vs HF %.3g" % (name, off, rh))

        # GGUF forms of the same weights
        for gt, tol in ({} if NO_GGUF else GGUF_TOL).items():
            g = os.path.join(TMP, "%s.%s.gguf" % (name, gt))
            if run(["convert", mdir, g, "--type", gt]).returncode != 0:
                continue
            og = logits(g, tok, vocab, n)
            if og is None:
                continue
            rg = rel(og, ref)
            # argmax must agree wherever the reference's top-2 margin exceeds the error bound
            srt = np.sort(ref, axis=1)
            margin = srt[:, -1] - srt[:, -2]
            clear = margin > 2 * (tol or 1.0) * np.abs(ref).max()
            agree = bool((og.argmax(1) == ref.argmax(1))[clear].all())
            if tol is not None:
                rows.append((name, "gguf " + gt, e["dtype"], rg, tol, agree))
                check(rg < tol, "%s gguf %s: rel error %.3g >= %.3g" % (name, gt, rg, tol))
                check(agree, "%s gguf %s: argmax differs where the margin is clear" % (name, gt))
            if gt.startswith("q"):
                gf = g + ".f32.gguf"
                if run(["convert", g, gf, "--type", "f32"]).returncode != 0:
                    continue
                od = logits(gf, tok, vocab, n)
                if od is None:
                    continue
                rd = rel(og, od)
                rows.append((name, "gguf %s vs dequant f32" % gt, e["dtype"], rd, QUANT_VS_DEQUANT_TOL,
                             bool((og.argmax(1) == od.argmax(1)).all())))
                check(rd < QUANT_VS_DEQUANT_TOL, "%s gguf %s: differs from its f32 dequantization by %.3g" % (name, gt, rd))

    print("%-16s %-29s %-9s %10s %9s %s" % ("model", "form", "weights", "rel err", "bound", "argmax"))
    for r in rows:
        print("%-16s %-29s %-9s %10.3g %9.3g %s" % (r[0], r[1], r[2], r[3], r[4], "same" if r[5] else "DIFF"))
    if os.environ.get("STRATA_REF_DATA"):
        print("%d passed, %d failed" % (len(rows) - len(failures), len(failures)))
        return 1 if failures else 0

    # bad input on the command line: clear message, non-zero status
    m0 = os.path.join(DATA, "models", "gqa_f32")
    out = os.path.join(TMP, "bad.f32")
    p = run(["logits", m0, "--tokens", "1 2 abc", "--out", out], expect_ok=False)
    check(p.returncode == 2 and "'abc'" in p.stderr, "bad token text: rc %d, %r" % (p.returncode, p.stderr))
    p = run(["logits", m0, "--tokens", "1 2 256", "--out", out], expect_ok=False)
    check(p.returncode == 1 and "outside the vocabulary" in p.stderr and "256" in p.stderr,
          "token past vocab: rc %d, %r" % (p.returncode, p.stderr))
    p = run(["logits", os.path.join(TMP, "no_such_model"), "--tokens", "1", "--out", out], expect_ok=False)
    check(p.returncode == 1 and "no_such_model" in p.stderr, "missing model: rc %d, %r" % (p.returncode, p.stderr))
    p = run(["logits", m0, "--tokens", "1 2", "--out", "/nonexistent-dir/x.f32"], expect_ok=False)
    check(p.returncode == 1 and "/nonexistent-dir/x.f32" in p.stderr, "unwritable out: %r" % p.stderr)

    p = run(["logits", m0, "--tokens", "1 2", "--out", out, "--pos-offset", "-1"], expect_ok=False)
    check(p.returncode == 2 and "--pos-offset" in p.stderr, "negative --pos-offset: rc %d, %r" % (p.returncode, p.stderr))
    p = run(["logits", m0, "--tokens", "1 2", "--out", out, "--pos-offset", "2147483647"], expect_ok=False)
    check(p.returncode == 2 and "2147483648" in p.stderr and "2^31 - 1" in p.stderr,
          "--pos-offset past int32: rc %d, %r" % (p.returncode, p.stderr))
    p = run(["logits", m0, "--tokens", "1 2", "--out", out, "--pos-offset", "2147483646"])
    check(p.returncode == 0, "--pos-offset to the last int32 position: rc %d, %r" % (p.returncode, p.stderr))

    n_checks = len(rows) + 7
    print("%d passed, %d failed" % (n_checks - len(failures), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
