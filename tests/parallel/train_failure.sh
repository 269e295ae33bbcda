#!/bin/bash
# A failure on one rank of `mpirun moecore train` stops every rank promptly with that rank's
# message, and nothing hangs: an error thrown on rank 1, and a NaN on rank 1 only (the ranks must
# agree the step is non-finite). Usage: train_failure.sh MOECORE MPIEXEC
set -u
moecore=$1 mpiexec=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
head -c 120000 /dev/urandom | base64 > "$dir/text.txt"
"$moecore" prepare --input "$dir/text.txt" --out "$dir/data" > /dev/null || exit 1
args=(train --set data.train_path="$dir/data/train.bin" --set data.valid_path="$dir/no_validation.bin"
      --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=2
      --set model.num_experts=4 --set model.top_k=2 --set model.expert_hidden=32 --set model.shared_hidden=0
      --set train.seq_len=32 --set train.batch_size=4 --set train.micro_batch_size=1 --set train.steps=6
      --set optim.warmup_steps=1 --set train.eval_every=0 --set checkpoint.at_end=false
      --set train.out_dir="$dir/out" --set parallel.dp=2 --set train.threads=1)
fail=0
run_case() {  # fault, expected text
  local start end rc
  start=$(date +%s)
  MOE_INJECT_FAULT=$1 timeout 60 "$mpiexec" --allow-run-as-root --oversubscribe -np 2 "$moecore" "${args[@]}" \
    > "$dir/log" 2>&1
  rc=$?
  end=$(date +%s)
  if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then
    echo "FAIL $1: exit code $rc (0: no failure seen, 124: hung)"; cat "$dir/log"; fail=1; return
  fi
  if ! grep -q "$2" "$dir/log"; then echo "FAIL $1: no '$2' in the output"; cat "$dir/log"; fail=1; return; fi
  echo "ok $1: exit $rc after $((end - start)) s: $(grep -m1 "$2" "$dir/log")"
}
run_case "error@1:3" "error on rank 1: injected fault"
run_case "nan@1:2" "non-finite values at step 2"
exit $fail
