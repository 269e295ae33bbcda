#!/usr/bin/env python
"""Writes the golden fixtures tests/golden/<name>.safetensors (see tools/reference/README.md).

Sources of truth:
- OLMoE configurations (pre-norm, qk_norm "full", softmax, no dense layers, no shared expert):
  logits and gradients from transformers' OlmoeForCausalLM (float64), cross-entropy from
  transformers' own `fixed_cross_entropy` (sum / num_items_in_batch), load-balancing and router
  z-losses from ai2-olmo-core's `olmo_core.nn.moe.loss` functions applied to the HF router logits,
  all backpropagated through the HF model. The 10 training steps also run on the HF model.
- Other configurations: the plain module tools/reference/moe_reference.py (which reproduces
  OlmoeForCausalLM in the OLMoE configuration; the difference is recorded in every fixture),
  with the same olmo-core loss functions.
The training loop (micro-batches, accumulation, torch.nn.utils.clip_grad_norm_, MODEL.md's LR
schedule, torch.optim.AdamW with weight-decay groups, loss-free bias update) is in this script.

- Olmo-core 3 configurations (tests/golden/olmo_core3/oc3_*.safetensors): ai2-olmo-core 3.0.0's
  own OLMoDDPModel built by tools/reference/olmo_core3.py (float64, CPU), its router's auxiliary
  losses and its cross_entropy_loss, cross-checked against its Olmo3MoeForCausalLM
  (olmo3moe_check.py) and against the plain module.

Usage: /path/to/venv/bin/python tools/reference/make_fixtures.py [--only NAME ...] [--out DIR]
(the oc3_* fixtures are written to DIR/olmo_core3/)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402
from hf_side import HFAdapter, PlainAdapter, hf_f64_patches  # noqa: E402
from fixture_io import self_test_file, versions, write_fixture  # noqa: E402
from fixture_catalog import (FIXTURES, GAP_ALL_MIN, GAP_STEP0_MIN, draw_inputs, init_bias,  # noqa: E402
                             init_params, make_batch, redraw_until_separated)
from fixture_training import run_training  # noqa: E402
from fixture_checks import (hf_stock_loss_check, hf_vs_plain, oc3_vs_plain_olmo3_peri,  # noqa: E402
                            olmo_core3_checks, olmo_core_dense_block_check, olmo_core_router_check,
                            roundtrip_check)


def model_json(cfg, source):
    """The model section: the fixtures from before the Olmo-core 3 options keep exactly their keys
    (the new fields are at their defaults there and are left out); oc3_* write every field."""
    return R.model_dict(cfg, with_new_fields=source == "olmo_core3")


# =========================================================================== main
def build_fixture(name, fx, shared_checks):
    cfg, lc, oc, tr, design = fx["model"], fx["loss"], fx["optim"], fx["train"], fx["design"]
    cfg.validate()
    P, bias0, ids, labels, n_redrawn = draw_inputs(fx)

    checks = OrderedDict()
    checks["embedding_rows_redrawn_for_routing_separation"] = n_redrawn
    if fx["source"] == "olmo_core3":
        rec = olmo_core3_checks(fx, P, bias0, ids, labels, checks, shared_checks)
    elif fx["source"] == "hf":
        with hf_f64_patches(True):
            adapter = HFAdapter(cfg, P)
            rec = run_training(adapter, fx, ids, labels, bias0, checks)
        checks["hf_vs_plain_this_config"], _ = hf_vs_plain(fx, P, ids, labels)
        checks.update(hf_stock_loss_check(fx, P, ids, labels))
    else:
        adapter = PlainAdapter(cfg, P)
        rec = run_training(adapter, fx, ids, labels, bias0, checks)
        checks["olmo_core_router_v2_vs_plain_step0"] = olmo_core_router_check(fx, P, bias0, ids)
        if cfg.n_dense_layers >= 1:
            checks["olmo_core_dense_block_vs_plain_layer0"] = olmo_core_dense_block_check(
                fx, P, ids)
    checks["plain_vs_OlmoeForCausalLM_olmoe_pre"] = shared_checks["plain_vs_hf"]
    if fx["source"] == "olmo_core3":
        checks["plain_vs_olmo_core3_olmo3_peri"] = shared_checks["plain_vs_oc3_olmo3_peri"]

    s0 = rec["step0"]
    mbs = tr.micro_batch_size
    M = tr.batch_size // mbs
    loss_tok = [int((labels[m * mbs:(m + 1) * mbs] >= 0).sum()) for m in range(M)]
    assert len(set(loss_tok)) == M, "micro-batches must have unequal loss tokens"
    zero = [dict(layer=L, expert=e) for L in cfg.moe_layers()
            for e in range(cfg.num_experts) if int(s0["counts"][L][e]) == 0]
    for L, e, _ in design["zero_experts"]:
        assert dict(layer=L, expert=e) in zero, ("designed zero expert got tokens", L, e)
    assert s0["min_gap"] >= GAP_STEP0_MIN, s0["min_gap"]
    assert min(rec["min_gap"]) > GAP_ALL_MIN, rec["min_gap"]
    clipped = [n + 1 for n, g in enumerate(rec["grad_norm"]) if g > oc.max_grad_norm]
    assert 1 in clipped, ("clipping must trigger at step 1", rec["grad_norm"][:3])
    checks["tokens_per_microbatch"] = [mbs * tr.seq_len] * M
    checks["loss_tokens_per_microbatch"] = loss_tok
    checks["zero_token_experts_step0"] = zero
    checks["zero_expert_design"] = [dict(layer=L, expert=e, router_weight_dim0=v,
                                         embed_offset_dim0=design["embed_offset"])
                                    for L, e, v in design["zero_experts"]]
    checks["step_counts"] = rec["counts"]
    checks["min_topk_gap_step0"] = s0["min_gap"]
    checks["min_topk_gap_per_step"] = rec["min_gap"]
    checks["min_topk_gap_all_steps"] = min(rec["min_gap"])
    checks["max_grad_norm"] = oc.max_grad_norm
    checks["grad_norm_pre_clip"] = rec["grad_norm"]
    checks["clipped_steps"] = clipped
    checks["clip_grad_norm_vs_sqrt_sumsq_max_abs"] = max(
        abs(a - b) for a, b in zip(rec["grad_norm"], rec["grad_norm_sumsq"]))
    checks["train_total"] = rec["total"]

    T = OrderedDict()
    for n, t in P.items():
        T["param." + n] = t
    if bias0 is not None:
        for L, b in bias0.items():
            T[f"router_bias.{L}"] = b
    T["ids"] = ids
    T["labels"] = labels
    T["step0.logits"] = s0["logits"]
    T["step0.ce"] = torch.tensor([s0["ce"]])
    T["step0.lm_z"] = torch.tensor([s0["lm_z"]])
    T["step0.total"] = torch.tensor([s0["total"]])
    T["step0.grad_norm"] = torch.tensor([rec["grad_norm"][0]])
    for L in cfg.moe_layers():
        T[f"step0.lbl.{L}"] = torch.tensor([s0["lbl"][L]])
        T[f"step0.router_z.{L}"] = torch.tensor([s0["rz"][L]])
        T[f"step0.counts.{L}"] = s0["counts"][L].to(torch.int32)
    for n, g in s0["grads"].items():
        T["step0.grad." + n] = g
    T["train.total"] = torch.tensor(rec["total"])
    T["train.ce"] = torch.tensor(rec["ce"])
    T["train.grad_norm"] = torch.tensor(rec["grad_norm"])
    T["train.lr"] = torch.tensor(rec["lr"])
    for n, t in rec["final_params"].items():
        T["final.param." + n] = t
    if rec["final_bias"] is not None:
        for L, b in rec["final_bias"].items():
            T[f"final.router_bias.{L}"] = b
    for n in R.param_shapes(cfg):  # sanity: all names present, shapes as in the table
        assert tuple(T["param." + n].shape) == R.param_shapes(cfg)[n]
        assert tuple(T["step0.grad." + n].shape) == R.param_shapes(cfg)[n]
        assert tuple(T["final.param." + n].shape) == R.param_shapes(cfg)[n]

    source = {
        "hf": "transformers OlmoeForCausalLM (float64; RMSNorm/router-softmax/RoPE float32 "
              "upcasts patched to keep float64) + olmo-core loss functions",
        "plain": "tools/reference/moe_reference.py (plain float64 module) + olmo-core loss "
                 "functions",
        "olmo_core3": "olmo_core3: ai2-olmo-core 3.0.0's own OLMoDDPModel (moe_fused_v2 blocks) "
                      "built by tools/reference/olmo_core3.py, float64 on CPU (only its GPU "
                      "plumbing replaced: TE permute/unpermute, grouped GEMM, streams; its "
                      "float32 casts keep float64), with its router's compute_aux_loss and its "
                      "cross_entropy_loss"}[fx["source"]]
    notes = dict(
        source=source,
        batches="the same batch (ids, labels) is used at every one of the 10 steps",
        layers="per-layer tensors (step0.lbl.L, step0.router_z.L, step0.counts.L, "
               "router_bias.L) are keyed by the model layer index L (MoE layers: %s)"
               % cfg.moe_layers(),
        step0="initial parameters, whole step (all micro-batches); grads accumulated over "
              "micro-batches BEFORE clipping; step0.grad_norm == train.grad_norm[0]",
        train="train.X[n-1] is optimizer step n (n = 1..10): total/ce/grad_norm measured on the "
              "parameters before step n, train.lr the LR used by step n; final.* after step 10",
        aux_normalization="step LBL / router z-loss = sum_m (T_m/T_step) X_m (MODEL.md); olmo-core "
                          "functions called with loss_div_factor = T_step (loss.aux_divisor = "
                          "labelled: T_step = the step's labelled tokens)"
                          + ("; olmo_core3: OLMoDDPModel.forward(loss_div_factor = T_step), so "
                             "its router's compute_aux_loss returns (T_m/T_step) X_m and attaches "
                             "lbl_coef x LBL + router_z_coef x z to the graph"
                             if fx["source"] == "olmo_core3" else ""),
        design=dict(design, zero_experts=[list(z) for z in design["zero_experts"]],
                    embedding_rows_redrawn=n_redrawn),
    )
    if fx["source"] == "olmo_core3":
        notes["olmo_core3"] = (
            "LM loss: Olmo-core's cross_entropy_loss (reduction sum, z multiplier 1) / labelled "
            "tokens of the step; LBL (local batch) and router z-loss: its MoERouterV2."
            "compute_aux_loss with loss_div_factor = all tokens of the step, or with loss.aux_divisor = "
            "labelled the step's labelled tokens as Olmo-core's train module passes, lb/z weights = lbl_coef / "
            "router_z_coef; the loss-free bias update is run_training's (float64), checked against "
            "Olmo-core's post_batch (checks). Plain-torch replacements of its GPU plumbing only; "
            "its float32 casts keep float64 (tools/reference/olmo_core3.py). None of "
            "make_fixtures' design requirements is relaxed.")
    loss_json = asdict(lc)
    if fx["source"] != "olmo_core3":  # fixtures from before the options keep their keys
        assert loss_json.pop("aux_divisor") == "tokens"
        assert loss_json.pop("lbl_granularity") == "local_batch"
    cfg_json = dict(model=model_json(cfg, fx["source"]), loss=loss_json, optim=asdict(oc),
                    train=asdict(tr))
    metadata = OrderedDict()
    metadata["format"] = "moecore-golden-v1"
    metadata["config"] = json.dumps(cfg_json)
    metadata["versions"] = json.dumps(versions())
    metadata["checks"] = json.dumps(checks)
    metadata["notes"] = json.dumps(notes)
    return T, dict(metadata), checks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "golden"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    # The plain module must reproduce OlmoeForCausalLM; computed once on olmoe_pre, recorded in
    # every fixture.
    fx0 = FIXTURES["olmoe_pre"]
    gen = torch.Generator().manual_seed(fx0["design"]["seed"])
    P0 = init_params(fx0["model"], fx0["design"], gen)
    init_bias(fx0["model"], fx0["design"], gen)
    ids0, labels0 = make_batch(fx0["model"], fx0["train"], fx0["design"], gen)
    redraw_until_separated(fx0["model"], fx0["design"], P0, None, ids0, gen)
    plain_vs_hf, _ = hf_vs_plain(fx0, P0, ids0, labels0)
    print("plain vs HF (olmoe_pre):", json.dumps(plain_vs_hf, indent=1))
    shared = dict(plain_vs_hf=plain_vs_hf)
    chosen = [n for n in FIXTURES if not args.only or n in args.only]
    if any(FIXTURES[n]["source"] == "olmo_core3" for n in chosen):
        shared["plain_vs_oc3_olmo3_peri"] = oc3_vs_plain_olmo3_peri()
        print("plain vs Olmo-core 3 (olmo3_peri):", json.dumps(shared["plain_vs_oc3_olmo3_peri"]))

    total = dict(legacy=0, olmo_core3=0)
    for name in chosen:
        fx = FIXTURES[name]
        T, meta, checks = build_fixture(name, fx, shared)
        group = "olmo_core3" if fx["source"] == "olmo_core3" else "legacy"
        out_dir = os.path.join(args.out, "olmo_core3") if group == "olmo_core3" else args.out
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, name + ".safetensors")
        arrays = write_fixture(path, T, meta)
        n = self_test_file(path, arrays, meta)
        rt = roundtrip_check(path)
        print(f"{name}: roundtrip (plain module rerun from the file) max diffs {rt}")
        assert max(rt.values()) < 1e-10, rt
        size = os.path.getsize(path)
        total[group] += size
        print(f"{name}: {n} tensors, {size} bytes -> {path}")
        print(json.dumps(checks, indent=1)[:6000])
    print("total bytes", total)
    assert total["legacy"] < 5 * 1024 * 1024
    assert total["olmo_core3"] <= 3 * 1000 * 1000


if __name__ == "__main__":
    main()