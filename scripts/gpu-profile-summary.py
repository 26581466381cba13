#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (`ncu --csv --page raw --metrics gpu__time_duration.sum`) by kernel.

Prints the kernels' count and total time on the GPU, then one line per kernel name (template
arguments and parameter lists cut): launches, total milliseconds, share of the whole, and mean
microseconds, largest first. Lines that are not ncu's CSV (the program's own output) are skipped.

    python3 scripts/gpu-profile-summary.py ncu.csv [--top 30]
"""
import csv
import re
import sys
from collections import defaultdict


def main() -> int:
    args = sys.argv[1:]
    top = 30
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    lines = [l for l in open(args[0], errors="replace") if l.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        print(f"no kernels in {args[0]}")
        return 1
    header, units = rows[0], rows[1]
    name, dur = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}.get(units[dur].strip(), 1e-3)
    by = defaultdict(lambda: [0, 0.0])
    total = 0.0
    for r in rows[2:]:
        try:
            us = float(r[dur].replace(",", "")) * scale
        except (ValueError, IndexError):
            continue
        k = re.sub(r"^void ", "", re.sub(r"[<(].*", "", r[name])).strip() or r[name]
        by[k][0] += 1
        by[k][1] += us
        total += us
    count = sum(c for c, _ in by.values())
    print(f"{count} kernels, {total / 1e3:.2f} ms on the GPU, mean {total / max(count, 1):.2f} us")
    print(f"{'kernel':60} {'launches':>9} {'ms':>9} {'share':>6} {'mean us':>8}")
    for k, (c, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{k[:60]:60} {c:9d} {us / 1e3:9.2f} {100 * us / total:5.1f}% {us / c:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
