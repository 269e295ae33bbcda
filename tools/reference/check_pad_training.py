"""Checks moecore's `model.pad_id` against transformers' `padding_idx`, over AdamW steps with weight decay.

1. A small OlmoeForCausalLM with pad_token_id = PAD (seeded init, which zeroes the padding row), saved with
   save_pretrained and imported with `moecore import-hf` (so both sides start from the same weights).
2. A token file with runs of PAD among random tokens; train.batch_size = the number of instances, so every
   step's global batch is the whole file (moecore shuffles the order, which changes neither the summed loss nor
   the gradient beyond rounding) and torch can take the same steps without knowing moecore's order.
3. `moecore train --set train.init_from=...`: constant LR, no warm-up, no clipping, no auxiliary losses, weight
   decay on every parameter (optim.no_decay_embeddings_norms = false), STEPS steps; then export-hf of the final
   checkpoint.
4. transformers: the same steps, labels = ids with PAD -> -100 (the model shifts them: a position whose next
   token is PAD carries no label, as moecore's loader does), torch.optim.AdamW on all parameters.
5. Compares the per-step cross-entropy, the padding row after STEPS steps (exactly 0 in both if it starts at 0;
   here it is set to non-zero values first, so only weight decay moves it: bitwise equal on both sides and to
   row * prod(1 - lr * wd)), its gradient (0 in transformers at every step), and every parameter.

usage: python tools/reference/check_pad_training.py --moecore build/moecore
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAD, VOCAB, SEQ, INSTANCES, STEPS, LR, WD = 3, 64, 32, 8, 6, 3e-3, 0.1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", default=os.path.join(ROOT, "build/moecore"))
    args = ap.parse_args()
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp()
    cfg = OlmoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=SEQ, pad_token_id=PAD, eos_token_id=None, bos_token_id=None,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, norm_topk_prob=False)
    model = OlmoeForCausalLM(cfg).float()
    assert model.model.embed_tokens.padding_idx == PAD
    assert torch.all(model.model.embed_tokens.weight[PAD] == 0), "transformers' init zeroes the padding row"
    with torch.no_grad():  # a non-zero padding row (as an imported checkpoint may have): weight decay shows
        model.model.embed_tokens.weight[PAD] = torch.linspace(-0.5, 0.5, 32)
    hf_dir = os.path.join(tmp, "hf")
    model.save_pretrained(hf_dir)
    params = os.path.join(tmp, "init.safetensors")
    subprocess.run([args.moecore, "import-hf", "--from", hf_dir, "--out", params], check=True, stdout=subprocess.DEVNULL)

    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, size=INSTANCES * SEQ).astype(np.uint16)
    ids[ids == PAD] = PAD + 1
    for start in rng.integers(0, INSTANCES * SEQ - 6, size=10):
        ids[start:start + rng.integers(1, 6)] = PAD
    data = os.path.join(tmp, "train.bin")
    ids.tofile(data)

    out = os.path.join(tmp, "run")
    sets = {"model.vocab_size": VOCAB, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
            "model.n_kv_heads": 2, "model.num_experts": 4, "model.top_k": 2, "model.expert_hidden": 16,
            "model.norm_eps": 1e-5, "model.pad_id": PAD, "model.max_position_embeddings": SEQ,
            "loss.lm_z_coef": 0, "loss.lbl_coef": 0, "loss.router_z_coef": 0,
            "optim.lr": LR, "optim.min_lr": LR, "optim.schedule": "constant", "optim.warmup_steps": 0,
            "optim.weight_decay": WD, "optim.no_decay_embeddings_norms": "false", "optim.max_grad_norm": 0,
            "optim.beta1": 0.9, "optim.beta2": 0.95, "optim.eps": 1e-8,
            "train.steps": STEPS, "train.seq_len": SEQ, "train.batch_size": INSTANCES,
            "train.micro_batch_size": INSTANCES, "train.threads": 1, "train.eval_every": 0,
            "data.train_path": data, "data.valid_path": "", "train.out_dir": out, "train.init_from": params}
    cmd = [args.moecore, "train"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    ours_ce = [json.loads(line)["ce"] for line in open(os.path.join(out, "metrics.jsonl"))]
    exported = os.path.join(tmp, "exported")
    subprocess.run([args.moecore, "export-hf", "--checkpoint", os.path.join(out, "checkpoints"), "--out", exported],
                   check=True, stdout=subprocess.DEVNULL)

    # transformers, the same steps on the whole file each step.
    x = torch.tensor(ids.astype(np.int64)).view(INSTANCES, SEQ)
    labels = x.clone()
    labels[labels == PAD] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    row = model.model.embed_tokens.weight[PAD].detach().clone()
    theirs_ce, ok = [], True
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        theirs_ce.append(loss.item())
        ok &= bool(torch.all(model.model.embed_tokens.weight.grad[PAD] == 0))
        opt.step()
        row = row * (1 - LR * WD)
    ce_rel = max(abs(a - b) / abs(b) for a, b in zip(ours_ce, theirs_ce))
    got = OlmoeForCausalLM.from_pretrained(exported, dtype=torch.float32)
    ours_row = got.model.embed_tokens.weight[PAD]
    theirs_row = model.model.embed_tokens.weight[PAD].detach()
    row_equal = torch.equal(ours_row, theirs_row)
    closed_form = (theirs_row - row).abs().max().item()
    sd_ours, sd_theirs = got.state_dict(), model.state_dict()
    worst = max(((sd_ours[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item() for k, v in sd_theirs.items())
    print(f"per-step CE, moecore vs transformers: max relative difference {ce_rel:.2e} "
          f"({', '.join(f'{a:.6f}/{b:.6f}' for a, b in zip(ours_ce, theirs_ce))})")
    print(f"padding row after {STEPS} AdamW steps (wd {WD}): moecore == transformers bitwise: {row_equal}; "
          f"transformers vs row * prod(1 - lr wd): max |diff| {closed_form:.1e}; grad of the row 0 at every step: {ok}")
    print(f"all parameters after {STEPS} steps: max relative difference {worst:.2e}")
    ok &= row_equal and ce_rel < 1e-5 and worst < 1e-3 and closed_form < 1e-7
    if not ok:
        sys.exit("check failed")
    print("ok")


if __name__ == "__main__":
    main()
