#!/usr/bin/env python
"""Writes tests/golden/mxfp8/model.safetensors: the whole model trained in MXFP8 by a PyTorch
emulation (train.precision = "mxfp8" with mxfp8.experts, and mxfp8.attention on), which the C++
f64 reference path must reproduce with every quantized tensor byte-equal (tests/model/
mxfp8_golden_test.cpp). CI only reads the file.

    /tmp/refenv/bin/pip install -r tools/reference/requirements.txt torchao==0.18.0 ml_dtypes==0.7.0
    /tmp/refenv/bin/python tools/reference/make_mx_model_fixture.py [--out FILE]

The emulation is moe_reference.py's plain float64 model with two changes, as moecore's MXFP8 mode
defines them (docs/MXFP8.md; model/mx_experts.h, model/attention_block.cpp):
- the routed experts' grouped GEMMs (forward and data gradient) and the attention q/k/v/o
  projections multiply dequantized MXFP8 operands: torchao's to_mx (rceil passed explicitly,
  E4M3, blocks of 32 along the reduction dimension) of the float32-rounded tensor, through
  make_mx_fixtures.quantize (torchao's bytes, except in blocks where torchao departs from its own
  documented rule; the count of such blocks is recorded and is 0 here);
- the weight gradients multiply the unquantized upstream gradient with the saved operand
  dequantized.
Everything else (router, shared expert, dense FFN, attention core, norms, LM head, losses) is the
plain float64 model. Products of dequantized values are exact in float64, so moecore's f64 path
and this one differ only in summation order (~1e-16), and every later quantization sees the same
float32 input: the quantized bytes must be equal, not close.

The file has the golden-fixture layout of make_fixtures.py (param.*, ids, labels, step0.*, train.*,
final.*; README.md) plus, for optimizer step 1, every quantized tensor, as U8 bytes:
  q.L<l>.experts.<gate|up|down>.<q|t>.codes/.scales   the expert weight caches (q: along the
        forward's reduction; t: along the data gradient's, stored transposed)
  q.L<l>.attn.<wq|wk|wv|wo>.<q|t>.codes/.scales       the attention projections' caches
  q.mb<m>.L<l>.attn.<h|o|dy|dq|dk|dv>.codes/.scales   micro-batch m: normed input, attention output,
        the output projection's upstream gradient, the q/k/v projections' upstream gradients
  q.mb<m>.L<l>.experts.<x|a|dy|dgate|dup>.codes/...   gathered rows (R,D) in moecore's expert-major,
        slot-ascending order; SwiGLU output; output gradient; SwiGLU gradients
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from dataclasses import asdict
from importlib.metadata import version as pkg_version

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import fixture_catalog as FC  # noqa: E402  (sets 1 thread, default dtype float64)
import fixture_training as FT  # noqa: E402
from hf_side import PlainAdapter  # noqa: E402
import make_mx_fixtures as MX  # noqa: E402
import moe_reference as R  # noqa: E402
from fixture_io import versions  # noqa: E402

F64 = torch.float64
ELEM = "e4m3"
RULE = "rceil"
FP8 = torch.float8_e4m3fn


class Recorder:
    """Quantizes (one place for every MXFP8 tensor of the emulation) and keeps the bytes of the
    tensors of the optimizer step being recorded."""

    def __init__(self):
        self.tensors = OrderedDict()
        self.record_weights = False  # the caches, at step 1's first forward (q.L*)
        self.record_acts = False     # the activations and gradients of step 1 (q.mb*)
        self.deviations = 0
        self.values = 0

    def q(self, x, tag=None):
        """x (rows, K) float64 -> dequantized float64 (rows, K); blocks of 32 along K."""
        x = x.detach().contiguous()
        _, _, codes, scales, devs, _ = MX.quantize(x.to(torch.float32), ELEM, RULE)
        self.deviations += len(devs)
        if tag is not None and (self.record_weights if tag.startswith("q.L") else self.record_acts):
            assert tag not in self.tensors, tag
            self.tensors[tag + ".codes"] = codes.contiguous()
            self.tensors[tag + ".scales"] = scales.contiguous()
            self.values += codes.numel()
        s = torch.pow(torch.tensor(2.0, dtype=F64), scales.to(F64) - 127.0)
        deq = codes.view(FP8).to(F64).reshape(x.shape[0], -1, MX.B) * s[:, :, None]
        return deq.reshape(x.shape)

    def qt(self, w, tag=None):
        """The transposed copy of w (N,K), quantized along N: (K,N)."""
        return self.q(w.t().contiguous(), tag)


REC = Recorder()


def silu_grad(g):
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


class MxExperts(torch.autograd.Function):
    """The routed experts of one MoE layer on the gathered rows x (R,D) (expert-major order,
    offsets: E+1 ints), as model/mx_experts.cpp runs them."""

    @staticmethod
    def forward(ctx, x, gate, up, down, offsets, tag, wtag):
        E, Fh, D = gate.shape
        xd = REC.q(x, tag + ".x")
        wg = REC.q(gate.reshape(E * Fh, D), wtag + ".gate.q").reshape(E, Fh, D)
        wu = REC.q(up.reshape(E * Fh, D), wtag + ".up.q").reshape(E, Fh, D)
        wd = REC.q(down.reshape(E * D, Fh), wtag + ".down.q").reshape(E, D, Fh)
        R_ = x.shape[0]
        eg = torch.zeros(R_, Fh, dtype=F64)
        eu = torch.zeros(R_, Fh, dtype=F64)
        for e in range(E):
            a, b = offsets[e], offsets[e + 1]
            eg[a:b] = xd[a:b] @ wg[e].t()
            eu[a:b] = xd[a:b] @ wu[e].t()
        act = F.silu(eg) * eu
        ad = REC.q(act, tag + ".a")
        y = torch.zeros(R_, D, dtype=F64)
        for e in range(E):
            a, b = offsets[e], offsets[e + 1]
            y[a:b] = ad[a:b] @ wd[e].t()
        # The transposed caches, quantized from the same masters (made here, recorded once).
        names = (".gate.t", ".up.t", ".down.t")
        wts = [[REC.qt(w[e], f"{wtag}{n}.{e}") for e in range(E)] for w, n in zip((gate, up, down), names)]
        ctx.save_for_backward(xd, eg, eu, ad)
        ctx.wts = wts
        ctx.offsets = offsets
        ctx.tag = tag
        return y

    @staticmethod
    def backward(ctx, gy):
        xd, eg, eu, ad = ctx.saved_tensors
        wgt, wut, wdt = ctx.wts  # per expert: (D,F) for gate/up, (F,D) for down
        off, tag = ctx.offsets, ctx.tag
        E = len(off) - 1
        gd = REC.q(gy, tag + ".dy")
        Fh = eg.shape[1]
        da = torch.zeros_like(eg)
        dWd = torch.zeros(E, gy.shape[1], Fh, dtype=F64)
        for e in range(E):
            a, b = off[e], off[e + 1]
            da[a:b] = gd[a:b] @ wdt[e].t()
            dWd[e] = gy[a:b].t() @ ad[a:b]
        dg = da * eu * silu_grad(eg)
        du = da * F.silu(eg)
        dgd = REC.q(dg, tag + ".dgate")
        dud = REC.q(du, tag + ".dup")
        dx = torch.zeros_like(xd)
        dWg = torch.zeros(E, Fh, xd.shape[1], dtype=F64)
        dWu = torch.zeros_like(dWg)
        for e in range(E):
            a, b = off[e], off[e + 1]
            dx[a:b] = dgd[a:b] @ wgt[e].t() + dud[a:b] @ wut[e].t()
            dWg[e] = dg[a:b].t() @ xd[a:b]
            dWu[e] = du[a:b].t() @ xd[a:b]
        return dx, dWg, dWu, dWd, None, None, None


class MxProjections(torch.autograd.Function):
    """q, k, v = h Wq^T, h Wk^T, h Wv^T with h quantized once (model/attention_block.cpp)."""

    @staticmethod
    def forward(ctx, h, wq, wk, wv, tag, wtag):
        hd = REC.q(h, tag + ".h")
        outs, wts = [], []
        for w, n in ((wq, "wq"), (wk, "wk"), (wv, "wv")):
            outs.append(hd @ REC.q(w, f"{wtag}.{n}.q").t())
            wts.append(REC.qt(w, f"{wtag}.{n}.t"))
        ctx.save_for_backward(hd)
        ctx.wts = wts
        ctx.tag = tag
        return tuple(outs)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        (hd,) = ctx.saved_tensors
        dh = torch.zeros_like(hd)
        dws = []
        for g, wt, n in zip((gq, gk, gv), ctx.wts, ("dq", "dk", "dv")):
            dh = dh + REC.q(g, f"{ctx.tag}.{n}") @ wt.t()
            dws.append(g.t() @ hd)
        return dh, dws[0], dws[1], dws[2], None, None


class MxLinear(torch.autograd.Function):
    """y = x W^T (the output projection), x quantized from float64."""

    @staticmethod
    def forward(ctx, x, w, tag, xname, gname, wtag):
        xd = REC.q(x, f"{tag}.{xname}")
        y = xd @ REC.q(w, wtag + ".q").t()
        ctx.save_for_backward(xd)
        ctx.wt = REC.qt(w, wtag + ".t")
        ctx.gtag = f"{tag}.{gname}"
        return y

    @staticmethod
    def backward(ctx, gy):
        (xd,) = ctx.saved_tensors
        return REC.q(gy, ctx.gtag) @ ctx.wt.t(), gy.t() @ xd, None, None, None, None


class MxReference(R.MoEReference):
    """moe_reference.MoEReference with MXFP8 experts and attention projections."""

    micro_batch = 0

    def _attention(self, L, h):
        c = self.cfg
        B, S, D = h.shape
        P = lambda n: self.param(f"layers.{L}.{n}")
        tag = f"q.mb{self.micro_batch}.L{L}.attn"
        q, k, v = MxProjections.apply(h.reshape(B * S, D), P("wq"), P("wk"), P("wv"), tag, f"q.L{L}.attn")
        q, k, v = q.view(B, S, -1), k.view(B, S, -1), v.view(B, S, -1)
        if c.qk_norm == "full":
            q = R.rmsnorm(q, P("q_norm"), c.norm_eps)
            k = R.rmsnorm(k, P("k_norm"), c.norm_eps)
        q = q.view(B, S, c.n_heads, c.head_dim)
        k = k.view(B, S, c.n_kv_heads, c.head_dim)
        v = v.view(B, S, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "per_head":
            q = R.rmsnorm(q, P("q_norm"), c.norm_eps)
            k = R.rmsnorm(k, P("k_norm"), c.norm_eps)
        q = R.rope(q, c.rope_theta)
        k = R.rope(k, c.rope_theta)
        o = R.causal_gqa_attention(q, k, v).reshape(B * S, c.n_heads * c.head_dim)
        y = MxLinear.apply(o, P("wo"), tag, "o", "dy", f"q.L{L}.attn.wo")
        return y.view(B, S, D)

    def _moe(self, L, h, router_bias, info):
        c = self.cfg
        B, S, D = h.shape
        P = lambda n: self.param(f"layers.{L}.{n}")
        x = h.reshape(B * S, D)
        z = F.linear(x, P("router"))
        s = torch.softmax(z, dim=-1) if c.score_func == "softmax" else torch.sigmoid(z)
        sel = s.detach()
        if router_bias is not None:
            sel = sel + router_bias[None, :]
        order = torch.sort(sel, dim=-1, descending=True, stable=True).indices
        idx = order[:, : c.top_k]
        w = s.gather(1, idx)
        if c.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        # moecore's permutation: expert-major, slot t*K+j ascending within an expert.
        toks, slots, offsets = [], [], [0]
        for e in range(c.num_experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            toks.append(tok)
            slots.append(slot)
            offsets.append(offsets[-1] + tok.numel())
        tok, slot = torch.cat(toks), torch.cat(slots)
        ys = MxExperts.apply(x[tok], P("experts.gate"), P("experts.up"), P("experts.down"), offsets,
                             f"q.mb{self.micro_batch}.L{L}.experts", f"q.L{L}.experts")
        out = torch.zeros_like(x).index_add(0, tok, ys * w[tok, slot][:, None])
        if c.shared_hidden > 0:
            u = R.swiglu_mlp(x, P("shared.gate"), P("shared.up"), P("shared.down"))
            out = out + u if c.shared_merge == "sum" else u / (c.top_k + 1) + out * (c.top_k / (c.top_k + 1))
        sel_sorted = torch.sort(sel, dim=-1, descending=True).values
        info.append(dict(layer=L, logits=z, scores=s, idx=idx, weights=w, sel_sorted=sel_sorted))
        return out.view(B, S, D)


class MxAdapter(PlainAdapter):
    """fixture_training.run_training's adapter over MxReference; records optimizer step 1 only."""

    def __init__(self, cfg, params, micro_batches):
        super().__init__(cfg, params)
        self.m = MxReference(cfg, params)
        self.M = micro_batches
        self.calls = 0

    def forward(self, ids, router_bias=None):
        self.m.micro_batch = self.calls % self.M
        REC.record_weights = self.calls == 0
        REC.record_acts = self.calls < self.M
        self.calls += 1
        return self.m(ids, router_bias)


FIXTURE = dict(
    model=R.ModelConfig(
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
        norm_eps=1e-5, norm_placement="pre", tie_embeddings=False, rope_theta=10000.0,
        qk_norm="full", n_dense_layers=1, dense_hidden=48, num_experts=8, top_k=2,
        expert_hidden=32, score_func="softmax", norm_topk_prob=False, shared_hidden=16,
        shared_merge="sum", routing="learned", router_bias_gamma=0.0, init_std=0.02),
    loss=R.LossConfig(lm_z_coef=1e-3, lbl_coef=0.05, router_z_coef=0.005),
    optim=FC.optim(max_grad_norm=0.3),
    train=R.TrainConfig(steps=10, seq_len=40, batch_size=4, micro_batch_size=2),
    design=dict(seed=5005, embed_std=1.0, embed_offset=3.0, router_std=0.3,
                zero_experts=[(1, 3, -8.0)], final_norm_scale=1.0, out_norm_scale=None,
                bias_std=0.0, masked=(5, 17)),
)


def u8(t):
    return ("U8", tuple(t.shape), MX.np_bytes(t.view(torch.uint8).numpy()))


def f64(t):
    t = torch.as_tensor(t, dtype=F64).detach().contiguous()
    return ("F64", tuple(t.shape), MX.np_bytes(t.numpy()))


def i32(t):
    t = torch.as_tensor(t).to(torch.int32).contiguous()
    return ("I32", tuple(t.shape), MX.np_bytes(t.numpy()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/golden/mxfp8/model.safetensors"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(F64)
    fx = FIXTURE
    cfg, lc, oc, tr, design = fx["model"], fx["loss"], fx["optim"], fx["train"], fx["design"]
    cfg.validate()
    gen = torch.Generator().manual_seed(design["seed"])
    torch.manual_seed(design["seed"])
    P = FC.init_params(cfg, design, gen)
    ids, labels = FC.make_batch(cfg, tr, design, gen)
    n_redrawn, _ = FC.redraw_until_separated(cfg, design, P, None, ids, gen)
    M = tr.batch_size // tr.micro_batch_size

    # The unquantized model on the same start, for the record: how much MXFP8 moves the losses.
    plain = FT.run_training(PlainAdapter(cfg, P), fx, ids, labels, None)
    REC.tensors.clear()
    adapter = MxAdapter(cfg, P, M)
    rec = FT.run_training(adapter, fx, ids, labels, None)
    s0 = rec["step0"]
    assert s0["min_gap"] >= FC.GAP_STEP0_MIN, s0["min_gap"]
    assert min(rec["min_gap"]) > FC.GAP_ALL_MIN, rec["min_gap"]
    assert REC.deviations == 0, f"{REC.deviations} blocks where torchao departs from its rule"
    clipped = [n + 1 for n, g in enumerate(rec["grad_norm"]) if g > oc.max_grad_norm]

    T = OrderedDict()
    for n, t in P.items():
        T["param." + n] = f64(t)
    T["ids"] = i32(ids)
    T["labels"] = i32(labels)
    T["step0.logits"] = f64(s0["logits"])
    for k in ("ce", "lm_z", "total"):
        T["step0." + k] = f64([s0[k]])
    T["step0.grad_norm"] = f64([rec["grad_norm"][0]])
    for L in cfg.moe_layers():
        T[f"step0.lbl.{L}"] = f64([s0["lbl"][L]])
        T[f"step0.router_z.{L}"] = f64([s0["rz"][L]])
        T[f"step0.counts.{L}"] = i32(s0["counts"][L])
    for n, g in s0["grads"].items():
        T["step0.grad." + n] = f64(g)
    for k in ("total", "ce", "grad_norm", "lr"):
        T["train." + k] = f64(rec[k])
    for n, t in rec["final_params"].items():
        T["final.param." + n] = f64(t)
    # The per-expert transposed caches were recorded one expert at a time: stack them.
    qs = OrderedDict()
    for name, t in REC.tensors.items():
        parts = name.split(".")
        if len(parts) == 7 and parts[2] == "experts" and parts[4] == "t":  # q.L1.experts.gate.t.<e>.codes
            key = ".".join(parts[:5] + parts[6:])
            qs.setdefault(key, []).append(t)
        else:
            qs[name] = t
    for name, t in qs.items():
        T[name] = u8(torch.stack(t) if isinstance(t, list) else t)

    checks = OrderedDict(
        embedding_rows_redrawn_for_routing_separation=n_redrawn,
        torchao_rule_deviation_blocks=REC.deviations,
        quantized_tensors_recorded=sum(1 for n in T if n.startswith("q.") and n.endswith(".codes")),
        quantized_values_recorded=REC.values,
        min_topk_gap_step0=s0["min_gap"], min_topk_gap_all_steps=min(rec["min_gap"]),
        clipped_steps=clipped, grad_norm_pre_clip=rec["grad_norm"],
        train_total_mxfp8=rec["total"], train_total_unquantized=plain["total"],
        step0_ce_mxfp8_minus_unquantized=s0["ce"] - plain["step0"]["ce"],
        final_ce_rel_change_mxfp8_vs_unquantized=(rec["ce"][-1] - plain["ce"][-1]) / plain["ce"][-1],
    )
    cfg_json = dict(model=R.model_dict(cfg, with_new_fields=False), loss=asdict(lc), optim=asdict(oc),
                    train=dict(asdict(tr), precision="mxfp8"),
                    mxfp8=dict(experts=True, dispatch=True, attention=True, scale_rule=RULE, grad_format=ELEM))
    ver = dict(versions(), torchao=pkg_version("torchao"), script="tools/reference/make_mx_model_fixture.py")
    meta = {"format": "moecore-golden-v1", "config": json.dumps(cfg_json), "versions": json.dumps(ver),
            "checks": json.dumps(checks),
            "notes": json.dumps(dict(design=dict(design, zero_experts=[list(z) for z in design["zero_experts"]]),
                                     recorded="q.* are optimizer step 1's quantized tensors"))}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    MX.write(args.out, T, meta)
    print(json.dumps(checks, indent=1))
    print(f"wrote {args.out}: {len(T)} tensors, {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
