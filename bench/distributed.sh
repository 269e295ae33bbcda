#!/bin/bash
# Distributed measurements for docs/PERFORMANCE_HISTORY.md (2 ranks on this 2-core machine, 1 thread
# each, alternating variants within each round so VM drift hits all of them):
#   DDP: no overlap vs parallel.overlap_grad_reduce; EP=2 vs DP-only on the fine-grained config;
#   PP=2 bubble with 2 and 8 micro-batches. Prints each run's tokens/s, communication ms/step
#   (time blocked in collectives and send/recv, rank 0) and MB sent per step by rank 0.
# Usage: bench/distributed.sh [ROUNDS (2)]
set -eu
rounds=${1:-2}
bin=${MOECORE:-build/moecore}
run() {  # label, then moecore bench arguments
  local label=$1
  shift
  OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" bench --steps 8 --set train.threads=1 "$@" \
    > /tmp/moecore_dist_bench.txt
  local tps comm sent
  tps=$(awk '/tokens\/s \(median\)/ {print $3}' /tmp/moecore_dist_bench.txt)
  comm=$(awk '$1 == "communication" {print $2}' /tmp/moecore_dist_bench.txt)
  sent=$(awk '/MB sent per step/ {for (i = 1; i <= NF; ++i) if ($i == "MB") print $(i-1)}' /tmp/moecore_dist_bench.txt)
  printf '%-44s %8s tok/s  communication %8s ms/step  sent %8s MB/step\n' "$label" "$tps" "$comm" "$sent"
}
for r in $(seq "$rounds"); do
  echo "== round $r"
  run "default dp=2" --set parallel.dp=2
  run "default dp=2 overlap_grad_reduce" --set parallel.dp=2 --set parallel.overlap_grad_reduce=true
  run "default dp=2 zero1" --set parallel.dp=2 --set parallel.zero1=true
  run "fine_grained dp=2" --config configs/bench/fine_grained.toml --set parallel.dp=2
  run "fine_grained dp=2 ep=2" --config configs/bench/fine_grained.toml --set parallel.dp=2 --set parallel.ep=2
  run "default pp=2, 2 micro-batches" --set parallel.pp=2
  run "default pp=2, 8 micro-batches" --set parallel.pp=2 --set train.micro_batch_size=2
done
