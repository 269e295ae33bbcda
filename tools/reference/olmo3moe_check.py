"""Cross-check of the Olmo-core 3 reference (olmo_core3.py) against Olmo-core 3.0.0's own Hugging
Face model class `Olmo3MoeForCausalLM` (olmo_core/nn/moe/v2/hf/modeling_olmo3moe.py), float64.

Olmo-core 3.0.0's defects worked around here (see tools/reference/README.md):
- its HF config builder `get_hf_config` refuses peri-LN models, writes max_position_embeddings = -1
  and drops a dense layer at index 1, so `Olmo3MoeConfig` is built by hand (`hf_config`);
- `modeling_olmo3moe._create_mask_compat` filters the mask kwargs to `create_causal_mask`'s
  signature, which under transformers 5.24 names the cache `cache` (not `past_key_values`): the
  required argument is dropped and the forward raises. `hf_patches` renames it, nothing else;
- Olmo-core's tensor converter `convert_olmo3moe_state_to_hf` is used for the weights; it rejects
  the router's `score_bias` buffer (olmo3moe has no score bias), which is dropped for the
  variant below, and the attention biases (which olmo3moe's attention_bias carries), which are
  moved by hand to q/k/v/o_proj.bias.
float64 patches (precision only, same formulas): Olmo3MoeRMSNorm, the rotary tables and the routed
experts' accumulator cast to float32 explicitly; `Tensor.float()` keeps float64 (router).
Configs olmo3moe cannot express (pre-norm, topk_softmax, qk_norm none, sigmoid eps != 1e-7,
expert_weight_scale != 1, a nonzero loss-free bias) are checked as a stated variant where one
exists: bias 0 and expert_weight_scale folded into the experts' down_proj (x scale, exact in
exact arithmetic since the routed output is linear in both), logits only.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import OrderedDict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402
import olmo_core3 as OC  # noqa: E402

F64 = torch.float64


def not_expressible(cfg: R.ModelConfig):
    """Reasons olmo3moe cannot express cfg exactly, and whether a variant check applies."""
    why, variant = [], []
    if cfg.norm_placement == "pre":
        why.append("pre-norm (olmo3moe has post/peri norms only)")
    if cfg.score_func not in ("softmax", "sigmoid"):
        why.append(f"gating {cfg.score_func} (olmo3moe: softmax | sigmoid)")
    if cfg.score_func == "sigmoid" and cfg.sigmoid_eps != 1e-7:
        why.append("sigmoid eps != 1e-7 (olmo3moe adds exactly 1e-7)")
    if cfg.qk_norm == "none":
        why.append("qk_norm none (olmo3moe always has q/k norms)")
    if cfg.shared_merge != "sum":
        why.append("shared_merge v1")
    if cfg.expert_weight_scale != 1.0:
        variant.append("expert_weight_scale (no olmo3moe field): folded into experts' down_proj")
    if cfg.n_group > 0:
        why.append("group-limited routing (olmo3moe has no n_group / topk_group)")
    if cfg.rope == "windowed":
        why.append("RoPE on windowed layers only (olmo3moe: use_rope for all layers or none)")
    if len({cfg.window(L) for L in range(cfg.n_layers)} - {0}) > 1:
        why.append("several sliding-window sizes (olmo3moe has one sliding_window)")
    if cfg.shared_experts > 1 or cfg.shared_router:
        why.append("several shared experts / a shared router (olmo3moe has one ungated shared expert)")
    if cfg.router_logit_bias:
        why.append("router logit bias (olmo3moe's gate is a Linear without bias)")
    if cfg.clip_qkv > 0:
        why.append("clip_qkv (olmo3moe has no field for it)")
    if cfg.rope_partial != 1.0:
        why.append("partial RoPE (olmo3moe rotates every head dim)")
    if cfg.has_router_bias():
        variant.append("router bias (olmo3moe has no score bias): bias 0 on both sides")
    return why, variant


def hf_config(cfg: R.ModelConfig, seq_len: int):
    """Olmo3MoeConfig by hand (Olmo-core's get_hf_config cannot, see the module docstring)."""
    from olmo_core.nn.moe.v2.hf.configuration_olmo3moe import Olmo3MoeConfig
    return Olmo3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        attention_hidden_size=cfg.n_heads * cfg.head_dim, head_dim=cfg.head_dim,
        dense_mlp_intermediate_size=cfg.dense_hidden, moe_intermediate_size=cfg.expert_hidden,
        shared_expert_intermediate_size=cfg.shared_hidden or None,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
        original_num_experts_per_tok=cfg.original_top_k or None,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, hidden_act="silu", gating_function=cfg.score_func,
        normalize_expert_weights=cfg.norm_topk_p if cfg.norm_topk_prob else None,
        restore_weight_scale=cfg.restore_weight_scale, max_position_embeddings=seq_len,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=cfg.attention_bias, rms_norm_eps=cfg.norm_eps,
        sliding_window=max([cfg.window(L) for L in range(cfg.n_layers)]) or None,
        use_head_qk_norm=cfg.qk_norm == "per_head", use_rope=cfg.rope != "none",
        layer_types=["sliding_attention" if cfg.window(L) else "full_attention"
                     for L in range(cfg.n_layers)],
        dense_layers_indices=cfg.dense_layer_set(), dense_layers_use_shared_expert=True,
        embed_scale=cfg.embed_scale, embed_norm=cfg.embedding_norm,
        use_peri_ln=cfg.norm_placement == "peri", attn_implementation="sdpa")


@contextlib.contextmanager
def hf_patches():
    from olmo_core.nn.moe.v2.hf import modeling_olmo3moe as M
    from inspect import signature
    orig_compat = M._create_mask_compat

    def mask_compat(mask_fn, **kwargs):  # transformers 5.24: past_key_values -> cache
        if "cache" in set(signature(mask_fn).parameters) and "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        return orig_compat(mask_fn, **kwargs)

    def rms_forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hs = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hs.pow(2).mean(-1, keepdim=True)
        hs = hs * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hs).to(input_dtype)

    def rotary_forward(self, x, position_ids, layer_type=None):
        assert layer_type is None and self.layer_type is None and self.attention_scaling == 1.0
        dt = torch.promote_types(x.dtype, torch.float32)
        inv = self.inv_freq[None, :, None].to(dt).expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].to(dt)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def experts_loop(self, hidden_states, topk_ids, topk_weights):
        N, H = hidden_states.shape
        acc = torch.promote_types(hidden_states.dtype, torch.float32)
        out = hidden_states.new_zeros((N, H), dtype=acc)
        for expert_id, expert in enumerate(self):
            mask = topk_ids == expert_id
            if not mask.any():
                continue
            token_ids, k_ids = mask.nonzero(as_tuple=True)
            y_sel = expert(hidden_states.index_select(0, token_ids))
            w_sel = topk_weights[token_ids, k_ids].unsqueeze(-1).to(acc)
            out.index_add_(0, token_ids, y_sel.to(acc) * w_sel)
        return out.to(hidden_states.dtype)

    saved = [(M, "_create_mask_compat", orig_compat),
             (M.Olmo3MoeRMSNorm, "forward", M.Olmo3MoeRMSNorm.forward),
             (M.Olmo3MoeRotaryEmbedding, "forward", M.Olmo3MoeRotaryEmbedding.forward),
             (M.Olmo3MoeExperts, "_forward_loop", M.Olmo3MoeExperts._forward_loop)]
    M._create_mask_compat = mask_compat
    M.Olmo3MoeRMSNorm.forward = rms_forward
    M.Olmo3MoeRotaryEmbedding.forward = rotary_forward
    M.Olmo3MoeExperts._forward_loop = experts_loop
    try:
        with OC.oc_cpu_patches():  # Tensor.float() keeps float64 (router); nothing else used
            yield
    finally:
        for obj, name, val in saved:
            setattr(obj, name, val)


def to_hf(hc, state):
    """Olmo-core's convert_olmo3moe_state_to_hf, with the attention biases: its 3.0.0 converter
    refuses them although Olmo3MoeConfig.attention_bias and its modeling carry them (nn.Linear
    q/k/v/o_proj with bias), so they are moved by hand, by the names its modeling gives them."""
    from olmo_core.nn.hf.convert import convert_olmo3moe_state_to_hf
    proj = dict(w_q="q_proj", w_k="k_proj", w_v="v_proj", w_out="o_proj")
    state = dict(state)
    biases = {k: state.pop(k) for k in [k for k in state if k.endswith(".bias") and ".attention.w_" in k]}
    hs = convert_olmo3moe_state_to_hf(hc, state)
    for k, v in biases.items():
        _, L, _, lin, _ = k.split(".")  # blocks.L.attention.w_q.bias
        hs[f"model.layers.{L}.self_attn.{proj[lin]}.bias"] = v
    return hs


def build_hf(cfg, oc_model, seq_len, scale_down=1.0):
    from olmo_core.nn.moe.v2.hf.modeling_olmo3moe import Olmo3MoeForCausalLM
    hc = hf_config(cfg, seq_len)
    torch.manual_seed(0)
    m = Olmo3MoeForCausalLM(hc).to(F64)
    m.eval()
    assert m.config._attn_implementation == "sdpa"
    assert m.model.embed_tokens.padding_idx is None
    hd = cfg.head_dim  # float64 inverse frequencies (the config computes them in float32)
    if m.model.rotary_embs is not None:  # use_rope = false: none
        m.model.rotary_embs.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=F64) / hd))
    state = {k: v.detach() for k, v in oc_model.state_dict().items() if not k.endswith("score_bias")}
    hs = to_hf(hc, state)
    if scale_down != 1.0:
        hs = {k: (v * scale_down if ".mlp.experts." in k and k.endswith("down_proj.weight") else v)
              for k, v in hs.items()}
    missing, unexpected = m.load_state_dict(hs, strict=True)
    assert not missing and not unexpected
    if cfg.tie_embeddings:
        assert m.lm_head.weight is m.model.embed_tokens.weight
    return m, hc


def rel(a, b):
    """max|a - b| / max|b| (a gradient of None = zeros: an expert that got no token)."""
    a = torch.zeros_like(b) if a is None else a.detach()
    b = b.detach()
    m = float(b.abs().max())
    d = float((a - b).abs().max())
    return d / m if m > 0 else d


def check(cfg, params, ids, labels, seq_len, bias=None):
    """Olmo-core 3 reference vs Olmo3MoeForCausalLM on the fixture's tokens and weights.
    logits max|d|/max|x| (and, when exact, the gradients of the summed CE)."""
    why, variant = not_expressible(cfg)
    if why:
        return dict(applicable=False, reason="; ".join(why),
                    also_not_in_olmo3moe="; ".join(variant) or None)
    ocm = OC.build_model(cfg, seq_len)
    OC.load_params(ocm, cfg, params)
    ocm.eval()  # no aux losses attached (olmo3moe has none); same forward otherwise
    for rt in OC.routers(ocm, cfg).values():
        if rt.score_bias is not None:
            rt.score_bias.zero_()
    with OC.oc_cpu_patches():
        lo = ocm(ids.long())
        ce_o = R.lm_loss_sums(lo, labels)[0]
        ce_o.backward()
    scale = cfg.expert_weight_scale
    hf, hc = build_hf(cfg, ocm, seq_len, scale_down=scale)
    with hf_patches():
        lh = hf(input_ids=ids.long(), use_cache=False).logits
        ce_h = R.lm_loss_sums(lh, labels)[0]
        ce_h.backward()
    out = OrderedDict(applicable=True, exact=not variant, variant="; ".join(variant) or None,
                      logits_max_abs=float((lh - lo).abs().max()),
                      logits_rel_to_max=rel(lh, lo), ce_sum_abs=abs(float(ce_h - ce_o)))
    lh, lo = lh.detach(), lo.detach()
    if not variant:
        g_oc = {k: torch.zeros_like(p) if p.grad is None else p.grad
                for k, p in ocm.named_parameters(remove_duplicate=False)}
        g_hf_from_oc = to_hf(hc, g_oc)
        worst, where = 0.0, None
        for k, p in hf.named_parameters(remove_duplicate=False):
            r = rel(p.grad, g_hf_from_oc[k])
            if r > worst:
                worst, where = r, k
        out["ce_grad_max_rel_to_tensor_max"] = worst
        out["ce_grad_worst_param"] = where
    out["hf_config"] = dict(use_peri_ln=hc.use_peri_ln, dense_layers_indices=hc.dense_layers_indices,
                            restore_weight_scale=hc.restore_weight_scale,
                            normalize_expert_weights=hc.normalize_expert_weights,
                            embed_scale=hc.embed_scale, embed_norm=hc.embed_norm,
                            gating_function=hc.gating_function,
                            original_num_experts_per_tok=hc.original_num_experts_per_tok)
    return out


if __name__ == "__main__":
    # Attention biases (olmo3moe attention_bias), which no oc3 fixture can check here (oc3_attention
    # also clips and rotates part of each head, which olmo3moe cannot): oc3_reordered's config
    # with biases ~ TN(0, 0.2), Olmo-core 3 vs Olmo3MoeForCausalLM, float64.
    import copy
    import json
    import fixture_catalog as FC
    fx = copy.deepcopy(FC.FIXTURES["oc3_reordered"])
    c = fx["model"]
    c.attention_bias, c.score_correction_bias = True, False
    fx["design"]["attn_bias_std"] = 0.2
    gen = torch.Generator().manual_seed(1234)
    P = FC.init_params(c, fx["design"], gen)
    ids, labels = FC.make_batch(c, fx["train"], fx["design"], gen)
    r = check(c, P, ids, labels, fx["train"].seq_len)
    assert r["applicable"] and r["logits_rel_to_max"] <= 1e-12 and r["ce_grad_max_rel_to_tensor_max"] <= 1e-12, r
    print(json.dumps({k: r[k] for k in ("logits_rel_to_max", "ce_grad_max_rel_to_tensor_max")}))
