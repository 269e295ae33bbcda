#!/bin/bash
# Whether two moecore binaries train bit for bit alike: 23 small configurations (fp32, bf16, MXFP8;
# shared experts sum / v1 / gated; recompute; expert parallelism over the p2p and padded
# transports; two pipeline stages; dense layers mixed in), 4 steps each, on byte-level tokens of
# this repository's docs; prints each run's per-step loss / grad norm and the diff of the two
# sets (nothing but "same" when a change is meant to be bitwise-neutral).
# Usage: tools/same_losses.sh OLD_BINARY NEW_BINARY [WORKDIR]
set -euo pipefail
OLD=$(realpath "$1"); NEW=$(realpath "$2"); WORK=${3:-$(mktemp -d)}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$WORK/data"
cat README.md docs/*.md ARCHITECTURE.md > "$WORK/data/in.txt"
"$NEW" prepare --input "$WORK/data/in.txt" --out "$WORK/data" > /dev/null
BASE="--set model.vocab_size=256 --set model.d_model=64 --set model.n_layers=3 --set model.n_heads=4 --set model.n_kv_heads=2
 --set model.num_experts=8 --set model.top_k=2 --set model.expert_hidden=32 --set train.seq_len=32 --set train.batch_size=8
 --set train.micro_batch_size=2 --set optim.warmup_steps=1 --set train.eval_every=0 --set data.valid_path= --set train.threads=1
 --set train.log_every=1000 --set train.steps=4 --set data.train_path=$WORK/data/train.bin --set checkpoint.every=0"
OC3="--set model.dense_layers=1 --set model.dense_hidden=48 --set model.norm_placement=reordered --set model.embedding_norm=true
 --set model.qk_norm=per_head --set model.score_func=sigmoid --set model.norm_topk_prob=true --set model.shared_hidden=16
 --set model.shared_experts=2 --set model.shared_router=true --set model.shared_router_bias=true --set model.router_logit_bias=true"
SH="--set model.shared_hidden=32"; BF="--set train.precision=bf16"; MX="--set train.precision=mxfp8"; RC="--set train.recompute=true"
EP="--set parallel.dp=2 --set parallel.ep=2"; DENSE="--set model.dense_layers=1 --set model.dense_hidden=96"
MPI="mpirun --allow-run-as-root --oversubscribe -np 2"
VARIANTS=(
  "fp32|" "bf16|$BF" "bf16_shared|$SH $BF" "bf16_v1|$SH --set model.shared_merge=v1 $BF" "fp32_v1|$SH --set model.shared_merge=v1"
  "oc3_bf16|$OC3 $BF" "oc3_bf16_rc|$OC3 $BF $RC" "oc3_fp32|$OC3" "oc3_mx|$OC3 $MX" "mx|$MX --set mxfp8.attention=true"
  "oc3_fp32_rc|$OC3 $RC" "oc3_mx_rc|$OC3 $MX $RC" "dense_rc_bf16|$DENSE $SH --set model.shared_merge=v1 $BF $RC"
  "mpi:ep_bf16|$SH $BF $EP" "mpi:ep_v1_rc|$SH --set model.shared_merge=v1 $RC $BF $EP" "mpi:ep_oc3_bf16|$OC3 $BF $EP"
  "mpi:ep_oc3_mx|$OC3 $MX $EP" "mpi:ep_fp32_pad|$EP --set parallel.ep_transport=padded"
  "mpi:ep_bf16_pad_rc|$SH $BF $RC $EP --set parallel.ep_transport=padded" "mpi:pp2_bf16|--set model.n_layers=4 $SH $BF --set parallel.pp=2"
  "mpi:pp2_oc3_rc|$OC3 --set model.n_layers=4 $BF $RC --set parallel.pp=2" "mpi:mx_ep_nodispatch|$MX --set mxfp8.dispatch=false $EP"
  "mpi:ep_dense_rc|$DENSE $BF $RC $EP")
for tag in old new; do
  BIN=$([ $tag = old ] && echo "$OLD" || echo "$NEW"); rm -f "$WORK/$tag.txt"
  for v in "${VARIANTS[@]}"; do
    name=${v%%|*}; sets=${v#*|}; launcher=""
    if [[ $name == mpi:* ]]; then name=${name#mpi:}; launcher=$MPI; fi
    mkdir -p "$WORK/$tag"; out="$WORK/$tag/$name"; rm -rf "$out"
    # shellcheck disable=SC2086
    $launcher "$BIN" train --config configs/default.toml $BASE $sets --set train.out_dir="$out" > "$out.log" 2>&1 || echo "$tag $name: FAILED (see $out.log)"
    python3 -c "import json,sys; print('$name', ' '.join('%r/%r' % (r['loss'], r['grad_norm']) for r in map(json.loads, open('$out/metrics.jsonl'))))" \
      >> "$WORK/$tag.txt" 2>/dev/null || echo "$name missing" >> "$WORK/$tag.txt"
  done
done
if diff "$WORK/old.txt" "$WORK/new.txt"; then echo "same: ${#VARIANTS[@]} runs, every step's loss and grad norm"; fi
