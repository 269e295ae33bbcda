"""The transformers side of the fixtures: float64 precision patches for OlmoeForCausalLM and
adapters that run it (or the plain module) on a fixture's parameters. Used by make_fixtures.py
(through fixture_training.py and fixture_checks.py)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import struct
import sys
from collections import OrderedDict
from importlib.metadata import version as pkg_version

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402

F64 = torch.float64


# =========================================================================== transformers side
@contextlib.contextmanager
def hf_f64_patches(active=True):
    """transformers' Olmoe upcasts to *float32* in RMSNorm, router softmax and RoPE (and its loss
    function casts logits to float32). In a float64 model these are downcasts that cost ~1e-7.
    Patch them to upcast to at least float32 instead (i.e. keep float64): pure precision changes,
    the formulas are untouched. Unpatched ('stock') differences are recorded in `checks`."""
    from transformers.models.olmoe import modeling_olmoe as MO
    if not active:
        yield
        return

    def rms_forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hs = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hs.pow(2).mean(-1, keepdim=True)
        hs = hs * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hs.to(input_dtype)

    def router_forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(
            router_logits, dtype=torch.promote_types(router_logits.dtype, torch.float32), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        router_top_value = router_top_value.to(router_logits.dtype)
        return router_logits, router_top_value, router_indices

    def rotary_forward(self, x, position_ids):
        dt = torch.promote_types(x.dtype, torch.float32)
        freqs = position_ids[..., None].to(dt) * self.inv_freq.to(device=x.device, dtype=dt)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    saved = [(MO.OlmoeRMSNorm, "forward", MO.OlmoeRMSNorm.forward),
             (MO.OlmoeTopKRouter, "forward", MO.OlmoeTopKRouter.forward),
             (MO.OlmoeRotaryEmbedding, "forward", MO.OlmoeRotaryEmbedding.forward)]
    MO.OlmoeRMSNorm.forward = rms_forward
    MO.OlmoeTopKRouter.forward = router_forward
    MO.OlmoeRotaryEmbedding.forward = rotary_forward
    try:
        yield
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)


def hf_supported(cfg: R.ModelConfig):
    return (cfg.norm_placement == "pre" and cfg.qk_norm == "full" and cfg.n_dense_layers == 0
            and cfg.shared_hidden == 0 and cfg.score_func == "softmax"
            and cfg.router_bias_gamma == 0 and cfg.head_dim * cfg.n_heads == cfg.d_model)


class HFAdapter:
    """OlmoeForCausalLM holding the fixture's parameters; exposes MODEL.md names."""

    def __init__(self, cfg: R.ModelConfig, params, f64_patched=True):
        from transformers import OlmoeConfig, OlmoeForCausalLM
        assert hf_supported(cfg)
        self.cfg = cfg
        self.patched = f64_patches = bool(f64_patched)
        hcfg = OlmoeConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.expert_hidden,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
            norm_topk_prob=cfg.norm_topk_prob, tie_word_embeddings=cfg.tie_embeddings,
            pad_token_id=None, bos_token_id=None, eos_token_id=None,  # no padding_idx (it kills the row's grad)
            max_position_embeddings=4096, attention_bias=False, attention_dropout=0.0,
            clip_qkv=None, attn_implementation="sdpa", experts_implementation="eager")
        torch.manual_seed(0)  # HF's own init is overwritten below
        m = OlmoeForCausalLM(hcfg).to(F64)
        m.train()
        assert m.model.embed_tokens.padding_idx is None
        assert m.config._attn_implementation == "sdpa"
        assert m.config._experts_implementation == "eager"
        if cfg.tie_embeddings:
            assert m.lm_head.weight is m.model.embed_tokens.weight
        if f64_patches:
            hd = cfg.head_dim
            m.model.rotary_emb.inv_freq = 1.0 / (
                cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=F64) / hd))
        self.m = m
        self.hf = self._name_map()
        with torch.no_grad():
            for name, t in params.items():
                self._view(name, "data").copy_(t)
        self.captured = []
        for L, layer in enumerate(m.model.layers):
            layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, L=L: self.captured.append((L, out)))

    def _name_map(self):
        F_ = self.cfg.expert_hidden
        mp = OrderedDict()
        mp["embed"] = ("model.embed_tokens.weight", None)
        for L in range(self.cfg.n_layers):
            h = f"model.layers.{L}."
            p = f"layers.{L}."
            mp[p + "attn_norm"] = (h + "input_layernorm.weight", None)
            mp[p + "wq"] = (h + "self_attn.q_proj.weight", None)
            mp[p + "wk"] = (h + "self_attn.k_proj.weight", None)
            mp[p + "wv"] = (h + "self_attn.v_proj.weight", None)
            mp[p + "wo"] = (h + "self_attn.o_proj.weight", None)
            mp[p + "q_norm"] = (h + "self_attn.q_norm.weight", None)
            mp[p + "k_norm"] = (h + "self_attn.k_norm.weight", None)
            mp[p + "ffn_norm"] = (h + "post_attention_layernorm.weight", None)
            mp[p + "router"] = (h + "mlp.gate.weight", None)
            # fused (E, 2F, D): gate = rows [0, F), up = rows [F, 2F) (chunk(2, dim=-1) of the output)
            mp[p + "experts.gate"] = (h + "mlp.experts.gate_up_proj", slice(0, F_))
            mp[p + "experts.up"] = (h + "mlp.experts.gate_up_proj", slice(F_, 2 * F_))
            mp[p + "experts.down"] = (h + "mlp.experts.down_proj", None)
        mp["final_norm"] = ("model.norm.weight", None)
        if not self.cfg.tie_embeddings:
            mp["lm_head"] = ("lm_head.weight", None)
        assert list(mp) == list(R.param_shapes(self.cfg)), "name map != MODEL.md table"
        hf_names = {n for n, _ in self.m.named_parameters()}
        assert {v[0] for v in mp.values()} == hf_names, hf_names ^ {v[0] for v in mp.values()}
        return mp

    def _view(self, name, what):
        hname, sl = self.hf[name]
        p = self.m.get_parameter(hname)
        t = p.data if what == "data" else p.grad
        if t is None:
            return None
        return t[:, sl] if sl is not None else t

    def ref_params(self):
        return OrderedDict((n, self._view(n, "data").detach().clone()) for n in self.hf)

    def ref_grads(self):
        return OrderedDict((n, self._view(n, "grad").detach().clone()) for n in self.hf)

    def opt_params(self):
        out, seen = [], set()
        for hname, p in self.m.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            ref = [n for n, (h, _) in self.hf.items() if h == hname][0]
            out.append((ref, p, not R.is_no_decay(ref)))
        return out

    def forward(self, ids, router_bias=None):
        assert router_bias is None
        self.captured.clear()
        out = self.m(input_ids=ids, output_router_logits=True, use_cache=False)
        info = []
        for (L, (z, top_w, idx)), z2 in zip(self.captured, out.router_logits):
            assert z is z2 or torch.equal(z, z2)
            s = torch.softmax(z, dim=-1)
            info.append(dict(layer=L, logits=z, scores=s, idx=idx, weights=top_w,
                             sel_sorted=torch.sort(s.detach(), dim=-1, descending=True).values))
        return out.logits, info


class PlainAdapter:
    def __init__(self, cfg, params):
        self.cfg = cfg
        self.m = R.MoEReference(cfg, params)
        self.patched = True

    def ref_params(self):
        return OrderedDict((n, p.detach().clone()) for n, p in self.m.named_ref())

    def ref_grads(self):
        return OrderedDict((n, p.grad.detach().clone()) for n, p in self.m.named_ref())

    def opt_params(self):
        return [(n, p, not R.is_no_decay(n)) for n, p in self.m.named_ref()]

    def forward(self, ids, router_bias=None):
        return self.m(ids, router_bias)
