#!/usr/bin/env bash
# The bench configs (configs/bench/*.toml) x routing (learned, random) x precision (fp32, bf16):
# tokens/s and MFU (medians over ROUNDS; the runs of one round go through the whole matrix, so
# drift in the shared VM hits every cell alike), the CPU-time rate (2 x tokens / CPU seconds:
# what a quiet machine's wall rate would be), and peak RSS (VmHWM) against the closed-form
# memory estimate of `moecore config` (issue #5: within 10%).
#
# usage: bench/bench_matrix.sh [moecore binary]; env ROUNDS (2), STEPS (8), WARMUP (3),
#        CONFIGS ("default olmoe_compat fine_grained"), ROUTING ("learned random"),
#        PRECISIONS ("fp32 bf16"), WAIT (passive)
# WAIT=passive: waiting OpenMP threads sleep, so the CPU-time rate counts work only; but waking
# them costs wall time on small steps (the default config's ~0.3 s step runs hundreds of
# parallel regions). WAIT=default leaves the runtime's own policy (spin, then sleep), which is
# what `moecore train` runs with: the wall-clock numbers to quote; its CPU time counts spinning.
set -euo pipefail
cd "$(dirname "$0")/.."
WAIT=${WAIT:-passive}
if [[ $WAIT == default ]]; then unset OMP_WAIT_POLICY; else export OMP_WAIT_POLICY=$WAIT; fi
BIN=${1:-build/moecore}
ROUNDS=${ROUNDS:-2} STEPS=${STEPS:-8} WARMUP=${WARMUP:-3}
CONFIGS=${CONFIGS:-"default olmoe_compat fine_grained"}
ROUTING=${ROUTING:-"learned random"}
PRECISIONS=${PRECISIONS:-"fp32 bf16"}
declare -A tps mfu cpu rss est
med() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
for ((r = 1; r <= ROUNDS; ++r)); do
  for c in $CONFIGS; do
    for rt in $ROUTING; do
      for p in $PRECISIONS; do
        key="$c $rt $p"
        args=(--config "configs/bench/$c.toml" --set "model.routing=$rt" --set "train.precision=$p")
        out=$("$BIN" bench "${args[@]}" --warmup "$WARMUP" --steps "$STEPS")
        tokens=$(sed -n 's/^precision [a-z0-9]*, \([0-9]*\) tokens\/step.*/\1/p' <<<"$out")
        t=$(sed -n 's/^tokens\/s (median): //p' <<<"$out")
        m=$(sed -n 's/.*MFU: \([0-9.]*\)%.*/\1/p' <<<"$out")
        cpus=$(sed -n 's/^cpu times (s): //p' <<<"$out")
        cr=$(awk -v t="$tokens" -v c="$(med "$cpus")" 'BEGIN {printf "%.0f", 2 * t / c}')
        mib=$(sed -n 's/^peak RSS: \([0-9.]*\) MiB/\1/p' <<<"$out")
        echo "round $r $key: $t tok/s, MFU $m%, cpu rate $cr tok/s, peak RSS $mib MiB"
        tps[$key]+="$t " mfu[$key]+="$m " cpu[$key]+="$cr " rss[$key]+="$mib "
        if [[ $r == 1 ]]; then
          bytes=$("$BIN" config "${args[@]}" | sed -n 's/^# memory total *\([0-9]*\) bytes.*/\1/p')
          est[$key]=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
        fi
      done
    done
  done
done
echo
echo "| config | routing | precision | tokens/s | MFU | CPU-time rate | peak RSS MiB | estimate MiB | RSS / estimate |"
echo "|---|---|---|---|---|---|---|---|---|"
for c in $CONFIGS; do
  for rt in $ROUTING; do
    for p in $PRECISIONS; do
      key="$c $rt $p"
      m_rss=$(med "${rss[$key]}")
      ratio=$(awk -v a="$m_rss" -v b="${est[$key]}" 'BEGIN {printf "%+.1f%%", 100 * (a / b - 1)}')
      echo "| $c | $rt | $p | $(med "${tps[$key]}") | $(med "${mfu[$key]}")% | $(med "${cpu[$key]}") | $m_rss | ${est[$key]} | $ratio |"
    done
  done
done
