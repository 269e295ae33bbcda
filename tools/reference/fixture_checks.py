"""The fixtures' cross-checks (tools/reference/make_fixtures.py records them in every file): the
plain module against OlmoeForCausalLM, against olmo-core's router and blocks, against Olmo-core
3's model and Olmo3MoeForCausalLM; and a written file's round trip through the plain module.
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402
from hf_side import HFAdapter, PlainAdapter, hf_f64_patches  # noqa: E402
from fixture_io import read_safetensors_plain  # noqa: E402
import olmo_core3 as OC  # noqa: E402
import olmo3moe_check as O3  # noqa: E402
from fixture_catalog import F64, FIXTURES, draw_inputs  # noqa: E402
from fixture_training import lm_losses, run_training  # noqa: E402


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
    cfg, tr, lc = fx["model"], fx["train"], fx["loss"]
    P, bias0, ids, labels, _ = draw_inputs(fx)
    rp = run_training(PlainAdapter(cfg, P), fx, ids, labels, bias0)
    ad = OC.OlmoCore3Adapter(cfg, P, lc.lbl_coef, lc.router_z_coef, tr.batch_size * tr.seq_len,
                             tr.seq_len)
    ro = run_training(ad, fx, ids, labels, bias0)
    cmp = OC.compare_with_plain(rp, ro, cfg)
    assert cmp["step0_logits_rel_to_max"] <= OC3_BOUND, cmp
    assert cmp["step0_grad_max_rel_to_tensor_max"] <= OC3_BOUND, cmp
    assert cmp["routing_counts_equal_all_steps"], cmp
    return cmp
