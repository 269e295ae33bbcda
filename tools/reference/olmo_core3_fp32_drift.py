#!/usr/bin/env python
"""How far does Olmo-core 3's OWN float32 run drift from its float64 run over the oc3_* fixtures'
10 AdamW steps? (And the plain module moe_reference.py in float32, as a second fp32 model.)

For each tests/golden/olmo_core3/oc3_*.safetensors:
- float64: Olmo-core 3 through olmo_core3.OlmoCore3Adapter and fixture_training.run_training, as the
  fixture was made, with a snapshot of the parameters after every step; its final parameters must
  equal the fixture's final.param.* to <= 1e-12 (relative to max|p|) before they are used.
- Olmo-core 3 fp32: the same builder (olmo_core3.build_model, built in float32 with the default
  dtype float32 so its router accumulators are float32 too, RoPE tables from Olmo-core's own float32
  code), the same GPU-plumbing replacements (oc_cpu_patches(keep_f64=False): no Tensor.float patch),
  the fixture's initial parameters and router biases rounded to fp32, run_training (same micro-
  batches, clipping, LR schedule, torch.optim.AdamW in fp32); the loss-free bias is Olmo-core's own
  fp32 MoERouterV2.post_batch.
- plain fp32: moe_reference.MoEReference with its DTYPE set to float32, same loop (bias update
  R.loss_free_bias_update in fp32).
Metrics against float64: step-0 logits max|d|/max|ref|, worst per-tensor gradient max|d|/max|g|;
after steps 1, 5, 10 per tensor max|p32 - p64| / max|p64| over the elements whose step-1 gradient
(fixture step0.grad.*) has |g| >= 1e-4 max|g| of its tensor; per-step CE relative difference.

Usage: /tmp/refenv/bin/python tools/reference/olmo_core3_fp32_drift.py [--out /tmp/oc3_fp32_drift.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict

import torch
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import fixture_catalog  # noqa: E402, F401  (sets 1 thread, default dtype float64)
import fixture_training as FT  # noqa: E402
import moe_reference as R  # noqa: E402
import olmo_core3 as OC  # noqa: E402
from hf_side import PlainAdapter  # noqa: E402

F64, F32 = torch.float64, torch.float32
torch.set_num_threads(1)
FIXTURES = ["oc3_reordered", "oc3_sigmoid", "oc3_topk_softmax", "oc3_shared", "oc3_attention"]
SMALL_GRAD, BOUND, REPORT_STEPS = 1e-4, 1e-6, (1, 5, 10)
ORIG_BUILD, ORIG_PATCHES = OC.build_model, OC.oc_cpu_patches


def load_fixture(path):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        T = {k: f.get_tensor(k) for k in f.keys()}
    c = json.loads(meta["config"])
    fx = dict(model=R.ModelConfig(**c["model"]), loss=R.LossConfig(**c["loss"]),
              optim=R.OptimConfig(**c["optim"]), train=R.TrainConfig(**c["train"]))
    cfg = fx["model"]
    P = OrderedDict((n, T["param." + n]) for n in R.param_shapes(cfg))
    bias0 = None
    if cfg.has_router_bias():
        bias0 = OrderedDict((L, T[f"router_bias.{L}"]) for L in cfg.moe_layers())
    return fx, P, bias0, T["ids"].long(), T["labels"].long(), T, json.loads(meta["checks"])


def with_snapshots(base, oc_bias=False):
    """Adapter that records the parameters after every optimizer step. oc_bias: the loss-free bias
    of the next step is Olmo-core's own post_batch result (fp32), not run_training's update."""
    class Snap(base):
        def after_step(self, bias, counts):
            if hasattr(base, "after_step"):
                base.after_step(self, bias, counts)  # Olmo-core: post_batch + check vs bias
            if oc_bias and bias is not None:
                for L, rt in self.routers.items():
                    bias[L] = rt.score_bias.detach().clone()
            self.snaps.append(OrderedDict((n, t.to(F64)) for n, t in self.ref_params().items()))
    return Snap


def build_fp32(cfg, seq_len, lbl_coef=0.0, router_z_coef=0.0, f64_rope=True, lbl_granularity="local_batch"):
    """olmo_core3.build_model's model in float32 (it asserts a float64 default dtype and casts to
    float64: built that way, cast back exactly, router accumulators re-created in float32)."""
    torch.set_default_dtype(F64)
    try:
        m = ORIG_BUILD(cfg, seq_len, lbl_coef, router_z_coef, f64_rope=False, lbl_granularity=lbl_granularity)
    finally:
        torch.set_default_dtype(F32)
    m = m.to(F32)
    for rt in OC.routers(m, cfg).values():
        rt.reset_parameters()  # accumulators (hidden tensors) in the default dtype, float32
    return m


def stock_fp32_patches(keep_f64=False):
    return ORIG_PATCHES(keep_f64=False)  # GPU plumbing only, Olmo-core's float32 casts as shipped


def f32_tensors(model):
    """every tensor held by the model (params, buffers, hidden accumulators, RoPE caches) is fp32."""
    bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
           if t is not None and t.is_floating_point() and t.dtype != F32]
    for mn, mod in model.named_modules():
        for k, v in vars(mod).items():
            t = getattr(v, "x", v)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != F32:
                bad.append(f"{mn}.{k}")
        cache = getattr(mod, "_cache", None)
        for k, t in (cache.items() if hasattr(cache, "items") else []):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != F32:
                bad.append(f"{mn}._cache.{k}")
    return sorted(set(bad))


def run(kind, fx, P, bias0, ids, labels):
    cfg, lc, tr = fx["model"], fx["loss"], fx["train"]
    T_step, S = tr.batch_size * tr.seq_len, tr.seq_len
    if lc.aux_divisor == "labelled":  # the auxiliary losses' divisor, as make_fixtures passes it
        T_step = int((labels >= 0).sum())
    if kind == "oc64":
        torch.set_default_dtype(F64)
        ad = with_snapshots(OC.OlmoCore3Adapter)(cfg, P, lc.lbl_coef, lc.router_z_coef, T_step, S,
                                                 lbl_granularity=lc.lbl_granularity)
        ad.snaps = []
        return FT.run_training(ad, fx, ids, labels, bias0), ad
    P32 = OrderedDict((n, t.to(F32)) for n, t in P.items())
    b32 = None if bias0 is None else OrderedDict((L, b.to(F32)) for L, b in bias0.items())
    torch.set_default_dtype(F32)
    try:
        if kind == "oc32":
            OC.build_model, OC.oc_cpu_patches = build_fp32, stock_fp32_patches
            ad = with_snapshots(OC.OlmoCore3Adapter, oc_bias=True)(
                cfg, P32, lc.lbl_coef, lc.router_z_coef, T_step, S, lbl_granularity=lc.lbl_granularity)
        else:  # plain fp32
            R.DTYPE = F32
            ad = with_snapshots(PlainAdapter)(cfg, P32)
        ad.snaps = []
        rec = FT.run_training(ad, fx, ids, labels, b32)
        if kind == "oc32":
            rec["non_fp32_tensors"] = f32_tensors(ad.m)
        else:
            assert all(p.dtype == F32 for _, p in ad.m.named_ref())
        return rec, ad
    finally:
        OC.build_model, OC.oc_cpu_patches, R.DTYPE = ORIG_BUILD, ORIG_PATCHES, F64
        torch.set_default_dtype(F64)


def rel(a, b):
    s = float(b.abs().max())
    d = float((a.to(F64) - b).abs().max())
    return d / s if s > 0 else d


def param_drift(p32, p64, g1):
    """per tensor: max over elements with |g1| >= 1e-4 max|g1| of |p32 - p64|, / max|p64|."""
    out = OrderedDict()
    for n, ref in p64.items():
        g = g1[n].abs()
        mask = g >= SMALL_GRAD * float(g.max())
        if float(g.max()) == 0 or not mask.any():
            continue
        out[n] = float((p32[n] - ref).abs()[mask].max()) / float(ref.abs().max())
    return out


def measure(rec, ad, ref_rec, ref_ad, T, P):
    s0 = rec["step0"]
    g = OrderedDict((n, rel(s0["grads"][n], T["step0.grad." + n])) for n in P)
    gw = max(g, key=g.get)
    ce64 = T["train.ce"].tolist()
    out = dict(step0_logits_rel=rel(s0["logits"], T["step0.logits"]), step0_grad_worst=g[gw],
               step0_grad_worst_tensor=gw, step0_grad_rel=g,
               ce_rel=[abs(a - b) / abs(b) for a, b in zip(rec["ce"], ce64)],
               total_rel=[abs(a - b) / abs(b) for a, b in zip(rec["total"], T["train.total"].tolist())],
               routing_counts_equal_f64_all_steps=rec["counts"] == ref_rec["counts"])
    g1 = OrderedDict((n, T["step0.grad." + n]) for n in P)
    for k in REPORT_STEPS:
        d = param_drift(ad.snaps[k - 1], ref_ad.snaps[k - 1], g1)
        w = max(d, key=d.get)
        out[f"step{k}"] = dict(worst=d[w], worst_tensor=w, n_above_bound=sum(v > BOUND for v in d.values()),
                               n_tensors=len(d), per_tensor=d,
                               unmasked_worst=max(rel(ad.snaps[k - 1][n], ref_ad.snaps[k - 1][n]) for n in P))
    if rec["final_bias"] is not None:
        out["final_bias_max_abs"] = max(float((rec["final_bias"][L].to(F64) - T[f"final.router_bias.{L}"])
                                              .abs().max()) for L in rec["final_bias"])
    if "non_fp32_tensors" in rec:
        out["non_fp32_tensors"] = rec["non_fp32_tensors"]
        out["post_batch_vs_f64_bias_update_max_abs"] = max(d["bias"] for d in ad.bias_checks) \
            if ad.bias_checks else 0.0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(REPO, "tests", "golden", "olmo_core3"))
    ap.add_argument("--out", default="/tmp/oc3_fp32_drift.json")
    ap.add_argument("--write", action="store_true",
                    help="also write the summary the C++ test reads: <dir>/fp32_drift.json")
    ap.add_argument("--only", nargs="*", default=None,
                    help="these fixtures only; --write then keeps the others' entries as they are")
    args = ap.parse_args()
    res = OrderedDict()
    for name in [n for n in FIXTURES if not args.only or n in args.only]:
        fx, P, bias0, ids, labels, T, checks = load_fixture(os.path.join(args.dir, name + ".safetensors"))
        r64, a64 = run("oc64", fx, P, bias0, ids, labels)
        chk = max(rel(r64["final_params"][n], T["final.param." + n]) for n in P)
        assert chk <= 1e-12, (name, chk)
        assert rel(a64.snaps[-1]["embed"], T["final.param.embed"]) <= 1e-12
        res[name] = OrderedDict(f64_rerun_final_vs_fixture_rel=chk,
                                plain_vs_oc_f64_final_rel_fixture_check=checks[
                                    "plain_vs_olmo_core3_this_config"]["final_param_max_rel_to_tensor_max"])
        for kind in ("oc32", "plain32"):
            rec, ad = run(kind, fx, P, bias0, ids, labels)
            res[name][kind] = measure(rec, ad, r64, a64, T, P)
            print(f"{name} {kind} done", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if args.write:  # tests/model/olmo_core3_golden_test.cpp bounds moecore's fp32 drift by these
        summary = OrderedDict(
            (name, OrderedDict((kind, OrderedDict(step0_grad_worst=r[kind]["step0_grad_worst"],
                                                  **{f"step{k}_worst": r[kind][f"step{k}"]["worst"]
                                                     for k in REPORT_STEPS}))
                               for kind in ("oc32", "plain32")))
            for name, r in res.items())
        summary_path = os.path.join(args.dir, "fp32_drift.json")
        if args.only and os.path.exists(summary_path):
            with open(summary_path) as f:
                kept = json.load(f, object_pairs_hook=OrderedDict)
            kept.pop("notes", None)
            summary = OrderedDict((n, summary[n] if n in summary else kept[n])
                                  for n in FIXTURES if n in summary or n in kept)
        summary["notes"] = ("max|p32 - p64| / max|p64| per tensor, the worst tensor, after k AdamW steps of the "
                            "fixture's run in float32 (oc32: Olmo-core 3's own model, plain32: "
                            "moe_reference.py), over elements whose step-1 |g| >= 1e-4 max|g|; "
                            "tools/reference/olmo_core3_fp32_drift.py --write")
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    hdr = (f"{'fixture':17s}{'impl':8s}{'logits0':>9s}{'grad0':>9s}  {'after 1':>13s}{'after 5':>13s}"
           f"{'after 10':>13s}  worst@10 / worst grad0{'CE rel max':>12s}")
    print(hdr)
    for name, r in res.items():
        for kind in ("oc32", "plain32"):
            m = r[kind]
            cells = "".join(f"{m[f'step{k}']['worst']:9.1e}({m[f'step{k}']['n_above_bound']:2d})"
                            for k in REPORT_STEPS)
            print(f"{name:17s}{kind:8s}{m['step0_logits_rel']:9.1e}{m['step0_grad_worst']:9.1e}  {cells}  "
                  f"{m['step10']['worst_tensor']} / {m['step0_grad_worst_tensor']}{max(m['ce_rel']):12.1e}")
        print(f"{'':17s}f64 rerun vs fixture final {r['f64_rerun_final_vs_fixture_rel']:.1e}; "
              f"tensors compared {r['oc32']['step10']['n_tensors']}; routing equal to f64 all steps: "
              f"oc32 {r['oc32']['routing_counts_equal_f64_all_steps']}, "
              f"plain32 {r['plain32']['routing_counts_equal_f64_all_steps']}; "
              f"oc32 non-fp32 tensors {r['oc32']['non_fp32_tensors']}")
    print("(k): tensors above 1e-6 (masked: step-1 |g| >= 1e-4 max|g|); JSON ->", args.out)


if __name__ == "__main__":
    main()
