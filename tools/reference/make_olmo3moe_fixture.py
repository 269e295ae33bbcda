"""An Olmo-core 3 model in its own Hugging Face format, for moecore's olmo3moe import and export
tests (tests/golden/hf/olmo3moe/ and tests/golden/hf/olmo3moe_expected.safetensors).

The model is Olmo-core 3.0.0's `OLMoDDPModel` (tools/reference/olmo_core3.py) with the production
block (reordered norms, per-head QK-norm, embed_scale = sqrt(d), embedding norm,
restore_weight_scale) plus what olmo3moe carries beyond it (p = 2 weight norm, sigmoid gating,
original_num_experts_per_tok, a shared expert, a dense layer at index 1, sliding windows on
alternate layers). Its weights go through Olmo-core's own converter
`convert_olmo3moe_state_to_hf` into `Olmo3MoeForCausalLM`, which `save_pretrained` writes in float32
(Olmo-core's `save_hf_model` cannot save a dense layer at index 1: see olmo3moe_check.py). A small
word-level tokenizer is saved beside it (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) so the import can carry it.

Recorded (float64): Olmo3MoeForCausalLM's logits on a batch (the saved float32 weights, computed
in float64), and Olmo-core's own training losses for 3 AdamW steps on that batch (its model in
float64, the auxiliary losses divided by the labelled tokens as its train module does).

Usage: python make_olmo3moe_fixture.py [--out tests/golden/hf]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections import OrderedDict
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402
import fixture_catalog as FC  # noqa: E402  (sets 1 thread, default dtype float64)
import fixture_training as FT  # noqa: E402
import olmo_core3 as OC  # noqa: E402
import olmo3moe_check as O3  # noqa: E402
from fixture_io import write_fixture  # noqa: E402

F64 = torch.float64

CFG = FC.oc3_model(vocab_size=64, d_model=32, n_layers=3, norm_placement="reordered", qk_norm="per_head",
                   embed_scale=math.sqrt(32.0), embedding_norm=True, score_func="sigmoid", sigmoid_eps=1e-7,
                   norm_topk_prob=True, norm_topk_p=2.0, restore_weight_scale=True, top_k=2, original_top_k=4,
                   shared_hidden=8, dense_layers="1", dense_hidden=16, sliding_window="12,-1",
                   sliding_window_full_first=False, sliding_window_full_last=False)
LOSS = R.LossConfig(lm_z_coef=0.0, lbl_coef=0.05, router_z_coef=0.005, aux_divisor="labelled")
OPTIM = FC.optim(max_grad_norm=1.0)
TRAIN = R.TrainConfig(steps=3, seq_len=32, batch_size=4, micro_batch_size=2)
DESIGN = dict(seed=8008, embed_std=1.0, embed_offset=3.0, router_std=0.3, zero_experts=[], final_norm_scale=1.0,
              out_norm_scale=0.04, bias_std=0.0, masked=(3, 5))


def save_tokenizer(out_dir, vocab_size):
    """A word-level tokenizer over the ids 0..V-1 ("t0" ... ), eos = the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="t0")
    fast.save_pretrained(out_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "golden", "hf"))
    args = ap.parse_args()
    torch.set_default_dtype(F64)
    cfg = CFG
    cfg.validate()
    fx = dict(model=cfg, loss=LOSS, optim=OPTIM, train=TRAIN, design=DESIGN, source="olmo_core3")
    gen = torch.Generator().manual_seed(DESIGN["seed"])
    torch.manual_seed(DESIGN["seed"])
    P = FC.init_params(cfg, DESIGN, gen)
    ids, labels = FC.make_batch(cfg, TRAIN, DESIGN, gen)
    FC.redraw_until_separated(cfg, DESIGN, P, None, ids, gen)
    # The weights as the saved float32 file holds them: every check below starts from those.
    P = OrderedDict((n, t.to(torch.float32).to(F64)) for n, t in P.items())

    # Olmo-core 3's model -> its converter -> Olmo3MoeForCausalLM -> save_pretrained (float32).
    ocm = OC.build_model(cfg, TRAIN.seq_len)
    OC.load_params(ocm, cfg, P)
    hf, hc = O3.build_hf(cfg, ocm, TRAIN.seq_len)
    hc.eos_token_id = cfg.vocab_size - 1
    hc.pad_token_id = None
    folder = os.path.join(args.out, "olmo3moe")
    shutil.rmtree(folder, ignore_errors=True)
    hf32 = O3.build_hf(cfg, ocm, TRAIN.seq_len)[0].to(torch.float32)
    hf32.config.eos_token_id = cfg.vocab_size - 1
    hf32.config.pad_token_id = None
    hf32.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder, cfg.vocab_size)

    # Olmo3MoeForCausalLM's logits (float64 arithmetic on the saved weights).
    with O3.hf_patches(), torch.no_grad():
        logits = hf(input_ids=ids[:TRAIN.micro_batch_size].long(), use_cache=False).logits
    # The same model reloaded from the folder gives the same logits (what was saved is what ran).
    from olmo_core.nn.moe.v2.hf.modeling_olmo3moe import Olmo3MoeForCausalLM
    back = Olmo3MoeForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(F64)
    back.model.rotary_embs.inv_freq = hf.model.rotary_embs.inv_freq
    with O3.hf_patches(), torch.no_grad():
        again = back(input_ids=ids[:TRAIN.micro_batch_size].long(), use_cache=False).logits
    reload_rel = float((again - logits).abs().max() / logits.abs().max())
    assert reload_rel <= 1e-12, reload_rel

    # Olmo-core's own 3 training steps from these weights.
    n_loss = int((labels >= 0).sum())
    adapter = OC.OlmoCore3Adapter(cfg, P, LOSS.lbl_coef, LOSS.router_z_coef, n_loss, TRAIN.seq_len)
    rec = FT.run_training(adapter, fx, ids, labels, None)
    print("Olmo-core 3 losses:", rec["total"], "ce:", rec["ce"])

    T = OrderedDict()
    T["ids"] = ids.to(torch.int32)
    T["labels"] = labels.to(torch.int32)
    T["logits"] = logits.reshape(-1, cfg.vocab_size)
    T["train.total"] = torch.tensor(rec["total"], dtype=F64)
    T["train.ce"] = torch.tensor(rec["ce"], dtype=F64)
    loss_json = asdict(LOSS)
    meta = OrderedDict(
        format="moecore-olmo3moe-expected-v1",
        config=json.dumps(dict(loss=loss_json, optim=asdict(OPTIM), train=asdict(TRAIN))),
        notes=("logits: Olmo3MoeForCausalLM on ids[:micro_batch_size] (float64 arithmetic on the saved float32 "
               "weights); train.*: Olmo-core 3's OLMoDDPModel in float64 from those weights, run_training of "
               "make_fixtures.py (train.X[n-1] = step n, measured before the update); reload check "
               f"{reload_rel:.1e}"),
        model=json.dumps(R.model_dict(cfg)))
    path = os.path.join(args.out, "olmo3moe_expected.safetensors")
    write_fixture(path, T, meta)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) + os.path.getsize(path)
    print(f"wrote {folder} and {path}: {size} bytes")


if __name__ == "__main__":
    main()
