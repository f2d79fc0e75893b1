#!/usr/bin/env python3
"""Checks src/core/quant.c against gguf-py (gguf.quants, numpy code written by
llama.cpp's authors), through the tool mode of the test_quant executable:

  dequant: random blocks of every type (random bytes, f16 scale fields set to
           random finite values, subnormals included) -> float32, compared bit
           for bit with gguf.quants.dequantize;
  quant:   random floats (many block scales, zero and constant blocks, exact
           rounding ties, f16 overflow/subnormal ranges) -> bytes, compared
           byte for byte with gguf.quants.quantize for F32, F16, BF16, Q8_0,
           Q4_0 and Q4_1.

Finds test_quant in $STRATA_BUILD, else in the directory of $STRATA_BIN.
Fails when numpy or gguf-py is missing (scripts/install-deps.sh installs them)."""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
except ImportError as e:  # pragma: no cover
    print(f"test_quant_pyref: FAILED, needs numpy and gguf-py ({e}); run scripts/install-deps.sh")
    sys.exit(1)

FAILURES = []


def find_tool():
    build = os.environ.get("STRATA_BUILD")
    if not build and os.environ.get("STRATA_BIN"):
        build = os.path.dirname(os.environ["STRATA_BIN"])
    if not build:
        build = os.path.join(os.environ.get("STRATA_SRC", "."), "build")
    exe = os.path.join(build, "test_quant")
    if not os.access(exe, os.X_OK):
        print(f"test_quant_pyref: {exe} not found (build the test_quant target)")
        sys.exit(1)
    return exe


def run_tool(exe, tmp, mode, name, data: bytes) -> bytes:
    src = os.path.join(tmp, f"{mode}_{name}.in")
    dst = os.path.join(tmp, f"{mode}_{name}.out")
    with open(src, "wb") as f:
        f.write(data)
    r = subprocess.run([exe, mode, name, src, dst], capture_output=True, text=True)
    if r.returncode != 0:
        FAILURES.append(f"{mode} {name}: test_quant exited {r.returncode}: {r.stderr.strip()}")
        return b""
    with open(dst, "rb") as f:
        return f.read()


# name -> (gguf type, block elems, block bytes, offsets of f16 fields in a block)
TYPES = {
    "f32": (QT.F32, 1, 4, []),
    "f16": (QT.F16, 1, 2, []),
    "bf16": (QT.BF16, 1, 2, []),
    "q8_0": (QT.Q8_0, 32, 34, [0]),
    "q4_0": (QT.Q4_0, 32, 18, [0]),
    "q4_1": (QT.Q4_1, 32, 20, [0, 2]),
    "q4_k": (QT.Q4_K, 256, 144, [0, 2]),
    "q6_k": (QT.Q6_K, 256, 210, [208]),
}


def random_finite_f16(rng, n):
    h = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    special = (h & 0x7C00) == 0x7C00
    h[special] &= 0xBFFF  # exponent 31 -> 15: finite
    return h


def random_blocks(rng, name, n_blocks):
    qt, be, bb, f16_at = TYPES[name]
    if name == "f32":
        v = rng.standard_normal(n_blocks).astype(np.float32) * np.float32(100)
        return v.view(np.uint8)
    if name in ("f16", "bf16"):
        h = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint32).astype(np.uint16)
        if name == "f16":
            nan = ((h & 0x7C00) == 0x7C00) & ((h & 0x03FF) != 0)
        else:
            nan = ((h & 0x7F80) == 0x7F80) & ((h & 0x007F) != 0)
        h[nan] &= 0xFFC0 if name == "bf16" else 0xFC00  # NaN -> inf: keep bit compare meaningful
        return h.view(np.uint8)
    blocks = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint32).astype(np.uint8)
    for off in f16_at:
        h = random_finite_f16(rng, n_blocks)
        # mostly moderate scales, some of the whole finite range (subnormals too)
        moderate = rng.random(n_blocks) < 0.7
        h[moderate] = (h[moderate] & 0x83FF) | np.uint16(0x1C00 + 0x400 * rng.integers(0, 6))
        blocks[:, off] = (h & 0xFF).astype(np.uint8)
        blocks[:, off + 1] = (h >> 8).astype(np.uint8)
    return blocks.reshape(-1)


def check_dequant(exe, tmp, rng):
    for name, (qt, be, bb, _) in TYPES.items():
        n_blocks = 4096 if be == 1 else (2000 if be == 32 else 400)
        data = random_blocks(rng, name, n_blocks)
        got = run_tool(exe, tmp, "dequant", name, data.tobytes())
        if not got and n_blocks:
            continue
        got = np.frombuffer(got, dtype=np.float32)
        want = quants.dequantize(data, qt).astype(np.float32, copy=False).reshape(-1)
        if got.shape != want.shape:
            FAILURES.append(f"dequant {name}: {got.shape} values, gguf-py gives {want.shape}")
            continue
        bad = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
        if bad.size:
            i = bad[0]
            FAILURES.append(
                f"dequant {name}: {bad.size} of {got.size} values differ; first at {i} "
                f"(block {i // be}): {got[i]!r} vs gguf-py {want[i]!r}")
        else:
            print(f"dequant {name}: {got.size} values bit-identical to gguf-py")


def quant_inputs(rng, name):
    """Float32 rows (whole blocks of 32) exercising the rounding edge cases."""
    parts = []
    for scale in (1e-6, 1e-3, 1.0, 37.0, 1e3, 6e4):
        parts.append(rng.standard_normal(32 * 40) * scale)
    parts.append(rng.uniform(-1, 1, 32 * 40) * 10.0 ** rng.uniform(-8, 5, 32 * 40))
    parts.append(np.zeros(32))                     # all-zero block
    parts.append(np.full(32, 3.25))                # constant block (Q4_1: d = 0)
    parts.append(np.full(32, -7.0))
    # Q8_0 ties: amax 127 -> d = 1 exactly, halves round away from zero
    t = np.arange(-16, 16) * 0.5
    t[0] = 127.0
    parts.append(t)
    parts.append(-t)
    # Q4_0 ties: largest magnitude -8 -> d = 1; x + 8.5 lands on integers
    t = (np.arange(32) % 31) * 0.5 - 8.0
    parts.append(t)
    # Q4_1 ties: min 0, max 15 -> d = 1; x + 0.5 lands on integers
    t = np.arange(32) % 16 + np.where(np.arange(32) >= 16, 0.5, 0.0)
    t[16] = 0.0
    t[17] = 15.0
    parts.append(t)
    # blocks whose largest magnitude appears twice with opposite signs (Q4_0 takes the first)
    t = rng.uniform(-1, 1, 32)
    t[3], t[9] = -2.0, 2.0
    parts.append(t)
    x = np.concatenate(parts).astype(np.float32)
    if name in ("f16", "bf16", "f32"):
        # f16 edge ranges: overflow, subnormals, rounding ties
        bits = rng.integers(0x32000000, 0x47900000, size=4096, dtype=np.uint32)
        sign = rng.integers(0, 2, size=4096, dtype=np.uint32) << 31
        edge = (bits | sign).view(np.float32)
        ties = (np.arange(0x3F800000, 0x3F800000 + 64 * 0x1000, 0x1000, dtype=np.uint32)).view(np.float32)
        big = rng.integers(0, 0x7F800000, size=4096, dtype=np.uint32).view(np.float32)
        x = np.concatenate([x, edge, ties, big, np.array([np.inf, -np.inf, 65520.0, 65519.996], np.float32)])
        x = x[: (x.size // 32) * 32]
    return x.astype(np.float32)


def check_quant(exe, tmp, rng):
    for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"):
        qt = TYPES[name][0]
        x = quant_inputs(rng, name)
        got = run_tool(exe, tmp, "quant", name, x.tobytes())
        if not got:
            continue
        with np.errstate(over="ignore"):
            want = np.ascontiguousarray(quants.quantize(x, qt)).tobytes()
        if got == want:
            print(f"quant {name}: {x.size} values, {len(got)} bytes identical to gguf-py")
            continue
        g = np.frombuffer(got, np.uint8)
        w = np.frombuffer(want, np.uint8)
        if g.size != w.size:
            FAILURES.append(f"quant {name}: {g.size} bytes, gguf-py gives {w.size}")
            continue
        bad = np.nonzero(g != w)[0]
        bb = TYPES[name][2]
        i = bad[0]
        b = i // bb
        FAILURES.append(
            f"quant {name}: {bad.size} bytes differ; first at byte {i} (block {b}): "
            f"{g[b * bb:(b + 1) * bb].tolist()} vs gguf-py {w[b * bb:(b + 1) * bb].tolist()}")


def main():
    exe = find_tool()
    base = os.environ.get("STRATA_TMP") or None
    if base:
        os.makedirs(base, exist_ok=True)
    rng = np.random.default_rng(20240607)
    with tempfile.TemporaryDirectory(prefix="quant_pyref-", dir=base) as tmp:
        check_dequant(exe, tmp, rng)
        check_quant(exe, tmp, rng)
    if FAILURES:
        for f in FAILURES:
            print("FAIL:", f)
        sys.exit(1)
    print("test_quant_pyref: all checks passed")


if __name__ == "__main__":
    main()
