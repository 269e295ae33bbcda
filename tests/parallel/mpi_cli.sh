#!/bin/bash
# `mpirun moecore train` checks that cannot run in one process:
#  1. ranks given different settings (Open MPI's MPMD form, one app context per rank) or token
#     files with different contents under the same (relative) path refuse to train, naming the key
#     or file; only train.threads may differ;
#  2. with output redirected (Open MPI still hands each rank a pseudo-terminal) the log holds no
#     progress line and no terminal escape codes, unless train.progress = "on";
#  3. `mpirun moecore bench`: bytes sent per step, MFU against the ranks' summed peak.
# Usage: mpi_cli.sh MOECORE MPIEXEC
set -u
moecore=$1 mpiexec=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/a" "$dir/b"
head -c 60000 /dev/urandom | base64 > "$dir/text.txt"
"$moecore" prepare --input "$dir/text.txt" --out "$dir/a" > /dev/null || exit 1
cp "$dir/a/train.bin" "$dir/b/train.bin"
common=(--set data.train_path=train.bin --set data.valid_path= --set model.vocab_size=256
        --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=2
        --set model.num_experts=4 --set model.top_k=2 --set model.expert_hidden=32
        --set train.seq_len=32 --set train.batch_size=4 --set train.micro_batch_size=1 --set train.steps=12
        --set optim.warmup_steps=1 --set train.eval_every=0 --set checkpoint.at_end=false
        --set train.log_every=4 --set parallel.dp=2)
mpi=("$mpiexec" --allow-run-as-root --oversubscribe)
fail=0
check() {  # name, rc, expected exit (0|1), expected text or ""
  if [ "$2" -eq 124 ]; then echo "FAIL $1: hung"; cat "$dir/log"; fail=1; return; fi
  if { [ "$3" -eq 0 ] && [ "$2" -ne 0 ]; } || { [ "$3" -ne 0 ] && [ "$2" -eq 0 ]; }; then
    echo "FAIL $1: exit code $2, expected $3"; cat "$dir/log"; fail=1; return
  fi
  if [ -n "$4" ] && ! grep -qF -- "$4" "$dir/log"; then echo "FAIL $1: no '$4' in the output"; cat "$dir/log"; fail=1; return; fi
  echo "ok $1 (exit $2)${4:+: $(grep -m1 -F -- "$4" "$dir/log")}"
}
mpmd() {  # name, expected exit, expected text, rank-1 extra args...
  local name=$1 want=$2 text=$3; shift 3
  timeout 60 "${mpi[@]}" -np 1 -wdir "$dir/a" "$moecore" train "${common[@]}" --set train.out_dir="$dir/out_$name" \
    : -np 1 -wdir "$dir/b" "$moecore" train "${common[@]}" --set train.out_dir="$dir/out_$name" "$@" > "$dir/log" 2>&1
  check "$name" $? "$want" "$text"
}
mpmd same_config 0 ""
mpmd threads_differ 0 "" --set train.threads=1
mpmd lr_differs 1 "rank 1 runs with optim.lr = 0.002, rank 0 with 0.003" --set optim.lr=0.002
mpmd seed_differs 1 "rank 1 runs with train.seed = 7, rank 0 with 1234" --set train.seed=7
mpmd shape_differs 1 "rank 1 runs with model.d_model = 64, rank 0 with 32" --set model.d_model=64
# Same path and size, other contents (each rank reads its own working directory's train.bin):
# '!' is not in base64's alphabet, so the byte surely changes.
printf '!' | dd of="$dir/b/train.bin" bs=1 seek=100 conv=notrunc status=none
mpmd data_differs 1 "rank 1 runs with token file data.train_path[0] 'train.bin' = size" 
cp "$dir/a/train.bin" "$dir/b/train.bin"

# Progress line: redirected output under mpirun has none (auto), unless asked for.
cd "$dir/a"
timeout 60 "${mpi[@]}" -np 2 "$moecore" train "${common[@]}" --set train.out_dir="$dir/out_log" > "$dir/log" 2>&1
rc=$?
check no_progress_line $rc 0 "step 12/12"
if grep -q $'\r' "$dir/log" || grep -q $'\033' "$dir/log"; then
  echo "FAIL no_progress_line: carriage returns or escape codes in the redirected log"; cat -v "$dir/log"; fail=1
fi
timeout 60 "${mpi[@]}" -np 2 "$moecore" train "${common[@]}" --set train.out_dir="$dir/out_log2" \
  --set train.progress=on > "$dir/log" 2>&1
rc=$?
check progress_on $rc 0 "step 12/12"
if ! grep -q $'\r' "$dir/log"; then echo "FAIL progress_on: no progress line although train.progress = on"; fail=1; fi
# 3. `mpirun moecore bench`: the bytes sent per step are per step (the same for 2 timed steps as for
#    4), and MFU stays below 1 against the ranks' summed measured peak.
bench_mb() {  # timed steps -> "MB sent per step" of rank 0
  timeout 60 "${mpi[@]}" -np 2 "$moecore" bench --warmup 1 --steps "$1" "${common[@]}" > "$dir/log" 2>&1 || return 1
  sed -n 's/.*, \([0-9.]*\) MB sent per step by rank 0/\1/p' "$dir/log"
}
mb2=$(bench_mb 2) mb4=$(bench_mb 4)
if [ -z "$mb2" ] || [ "$mb2" != "$mb4" ] || [ "$mb2" = "0.00" ]; then
  echo "FAIL bench_bytes: MB sent per step $mb2 with 2 timed steps, $mb4 with 4"; cat "$dir/log"; fail=1
else
  echo "ok bench_bytes: $mb2 MB sent per step with 2 and with 4 timed steps"
fi
mfu=$(sed -n 's/.*  MFU: \([0-9.]*\)% of .*/\1/p' "$dir/log")
if ! grep -q "(measured: .* x 2 ranks (summed))" "$dir/log" || awk -v m="$mfu" 'BEGIN {exit !(m == "" || m + 0 > 100)}'; then
  echo "FAIL bench_mfu: MFU '$mfu' against $(grep -o 'of [0-9.]* GFLOP/s.*' "$dir/log")"; fail=1
else
  echo "ok bench_mfu: $mfu% $(grep -o 'of [0-9.]* GFLOP/s.*' "$dir/log")"
fi
exit $fail
