#!/usr/bin/env bash
# Expert scaling at constant active parameters (issue #5): top-4 routing, experts in
# {8, 32, 64, 128}, every expert of the same width (so top_k x expert_hidden, the active expert
# parameters per token, is fixed; only the router's d_model x E grows, +2.8% active matmul
# parameters from 8 to 128 experts). 65,536 tokens per step (128 x 512) in micro-batches of
# 32 x 512 = 16,384 tokens, so each grouped GEMM sees 16,384 x 4 / E rows per expert on average:
# 512 at 128 experts, 8,192 at 8. The model is small (2 layers, d_model 256, expert_hidden 256,
# byte vocabulary) so a 65k-token step takes seconds on 2 cores; the experts are ~75% of its FLOPs.
# Those are means: the learned router leaves each size its own load, which the script prints (the
# busiest expert's tokens over the mean, per MoE layer: 1.3-1.5 at 8 experts, 3-10 at 128 on the
# bench's random ids, Emerald Rapids, 2026-12-06).
#
# Full step = the best (shortest) step of `moecore bench`; forward+backward = the best of its
# "fwd+bwd times" (each step less its optimizer phase: grad norm, clipping, AdamW, bf16 refresh,
# the part that grows with the total parameter count). Best, not median: the VM is shared and
# noise only ever adds time. The same from bench's CPU times. Rounds run the sizes in turn, every
# other round in reverse (8, 32, 64, 128, 128, 64, 32, 8, 8, ...), so that a machine whose speed
# drifts through the run (a quarter in 5 minutes, seen on the Emerald Rapids VM) does not favour
# the size that runs first.
#
# Then the same from the median round, with the spread of the rounds, and each round paired with
# the same round's first size (issue #30 asks at least 5 alternated rounds: ROUNDS=5 EXPERTS="8 128").
#
# usage: bench/expert_scaling.sh [moecore binary] ; env ROUNDS (1), STEPS (2), WARMUP (1),
#        PRECISION (fp32), EXPERTS ("8 32 64 128"), EXTRA (more --set flags)
set -euo pipefail
cd "$(dirname "$0")/.."
# Waiting threads sleep rather than spin, so CPU time counts work only (see the cpu columns).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
BIN=${1:-build/moecore}
ROUNDS=${ROUNDS:-1} STEPS=${STEPS:-2} WARMUP=${WARMUP:-1} PRECISION=${PRECISION:-fp32}
EXPERTS=${EXPERTS:-"8 32 64 128"}
common=(--config configs/bench/default.toml --warmup "$WARMUP" --steps "$STEPS"
        --set model.n_layers=2 --set model.d_model=256 --set model.n_heads=4 --set model.n_kv_heads=4
        --set model.top_k=4 --set model.expert_hidden=256
        --set train.seq_len=512 --set train.batch_size=128 --set train.micro_batch_size=32
        --set train.threads=2 --set "train.precision=$PRECISION")
# shellcheck disable=SC2206
common+=(${EXTRA:-})
echo "command: $BIN bench ${common[*]} --set model.num_experts=E"
declare -A full fb cfull cfb rows load
for ((r = 1; r <= ROUNDS; ++r)); do
  order=$EXPERTS
  ((r % 2 == 0)) && order=$(tr ' ' '\n' <<<"$EXPERTS" | tac | tr '\n' ' ')
  for e in $order; do
    out=$("$BIN" bench "${common[@]}" --set "model.num_experts=$e")
    tokens=$(sed -n 's/^precision [a-z0-9]*, \([0-9]*\) tokens\/step.*/\1/p' <<<"$out")
    mb_tokens=$(sed -n 's/^precision .*(\([0-9]*\) x \([0-9]*\), micro-batch \([0-9]*\)).*/\2 \3/p' <<<"$out" |
                awk '{print $1 * $2}')
    rows[$e]=$((mb_tokens * 4 / e))
    steps=$(sed -n 's/^step times (s): //p' <<<"$out")
    fbs=$(sed -n 's/^fwd+bwd times (s): //p' <<<"$out")
    # Best step of the run: on the shared machine noise only ever adds time.
    f=$(tr ' ' '\n' <<<"$steps" | sort -g | head -1 | awk -v t="$tokens" '{printf "%.0f", t / $1}')
    b=$(tr ' ' '\n' <<<"$fbs" | sort -g | head -1 | awk -v t="$tokens" '{printf "%.0f", t / $1}')
    cpu=$(sed -n 's/^cpu times (s): //p' <<<"$out")
    cfbs=$(sed -n 's/^cpu fwd+bwd times (s): //p' <<<"$out")
    # CPU-time throughput: tokens per (CPU seconds / 2 threads), the wall rate of a quiet machine.
    cf=$(tr ' ' '\n' <<<"$cpu" | sort -g | head -1 | awk -v t="$tokens" '{printf "%.0f", 2 * t / $1}')
    cb=$(tr ' ' '\n' <<<"$cfbs" | sort -g | head -1 | awk -v t="$tokens" '{printf "%.0f", 2 * t / $1}')
    # The load the grouped GEMMs ran on (per MoE layer, the busiest expert's tokens over the mean).
    load[$e]=$(sed -n 's/^expert load ([^)]*):\([0-9. ]*\)(.*/\1/p' <<<"$out" | xargs)
    echo "round $r E=$e: steps (s) $steps | fwd+bwd (s) $fbs | cpu (s) $cpu | cpu fwd+bwd (s) $cfbs | expert load ${load[$e]}"
    echo "  best wall: full step $f tok/s, fwd+bwd $b tok/s; best cpu: full step $cf tok/s, fwd+bwd $cb tok/s"
    full[$e]+="$f " fb[$e]+="$b " cfull[$e]+="$cf " cfb[$e]+="$cb "
  done
done
# Best round per size, relative to 8 experts: by wall time, and by CPU time (2 x tokens / CPU
# seconds of both threads: what a quiet machine's wall rate would be, robust to other
# processes taking the cores; imbalance between the two threads does not show in it).
best() { tr ' ' '\n' <<<"$1" | sort -n | tail -1; }
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
# max - min over the rounds, as a percentage of the median
spread() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk -v m="$(median "$1")" 'NR == 1 {lo=$1} {hi=$1} END {printf "%.1f", 100 * (hi - lo) / m}'; }
first=${EXPERTS%% *}
# One table cell of a size's rounds ($2) against the first size's ($3): `best` or `median` (the
# rate and its change; the median with the rounds' spread), or `paired`: each round against the
# same round's first size (the two ran minutes apart, so a drifting machine moves both), the
# median of those changes and their range.
cell() {
  if [[ $1 == paired ]]; then
    local changes
    changes=$(paste -d' ' <(tr ' ' '\n' <<<"$2" | grep .) <(tr ' ' '\n' <<<"$3" | grep .) |
              awk '{printf "%.2f ", 100 * ($1 / $2 - 1)}')
    tr ' ' '\n' <<<"$changes" | grep . | sort -g | awk -v m="$(median "$changes")" \
      'NR == 1 {lo=$1} {hi=$1} END {printf " %+.1f%% (%+.1f .. %+.1f) |", m, lo, hi}'
  else
    local sp=""
    [[ $1 == median ]] && sp=" ($(spread "$2")%)"
    awk -v v="$("$1" "$2")" -v v0="$("$1" "$3")" -v sp="$sp" 'BEGIN {printf " %d%s | %+.1f%% |", v, sp, 100 * (v / v0 - 1)}'
  fi
}
table() {
  if [[ $1 == paired ]]; then
    echo "| experts | rows/expert (mean, per GEMM) | fwd+bwd (wall) | full step (wall) | fwd+bwd (cpu) | full step (cpu) |"
    echo "|---|---|---|---|---|---|"
  else
    echo "| experts | rows/expert (mean, per GEMM) | fwd+bwd tok/s (wall) | vs $first | full step (wall) | vs $first | fwd+bwd (cpu) | vs $first | full step (cpu) | vs $first |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
  fi
  for e in $EXPERTS; do
    row="| $e | ${rows[$e]} |"
    for m in fb full cfb cfull; do
      declare -n arr=$m
      row+=$(cell "$1" "${arr[$e]}" "${arr[$first]}")
    done
    echo "$row"
  done
}
echo
echo "expert load of each size's last round (per MoE layer, the busiest expert's tokens over the mean; 1 is even):"
for e in $EXPERTS; do echo "  E=$e: ${load[$e]}"; done
echo
table best
echo
echo "median of $ROUNDS rounds (spread: max - min, % of the median):"
table median
echo
echo "paired by round, change against $first (median, min .. max over $ROUNDS rounds):"
table paired
