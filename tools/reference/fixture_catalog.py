"""The golden fixtures' catalogue (tools/reference/make_fixtures.py writes them): each fixture's
model, losses, optimizer, batch and design, and how its initial parameters and batch are drawn
from its seed, with the routing kept away from ties. Importing this module sets torch to one
thread and float64 by default, as every fixture script needs (bitwise-repeatable regeneration).
"""

from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402

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


def draw_inputs(fx):
    """A fixture's initial parameters, router bias, batch and the number of embedding rows redrawn,
    from its design's seed."""
    cfg, design = fx["model"], fx["design"]
    gen = torch.Generator().manual_seed(design["seed"])
    torch.manual_seed(design["seed"])
    P = init_params(cfg, design, gen)
    bias0 = init_bias(cfg, design, gen)
    ids, labels = make_batch(cfg, fx["train"], design, gen)
    n_redrawn, _ = redraw_until_separated(cfg, design, P, bias0, ids, gen)
    return P, bias0, ids, labels, n_redrawn
