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
# Each size is compared with the first in one process (`moecore bench --versus`): the two
# models' steps alternate (A B, B A, A B, ...), so each pair of steps runs seconds apart. Runs
# of each size minutes apart (this script until 2026-12-06) compared the shared VM's moments as
# much as the sizes: on the Emerald Rapids VM its speed drifted by a quarter in 5 minutes, and 10
# such rounds read 128 experts +6.7% by the best round, -1.2% by the median, -8.6% paired.
#
# Per pair of timed steps: B's time per token over A's, less one, by wall time and by CPU time
# (both threads' CPU seconds: robust to another process taking a core), for the full step and
# for forward+backward (each step less its optimizer phase: grad norm, clipping, AdamW, the part
# that grows with the total parameter count). ROUNDS processes per size (issue #30 asks at least
# 5 alternated rounds), STEPS timed pairs each: the median over every pair with its min .. max,
# and the spread of the rounds' own medians.
#
# The router's d_model x E is 2.6% of the 128-expert model's FLOPs here, about 14x its share in
# Olmo-core 3's published 8 -> 128 benchmark (d_model = expert_hidden = 4,096): EXTRA="--set
# model.expert_hidden=1024" brings it to 0.9% (12-14 s steps). Where a difference goes, op by op:
# the printed command with --ops (moecore bench --versus ... --ops). The table's last column
# divides those FLOPs out (time per model FLOP, `moecore bench`'s FLOPs per token of each size):
# what the larger expert count costs beyond the work it adds.
#
# usage: bench/expert_scaling.sh [moecore binary] ; env ROUNDS (5), STEPS (4), WARMUP (1),
#        PRECISION (fp32), EXPERTS ("8 32 64 128": the first is A), EXTRA (more --set flags)
set -euo pipefail
cd "$(dirname "$0")/.."
# Waiting threads sleep rather than spin, so CPU time counts work only (see the cpu columns).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
BIN=${1:-build/moecore}
ROUNDS=${ROUNDS:-5} STEPS=${STEPS:-4} WARMUP=${WARMUP:-1} PRECISION=${PRECISION:-fp32}
EXPERTS=${EXPERTS:-"8 32 64 128"}
common=(--config configs/bench/default.toml --warmup "$WARMUP" --steps "$STEPS"
        --set model.n_layers=2 --set model.d_model=256 --set model.n_heads=4 --set model.n_kv_heads=4
        --set model.top_k=4 --set model.expert_hidden=256
        --set train.seq_len=512 --set train.batch_size=128 --set train.micro_batch_size=32
        --set train.threads=2 --set "train.precision=$PRECISION")
# shellcheck disable=SC2206
common+=(${EXTRA:-})
first=${EXPERTS%% *}
echo "command: $BIN bench ${common[*]} --set model.num_experts=$first --versus model.num_experts=E"

# The n-th (1: A's, 2: B's) occurrence of a "NAME: v v v" line of the output.
values() { sed -n "s/^$2: //p" <<<"$1" | sed -n "$3p"; }
# Per pair: 100 * (b / a - 1), both the same tokens per step.
changes() { paste -d' ' <(tr ' ' '\n' <<<"$1" | grep .) <(tr ' ' '\n' <<<"$2" | grep .) |
            awk '{printf "%.3f ", 100 * ($2 / $1 - 1)}'; }
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
# "median% (min .. max)" of a list of changes
summary() {
  tr ' ' '\n' <<<"$1" | grep . | sort -g |
    awk -v m="$(median "$1")" 'NR == 1 {lo=$1} {hi=$1} END {printf "%+.1f%% (%+.1f .. %+.1f)", m, lo, hi}'
}
metrics=("step times (s)" "fwd+bwd times (s)" "cpu times (s)" "cpu fwd+bwd times (s)")
declare -A pairs round_medians best_a best_b load_a load_b rows flops
for ((r = 1; r <= ROUNDS; ++r)); do
  for e in ${EXPERTS#"$first"}; do
    out=$("$BIN" bench "${common[@]}" --set "model.num_experts=$first" --versus "model.num_experts=$e")
    tokens=$(sed -n 's/^precision [a-z0-9]*, \([0-9]*\) tokens\/step.*/\1/p' <<<"$out" | head -1)
    mb_tokens=$(sed -n 's/^precision .*(\([0-9]*\) x \([0-9]*\), micro-batch \([0-9]*\)).*/\2 \3/p' <<<"$out" |
                head -1 | awk '{print $1 * $2}')
    rows[$e]=$((mb_tokens * 4 / e)) rows[$first]=$((mb_tokens * 4 / first))
    line="round $r, $first vs $e experts:"
    for m in "${!metrics[@]}"; do
      a=$(values "$out" "${metrics[$m]}" 1) b=$(values "$out" "${metrics[$m]}" 2)
      c=$(changes "$a" "$b")
      pairs[$e,$m]+="$c " round_medians[$e,$m]+="$(median "$c") "
      line+=" ${metrics[$m]%% times*} $(summary "$c") |"
      if ((m == 0)); then  # the best step of each size (noise only ever adds time): tokens/s
        best_a[$e]+="$(tr ' ' '\n' <<<"$a" | grep . | sort -g | head -1 | awk -v t="$tokens" '{printf "%.0f", t / $1}') "
        best_b[$e]+="$(tr ' ' '\n' <<<"$b" | grep . | sort -g | head -1 | awk -v t="$tokens" '{printf "%.0f", t / $1}') "
      fi
    done
    # Model FLOPs per token of each (A's line, then B's): B's router does more.
    fl=$(sed -n 's/^model FLOPs\/token (causal): \([0-9.]*\) M$/\1/p' <<<"$out")
    flops[$first]=$(sed -n 1p <<<"$fl") flops[$e]=$(sed -n 2p <<<"$fl")
    loads=$(sed -n 's/^expert load ([^)]*): *\([0-9. ]*[0-9]\) *(.*/\1/p' <<<"$out")
    load_a[$e]=$(sed -n 1p <<<"$loads") load_b[$e]=$(sed -n 2p <<<"$loads")
    echo "$line"
    echo "  steps (s): $first experts $(values "$out" "step times (s)" 1) | $e experts $(values "$out" "step times (s)" 2)"
    echo "  expert load (busiest / mean, per MoE layer): $first experts ${load_a[$e]} | $e experts ${load_b[$e]}"
  done
done

# Per-token changes (%) as changes in time per FLOP: (1 + c) x fa / fb - 1.
changes_per_flop() {
  tr ' ' '\n' <<<"$1" | grep . | awk -v a="$2" -v b="$3" '{printf "%.3f ", 100 * ((1 + $1 / 100) * a / b - 1)}'
}
best() { tr ' ' '\n' <<<"$1" | grep . | sort -n | tail -1; }
# max - min of the rounds' medians, in points
spread() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk 'NR == 1 {lo=$1} {hi=$1} END {printf "%.1f", hi - lo}'; }
echo
echo "each size against $first experts in the same process, steps alternated; B / A - 1 in time per token:"
echo "median over all $((ROUNDS * STEPS)) pairs (min .. max); the rounds' medians spread over (max - min) points"
echo
echo "per FLOP: the same change in time per model FLOP (B's time per token x A's FLOPs per token / B's - 1),"
echo "what is left of it once the router's added FLOPs are paid for"
echo
echo "| experts | rows/expert (mean, per GEMM; at $first) | best tok/s, $first / E | fwd+bwd (wall) | full step (wall) | fwd+bwd (cpu) | full step (cpu) | rounds' spread, wall / cpu fwd+bwd | MFLOP/token, $first / E | fwd+bwd (wall) per FLOP |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for e in ${EXPERTS#"$first"}; do
  per_flop=$(changes_per_flop "${pairs[$e,1]}" "${flops[$first]}" "${flops[$e]}")
  echo "| $e | ${rows[$e]} (${rows[$first]}) | $(best "${best_a[$e]}") / $(best "${best_b[$e]}") |" \
       "$(summary "${pairs[$e,1]}") | $(summary "${pairs[$e,0]}") | $(summary "${pairs[$e,3]}") |" \
       "$(summary "${pairs[$e,2]}") | $(spread "${round_medians[$e,1]}") / $(spread "${round_medians[$e,3]}") |" \
       "${flops[$first]} / ${flops[$e]} | $(summary "$per_flop") |"
done
