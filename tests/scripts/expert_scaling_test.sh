#!/usr/bin/env bash
# bench/expert_scaling.sh against the real moecore (argument 1) on a small model: it reads both
# configurations' lines from `bench --versus` (A's, then B's), prints each round's steps and
# expert loads, and its table's medians are the medians of the pairs it printed.
set -euo pipefail
bin=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
fail() { echo "FAIL: $*"; echo "$out"; exit 1; }

# The script's model at 4,096 tokens a step (its steps print in ms: long enough to recompute
# their ratios from the printed values), one layer.
small="--set model.n_layers=1 --set train.batch_size=8 --set train.micro_batch_size=8"
out=$(ROUNDS=2 STEPS=3 WARMUP=1 EXPERTS="4 8" EXTRA="$small" bash "$root/bench/expert_scaling.sh" "$bin" 2>&1) ||
  fail "the script failed"

[ "$(grep -c '^round [12], 4 vs 8 experts: step [+-][0-9.]*% ' <<<"$out")" = 2 ] || fail "not two rounds of 4 vs 8"
# Each round: three steps of each size, one load per MoE layer of each (one layer here).
while read -r line; do
  [[ $line =~ ^steps\ \(s\):\ 4\ experts\ [0-9.]+\ [0-9.]+\ [0-9.]+\ \|\ 8\ experts\ [0-9.]+\ [0-9.]+\ [0-9.]+$ ]] ||
    fail "steps line: $line"
done < <(grep '^  steps (s): ' <<<"$out" | sed 's/^  //')
[ "$(grep -c '^  expert load (busiest / mean, per MoE layer): 4 experts [0-9.]* | 8 experts [0-9.]*$' <<<"$out")" = 2 ] ||
  fail "expert load lines"

# The table's full-step median is the median of the six pairs' changes, B / A - 1, from the steps
# the rounds printed (to the ms there: within 0.5 points at steps of 0.1 s or more).
want=$(grep '^  steps (s): ' <<<"$out" | sed 's/^  steps (s): 4 experts //; s/ | 8 experts / /' |
       awk '{for (i = 1; i <= 3; ++i) print 100 * ($(i + 3) / $i - 1)}' | sort -g |
       awk '{v[NR] = $1} END {print (v[3] + v[4]) / 2}')
row=$(grep '^| 8 | ' <<<"$out") || fail "no table row for 8 experts"
got=$(awk -F'|' '{print $6}' <<<"$row" | sed 's/%.*//; s/ //g')
awk -v a="$got" -v b="$want" 'BEGIN {exit !(a - b < 0.5 && b - a < 0.5)}' ||
  fail "full step median $got vs the printed pairs' $want"
grep -q '^median over all 6 pairs' <<<"$out" || fail "the pair count"
echo "ok: 2 rounds x 3 pairs, full-step median $got% (pairs' $want%)"
