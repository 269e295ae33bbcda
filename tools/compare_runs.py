#!/usr/bin/env python3
"""Compares training runs window by window: the mean cross-entropy of every W-step window of each
run's metrics.jsonl against the first (baseline) run, and the largest relative difference.

    python3 tools/compare_runs.py runs/bf16 runs/mxfp8 runs/fp32 [--window 25] [--band 0.02]

Exits 1 when a window of a run differs from the baseline's by more than --band (relative)."""
import argparse
import json
import os
import sys


def windows(run_dir, window):
    ce = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                r = json.loads(line)
                ce[r["step"]] = float(r["ce"])
    steps = sorted(ce)
    out = []
    for start in range(0, len(steps) - window + 1, window):
        chunk = steps[start:start + window]
        out.append((chunk[0], chunk[-1], sum(ce[s] for s in chunk) / window))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--band", type=float, default=0.02)
    a = ap.parse_args()
    base = windows(a.runs[0], a.window)
    others = {r: windows(r, a.window) for r in a.runs[1:]}
    names = [os.path.basename(os.path.normpath(r)) for r in a.runs]
    print("| steps | " + " | ".join(names) + " | " + " | ".join(f"{n} vs {names[0]}" for n in names[1:]) + " |")
    print("|---" * (1 + len(names) + len(names) - 1) + "|")
    worst = {r: 0.0 for r in others}
    for i, (s0, s1, b) in enumerate(base):
        vals = [others[r][i][2] for r in others]
        rels = [(v - b) / b for v in vals]
        for r, rel in zip(others, rels):
            worst[r] = max(worst[r], abs(rel))
        print(f"| {s0}-{s1} | {b:.4f} | " + " | ".join(f"{v:.4f}" for v in vals) + " | " +
              " | ".join(f"{rel * 100:+.2f}%" for rel in rels) + " |")
    ok = True
    for r, w in worst.items():
        inside = w <= a.band
        ok &= inside
        print(f"{os.path.basename(os.path.normpath(r))}: largest window difference {w * 100:.2f}% "
              f"({'within' if inside else 'OUTSIDE'} the {a.band * 100:.0f}% band)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
