#!/usr/bin/env bash
# bench/expert_scaling.sh against the real moecore (argument 1) on a small model: it reads both
# configurations' lines from `bench --versus` (A's, then B's), prints each round's steps and
# expert loads, its table's medians are the medians of the pairs it printed, and its per-FLOP
# column is the fwd+bwd change with the larger router's FLOPs divided out (4 against 64 experts:
# 7.48 against 7.57 MFLOP per token, enough to tell the two columns apart).
set -euo pipefail
bin=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
fail() { echo "FAIL: $*"; echo "$out"; exit 1; }

# The script's model at 4,096 tokens a step (its steps print in ms: long enough to recompute
# their ratios from the printed values), one layer.
small="--set model.n_layers=1 --set train.batch_size=8 --set train.micro_batch_size=8"
out=$(ROUNDS=2 STEPS=3 WARMUP=1 EXPERTS="4 64" EXTRA="$small" bash "$root/bench/expert_scaling.sh" "$bin" 2>&1) ||
  fail "the script failed"

[ "$(grep -c '^round [12], 4 vs 64 experts: step [+-][0-9.]*% ' <<<"$out")" = 2 ] || fail "not two rounds of 4 vs 64"
# Each round: three steps of each size, one load per MoE layer of each (one layer here).
while read -r line; do
  [[ $line =~ ^steps\ \(s\):\ 4\ experts\ [0-9.]+\ [0-9.]+\ [0-9.]+\ \|\ 64\ experts\ [0-9.]+\ [0-9.]+\ [0-9.]+$ ]] ||
    fail "steps line: $line"
done < <(grep '^  steps (s): ' <<<"$out" | sed 's/^  //')
[ "$(grep -c '^  expert load (busiest / mean, per MoE layer): 4 experts [0-9.]* | 64 experts [0-9.]*$' <<<"$out")" = 2 ] ||
  fail "expert load lines"

# The table's full-step median is the median of the six pairs' changes, B / A - 1, from the steps
# the rounds printed (to the ms there: within 0.5 points at steps of 0.1 s or more).
want=$(grep '^  steps (s): ' <<<"$out" | sed 's/^  steps (s): 4 experts //; s/ | 64 experts / /' |
       awk '{for (i = 1; i <= 3; ++i) print 100 * ($(i + 3) / $i - 1)}' | sort -g |
       awk '{v[NR] = $1} END {print (v[3] + v[4]) / 2}')
row=$(grep '^| 64 | ' <<<"$out") || fail "no table row for 64 experts"
got=$(awk -F'|' '{print $6}' <<<"$row" | sed 's/%.*//; s/ //g')
awk -v a="$got" -v b="$want" 'BEGIN {exit !(a - b < 0.5 && b - a < 0.5)}' ||
  fail "full step median $got vs the printed pairs' $want"
grep -q '^median over all 6 pairs' <<<"$out" || fail "the pair count"
# The per-FLOP median is the fwd+bwd median scaled by A's FLOPs per token over B's (both from the
# row; each printed to 0.1 points, so within 0.15).
fa=$(awk -F'|' '{print $10}' <<<"$row" | awk -F/ '{print $1 + 0}') fb=$(awk -F'|' '{print $10}' <<<"$row" | awk -F/ '{print $2 + 0}')
[ "$(grep -c '^model FLOPs/token (causal): ' <<<"$out")" = 0 ] || fail "bench output leaked into the table"
fwd=$(awk -F'|' '{print $5}' <<<"$row" | sed 's/%.*//; s/ //g')
per_flop=$(awk -F'|' '{print $11}' <<<"$row" | sed 's/%.*//; s/ //g')
awk -v f="$fwd" -v p="$per_flop" -v a="$fa" -v b="$fb" \
  'BEGIN {w = 100 * ((1 + f / 100) * a / b - 1); exit !(a > 0 && b > 0 && p - w < 0.15 && w - p < 0.15)}' ||
  fail "per-FLOP median $per_flop vs fwd+bwd $fwd% at $fa / $fb MFLOP per token"
echo "ok: 2 rounds x 3 pairs, full-step median $got% (pairs' $want%), fwd+bwd $fwd% = $per_flop% per FLOP at $fa / $fb MFLOP per token"
