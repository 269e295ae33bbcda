"""Olmo-core 3's own MoE model (ai2-olmo-core 3.0.0 `OLMoDDPModel`, `moe_fused_v2`) as a float64
CPU reference for the fixtures under tests/golden/olmo_core3/ (see tools/reference/README.md).

`build_model(cfg, seq_len)` builds the model through Olmo-core's own config classes
(OLMoDDPModelConfig, OLMoDDPTransformerBlockConfig with block_overrides for the dense layers,
MoERouterConfigV2, RoutedExpertsConfig, SharedExpertsConfig, AttentionConfig, RoPEConfig,
LayerNormConfig, LMHeadConfig) from a moecore `ModelConfig` and casts it to float64.
`oc_cpu_patches()` replaces ONLY the GPU-only plumbing of its no-EP forward, at runtime (nothing in
site-packages is edited), and leaves every model formula as it is:
- TransformerEngine `moe_permute` / `moe_unpermute` (map_type "index"): an index map (stable
  sort of the flattened (token, slot) expert ids) and `index_add` of prob-weighted rows;
- the grouped GEMM `routed_experts.gmm` (CPU `F.grouped_mm` has no float64): a loop over experts;
- the device->host copy of the split sizes, CUDA streams and events: no-ops
  (`requires_host_side_split_sizes` -> True so the split sizes stay a CPU tensor);
- `Tensor.float()` keeps float64 tensors in float64 (router input / weight / logits, RMSNorm,
  cross-entropy, RoPE q/k casts); other dtypes are cast as before. The RoPE tables, which
  Olmo-core builds from explicit float32 aranges, are pre-filled in its own BufferCache with the
  same formula in float64 (`_fill_rope_cache`).
`OlmoCore3Adapter` exposes moecore's parameter names (`param_views`) and the interface of
hf_side.PlainAdapter / HFAdapter, so fixture_training.run_training drives it. Its auxiliary losses
are Olmo-core's own: the router's `compute_aux_loss` (`load_balancing_loss`, local batch, and
`router_z_loss`) with `loss_div_factor` = all tokens of the step, attached to the graph by the
block (`attach_auxiliary_loss`) with lb_loss_weight / z_loss_weight = the fixture's coefficients;
the values come from the router's metric accumulators. The LM loss is Olmo-core's
`cross_entropy_loss` (reduction "sum", z-loss multiplier 1) divided by the step's labelled tokens.
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

F64 = torch.float64


# =========================================================================== CPU / float64 patches
class _NoEvent:
    def synchronize(self):
        pass


def _permute_index(inp, routing_map, num_out_tokens, map_type="index", **kw):
    """TE moe_permute, map_type "index": rows grouped by expert (token order inside an expert)."""
    assert map_type == "index" and not kw, (map_type, kw)
    T, K = routing_map.shape
    assert num_out_tokens == T * K
    order = torch.argsort(routing_map.reshape(-1).long(), stable=True)  # permuted row -> t*K + k
    return inp.index_select(0, order // K), order


def _unpermute_index(inp, row_id_map, restore_shape, map_type="index", merging_probs=None, **kw):
    """TE moe_unpermute, map_type "index": out[t] = sum_k probs[t, k] * rows[(t, k)]."""
    assert map_type == "index" and merging_probs is not None and not kw, (map_type, kw)
    K = merging_probs.shape[-1]
    w = merging_probs.reshape(-1).index_select(0, row_id_map)
    out = torch.zeros(restore_shape, dtype=inp.dtype, device=inp.device)
    return out.index_add(0, row_id_map // K, inp * w[:, None].to(inp.dtype))


def _gmm_loop(a, b, batch_sizes, trans_b=False, out=None, input_grad_out=None):
    """grouped GEMM: rows [off_e, off_e + n_e) of a times b[e] (or b[e]^T)."""
    assert out is None and input_grad_out is None
    parts, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        w = b[e].transpose(0, 1) if trans_b else b[e]
        parts.append(a[start:start + n] @ w)
        start += n
    assert start == a.shape[0]
    return torch.cat(parts, 0)


@contextlib.contextmanager
def oc_cpu_patches(keep_f64=True):
    """keep_f64=False: the plumbing only (Olmo-core's float32 casts as shipped; for the record)."""
    from olmo_core.nn.ddp import block as B
    from olmo_core.nn.moe.v2 import no_ep as NE
    from olmo_core.nn.moe.v2 import routed_experts as RE
    orig_float = torch.Tensor.float

    def float_keep_f64(self, *a, **k):
        return self if self.dtype == F64 else orig_float(self, *a, **k)

    saved = []

    def put(obj, name, val):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, val)

    if keep_f64:
        put(torch.Tensor, "float", float_keep_f64)
    put(NE, "moe_permute_no_compile", _permute_index)
    put(NE, "moe_unpermute_no_compile", _unpermute_index)
    put(NE, "requires_host_side_split_sizes", lambda: True)
    put(NE, "async_copy_to_cpu", lambda buf, event=None, return_event=True: (buf, None, _NoEvent()))
    put(NE, "wait_stream_no_compile", lambda this_stream, other_stream: None)
    put(RE, "requires_host_side_split_sizes", lambda: True)
    put(RE, "gmm", _gmm_loop)
    put(B.OLMoDDPTransformerBlock, "get_dense_stream", lambda self, for_x1=False: None)
    put(torch.cuda, "current_stream", lambda device=None: None)  # torch.cuda.stream(None): no-op
    try:
        yield
    finally:
        for obj, name, val in reversed(saved):
            setattr(obj, name, val)


# =========================================================================== the model
def check_expressible(cfg: R.ModelConfig):
    assert cfg.shared_merge == "sum", "Olmo-core 3 merges one shared expert by sum only"
    assert cfg.routing == "learned"


def build_model(cfg: R.ModelConfig, seq_len: int, lbl_coef=0.0, router_z_coef=0.0, f64_rope=True,
                lbl_granularity="local_batch"):
    """OLMoDDPModel for `cfg`, float64, CPU, train mode (weights: Olmo-core's init; overwrite)."""
    from olmo_core.config import DType
    from olmo_core.nn.attention import (AttentionBackendName, AttentionConfig,
                                        SlidingWindowAttentionConfig)
    from olmo_core.nn.ddp.block import OLMoDDPTransformerBlockConfig
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
    from olmo_core.nn.lm_head import LMHeadConfig
    from olmo_core.nn.moe.loss import MoELoadBalancingLossGranularity
    from olmo_core.nn.moe.router import MoERouterGatingFunction
    from olmo_core.nn.moe.v2.routed_experts import RoutedExpertsConfig
    from olmo_core.nn.moe.v2.router import MoERouterConfigV2
    from olmo_core.nn.moe.v2.shared_experts import SharedExpertsConfig
    from olmo_core.nn.rope import RoPEConfig
    from olmo_core.nn.transformer.config import (OLMoDDPModelConfig, TransformerBlockType,
                                                 TransformerType)
    cfg.validate()
    check_expressible(cfg)
    # the router's metric accumulators (LBL, z-loss, counts) are created in the default dtype
    assert torch.get_default_dtype() == F64, "call torch.set_default_dtype(torch.float64) first"
    D = cfg.d_model
    f32 = DType.float32  # Olmo-core has no float64 DType: built in float32, then .to(float64)
    ln = LayerNormConfig(name=LayerNormType.rms, eps=cfg.norm_eps, bias=False)
    att = AttentionConfig(
        n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        bias=cfg.attention_bias, clip_qkv=cfg.clip_qkv if cfg.clip_qkv > 0 else None,
        rope=None if cfg.rope == "none" else RoPEConfig(
            theta=cfg.rope_theta, no_global_rope=cfg.rope == "windowed",
            partial_rotary_factor=cfg.rope_partial),
        backend=AttentionBackendName.torch,
        qk_norm=None if cfg.qk_norm == "none" else ln, use_head_qk_norm=cfg.qk_norm == "per_head",
        sliding_window=None if not cfg.sliding_window else SlidingWindowAttentionConfig(
            pattern=[int(v) for v in cfg.sliding_window.split(",")],
            force_full_attention_on_first_layer=cfg.sliding_window_full_first,
            force_full_attention_on_last_layer=cfg.sliding_window_full_last))
    router = MoERouterConfigV2(
        d_model=D, num_experts=cfg.num_experts, top_k=cfg.top_k,
        gating_function=MoERouterGatingFunction(cfg.score_func),
        normalize_expert_weights=cfg.norm_topk_p if cfg.norm_topk_prob else None,
        restore_weight_scale=cfg.restore_weight_scale,
        expert_weight_scale=None if cfg.expert_weight_scale == 1.0 else cfg.expert_weight_scale,
        original_top_k=cfg.original_top_k or None,
        bias_gamma=cfg.router_bias_gamma if cfg.router_bias_gamma > 0 else None,
        sigmoid_stability_epsilon=cfg.sigmoid_eps,
        score_correction_bias=cfg.score_correction_bias,
        n_group=cfg.n_group or None, topk_group=cfg.topk_group or None,
        lb_loss_weight=lbl_coef, z_loss_weight=router_z_coef,
        lb_loss_granularity=MoELoadBalancingLossGranularity(lbl_granularity),
        bias=cfg.router_logit_bias)
    # the shared experts' gate: scores only (top_k unused), no auxiliary losses
    shared_router = MoERouterConfigV2(
        d_model=D, num_experts=cfg.shared_experts, top_k=1, bias=cfg.shared_router_bias,
        gating_function=MoERouterGatingFunction(cfg.shared_router_score),
        normalize_expert_weights=cfg.shared_router_norm_p or None,
        sigmoid_stability_epsilon=cfg.shared_router_sigmoid_eps) if cfg.shared_router else None
    placement = dict(use_peri_norm=cfg.norm_placement == "peri",
                     use_pre_norm=cfg.norm_placement == "pre")

    def shared(hidden, n=1):
        return SharedExpertsConfig(d_model=D, hidden_size=hidden, num_experts=n, bias=False,
                                   dtype=f32)

    moe_block = OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2, sequence_mixer=att, layer_norm=ln,
        routed_experts=RoutedExpertsConfig(d_model=D, hidden_size=cfg.expert_hidden,
                                           num_experts=cfg.num_experts, bias=False, dtype=f32),
        routed_experts_router=router,
        shared_experts=shared(cfg.shared_hidden, cfg.shared_experts) if cfg.shared_hidden > 0 else None,
        shared_experts_router=shared_router, **placement)
    dense_block = OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2, sequence_mixer=att, layer_norm=ln,
        shared_experts=shared(cfg.dense_hidden), **placement)
    mc = OLMoDDPModelConfig(
        name=TransformerType.moe_fused_v2, d_model=D, vocab_size=cfg.vocab_size,
        n_layers=cfg.n_layers, block=moe_block,
        block_overrides={L: dense_block for L in cfg.dense_layer_set()} or None,
        lm_head=LMHeadConfig(layer_norm=ln, bias=False, dtype=f32),
        embed_scale=None if cfg.embed_scale == 1.0 else cfg.embed_scale,
        embedding_norm=ln if cfg.embedding_norm else None,
        tie_word_embeddings=cfg.tie_embeddings)
    torch.manual_seed(0)  # Olmo-core's own init is overwritten by the fixture's weights
    model = mc.build(init_device="cpu").to(F64)
    model.train()
    if f64_rope:
        _fill_rope_cache(model, cfg, seq_len)
    return model


def _fill_rope_cache(model, cfg, S):
    """RotaryEmbedding._get_rotary_embedding's tables (inv_freq = 1/theta^(2i/rd) over its
    rotary_dim rd = int(hd * partial_rotary_factor), positions 0..S-1, sin/cos of
    cat(freqs, freqs)) computed in float64 instead of float32."""
    rd = cfg.rotary_dim()
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=F64) / rd))
    freqs = torch.einsum("i , j -> i j", torch.arange(S, dtype=F64), inv)
    pos = torch.cat((freqs, freqs), dim=-1)
    for blk in model.blocks.values():
        rope = blk.attention.rope
        if rope is None:  # model.rope = "none", or a full layer under no_global_rope
            continue
        assert rope.rotary_dim == rd, (rope.rotary_dim, rd)
        rope._cache["rope_pos_sin"] = pos.sin()
        rope._cache["rope_pos_cos"] = pos.cos()


def param_views(model, cfg: R.ModelConfig):
    """moecore name -> (Olmo-core parameter name, function giving the moecore-shaped VIEW of a
    tensor of that parameter's shape). Olmo-core's layouts (ai2-olmo-core 3.0.0):
    routed_experts.w_up_gate (E, 2F, D) = [up | gate] rows, w_down (E, F, D) = down^T per expert;
    shared_experts.w_up_gate (D, Es*2Fs) column-packed [up | gate] per expert (x @ W), w_down
    (Es, Fs, D); shared_experts_router.weight flat (Es*D,); routers' bias (E,) / (Es,);
    routed_experts_router.weight flat (E*D,) = router (E, D) row-major; dense layers are
    shared-only blocks. Norms: reordered: attention_norm / feed_forward_norm are the OUTPUT norms;
    peri: attention_input_norm / feed_forward_input_norm (input) + attention_norm /
    feed_forward_norm (output); pre: attention_norm / feed_forward_norm (input)."""
    E, D, Fe = cfg.num_experts, cfg.d_model, cfg.expert_hidden
    ident = lambda t: t
    mp = OrderedDict()
    mp["embed"] = ("embeddings.weight", ident)
    if cfg.embedding_norm:
        mp["embed_norm"] = ("embedding_norm.weight", ident)
    norms = {"pre": dict(attn_norm="attention_norm", ffn_norm="feed_forward_norm"),
             "peri": dict(attn_norm="attention_input_norm", attn_out_norm="attention_norm",
                          ffn_norm="feed_forward_input_norm", ffn_out_norm="feed_forward_norm"),
             "reordered": dict(attn_out_norm="attention_norm",
                               ffn_out_norm="feed_forward_norm")}[cfg.norm_placement]
    for L in range(cfg.n_layers):
        p, b = f"layers.{L}.", f"blocks.{L}."
        attn = dict(wq="attention.w_q.weight", wk="attention.w_k.weight",
                    wv="attention.w_v.weight", wo="attention.w_out.weight")
        if cfg.attention_bias:
            attn.update(bq="attention.w_q.bias", bk="attention.w_k.bias",
                        bv="attention.w_v.bias", bo="attention.w_out.bias")
        if cfg.qk_norm != "none":
            attn.update(q_norm="attention.q_norm.weight", k_norm="attention.k_norm.weight")
        for n in ("attn_norm", "attn_out_norm"):
            if n in norms:
                mp[p + n] = (b + norms[n] + ".weight", ident)
        for n, o in attn.items():
            mp[p + n] = (b + o, ident)
        for n in ("ffn_norm", "ffn_out_norm"):
            if n in norms:
                mp[p + n] = (b + norms[n] + ".weight", ident)

        def packed(prefix, hidden, n=1):
            return OrderedDict([
                (prefix + "gate", (b + "shared_experts.w_up_gate", stacked(hidden, n, 1))),
                (prefix + "up", (b + "shared_experts.w_up_gate", stacked(hidden, n, 0))),
                (prefix + "down", (b + "shared_experts.w_down",
                                   lambda t, h=hidden, n=n: t.view(n * h, D).t()))])
        if cfg.is_dense(L):
            mp.update(packed(p + "mlp.", cfg.dense_hidden))
            continue
        mp[p + "router"] = (b + "routed_experts_router.weight", lambda t: t.view(E, D))
        if cfg.router_logit_bias:
            mp[p + "router.bias"] = (b + "routed_experts_router.bias", ident)
        mp[p + "experts.gate"] = (b + "routed_experts.w_up_gate", lambda t: t[:, Fe:, :])
        mp[p + "experts.up"] = (b + "routed_experts.w_up_gate", lambda t: t[:, :Fe, :])
        mp[p + "experts.down"] = (b + "routed_experts.w_down", lambda t: t.transpose(1, 2))
        if cfg.shared_hidden > 0:
            mp.update(packed(p + "shared.", cfg.shared_hidden, cfg.shared_experts))
            Es = cfg.shared_experts
            if cfg.shared_router:
                mp[p + "shared.router"] = (b + "shared_experts_router.weight",
                                           lambda t, Es=Es: t.view(Es, D))
            if cfg.shared_router_bias:
                mp[p + "shared.router.bias"] = (b + "shared_experts_router.bias", ident)
    mp["final_norm"] = ("lm_head.norm.weight", ident)
    if not cfg.tie_embeddings:
        mp["lm_head"] = ("lm_head.w_out.weight", ident)
    assert list(mp) == list(R.param_shapes(cfg)), "name map != MODEL.md table"
    names = {n for n, _ in model.named_parameters()}
    assert {v[0] for v in mp.values()} == names, names ^ {v[0] for v in mp.values()}
    if cfg.tie_embeddings:
        assert model.lm_head.w_out.weight is model.embeddings.weight
    return mp


def stacked(H, n, k):
    """moecore's stacked shared gate (k = 1) or up (k = 0), (n*H, D), of Olmo-core's column-packed
    w_up_gate (D, n*2*H) = [expert e: up (H) | gate (H)] (SharedExperts.forward's view(BS, E, 2, H)).
    Not a view for n > 1: `set` writes it back."""
    def get(t):
        return t.view(t.shape[0], n, 2, H)[:, :, k, :].reshape(t.shape[0], n * H).t()

    def set_(t, v):
        t.view(t.shape[0], n, 2, H)[:, :, k, :].copy_(v.t().reshape(t.shape[0], n, H))
    get.set = set_
    return get


def load_params(model, cfg, params):
    views = param_views(model, cfg)
    with torch.no_grad():
        for name, (oc, view) in views.items():
            p = model.get_parameter(oc).data
            dst = view(p)
            assert tuple(dst.shape) == tuple(params[name].shape), (name, dst.shape)
            if hasattr(view, "set"):
                view.set(p, params[name])
                assert torch.equal(view(p), params[name]), name
            else:
                dst.copy_(params[name])
    return views


def routers(model, cfg):
    return OrderedDict((L, model.blocks[str(L)].routed_experts_router) for L in cfg.moe_layers())


def oc_lm_losses(logits, labels, n_loss):
    """Olmo-core's cross_entropy_loss (as its LMHead calls it) with reduction "sum", divided by
    the step's labelled tokens: CE and the unscaled LM z-loss (multiplier 1)."""
    from olmo_core.nn.functional.cross_entropy_loss import cross_entropy_loss
    V = logits.shape[-1]
    with oc_cpu_patches():  # its logits.float() keeps float64
        ce, z = cross_entropy_loss(logits.reshape(-1, V), labels.reshape(-1).long(),
                                   ignore_index=-100, reduction="sum", compute_z_loss=True,
                                   z_loss_multiplier=1.0)
    return ce / n_loss, z / n_loss


# =========================================================================== adapter
class OlmoCore3Adapter:
    """OLMoDDPModel holding the fixture's parameters; moecore names; run_training's interface.
    info records carry Olmo-core's own step-scaled LBL / router z-loss (`lbl`, `rz`, already in
    the autograd graph) and its per-expert counts."""

    aux_in_graph = True

    def __init__(self, cfg, params, lbl_coef=0.0, router_z_coef=0.0, T_step=None, seq_len=None,
                 lbl_granularity="local_batch"):
        self.cfg = cfg
        self.patched = True
        self.T_step = T_step
        self.m = build_model(cfg, seq_len, lbl_coef, router_z_coef, lbl_granularity=lbl_granularity)
        self.views = load_params(self.m, cfg, params)
        self.routers = routers(self.m, cfg)
        self.bias_checks = []  # Olmo-core's post_batch vs run_training's bias update, per step
        # clip_qkv: per forward, the smallest | |x| - c | over the q/k/v projections and the
        # fraction clamped (the hooks run before Olmo-core's in-place clamp_)
        self.clip_stats = []
        if cfg.clip_qkv > 0:
            for blk in self.m.blocks.values():
                for lin in (blk.attention.w_q, blk.attention.w_k, blk.attention.w_v):
                    lin.register_forward_hook(self._clip_hook)
        self._captured = {}
        for L, rt in self.routers.items():
            orig = rt.forward

            def spy(*a, _L=L, _orig=orig, **k):
                out = _orig(*a, **k)
                self._captured[_L] = (a[0], out)
                return out
            rt.forward = spy

    def _clip_hook(self, module, inputs, out):
        c = self.cfg.clip_qkv
        a = out.detach().abs()
        self._clip.append((float((a - c).abs().min()), int((a > c).sum()), a.numel()))

    def _view(self, name, what):
        oc, view = self.views[name]
        p = self.m.get_parameter(oc)
        t = p.data if what == "data" else p.grad
        return None if t is None else view(t)

    def ref_params(self):
        return OrderedDict((n, self._view(n, "data").detach().clone()) for n in self.views)

    def ref_grads(self):
        return OrderedDict((n, self._view(n, "grad").detach().clone()) for n in self.views)

    def opt_params(self):
        out = []
        for oc, p in self.m.named_parameters():  # tied: embeddings.weight once
            refs = [n for n, (o, _) in self.views.items() if o == oc]
            decay = {not R.is_no_decay(n) for n in refs}
            assert len(decay) == 1, refs
            out.append((refs[0], p, decay.pop()))
        return out

    def set_bias(self, router_bias):
        """run_training owns the loss-free bias; None = zero bias (olmo3moe cross-check)."""
        with torch.no_grad():
            for L, rt in self.routers.items():
                if rt.score_bias is None:
                    assert router_bias is None
                elif router_bias is None:
                    rt.score_bias.zero_()
                else:
                    rt.score_bias.copy_(router_bias[L])

    def forward(self, ids, router_bias=None, loss_div_factor="step"):
        c = self.cfg
        self.set_bias(router_bias)
        for rt in self.routers.values():
            rt.reset_metrics()
        self._captured.clear()
        self._clip = []
        ldf = self.T_step if loss_div_factor == "step" else loss_div_factor
        with oc_cpu_patches():
            logits = self.m(ids.long(), loss_div_factor=ldf)
        if self._clip:
            self.clip_stats.append(dict(min_margin=min(m for m, _, _ in self._clip),
                                        clamped=sum(n for _, n, _ in self._clip),
                                        of=sum(t for _, _, t in self._clip)))
        info = []
        for L, rt in self.routers.items():
            x, (w, idx, bspe, aux) = self._captured[L]
            scores, z = aux[0], aux[1]
            E, K = c.num_experts, c.top_k
            sel = (z if c.score_func == "topk_softmax" else scores).detach().reshape(-1, E)
            if rt.score_bias is not None:
                sel = sel + rt.score_bias[None, :]
            sel, group_gap = R.group_limited(sel, c)
            rec = dict(layer=L, logits=z.reshape(-1, E), scores=scores.reshape(-1, E),
                       idx=idx.reshape(-1, K), weights=w.reshape(-1, K),
                       sel_sorted=torch.sort(sel, dim=-1, descending=True).values,
                       group_gap=group_gap,
                       counts=bspe.to(torch.int64), router_input=x)
            if self.m.training and torch.is_grad_enabled():
                rec["lbl"] = rt.load_balancing_loss.detach().clone()
                rec["rz"] = rt.z_loss.detach().clone()
            info.append(rec)
        return logits, info

    def lm_losses(self, logits, labels, n_loss):
        return oc_lm_losses(logits, labels, n_loss)

    def after_step(self, new_bias, step_counts):
        """Olmo-core's own loss-free bias update (MoERouterV2.post_batch, on the counts its
        compute_aux_loss accumulated over the step's micro-batches) vs run_training's."""
        d = dict(bias=0.0, counts_equal=True)
        for L, rt in self.routers.items():
            if rt.bias_gamma is None:
                continue
            acc = rt.score_bias_batch_size_per_expert.clone()
            d["counts_equal"] &= bool(torch.equal(acc.to(torch.int64), step_counts[L]))
            rt.post_batch()
            d["bias"] = max(d["bias"], float((rt.score_bias.to(F64) - new_bias[L]).abs().max()))
        self.bias_checks.append(d)


def small_grad_counts(grads, rel=1e-4):
    """Per tensor: elements whose |g| < rel * max|g| of that tensor (the C++ fp32 test skips them)."""
    out = OrderedDict()
    for n, g in grads.items():
        m = float(g.abs().max())
        out[n] = int((g.abs() < rel * m).sum()) if m > 0 else int(g.numel())
    return out


def max_abs(a, b):
    return float((a - b).abs().max())


def rel_max(a, b):
    """max|a - b| / max|b|."""
    s = float(b.abs().max())
    return max_abs(a, b) / s if s > 0 else max_abs(a, b)


def grads_rel(g1, g2):
    """largest over tensors of max|d| / max|g2| (tensor), and the worst tensor."""
    worst, where = 0.0, None
    for n in g2:
        r = rel_max(g1[n], g2[n])
        if r > worst:
            worst, where = r, n
    return worst, where


def compare_with_plain(rp, ro, cfg):
    """run_training records: plain module (rp) vs Olmo-core (ro)."""
    s0p, s0o = rp["step0"], ro["step0"]
    gr, where = grads_rel(s0o["grads"], s0p["grads"])
    return dict(
        step0_logits_max_abs=max_abs(s0o["logits"], s0p["logits"]),
        step0_logits_rel_to_max=rel_max(s0o["logits"], s0p["logits"]),
        step0_grad_max_rel_to_tensor_max=gr, step0_grad_worst_param=where,
        step0_grad_max_abs=max(max_abs(s0o["grads"][n], s0p["grads"][n]) for n in s0p["grads"]),
        step0_ce_abs=abs(s0o["ce"] - s0p["ce"]), step0_total_abs=abs(s0o["total"] - s0p["total"]),
        step0_lbl_max_abs=max(abs(s0o["lbl"][L] - s0p["lbl"][L]) for L in cfg.moe_layers()),
        step0_router_z_max_abs=max(abs(s0o["rz"][L] - s0p["rz"][L]) for L in cfg.moe_layers()),
        train_total_max_abs=max(abs(a - b) for a, b in zip(ro["total"], rp["total"])),
        train_grad_norm_max_abs=max(abs(a - b) for a, b in zip(ro["grad_norm"], rp["grad_norm"])),
        final_param_max_rel_to_tensor_max=grads_rel(ro["final_params"], rp["final_params"])[0],
        final_bias_max_abs=(0.0 if rp["final_bias"] is None else
                            max(max_abs(ro["final_bias"][L], rp["final_bias"][L])
                                for L in cfg.moe_layers())),
        routing_counts_equal_all_steps=ro["counts"] == rp["counts"])


def stock_precision_logits_rel(cfg, params, ids, bias):
    """Olmo-core with its float32 casts as shipped (router, RMSNorm, RoPE tables) vs the float64
    reference, step-0 logits of micro-batch 0: what the float64 patches remove (recorded)."""
    out = {}
    for keep in (True, False):
        m = build_model(cfg, ids.shape[1], f64_rope=keep)
        load_params(m, cfg, params)
        for L, rt in routers(m, cfg).items():
            if rt.score_bias is not None:
                with torch.no_grad():
                    rt.score_bias.copy_(bias[L])
        with torch.no_grad(), oc_cpu_patches(keep_f64=keep):
            out[keep] = m(ids.long())
    return rel_max(out[False], out[True])


def olmo_core_hf_config_attempt(model):
    """What Olmo-core's own get_hf_config makes of this model (recorded; not used)."""
    from olmo_core.nn.hf.config import get_hf_config
    try:
        hc = get_hf_config(model)
    except Exception as e:  # noqa: BLE001 (recorded as text)
        return dict(raises=f"{type(e).__name__}: {str(e)[:160]}")
    return dict(max_position_embeddings=getattr(hc, "max_position_embeddings", None),
                dense_layers_indices=getattr(hc, "dense_layers_indices", None),
                use_peri_ln=getattr(hc, "use_peri_ln", None))


__all__ = ["build_model", "oc_cpu_patches", "param_views", "load_params", "OlmoCore3Adapter",
           "oc_lm_losses", "small_grad_counts", "compare_with_plain", "stock_precision_logits_rel"]
