#!/usr/bin/env python3
"""Two builds side by side on a noisy machine: alternated rounds, paired, with their spread.

The 2-vCPU VMs we measure on drift by several percent within minutes (a binary can run 3-4%
slower than it did an hour before, a two-thread GEMM benchmark flips between two speeds for
minutes at a time). A change is judged by rounds that run the old and the new build back to back,
in ABBA order (each round reverses the order of the one before, so a steady drift cancels), each
round's new figure taken against the same round's old one.

Steps (default): BIN is a moecore; each run is `BIN bench --config CONFIG [--set K=V ...]`; per
round the step-time median, tokens/s and each phase's ms/step. Prints each round's change, the
median change and its spread, and each phase's median ms for both builds.

Kernels (--kernels FILTER): BIN is a kernels_bench; each run is `BIN --benchmark_filter=FILTER
--benchmark_repetitions=3`; per benchmark the GFLOP/s counter (or the real time where there is
none) of every repetition. Prints, per benchmark, the max and the median of each build and the
change of the median.

Usage: tools/ab_bench.py [--rounds N] [--config FILE] [--set K=V]... OLD NEW
       tools/ab_bench.py --kernels FILTER [--rounds N] OLD_KERNELS_BENCH NEW_KERNELS_BENCH
       tools/ab_bench.py --self-test
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ab_bench: {' '.join(cmd)} exited with {out.returncode}:\n{out.stderr[-2000:]}")
    return out.stdout + out.stderr


def parse_steps(text):
    """step median (s), tokens/s and {phase: ms/step} from `moecore bench` output."""
    step = re.search(r"^step time: median ([0-9.]+) s", text, re.M)
    tokens = re.search(r"^tokens/s \(median\): ([0-9.]+)", text, re.M)
    if not step or not tokens:
        sys.exit("ab_bench: no 'step time: median' / 'tokens/s (median)' line in moecore bench's output:\n" + text[-2000:])
    phases = {}
    table = text.split("phase breakdown", 1)[1] if "phase breakdown" in text else ""
    for m in re.finditer(r"^  ([a-z_]+)\s+([0-9.]+)\s+[0-9.]+", table, re.M):
        if m.group(1) != "phase":
            phases[m.group(1)] = float(m.group(2))
    return float(step.group(1)), float(tokens.group(1)), phases


def parse_kernels(text):
    """{benchmark: [figure per repetition]}: GFLOP/s where reported, else real time (lower is better)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"(BM_\S+?)(/real_time)?\s+([0-9.]+) (ns|us|ms|s)\s", line)
        if not m or re.search(r"_(mean|median|stddev|cv)\b", m.group(1)):
            continue
        g = re.search(r"GFLOP/s=([0-9.]+)", line)
        out.setdefault(m.group(1), []).append(("GFLOP/s", float(g.group(1))) if g else (m.group(4), float(m.group(3))))
    return out


def pct(new, old):
    return 100.0 * (new / old - 1.0)


def steps(args):
    bins = (args.old, args.new)
    rounds = ([], [])  # by position, not path: one build against itself is a noise measurement
    for r in range(args.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            cmd = [bins[i], "bench", "--config", args.config]
            for kv in args.set:
                cmd += ["--set", kv]
            rounds[i].append(parse_steps(run(cmd)))
        o, n = rounds[0][-1], rounds[1][-1]
        print(f"round {r + 1}: step {o[0]:.4f} -> {n[0]:.4f} s ({pct(n[0], o[0]):+.1f}%), "
              f"tokens/s {o[1]:.0f} -> {n[1]:.0f} ({pct(n[1], o[1]):+.1f}%)", flush=True)
    changes = [pct(n[1], o[1]) for o, n in zip(rounds[0], rounds[1])]
    print(f"tokens/s, paired by round: median {statistics.median(changes):+.1f}% "
          f"(rounds {min(changes):+.1f} .. {max(changes):+.1f}%), {args.rounds} rounds")
    phases = [p for p in rounds[0][0][2] if rounds[0][0][2][p] > 0.5]
    print(f"{'phase':14s} {'old ms':>9s} {'new ms':>9s} {'change':>8s}   (medians of the rounds)")
    for p in phases:
        o = statistics.median(x[2].get(p, 0.0) for x in rounds[0])
        n = statistics.median(x[2].get(p, 0.0) for x in rounds[1])
        print(f"{p:14s} {o:9.2f} {n:9.2f} {pct(n, o):+7.1f}%")


def kernels(args):
    bins = (args.old, args.new)
    res = ({}, {})  # by position, as in steps()
    for r in range(args.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            for name, vals in parse_kernels(run([bins[i], f"--benchmark_filter={args.kernels}", "--benchmark_repetitions=3"])).items():
                res[i].setdefault(name, []).extend(vals)
    names = [n for n in res[0] if n in res[1]]
    if not names:
        sys.exit(f"ab_bench: no benchmark matched {args.kernels!r} in both binaries")
    for name in names:
        unit = res[0][name][0][0]
        o = [v for _, v in res[0][name]]
        n = [v for _, v in res[1][name]]
        best = max if unit == "GFLOP/s" else min
        what = "" if unit == "GFLOP/s" else " (time: lower is better)"
        print(f"{name.replace('BM_', ''):64s} {unit}{what}: old best {best(o):9.2f} median {statistics.median(o):9.2f} | "
              f"new best {best(n):9.2f} median {statistics.median(n):9.2f} | median {pct(statistics.median(n), statistics.median(o)):+.1f}%")


FAKE_BENCH = """#!/bin/sh
# A stand-in for moecore bench: its step time is in the file beside it, <its name>.time.
t=$(cat "$(dirname "$0")/$(basename "$0").time")
echo "step time: median $t s, mean $t s"
echo "tokens/s (median): $(python3 -c "print(int(2048/$t))")"
echo "phase breakdown (mean per timed step, exclusive):"
echo "  phase          ms/step      %  cpu ms/step   allocs/step   GFLOP/s  % of peak"
echo "  attention       $(python3 -c "print($t*400)")    34.0       355.40       4672.00     361.4       62.5"
echo "  optimizer        18.89     3.6        38.12          0.00"
"""

FAKE_KERNELS = """#!/bin/sh
g=$(cat "$(dirname "$0")/$(basename "$0").gflops")
for i in 1 2 3; do
  echo "BM_GemmLinear/op:2/thr:2/real_time       2.00 ms       2.00 ms       100 GFLOP/s=$g/s"
  echo "BM_Other/real_time       3.00 ms       3.00 ms       100"
done
echo "BM_GemmLinear/op:2/thr:2/real_time_median       2.00 ms       2.00 ms       3 GFLOP/s=1/s"
"""


def self_test():
    """Fake builds with known figures: the tool must report the change they were given."""
    with tempfile.TemporaryDirectory() as d:
        def make(name, body, figure, ext):
            path = os.path.join(d, name)
            with open(path, "w") as f:
                f.write(body)
            os.chmod(path, 0o755)
            with open(f"{path}.{ext}", "w") as f:
                f.write(figure)
            return path
        old = make("old", FAKE_BENCH, "0.5", "time")
        new = make("new", FAKE_BENCH, "0.4", "time")
        me = os.path.abspath(__file__)
        out = run([sys.executable, me, "--rounds", "3", "--config", "x.toml", old, new])
        # 2048/0.5 = 4096 -> 2048/0.4 = 5120 tokens/s: +25.0%; attention 200 -> 160 ms: -20.0%.
        assert "median +25.0% (rounds +25.0 .. +25.0%), 3 rounds" in out, out
        assert re.search(r"attention\s+200.00\s+160.00\s+-20.0%", out), out
        # One build against itself (the same path twice) must still pair the round's two runs:
        # this one alternates 0.5 and 0.625 s, so the rounds are -20% and +25%.
        flip = make("flip", FAKE_BENCH.replace('t=$(cat', 'n=$(($(cat "$0.n" 2>/dev/null || echo 0) + 1)); echo $n > "$0.n"\n'
                                                 't=$([ $((n % 2)) = 1 ] && echo 0.5 || echo 0.625) #'), "", "time")
        out = run([sys.executable, me, "--rounds", "2", "--config", "x.toml", flip, flip])
        assert "(rounds -20.0 .. +25.0%), 2 rounds" in out, out
        ko = make("kold", FAKE_KERNELS, "400", "gflops")
        kn = make("knew", FAKE_KERNELS, "500", "gflops")
        out = run([sys.executable, me, "--kernels", "Gemm", "--rounds", "2", ko, kn])
        assert re.search(r"GemmLinear/op:2/thr:2 .*old best\s+400.00.*new best\s+500.00.*median \+25.0%", out), out
        assert re.search(r"Other .*ms \(time: lower is better\): .*median \+0.0%", out), out
    print("ab_bench self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", nargs="?")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--config", default="configs/bench/olmoe_compat.toml")
    ap.add_argument("--set", action="append", default=[], metavar="K=V")
    ap.add_argument("--kernels", metavar="FILTER", help="compare two kernels_bench binaries on this filter")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.old or not args.new or args.rounds < 1:
        ap.error("give the OLD and NEW binaries (and --rounds >= 1)")
    for b in (args.old, args.new):
        if not os.access(b, os.X_OK):
            ap.error(f"{b}: not an executable file")
    (kernels if args.kernels else steps)(args)


if __name__ == "__main__":
    main()
