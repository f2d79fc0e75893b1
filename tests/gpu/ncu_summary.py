#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel durations (ncu --csv --metrics
gpu__time_duration.sum) by kernel name and prints a table, largest first:
where a run's GPU time goes. Usage: ncu_summary.py NCU_CSV [TOP]"""
import csv
import re
import sys


def short(name):
    name = re.sub(r"\(.*", "", name)          # drop the parameter list
    name = re.sub(r"^void ", "", name)
    return name[:90]


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own messages are not CSV
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "")
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        rows.append((short(r["Kernel Name"]), v * scale, r.get("Grid Size", ""), r.get("Block Size", "")))
    if not rows:
        print("no kernel durations in %s" % path)
        return 1
    total = sum(r[1] for r in rows)
    by = {}
    for name, us, grid, block in rows:
        e = by.setdefault(name, [0.0, 0, grid, block])
        e[0] += us
        e[1] += 1
    print("%d kernels, %.3f ms of GPU time in kernels (serialized by the profiler)" % (len(rows), total / 1e3))
    print("%9s %6s %6s %9s  %s" % ("ms", "%", "count", "us/each", "kernel (grid, block of one launch)"))
    for name, (us, n, grid, block) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
        print("%9.3f %5.1f%% %6d %9.1f  %s %s %s" % (us / 1e3, 100 * us / total, n, us / n, name, grid, block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
