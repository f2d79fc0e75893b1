#!/usr/bin/env python3
"""Generates src/tokenizer/unicode_tables.c from the Unicode Character Database.

    apt-get install unicode-data        # Debian: /usr/share/unicode/
    python3 tools/gen_unicode_tables.py [UCD_DIR] > src/tokenizer/unicode_tables.c

Reads UnicodeData.txt (general categories; "<..., First>"/"<..., Last>" pairs
are ranges) and PropList.txt (White_Space). When PropList.txt is missing, the
White_Space list of Unicode 15 is used (it has not changed since 6.0).

Also reads the canonical combining classes and canonical decompositions of
UnicodeData.txt and Full_Composition_Exclusion of DerivedNormalizationProps.txt
(computed from CompositionExclusions.txt, singletons and non-starter
decompositions when that file is missing) for NFC (HF's "NFC" normalizer, used
by Qwen2's tokenizer.json).

Output: the code points 0..0x10FFFF cut into maximal runs of equal flags,
  ST_UCAT_L  general category L*  (Lu Ll Lt Lm Lo)   regex \\p{L}
  ST_UCAT_N  general category N*  (Nd Nl No)         regex \\p{N}
  ST_UCAT_M  general category M*  (Mn Mc Me)
  ST_UCAT_WS property White_Space                    regex \\s
as two parallel arrays (run start, run flags) searched by binary search, plus a
direct table for U+0000..U+00FF. Unassigned code points have no flag.
Normalization: runs of equal canonical combining class; the one-step canonical
decompositions (cp -> a [b]) sorted by cp; the primary composites (a, b -> cp,
not excluded) sorted by (a, b). Hangul syllables are algorithmic (not listed).
"""
import os
import re
import sys

WS_FALLBACK = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
               (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
               (0x3000, 0x3000)]
F_L, F_N, F_M, F_WS = 1, 2, 4, 8
MAXCP = 0x10FFFF


def read_categories(path, ccc, decomp):
    flags = bytearray(MAXCP + 1)
    first = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.rstrip("\n").split(";")
            if len(fields) < 6:
                continue
            cp = int(fields[0], 16)
            name, gc = fields[1], fields[2]
            if int(fields[3]):
                ccc[cp] = int(fields[3])
            if fields[5] and not fields[5].startswith("<"):
                decomp[cp] = [int(x, 16) for x in fields[5].split()]
            fl = F_L if gc[0] == "L" else F_N if gc[0] == "N" else F_M if gc[0] == "M" else 0
            if name.endswith(", First>"):
                first = cp
                continue
            lo = first if (name.endswith(", Last>") and first is not None) else cp
            first = None
            for c in range(lo, cp + 1):
                flags[c] = fl
    return flags


def read_white_space(path):
    if not os.path.exists(path):
        return WS_FALLBACK, "built-in list (PropList.txt not found)"
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            rng, prop = [x.strip() for x in line.split(";")]
            if prop != "White_Space":
                continue
            if ".." in rng:
                lo, hi = (int(x, 16) for x in rng.split(".."))
            else:
                lo = hi = int(rng, 16)
            out.append((lo, hi))
    return out, "PropList.txt"


def read_prop_ranges(path, prop):
    out = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = [x.strip() for x in line.split(";")]
            if len(parts) < 2 or parts[1] != prop:
                continue
            if ".." in parts[0]:
                lo, hi = (int(x, 16) for x in parts[0].split(".."))
            else:
                lo = hi = int(parts[0], 16)
            out.update(range(lo, hi + 1))
    return out


def composition_exclusions(ucd, ccc, decomp):
    p = os.path.join(ucd, "DerivedNormalizationProps.txt")
    if os.path.exists(p):
        return read_prop_ranges(p, "Full_Composition_Exclusion"), "DerivedNormalizationProps.txt"
    excl = set()
    with open(os.path.join(ucd, "CompositionExclusions.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                excl.add(int(line, 16))
    for cp, d in decomp.items():
        if len(d) == 1 or ccc.get(cp, 0) or ccc.get(d[0], 0):
            excl.add(cp)
    return excl, "CompositionExclusions.txt + singletons + non-starter decompositions"


def ucd_version(ucd):
    p = os.path.join(ucd, "ReadMe.txt")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            for line in f:
                m = re.search(r"Version (\d+\.\d+\.\d+)", line)
                if m:
                    return "Unicode Character Database " + m.group(1)
    return "unknown version"


def main():
    ucd = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/unicode"
    ccc, decomp = {}, {}
    flags = read_categories(os.path.join(ucd, "UnicodeData.txt"), ccc, decomp)
    excl, excl_src = composition_exclusions(ucd, ccc, decomp)
    ws, ws_src = read_white_space(os.path.join(ucd, "PropList.txt"))
    for lo, hi in ws:
        for c in range(lo, hi + 1):
            flags[c] |= F_WS
    starts, vals = [], []
    prev = None
    for cp in range(MAXCP + 1):
        if flags[cp] != prev:
            starts.append(cp)
            vals.append(flags[cp])
            prev = flags[cp]
    o = []
    o.append("/* GENERATED by tools/gen_unicode_tables.py -- do not edit.")
    o.append(" * Regenerate with (Debian package unicode-data):")
    o.append(" *   python3 tools/gen_unicode_tables.py /usr/share/unicode > src/tokenizer/unicode_tables.c")
    o.append(f" * Source: {ucd_version(ucd)}; White_Space from {ws_src};")
    o.append(f" * Full_Composition_Exclusion from {excl_src}.")
    o.append(" * Runs of code points with equal flags (see unicode.h for the flags). */")
    o.append('#include "tokenizer/unicode.h"')
    o.append("")
    o.append(f"const int32_t st_ucat_n_runs = {len(starts)};")
    o.append("")
    o.append(f"const uint32_t st_ucat_run_start[{len(starts)}] = {{")
    for i in range(0, len(starts), 10):
        o.append("    " + ", ".join(f"0x{s:X}" for s in starts[i:i + 10]) + ",")
    o.append("};")
    o.append("")
    o.append(f"const uint8_t st_ucat_run_flags[{len(vals)}] = {{")
    for i in range(0, len(vals), 24):
        o.append("    " + ", ".join(str(v) for v in vals[i:i + 24]) + ",")
    o.append("};")
    o.append("")
    o.append("const uint8_t st_ucat_latin1[256] = {")
    for i in range(0, 256, 32):
        o.append("    " + ", ".join(str(flags[c]) for c in range(i, i + 32)) + ",")
    o.append("};")
    # canonical combining class runs
    cstarts, cvals, prev = [], [], None
    for cp in range(MAXCP + 1):
        v = ccc.get(cp, 0)
        if v != prev:
            cstarts.append(cp)
            cvals.append(v)
            prev = v
    o.append("")
    o.append(f"const int32_t st_ccc_n_runs = {len(cstarts)};")
    o.append(f"const uint32_t st_ccc_run_start[{len(cstarts)}] = {{")
    for i in range(0, len(cstarts), 10):
        o.append("    " + ", ".join(f"0x{x:X}" for x in cstarts[i:i + 10]) + ",")
    o.append("};")
    o.append(f"const uint8_t st_ccc_run_value[{len(cvals)}] = {{")
    for i in range(0, len(cvals), 24):
        o.append("    " + ", ".join(str(x) for x in cvals[i:i + 24]) + ",")
    o.append("};")
    # decompositions: {cp, a, b}
    keys = sorted(decomp)
    o.append("")
    o.append(f"const int32_t st_nfd_n = {len(keys)};")
    o.append(f"const uint32_t st_nfd_map[{len(keys)}][3] = {{")
    for i in range(0, len(keys), 4):
        o.append("    " + " ".join("{0x%X, 0x%X, 0x%X}," % (k, decomp[k][0], decomp[k][1] if len(decomp[k]) > 1 else 0)
                                   for k in keys[i:i + 4]))
    o.append("};")
    # primary composites: {a, b, cp}
    comp = sorted((d[0], d[1], cp) for cp, d in decomp.items() if len(d) == 2 and cp not in excl)
    o.append("")
    o.append(f"const int32_t st_nfc_n = {len(comp)};")
    o.append(f"const uint32_t st_nfc_map[{len(comp)}][3] = {{")
    for i in range(0, len(comp), 4):
        o.append("    " + " ".join("{0x%X, 0x%X, 0x%X}," % c for c in comp[i:i + 4]))
    o.append("};")
    sys.stdout.write("\n".join(o) + "\n")


if __name__ == "__main__":
    main()
