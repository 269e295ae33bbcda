#!/bin/bash
# np=2 x 1 thread (data parallel) against np=1 x 2 threads on this machine, alternating A/B/A/B
# so drift in the shared VM hits both. Prints each run's median tokens/s and the speed-up.
# Usage: bench/ranks_vs_threads.sh [ROUNDS (3)] [extra --set overrides...]
set -eu
rounds=${1:-3}
shift || true
bin=${MOECORE:-build/moecore}
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2)
tps() { grep "tokens/s (median)" | awk '{print $3}'; }
a_all=() b_all=()
for r in $(seq "$rounds"); do
  a=$("$bin" bench --steps 8 --set train.threads=2 "$@" | tps)
  b=$(OMP_NUM_THREADS=1 "${mpi[@]}" "$bin" bench --steps 8 --set train.threads=1 --set parallel.dp=2 "$@" | tps)
  echo "round $r: np=1 x 2 threads ${a} tok/s | np=2 x 1 thread (dp=2) ${b} tok/s | ratio $(echo "scale=3; $b / $a" | bc)"
  a_all+=("$a") b_all+=("$b")
done
med() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
ma=$(med "${a_all[@]}") mb=$(med "${b_all[@]}")
echo "median: np=1x2 ${ma} tok/s, np=2x1 ${mb} tok/s, speed-up $(echo "scale=3; $mb / $ma" | bc)"
