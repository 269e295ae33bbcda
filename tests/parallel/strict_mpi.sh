#!/bin/bash
# Device discipline under mpirun: `moecore train` on the strict backend (memory the host cannot
# read; communication staged through counted host copies) against the cpu backend, for DP=2 with
# ZeRO-1, DP=2 with EP=2 (p2p and padded transports), PP=2 (plain and interleaved) and PP x DP x EP
# at 4 ranks. Each run: 6 steps with clipping, a
# skipped NaN step, evaluations, checkpoints; strict once more from its step-2 checkpoint with
# --resume. Every logged number (time and transfer fields aside) and every rank's final state
# file must be byte-identical, and a plain step of rank 0 must read the device exactly
# 1 + (MoE layers it holds x micro-batches, with EP) times: the step's statistics plus the expert
# exchange's count reads (none with parallel.ep_transport = padded).
# Usage: strict_mpi.sh MOECORE MPIEXEC
set -u
moecore=$1 mpiexec=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
head -c 60000 /dev/urandom | base64 > "$dir/text.txt"
"$moecore" prepare --input "$dir/text.txt" --out "$dir" > /dev/null || exit 1
common=(--set data.train_path="$dir/train.bin" --set data.valid_path="$dir/valid.bin" --set model.vocab_size=256
        --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=2
        --set model.num_experts=4 --set model.top_k=2 --set model.expert_hidden=16
        --set train.seq_len=24 --set train.batch_size=4 --set train.micro_batch_size=1 --set train.steps=6
        --set optim.warmup_steps=1 --set optim.max_grad_norm=0.05 --set train.on_nonfinite=skip
        --set train.eval_every=2 --set train.eval_batches=2 --set checkpoint.every=2 --set train.log_every=1
        --set train.threads=1)
mpi=("$mpiexec" --allow-run-as-root --oversubscribe -x MOE_INJECT_FAULT -x OMP_NUM_THREADS=1)
export MOE_INJECT_FAULT=nangrad@0:4
measured='"(elapsed_s|mfu|peak_rss_mb|peak_source|peak_tflops|pp_bubble_s|staged_to_device_bytes|staged_to_host_bytes|step_s|tflops|to_device|to_device_bytes|to_host|to_host_bytes|tokens_per_s)":[^,}]*'
fail=0
run() {  # out_dir, np, backend, extra args...
  local out=$1 np=$2 backend=$3; shift 3
  timeout 120 "${mpi[@]}" -np "$np" "$moecore" train "${common[@]}" --set train.backend="$backend" \
    --set train.out_dir="$out" "$@" > "$out.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { echo "FAIL: $backend run in $out exited $rc"; tail -20 "$out.log"; fail=1; }
  return $rc
}
layout() {  # name, np, expected device reads of a plain step on rank 0, layout args...
  local name=$1 np=$2 reads=$3; shift 3
  local a="$dir/$name.cpu" b="$dir/$name.strict"
  run "$a" "$np" cpu "$@" || return
  run "$b" "$np" strict "$@" || return
  for c in "$b"/checkpoints/*; do [ "$(basename "$c")" = step_00000002 ] || rm -rf "$c"; done
  run "$b" "$np" strict "$@" --resume || return
  grep -q "resumed from" "$b.log" || { echo "FAIL $name: the strict run did not resume"; fail=1; }
  if ! cmp -s <(sed -E "s/$measured//g" "$a/metrics.jsonl") <(sed -E "s/$measured//g" "$b/metrics.jsonl"); then
    echo "FAIL $name: metrics differ"; diff <(sed -E "s/$measured//g" "$a/metrics.jsonl") <(sed -E "s/$measured//g" "$b/metrics.jsonl") | head -6
    fail=1
  fi
  local last; last=$(basename "$(ls -d "$a"/checkpoints/step_* | tail -1)")
  for f in "$a/checkpoints/$last"/rank_*.safetensors; do
    cmp -s "$f" "$b/checkpoints/$last/$(basename "$f")" || { echo "FAIL $name: $(basename "$f") differs"; fail=1; }
  done
  local lines skipped clipped evals plain_ok
  lines=$(wc -l < "$b/metrics.jsonl"); skipped=$(grep -c '"skipped":true' "$b/metrics.jsonl")
  clipped=$(grep -c '"clipped":true' "$b/metrics.jsonl"); evals=$(grep -c '"valid_ce"' "$b/metrics.jsonl")
  plain_ok=$(grep -v '"skipped":true' "$b/metrics.jsonl" | grep -c "\"to_host\":$reads,")
  [ "$lines" -eq 6 ] && [ "$skipped" -eq 1 ] && [ "$clipped" -ge 3 ] && [ "$evals" -eq 3 ] ||
    { echo "FAIL $name: $lines steps, $skipped skipped, $clipped clipped, $evals evaluations"; fail=1; }
  [ "$plain_ok" -eq 5 ] || { echo "FAIL $name: $plain_ok of 5 plain steps read the device $reads times"; grep -o '"to_host":[0-9]*' "$b/metrics.jsonl"; fail=1; }
  echo "ok $name: strict = cpu bitwise ($lines steps, 1 skipped, $clipped clipped, $evals evaluations, resumed; $reads device reads per plain step)"
}
# micro-batches per rank: batch 4 / dp 2 / micro 1 = 2; MoE layers on rank 0: 2, or 1 with pp = 2.
layout dp2_zero1 2 1 --set parallel.dp=2 --set parallel.zero1=true
layout dp2_ep2 2 5 --set parallel.dp=2 --set parallel.ep=2
# The padded expert transport reads no routing count on the host: the statistics only.
layout dp2_ep2_padded 2 1 --set parallel.dp=2 --set parallel.ep=2 --set parallel.ep_transport=padded
layout pp2 2 1 --set parallel.pp=2
# Interleaved 1F1B: 4 layers in 2 chunks per stage, the same single read.
layout pp2_interleaved 2 1 --set parallel.pp=2 --set parallel.pp_interleave=2 --set model.n_layers=4
layout pp2_dp2_ep2 4 3 --set parallel.pp=2 --set parallel.dp=2 --set parallel.ep=2
exit $fail
