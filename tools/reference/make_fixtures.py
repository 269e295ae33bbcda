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
import contextlib
import json
import math
import os
import platform
import struct
import sys
from collections import OrderedDict
from dataclasses import asdict
from importlib.metadata import version as pkg_version

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402
from hf_side import HFAdapter, PlainAdapter, hf_f64_patches, hf_supported  # noqa: E402
from fixture_io import read_safetensors_plain, self_test_file, to_np, versions, write_fixture  # noqa: E402
import olmo_core3 as OC  # noqa: E402
import olmo3moe_check as O3  # noqa: E402

F64 = torch.float64
torch.set_num_threads(1)  # bitwise-repeatable regeneration
torch.set_default_dtype(F64)

# Hard requirements of the brief.
GAP_STEP0_MIN = 1e-3  # K-th vs (K+1)-th selection score at step 0
GAP_ALL_MIN = 1e-9  # over all 10 steps
GAP_REDRAW_TARGET = 2e-3  # embedding rows of tokens closer than this are redrawn (margin)


# =========================================================================== configurations
def olmoe_model(**kw):
    m = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
             norm_eps=1e-5, norm_placement="pre", tie_embeddings=False, rope_theta=10000.0,
             qk_norm="full", n_dense_layers=0, dense_hidden=0, num_experts=8, top_k=2,
             expert_hidden=16, score_func="softmax", norm_topk_prob=False, shared_hidden=0,
             shared_merge="sum", routing="learned", router_bias_gamma=0.0, init_std=0.02)
    m.update(kw)
    return R.ModelConfig(**m)


def optim(**kw):
    o = dict(lr=3e-3, min_lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
             no_decay_embeddings_norms=True, max_grad_norm=1.0, schedule="cosine",
             warmup_steps=3, decay_steps=0)
    o.update(kw)
    return R.OptimConfig(**o)


# design: how the initial parameters and the batch are drawn (see init_params / make_batch).
#   embed_std, embed_offset: embedding rows ~ TN(0, embed_std) plus embed_offset on dimension 0
#     for every token (a shared direction the zero-token experts are steered away from; a large
#     embedding scale also keeps each token's routing well away from ties);
#   router_std: router rows ~ TN(0, router_std); zero_experts: (layer, expert, value) sets
#     router[expert, 0] = value (strongly negative along the offset dimension -> zero tokens);
#   norm weights ~ U(1-0.2, 1+0.2) (final_norm times final_norm_scale), peri output norms
#     ~ out_norm_scale * U(0.8, 1.2); all other matrices ~ TN(0, init_std) truncated at 3 std;
#   bias_std: initial loss-free router bias ~ U(-bias_std, bias_std) (only if gamma > 0);
#   masked: number of extra masked labels in micro-batch 0, 1 (unequal loss tokens).
FIXTURES = OrderedDict()

FIXTURES["olmoe_pre"] = dict(
    source="hf",
    model=olmoe_model(),
    loss=R.LossConfig(lm_z_coef=0.0, lbl_coef=0.05, router_z_coef=0.005),
    optim=optim(max_grad_norm=0.275),
    train=R.TrainConfig(steps=10, seq_len=150, batch_size=4, micro_batch_size=2),
    design=dict(seed=1001, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(0, 5, -8.0)], final_norm_scale=1.0, out_norm_scale=None,
                bias_std=0.0, masked=(7, 23)),
)

FIXTURES["olmoe_topk"] = dict(
    source="hf",
    model=olmoe_model(norm_topk_prob=True, tie_embeddings=True),
    loss=R.LossConfig(lm_z_coef=1e-3, lbl_coef=0.05, router_z_coef=0.005),
    optim=optim(max_grad_norm=2.5),
    train=R.TrainConfig(steps=10, seq_len=150, batch_size=4, micro_batch_size=2),
    design=dict(seed=2002, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(1, 2, -8.0)], final_norm_scale=0.15, out_norm_scale=None,
                bias_std=0.0, masked=(19, 4)),
)

FIXTURES["olmo3_peri"] = dict(
    source="plain",
    model=R.ModelConfig(
        vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
        norm_eps=1e-6, norm_placement="peri", tie_embeddings=False, rope_theta=500000.0,
        qk_norm="per_head", n_dense_layers=1, dense_hidden=48, num_experts=8, top_k=2,
        expert_hidden=16, score_func="sigmoid", norm_topk_prob=False, shared_hidden=16,
        shared_merge="sum", routing="learned", router_bias_gamma=1e-3, init_std=0.02),
    loss=R.LossConfig(lm_z_coef=2e-4, lbl_coef=0.05, router_z_coef=0.005),
    optim=optim(max_grad_norm=0.27),
    train=R.TrainConfig(steps=10, seq_len=150, batch_size=4, micro_batch_size=2),
    design=dict(seed=3003, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(1, 6, -8.0)], final_norm_scale=1.0, out_norm_scale=0.04,
                bias_std=0.05, masked=(11, 30)),
)

FIXTURES["olmo_v1"] = dict(
    source="plain",
    model=R.ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=12,
        norm_eps=1e-5, norm_placement="pre", tie_embeddings=True, rope_theta=10000.0,
        qk_norm="none", n_dense_layers=1, dense_hidden=40, num_experts=8, top_k=3,
        expert_hidden=8, score_func="softmax", norm_topk_prob=True, shared_hidden=16,
        shared_merge="v1", routing="learned", router_bias_gamma=0.0, init_std=0.02),
    loss=R.LossConfig(lm_z_coef=1e-3, lbl_coef=0.05, router_z_coef=0.005),
    optim=optim(max_grad_norm=2.7),
    train=R.TrainConfig(steps=10, seq_len=70, batch_size=4, micro_batch_size=2),
    design=dict(seed=4004, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(1, 0, -8.0)], final_norm_scale=0.15, out_norm_scale=None,
                bias_std=0.0, masked=(3, 9)),
)


# Olmo-core 3 (source "olmo_core3": OLMoDDPModel through olmo_core3.OlmoCore3Adapter). Written to
# tests/golden/olmo_core3/. S = 64 and small hidden sizes keep the three files under 3 MB.
def oc3_model(**kw):
    m = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
             norm_eps=1e-6, norm_placement="peri", tie_embeddings=False, rope_theta=500000.0,
             qk_norm="per_head", n_dense_layers=0, dense_hidden=24, num_experts=8, top_k=2,
             expert_hidden=8, score_func="softmax", norm_topk_prob=False, shared_hidden=0,
             shared_merge="sum", routing="learned", router_bias_gamma=0.0, init_std=0.02)
    m.update(kw)
    return R.ModelConfig(**m)


OC3_TRAIN = R.TrainConfig(steps=10, seq_len=64, batch_size=4, micro_batch_size=2)

FIXTURES["oc3_reordered"] = dict(
    source="olmo_core3",
    model=oc3_model(norm_placement="reordered", embed_scale=math.sqrt(32.0), embedding_norm=True,
                    norm_topk_prob=True, norm_topk_p=1.0, restore_weight_scale=True,
                    qk_norm="per_head", shared_hidden=8, dense_layers="1", sliding_window="16",
                    score_correction_bias=True),
    loss=R.LossConfig(lm_z_coef=0.0, lbl_coef=0.05, router_z_coef=0.005, aux_divisor="labelled"),
    optim=optim(max_grad_norm=0.415),
    train=OC3_TRAIN,
    design=dict(seed=5005, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(2, 3, -8.0)], final_norm_scale=1.0, out_norm_scale=0.04,
                bias_std=0.05, masked=(5, 13)),
)

FIXTURES["oc3_sigmoid"] = dict(
    source="olmo_core3",
    model=oc3_model(vocab_size=48, n_layers=4, norm_placement="peri", qk_norm="full",
                    score_func="sigmoid", sigmoid_eps=1e-7, norm_topk_prob=True, norm_topk_p=2.0,
                    expert_weight_scale=2.5, top_k=2, original_top_k=4, router_bias_gamma=1e-3,
                    dense_layers="0,2", dense_hidden=16, sliding_window="24,-1",
                    sliding_window_full_first=False, n_group=4, topk_group=2, rope="windowed"),
    loss=R.LossConfig(lm_z_coef=0.0, lbl_coef=0.05, router_z_coef=0.005),
    optim=optim(max_grad_norm=0.4),
    train=OC3_TRAIN,
    design=dict(seed=6006, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(3, 5, -8.0)], final_norm_scale=1.0, out_norm_scale=0.04,
                bias_std=0.05, masked=(9, 2)),
)

FIXTURES["oc3_topk_softmax"] = dict(
    source="olmo_core3",
    model=oc3_model(n_layers=2, norm_placement="pre", qk_norm="full", tie_embeddings=True,
                    embed_scale=2.0, score_func="topk_softmax", top_k=3, norm_topk_prob=False,
                    router_bias_gamma=1e-3, rope_theta=10000.0, norm_eps=1e-5),
    loss=R.LossConfig(lm_z_coef=1e-3, lbl_coef=0.05, router_z_coef=0.005, lbl_granularity="instance"),
    optim=optim(max_grad_norm=2.8),
    train=OC3_TRAIN,
    design=dict(seed=7007, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(0, 6, -8.0)], final_norm_scale=0.15, out_norm_scale=None,
                bias_std=0.05, masked=(3, 17)),
)

# Several gated shared experts (softmax gate with a logit bias, p = 2 normalization) and the
# routed router's logit bias, on the reordered block with sigmoid routing.
FIXTURES["oc3_shared"] = dict(
    source="olmo_core3",
    model=oc3_model(vocab_size=48, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                    tie_embeddings=True, norm_placement="reordered", qk_norm="per_head", num_experts=4, top_k=2,
                    expert_hidden=8, score_func="sigmoid", sigmoid_eps=1e-7, norm_topk_prob=True,
                    shared_hidden=4, shared_experts=3, shared_router=True,
                    shared_router_bias=True, shared_router_norm_p=2.0, router_logit_bias=True),
    loss=R.LossConfig(lm_z_coef=0.0, lbl_coef=0.05, router_z_coef=0.005),
    optim=optim(max_grad_norm=0.4),
    train=R.TrainConfig(steps=10, seq_len=32, batch_size=4, micro_batch_size=2),
    design=dict(seed=8008, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(1, 2, -8.0)], final_norm_scale=1.0, out_norm_scale=0.04,
                bias_std=0.05, masked=(3, 7), logit_bias_std=0.3),
)


# Olmo-core 3's attention options: clip_qkv, attention biases (bq bk bv bo), partial RoPE (4 of
# 8 head dims). A smaller model (d 16, V 32, S 32) keeps the file near 220 KB. init_std 0.1 and
# biases ~ TN(0, 0.2) make about a quarter of the projections exceed the clamp at 0.5.
FIXTURES["oc3_attention"] = dict(
    source="olmo_core3",
    model=oc3_model(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    num_experts=4, top_k=2, expert_hidden=8, norm_placement="peri",
                    qk_norm="per_head", clip_qkv=0.5, attention_bias=True, rope_partial=0.5,
                    init_std=0.1),
    loss=R.LossConfig(lm_z_coef=0.0, lbl_coef=0.05, router_z_coef=0.005),
    optim=optim(max_grad_norm=0.42),
    train=R.TrainConfig(steps=10, seq_len=32, batch_size=4, micro_batch_size=2),
    design=dict(seed=8009, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(1, 3, -8.0)], final_norm_scale=1.0, out_norm_scale=0.04,
                bias_std=0.0, masked=(4, 7), attn_bias_std=0.2),
)


# =========================================================================== init and batch
def tn(shape, std, gen):
    t = torch.empty(shape, dtype=F64)
    torch.nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=gen)
    return t


def unif(shape, lo, hi, gen):
    return lo + (hi - lo) * torch.rand(shape, dtype=F64, generator=gen)


def embed_row(D, design, gen):
    r = tn((D,), design["embed_std"], gen)
    r[0] += design["embed_offset"]
    return r


def init_params(cfg: R.ModelConfig, design, gen):
    P = OrderedDict()
    for name, shape in R.param_shapes(cfg).items():
        if name == "embed":
            t = torch.stack([embed_row(cfg.d_model, design, gen) for _ in range(shape[0])])
        elif name.endswith(".router"):
            t = tn(shape, design["router_std"], gen)
        elif name.endswith("router.bias"):  # the routers' logit biases (model.*_bias)
            t = tn(shape, design["logit_bias_std"], gen)
        elif name.endswith("out_norm"):
            t = design["out_norm_scale"] * unif(shape, 0.8, 1.2, gen)
        elif name == "final_norm":
            t = design["final_norm_scale"] * unif(shape, 0.8, 1.2, gen)
        elif name.endswith("norm"):
            t = unif(shape, 0.8, 1.2, gen)
        elif name.rsplit(".", 1)[-1] in ("bq", "bk", "bv", "bo"):
            t = tn(shape, design["attn_bias_std"], gen)
        else:
            t = tn(shape, cfg.init_std, gen)
        P[name] = t
    for L, e, v in design["zero_experts"]:
        assert L in cfg.moe_layers()
        P[f"layers.{L}.router"][e, 0] = v
    return P


def init_bias(cfg, design, gen):
    if not cfg.has_router_bias():
        return None
    s = design["bias_std"]
    return OrderedDict((L, unif((cfg.num_experts,), -s, s, gen)) for L in cfg.moe_layers())


def make_batch(cfg, tr: R.TrainConfig, design, gen):
    B, S, mbs = tr.batch_size, tr.seq_len, tr.micro_batch_size
    assert B % mbs == 0 and B // mbs == 2
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen, dtype=torch.int64)
    labels = torch.full((B, S), -100, dtype=torch.int64)
    labels[:, :-1] = ids[:, 1:]
    for m, nmask in enumerate(design["masked"]):
        rows = torch.arange(m * mbs, (m + 1) * mbs)
        cand = [(int(b), s) for b in rows for s in range(S - 1)]
        pick = torch.randperm(len(cand), generator=gen)[:nmask]
        for i in pick.tolist():
            b, s = cand[i]
            labels[b, s] = -100
    return ids, labels


def selection_gaps(info, K):
    """min over tokens of (K-th - (K+1)-th) selection score, per layer; and per-token gaps."""
    g = {r["layer"]: (r["sel_sorted"][:, K - 1] - r["sel_sorted"][:, K]) for r in info}
    for r in info:  # group-limited routing: the chosen groups' margin too
        if r.get("group_gap") is not None:
            g[r["layer"]] = torch.minimum(g[r["layer"]], r["group_gap"])
    return g


def redraw_until_separated(cfg, design, P, bias, ids, gen, max_iter=200):
    """Redraw embedding rows of tokens whose top-K selection is within GAP_REDRAW_TARGET of a tie
    (at any occurrence, any MoE layer) until no such token is left. Returns #rows redrawn."""
    n_redrawn = 0
    K = cfg.top_k
    for it in range(max_iter):
        model = R.MoEReference(cfg, P)
        with torch.no_grad():
            _, info = model(ids, bias)
        gaps = selection_gaps(info, K)
        bad = torch.zeros(ids.numel(), dtype=torch.bool)
        for L, g in gaps.items():
            bad |= g < GAP_REDRAW_TARGET
        if not bad.any():
            return n_redrawn, it
        for v in torch.unique(ids.reshape(-1)[bad]).tolist():
            P["embed"][v] = embed_row(cfg.d_model, design, gen)
            n_redrawn += 1
    raise RuntimeError("could not separate routing; change the design seed")




# =========================================================================== losses and training
def olmo_core_aux(route, Bm, S, E, K, score_func, T_step, granularity="local_batch"):
    """LBL and router z-loss of one layer on one micro-batch with olmo-core's functions, scaled to
    the step (loss_div_factor = T_step gives (T_m / T_step) * X_m, MODEL.md's token weighting)."""
    from olmo_core.nn.moe.loss import (MoELoadBalancingLossGranularity, load_balancing_loss,
                                       router_z_loss)
    from olmo_core.ops.moe import batched_histc
    scores = route["scores"]
    if score_func == "sigmoid":  # as MoERouterV2.compute_aux_loss (MODEL.md: normalize first)
        scores = scores / scores.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        batched = batched_histc(route["idx"].reshape(Bm, S * K), E)  # (Bm, E) per sequence
        counts = batched.sum(dim=0)
    lbl = load_balancing_loss(num_experts=E, top_k=K, expert_scores=scores.view(Bm, S, E),
                              batch_size_per_expert=counts, batched_batch_size_per_expert=batched,
                              granularity=MoELoadBalancingLossGranularity(granularity),
                              loss_div_factor=T_step)
    rz = router_z_loss(expert_logits=route["logits"].view(Bm, S, E), loss_div_factor=T_step)
    return lbl, rz, counts


def lm_losses(adapter, logits, labels, n_loss):
    V = logits.shape[-1]
    if hasattr(adapter, "lm_losses"):  # olmo_core3.OlmoCore3Adapter: Olmo-core's cross_entropy_loss
        return adapter.lm_losses(logits, labels, n_loss)
    if isinstance(adapter, HFAdapter):
        from transformers.loss.loss_utils import fixed_cross_entropy
        ce = fixed_cross_entropy(logits.reshape(-1, V), labels.reshape(-1),
                                 num_items_in_batch=n_loss, ignore_index=-100)
        _, z_sum = R.lm_loss_sums(logits, labels)
    else:
        ce_sum, z_sum = R.lm_loss_sums(logits, labels)
        ce = ce_sum / n_loss
    return ce, z_sum / n_loss


def run_training(adapter, fx, ids, labels, bias0, checks=None):
    cfg, lc, oc, tr = fx["model"], fx["loss"], fx["optim"], fx["train"]
    B, S, mbs, E, K = tr.batch_size, tr.seq_len, tr.micro_batch_size, cfg.num_experts, cfg.top_k
    M = B // mbs
    n_loss = int((labels >= 0).sum())
    T_step = n_loss if lc.aux_divisor == "labelled" else B * S  # the auxiliary losses' divisor
    moe_layers = cfg.moe_layers()
    triples = adapter.opt_params()
    params = [p for _, p, _ in triples]
    groups = [dict(params=[p for _, p, d in triples if d], weight_decay=oc.weight_decay),
              dict(params=[p for _, p, d in triples if not d],
                   weight_decay=0.0 if oc.no_decay_embeddings_norms else oc.weight_decay)]
    opt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps,
                            foreach=False, fused=False)
    bias = None if bias0 is None else OrderedDict((L, b.clone()) for L, b in bias0.items())
    rec = dict(total=[], ce=[], lm_z=[], grad_norm=[], grad_norm_sumsq=[], lr=[], min_gap=[],
               counts=[], bias=[])
    step0 = None
    for n in range(1, tr.steps + 1):
        opt.zero_grad(set_to_none=True)
        acc = dict(total=0.0, ce=0.0, lm_z=0.0)
        lbl = {L: 0.0 for L in moe_layers}
        rz = {L: 0.0 for L in moe_layers}
        counts = {L: torch.zeros(E, dtype=torch.int64) for L in moe_layers}
        logits_all, min_gap = [], math.inf
        for m in range(M):
            sl = slice(m * mbs, (m + 1) * mbs)
            logits, info = adapter.forward(ids[sl], bias)
            assert [r["layer"] for r in info] == moe_layers
            ce, lmz = lm_losses(adapter, logits, labels[sl], n_loss)
            total = ce + lc.lm_z_coef * lmz
            aux_in_graph = 0.0  # value of the aux losses the model attached to its own graph
            for r in info:
                if "lbl" in r:  # Olmo-core 3: its router's compute_aux_loss (loss_div_factor =
                    # T_step), already attached to the graph by the block; counts from its router
                    l_, z_, c_ = r["lbl"], r["rz"], r["counts"]
                    aux_in_graph += float(lc.lbl_coef * l_ + lc.router_z_coef * z_)
                else:
                    l_, z_, c_ = olmo_core_aux(r, mbs, S, E, K, cfg.score_func, T_step, lc.lbl_granularity)
                    total = total + lc.lbl_coef * l_ + lc.router_z_coef * z_
                lbl[r["layer"]] += float(l_.detach())
                rz[r["layer"]] += float(z_.detach())
                counts[r["layer"]] += c_.to(torch.int64)
                g = r["sel_sorted"][:, K - 1] - r["sel_sorted"][:, K]
                if r.get("group_gap") is not None:  # the chosen groups' margin too
                    g = torch.minimum(g, r["group_gap"])
                min_gap = min(min_gap, float(g.min()))
                if n == 1 and m == 0 and checks is not None:
                    aux_definition_checks(r, mbs, S, cfg, T_step, checks)
            total.backward()
            acc["total"] += float(total.detach()) + aux_in_graph
            acc["ce"] += float(ce.detach())
            acc["lm_z"] += float(lmz.detach())
            logits_all.append(logits.detach().clone())
        for p in params:  # experts with no tokens etc.: zero gradient, not None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if n == 1:
            step0 = dict(logits=torch.cat(logits_all, 0), grads=adapter.ref_grads(),
                         total=acc["total"], ce=acc["ce"], lm_z=acc["lm_z"], lbl=dict(lbl),
                         rz=dict(rz), counts={L: c.clone() for L, c in counts.items()},
                         min_gap=min_gap)
        sumsq = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
        gn = float(torch.nn.utils.clip_grad_norm_(params, oc.max_grad_norm, foreach=False))
        lr = R.lr_at(n, oc, tr.steps)
        for gr in opt.param_groups:
            gr["lr"] = lr
        opt.step()
        if bias is not None and cfg.router_bias_gamma > 0:  # a score-correction bias stays fixed
            for L in moe_layers:
                bias[L] = R.loss_free_bias_update(bias[L], counts[L], cfg.router_bias_gamma)
        if hasattr(adapter, "after_step"):
            adapter.after_step(bias, counts)
        rec["total"].append(acc["total"])
        rec["ce"].append(acc["ce"])
        rec["lm_z"].append(acc["lm_z"])
        rec["grad_norm"].append(gn)
        rec["grad_norm_sumsq"].append(sumsq)
        rec["lr"].append(lr)
        rec["min_gap"].append(min_gap)
        rec["counts"].append({L: c.tolist() for L, c in counts.items()})
    rec["final_params"] = adapter.ref_params()
    rec["final_bias"] = bias
    rec["step0"] = step0
    return rec


def aux_definition_checks(r, Bm, S, cfg, T_step, checks):
    """olmo-core's functions vs MODEL.md's definitions on one micro-batch (no step scaling)."""
    from olmo_core.nn.moe.loss import (MoELoadBalancingLossGranularity, load_balancing_loss,
                                       router_z_loss)
    E, K = cfg.num_experts, cfg.top_k
    with torch.no_grad():
        counts = torch.bincount(r["idx"].reshape(-1), minlength=E)
        sc = r["scores"]
        if cfg.score_func == "sigmoid":
            sc = sc / sc.sum(dim=-1, keepdim=True)
        oc_lbl = load_balancing_loss(
            num_experts=E, top_k=K, expert_scores=sc.view(Bm, S, E), batch_size_per_expert=counts,
            batched_batch_size_per_expert=counts[None].expand(Bm, E),
            granularity=MoELoadBalancingLossGranularity.local_batch, loss_div_factor=None)
        oc_rz = router_z_loss(expert_logits=r["logits"].view(Bm, S, E), loss_div_factor=None)
        d_lbl = R.lbl_definition(r["scores"], counts, K, cfg.score_func)
        d_rz = R.router_z_definition(r["logits"])
        # scaled form used in training: loss_div_factor = T_step -> (T_m/T_step) * definition
        oc_lbl_s = load_balancing_loss(
            num_experts=E, top_k=K, expert_scores=sc.view(Bm, S, E), batch_size_per_expert=counts,
            batched_batch_size_per_expert=counts[None].expand(Bm, E),
            granularity=MoELoadBalancingLossGranularity.local_batch, loss_div_factor=T_step)
    L = r["layer"]
    checks.setdefault("olmo_core_loss_vs_definition", {})[f"layer{L}_microbatch0"] = dict(
        lbl_olmo_core=float(oc_lbl), lbl_definition=float(d_lbl),
        lbl_abs_diff=abs(float(oc_lbl - d_lbl)),
        router_z_olmo_core=float(oc_rz), router_z_definition=float(d_rz),
        router_z_abs_diff=abs(float(oc_rz - d_rz)),
        lbl_step_scaled_abs_diff=abs(float(oc_lbl_s - d_lbl * (Bm * S) / T_step)))


# =========================================================================== cross-checks
def max_abs(a, b):
    return float((a - b).abs().max())


def compare_grads(g1, g2):
    worst, worst_rel, where = 0.0, 0.0, None
    for n in g1:
        d = max_abs(g1[n], g2[n])
        scale = float(g1[n].abs().max())
        if d > worst:
            worst, where = d, n
        if scale > 0:
            worst_rel = max(worst_rel, d / scale)
    return worst, worst_rel, where


def hf_vs_plain(fx, P, ids, labels):
    """Plain module vs OlmoeForCausalLM (patched f64 and stock) on step 0 (forward + grads of
    the full step loss), and over the whole 10-step training run (patched)."""
    cfg = fx["model"]
    out = {}
    plain = PlainAdapter(cfg, P)
    rp = run_training(plain, fx, ids, labels, None)
    for label, patched in (("f64_patched", True), ("stock_transformers", False)):
        with hf_f64_patches(patched):
            hf = HFAdapter(cfg, P, f64_patched=patched)
            rh = run_training(hf, fx, ids, labels, None)
        g, grel, where = compare_grads(rh["step0"]["grads"], rp["step0"]["grads"])
        d = dict(step0_logits_max_abs=max_abs(rh["step0"]["logits"], rp["step0"]["logits"]),
                 step0_total_abs=abs(rh["step0"]["total"] - rp["step0"]["total"]),
                 step0_grad_max_abs=g, step0_grad_max_rel_to_tensor_max=grel,
                 step0_grad_worst_param=where,
                 step0_counts_equal=all(torch.equal(rh["step0"]["counts"][L],
                                                    rp["step0"]["counts"][L])
                                        for L in cfg.moe_layers()),
                 train_total_max_abs=max(abs(a - b) for a, b in zip(rh["total"], rp["total"])),
                 train_grad_norm_max_abs=max(abs(a - b) for a, b in
                                             zip(rh["grad_norm"], rp["grad_norm"])),
                 final_param_max_abs=compare_grads(rh["final_params"], rp["final_params"])[0],
                 routing_counts_equal_all_steps=rh["counts"] == rp["counts"])
        out[label] = d
    return out, rp


def hf_stock_loss_check(fx, P, ids, labels):
    """transformers' full ForCausalLMLoss (which casts logits to float32) vs the float64 CE."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    cfg, tr = fx["model"], fx["train"]
    n_loss = int((labels >= 0).sum())
    with hf_f64_patches(True):
        hf = HFAdapter(cfg, P)
        with torch.no_grad():
            d = d2 = 0.0
            for m in range(tr.batch_size // tr.micro_batch_size):
                sl = slice(m * tr.micro_batch_size, (m + 1) * tr.micro_batch_size)
                logits, _ = hf.forward(ids[sl])
                a = ForCausalLMLoss(logits, None, cfg.vocab_size, num_items_in_batch=n_loss,
                                    shift_labels=labels[sl])
                b, _ = lm_losses(hf, logits, labels[sl], n_loss)
                c = R.lm_loss_sums(logits, labels[sl])[0] / n_loss
                d = max(d, abs(float(a) - float(b)))
                d2 = max(d2, abs(float(b) - float(c)))
    return dict(ForCausalLMLoss_fp32_vs_f64_abs=d, fixed_cross_entropy_vs_definition_abs=d2)


def olmo_core_router_check(fx, P, bias, ids):
    """olmo-core's MoERouterV2 (gating, top-k on scores + score_bias, normalize_expert_weights,
    post_batch bias update) vs the plain module's routing, on the step-0 router inputs.
    MoERouterV2 casts the router input and weight to float32, so weights agree to ~1e-7."""
    from olmo_core.nn.moe.router import MoERouterGatingFunction
    from olmo_core.nn.moe.v2.router import MoERouterV2
    cfg = fx["model"]
    E, K, D = cfg.num_experts, cfg.top_k, cfg.d_model
    model = R.MoEReference(cfg, P)
    hs = {}

    orig = model._moe

    def spy(L, h, rb, info):
        hs[L] = h.detach().clone()
        return orig(L, h, rb, info)

    model._moe = spy
    with torch.no_grad():
        _, info = model(ids, bias)
    res = {}
    for r in info:
        L = r["layer"]
        rt = MoERouterV2(d_model=D, num_experts=E, top_k=K,
                         gating_function=MoERouterGatingFunction(cfg.score_func),
                         bias_gamma=cfg.router_bias_gamma if cfg.router_bias_gamma > 0 else None,
                         normalize_expert_weights=1.0 if cfg.norm_topk_prob else None,
                         sigmoid_stability_epsilon=0.0, lb_loss_weight=1.0, z_loss_weight=1.0,
                         dtype=F64)
        rt.train()
        with torch.no_grad():
            rt.weight.copy_(P[f"layers.{L}.router"].reshape(-1))
            if bias is not None:
                rt.score_bias.copy_(bias[L])
        B, S = ids.shape
        w, idx, bspe, aux_info = rt(hs[L], scores_only=False, loss_div_factor=None)
        idx = idx.reshape(-1, K)
        same_idx = bool(torch.equal(idx, r["idx"]))
        wd = max_abs(w.reshape(-1, K).to(F64), r["weights"].detach())
        entry = dict(indices_equal=same_idx, weights_max_abs=wd,
                     counts_equal=bool(torch.equal(bspe.to(torch.int64),
                                                   torch.bincount(r["idx"].reshape(-1),
                                                                  minlength=E))))
        if bias is not None:
            rt.score_bias_batch_size_per_expert = bspe.float().clone()
            before = rt.score_bias.clone()
            rt.post_batch()
            mine = R.loss_free_bias_update(before, bspe.to(torch.int64), cfg.router_bias_gamma)
            entry["bias_update_max_abs"] = max_abs(rt.score_bias.to(F64), mine)
        res[f"layer{L}"] = entry
    return res


def olmo_core_dense_block_check(fx, P, ids):
    """olmo-core's own TransformerBlock / PeriNormTransformerBlock (attention with RoPE, QK-norm
    full/per-head/none, GQA, dense SwiGLU FFN, pre/peri norms), cast to float64, vs the plain
    module's layer 0 (a dense layer). Checks the semantics of the options HF's Olmoe lacks."""
    from olmo_core.nn.attention import AttentionBackendName, AttentionConfig
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
    from olmo_core.nn.rope import RoPEConfig
    from olmo_core.nn.transformer.block import PeriNormTransformerBlock, TransformerBlock
    cfg = fx["model"]
    assert cfg.n_dense_layers >= 1
    # full_precision=False: olmo-core would otherwise cast RMSNorm and RoPE to float32.
    ln = LayerNormConfig(name=LayerNormType.rms, eps=cfg.norm_eps, bias=False, full_precision=False)
    att = AttentionConfig(
        n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, bias=False,
        rope=RoPEConfig(theta=cfg.rope_theta, full_precision=False),
        qk_norm=None if cfg.qk_norm == "none" else ln,
        use_head_qk_norm=cfg.qk_norm == "per_head", backend=AttentionBackendName.torch)
    ff = FeedForwardConfig(hidden_size=cfg.dense_hidden, bias=False)
    cls = PeriNormTransformerBlock if cfg.norm_placement == "peri" else TransformerBlock
    blk = cls(d_model=cfg.d_model, block_idx=0, n_layers=cfg.n_layers, sequence_mixer=att,
              feed_forward=ff, layer_norm=ln).to(F64)
    mp = {"attention.w_q.weight": "wq", "attention.w_k.weight": "wk", "attention.w_v.weight": "wv",
          "attention.w_out.weight": "wo", "attention.q_norm.weight": "q_norm",
          "attention.k_norm.weight": "k_norm", "attention_norm.weight": "attn_norm",
          "feed_forward.w1.weight": "mlp.gate", "feed_forward.w3.weight": "mlp.up",
          "feed_forward.w2.weight": "mlp.down", "feed_forward_norm.weight": "ffn_norm",
          "post_attention_norm.weight": "attn_out_norm",
          "post_feed_forward_norm.weight": "ffn_out_norm"}
    names = dict(blk.named_parameters())
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(P["layers.0." + mp[n]])
    # olmo-core computes the RoPE tables with float32 positions / inverse frequencies; pre-fill its
    # cache with the same tables (same formula) in float64.
    S, hd = ids.shape[1], cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=F64) / hd))
    ang = torch.arange(S, dtype=F64)[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    blk.attention.rope._cache["rope_pos_sin"] = ang.sin()
    blk.attention.rope._cache["rope_pos_cos"] = ang.cos()
    model = R.MoEReference(cfg, P)
    hidden = []
    with torch.no_grad():
        model(ids, None, hidden)
        y = blk(hidden[0])
    return dict(block=cls.__name__, olmo_core_params=sorted(names),
                layer0_output_max_abs=max_abs(y, hidden[1]),
                layer0_update_max=float((hidden[1] - hidden[0]).abs().max()))


def roundtrip_check(path):
    """Re-read a written fixture (json + struct only), rebuild the config from the metadata keys,
    rerun the whole 10-step computation with the plain module from the stored initial state and
    return the largest differences to the stored results (proves the file is self-consistent)."""
    meta, out = read_safetensors_plain(path)
    c = json.loads(meta["config"])
    fx = dict(model=R.ModelConfig(**c["model"]), loss=R.LossConfig(**c["loss"]),
              optim=R.OptimConfig(**c["optim"]), train=R.TrainConfig(**c["train"]))
    cfg = fx["model"]

    def T(name):
        dt, shape, vals = out[name]
        t = torch.tensor(vals, dtype=F64 if dt == "F64" else torch.int64)
        return t.reshape(shape)

    P = OrderedDict((n, T("param." + n)) for n in R.param_shapes(cfg))
    bias0 = None
    if cfg.has_router_bias():
        bias0 = OrderedDict((L, T(f"router_bias.{L}")) for L in cfg.moe_layers())
    rec = run_training(PlainAdapter(cfg, P), fx, T("ids"), T("labels"), bias0)
    s0 = rec["step0"]
    d = dict(
        logits=max_abs(s0["logits"], T("step0.logits")),
        scalars=max(abs(s0[k] - float(T("step0." + k)[0])) for k in ("ce", "lm_z", "total")),
        aux=max(max(abs(s0["lbl"][L] - float(T(f"step0.lbl.{L}")[0])),
                    abs(s0["rz"][L] - float(T(f"step0.router_z.{L}")[0])))
                for L in cfg.moe_layers()),
        grads=compare_grads(OrderedDict((n, T("step0.grad." + n)) for n in P), s0["grads"])[0],
        train=max(max_abs(torch.tensor(rec[k]), T("train." + k))
                  for k in ("total", "ce", "grad_norm", "lr")),
        final=compare_grads(OrderedDict((n, T("final.param." + n)) for n in P),
                            rec["final_params"])[0],
    )
    for L in cfg.moe_layers():
        assert torch.equal(s0["counts"][L], T(f"step0.counts.{L}")), L
        if bias0 is not None:
            d["final_bias"] = max(d.get("final_bias", 0.0),
                                  max_abs(rec["final_bias"][L], T(f"final.router_bias.{L}")))
    return d


def model_json(cfg, source):
    """The model section: the fixtures from before the Olmo-core 3 options keep exactly their keys
    (the new fields are at their defaults there and are left out); oc3_* write every field."""
    return R.model_dict(cfg, with_new_fields=source == "olmo_core3")


# Bounds of the Olmo-core 3 cross-checks (float64).
OC3_BOUND = 1e-12


def olmo_core3_checks(fx, P, bias0, ids, labels, checks, shared_checks):
    """Runs the 10 steps on Olmo-core 3's model (the source of truth) and records the checks:
    plain module vs Olmo-core on this config, Olmo-core vs Olmo3MoeForCausalLM, Olmo-core's own
    post_batch vs the bias update, small-gradient counts, what get_hf_config makes of the model."""
    cfg, lc, tr = fx["model"], fx["loss"], fx["train"]
    T_step = tr.batch_size * tr.seq_len
    if lc.aux_divisor == "labelled":  # Olmo-core 3's train module: loss_div_factor = labelled tokens
        T_step = int((labels >= 0).sum())
    adapter = OC.OlmoCore3Adapter(cfg, P, lc.lbl_coef, lc.router_z_coef, T_step, tr.seq_len,
                                  lbl_granularity=lc.lbl_granularity)
    rec = run_training(adapter, fx, ids, labels, bias0, checks)
    rp = run_training(PlainAdapter(cfg, P), fx, ids, labels, bias0)
    cmp = OC.compare_with_plain(rp, rec, cfg)
    assert cmp["step0_logits_rel_to_max"] <= OC3_BOUND, cmp
    assert cmp["step0_grad_max_rel_to_tensor_max"] <= OC3_BOUND, cmp
    assert cmp["routing_counts_equal_all_steps"], cmp
    checks["plain_vs_olmo_core3_this_config"] = cmp
    hf = O3.check(cfg, P, ids, labels, tr.seq_len)
    if hf["applicable"]:
        assert hf["logits_rel_to_max"] <= OC3_BOUND, hf
        assert hf.get("ce_grad_max_rel_to_tensor_max", 0.0) <= OC3_BOUND, hf
    checks["olmo_core3_vs_Olmo3MoeForCausalLM"] = hf
    bc = adapter.bias_checks
    checks["olmo_core3_post_batch_vs_bias_update"] = dict(
        bias_max_abs_all_steps=max(d["bias"] for d in bc),
        router_counts_equal_all_steps=all(d["counts_equal"] for d in bc))
    assert all(d["counts_equal"] for d in bc)
    if cfg.clip_qkv > 0:  # no projection within rounding of the clamp's bounds, in any forward
        cs = adapter.clip_stats
        checks["clip_qkv_projections"] = dict(
            min_distance_to_bound_all_forwards=min(d["min_margin"] for d in cs),
            clamped_fraction_step0=cs[0]["clamped"] / cs[0]["of"], forwards=len(cs))
        assert checks["clip_qkv_projections"]["min_distance_to_bound_all_forwards"] > 1e-6, cs
    checks["olmo_core_get_hf_config_on_this_model"] = OC.olmo_core_hf_config_attempt(adapter.m)
    checks["olmo_core3_stock_float32_casts_vs_float64_step0_logits_rel"] = \
        OC.stock_precision_logits_rel(cfg, P, ids[:tr.micro_batch_size], bias0)
    g = OC.small_grad_counts(rec["step0"]["grads"])
    checks["step1_grad_elements_below_1e-4_of_tensor_max"] = dict(
        total=sum(g.values()), of=sum(t.numel() for t in rec["step0"]["grads"].values()),
        per_tensor={n: c for n, c in g.items() if c})
    return rec


def oc3_vs_plain_olmo3_peri():
    """Olmo-core 3 reference vs the plain module on the olmo3_peri fixture's configuration (both
    express it: peri, per-head QK-norm, dense layer 0, shared expert, sigmoid without epsilon,
    loss-free bias): the whole 10-step run."""
    fx = FIXTURES["olmo3_peri"]
    cfg, design, tr, lc = fx["model"], fx["design"], fx["train"], fx["loss"]
    gen = torch.Generator().manual_seed(design["seed"])
    torch.manual_seed(design["seed"])
    P = init_params(cfg, design, gen)
    bias0 = init_bias(cfg, design, gen)
    ids, labels = make_batch(cfg, tr, design, gen)
    redraw_until_separated(cfg, design, P, bias0, ids, gen)
    rp = run_training(PlainAdapter(cfg, P), fx, ids, labels, bias0)
    ad = OC.OlmoCore3Adapter(cfg, P, lc.lbl_coef, lc.router_z_coef, tr.batch_size * tr.seq_len,
                             tr.seq_len)
    ro = run_training(ad, fx, ids, labels, bias0)
    cmp = OC.compare_with_plain(rp, ro, cfg)
    assert cmp["step0_logits_rel_to_max"] <= OC3_BOUND, cmp
    assert cmp["step0_grad_max_rel_to_tensor_max"] <= OC3_BOUND, cmp
    assert cmp["routing_counts_equal_all_steps"], cmp
    return cmp


# =========================================================================== main
def build_fixture(name, fx, shared_checks):
    cfg, lc, oc, tr, design = fx["model"], fx["loss"], fx["optim"], fx["train"], fx["design"]
    cfg.validate()
    gen = torch.Generator().manual_seed(design["seed"])
    torch.manual_seed(design["seed"])
    P = init_params(cfg, design, gen)
    bias0 = init_bias(cfg, design, gen)
    ids, labels = make_batch(cfg, tr, design, gen)
    n_redrawn, n_iter = redraw_until_separated(cfg, design, P, bias0, ids, gen)

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
