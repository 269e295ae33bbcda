#!/usr/bin/env python3
"""Per-kernel GPU time from an Nsight Compute CSV (ncu --metrics gpu__time_duration.sum --csv).

scripts/gpu_check.sh --profile runs ncu over a few training steps and prints this table: each
kernel's name (templates folded), launches, total and mean time, and share of all kernel time,
largest first. ncu serializes kernels, so the shares say where device time goes, not the overlap.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict

UNIT_NS = {"ns": 1.0, "nsecond": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}


def short_name(name: str, width: int) -> str:
    # Fold template arguments and parameter lists: "void f<a, b>(int)" -> "f<...>".
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            if depth == 0:
                out.append("<...>")
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    s = "".join(out)
    s = re.sub(r"\(.*$", "", s)
    s = re.sub(r"^void ", "", s).strip()
    return s if len(s) <= width else s[: width - 3] + "..."


def read(path: str):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own "==PROF==" lines around the CSV
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNIT_NS.get(r.get("Metric Unit", "ns").strip(), None)
        if unit is None:
            sys.exit(f"ncu_kernel_table: unknown time unit {r.get('Metric Unit')!r} in {path}")
        rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * unit))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("csv", help="ncu --csv output")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--steps", type=float, default=1.0, help="divide totals by this many steps")
    ap.add_argument("--width", type=int, default=70)
    a = ap.parse_args()
    rows = read(a.csv)
    if not rows:
        print(f"ncu_kernel_table: no gpu__time_duration.sum rows in {a.csv}", file=sys.stderr)
        return 1
    total = sum(t for _, t in rows)
    by = defaultdict(lambda: [0, 0.0])
    for name, t in rows:
        k = short_name(name, a.width)
        by[k][0] += 1
        by[k][1] += t
    print(f"{len(rows)} kernel launches, {total / 1e6 / a.steps:.2f} ms of kernel time per step ({a.steps:g} steps)")
    print(f"{'kernel':<{a.width}} | {'launches':>8} | {'ms/step':>8} | {'mean us':>8} | share")
    for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{k:<{a.width}} | {n / a.steps:8.1f} | {t / 1e6 / a.steps:8.2f} | {t / n / 1e3:8.1f} | {100 * t / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
