"""The fixtures' training loop (tools/reference/make_fixtures.py): micro-batches, accumulation,
torch.nn.utils.clip_grad_norm_, MODEL.md's LR schedule, torch.optim.AdamW with weight-decay groups,
the loss-free bias update, over any adapter of hf_side.py or olmo_core3.py; the losses it sums
(olmo-core's auxiliary-loss functions, transformers' or the definition's cross-entropy) and the
check of olmo-core's functions against MODEL.md's definitions.
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
from hf_side import HFAdapter  # noqa: E402


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
