"""Plain float64 PyTorch reference of the moecore model (docs/MODEL.md).

This module is deliberately written from MODEL.md alone, without transformers or olmo-core, so that
it can be checked against both (see make_fixtures.py, which compares it with transformers'
OlmoeForCausalLM and uses olmo-core's loss functions). Parameter names are exactly MODEL.md's
(`embed`, `layers.0.wq`, `layers.1.experts.gate`, ...). Everything runs in float64.

Options covered: norm_placement pre|peri|reordered, qk_norm none|full|per_head, n_dense_layers or
dense_layers (any indices), shared expert (shared_merge sum|v1), score_func softmax|sigmoid|
topk_softmax, sigmoid_eps, norm_topk_prob with norm_topk_p, restore_weight_scale,
expert_weight_scale, original_top_k, router_bias (loss-free balancing), embed_scale,
embedding_norm, tie_embeddings, GQA, RoPE rotate-halves with theta (partial: rope_partial),
head_dim != d_model / n_heads, clip_qkv, attention_bias.
The options added for Olmo-core 3 (reordered norm, embed_scale, embedding_norm, norm_topk_p,
restore_weight_scale, expert_weight_scale, original_top_k, sigmoid_eps, topk_softmax,
dense_layers) follow ai2-olmo-core 3.0.0's OLMoDDPModel / OLMoDDPTransformerBlock / MoERouterV2;
see tools/reference/olmo_core3.py, which checks this module against that model.

Nothing here is run by CI; CI only reads the fixtures written by make_fixtures.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPE = torch.float64


# --------------------------------------------------------------------------- configuration
@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    norm_placement: str  # "pre" | "peri"
    tie_embeddings: bool
    rope_theta: float
    qk_norm: str  # "none" | "full" | "per_head"
    n_dense_layers: int
    dense_hidden: int
    num_experts: int
    top_k: int
    expert_hidden: int
    score_func: str  # "softmax" | "sigmoid"
    norm_topk_prob: bool
    shared_hidden: int  # 0 = no shared expert
    shared_merge: str  # "sum" | "v1"
    routing: str  # only "learned" here
    router_bias_gamma: float  # 0 = loss-free balancing off
    init_std: float
    # ---- Olmo-core 3 options (defaults = the behaviour before they existed)
    embed_scale: float = 1.0  # h = embed(ids) * embed_scale
    embedding_norm: bool = False  # then h = rmsnorm(h, embed_norm)
    norm_topk_p: float = 1.0  # norm_topk_prob: weights /= ||weights||_p
    restore_weight_scale: bool = False  # weights *= top_k (after normalizing)
    expert_weight_scale: float = 1.0  # weights *= expert_weight_scale
    original_top_k: int = 0  # 0 = top_k; else weights *= sqrt(original_top_k / top_k)
    sigmoid_eps: float = 0.0  # sigmoid scores + eps (selection, weights and LBL)
    dense_layers: str = ""  # "1" or "0,2": dense layer indices ("" = the first n_dense_layers)
    # sliding windows, Olmo-core 3's SlidingWindowAttentionConfig: pattern "16,-1" (-1 = full)
    sliding_window: str = ""
    sliding_window_full_first: bool = True
    sliding_window_full_last: bool = True
    # group-limited routing: experts in n_group groups of consecutive ids, topk_group allowed
    n_group: int = 0
    topk_group: int = 0
    # the router bias selects without loss-free balancing too (loaded, fixed)
    score_correction_bias: bool = False
    # which layers apply RoPE: "all", "none", "windowed" (Olmo-core 3's no_global_rope)
    rope: str = "all"
    # several shared experts (stacked rows of shared.gate/up, columns of shared.down) and their
    # gate: w = score(x W_s^T + b_s) (/ its p-norm), out += sum_e w[t,e] expert_e(x)[t]
    shared_experts: int = 1
    shared_router: bool = False
    shared_router_score: str = "softmax"  # "softmax" | "sigmoid"
    shared_router_sigmoid_eps: float = 0.0
    shared_router_norm_p: float = 0.0  # 0 = not normalized
    shared_router_bias: bool = False  # learned bias on the shared router's logits
    router_logit_bias: bool = False  # learned bias on the routed router's logits
    # attention options (Olmo-core 3's Attention): q, k, v clamped to [-c, c] after their
    # projections (0 = off); biases bq bk bv bo; RoPE on the first int(hd * rope_partial) dims
    clip_qkv: float = 0.0
    attention_bias: bool = False
    rope_partial: float = 1.0

    # the fields added for Olmo-core 3, in order (make_fixtures writes them only when set)
    NEW_FIELDS = ("embed_scale", "embedding_norm", "norm_topk_p", "restore_weight_scale",
                  "expert_weight_scale", "original_top_k", "sigmoid_eps", "dense_layers",
                  "sliding_window", "sliding_window_full_first", "sliding_window_full_last",
                  "n_group", "topk_group", "score_correction_bias", "rope", "shared_experts",
                  "shared_router", "shared_router_score", "shared_router_sigmoid_eps",
                  "shared_router_norm_p", "shared_router_bias", "router_logit_bias", "clip_qkv",
                  "attention_bias", "rope_partial")

    def window(self, L):
        """Keys a query of layer L sees counting itself (0 = full causal): Olmo-core 3's
        SlidingWindowAttentionConfig._get_window_size."""
        if not self.sliding_window:
            return 0
        if self.sliding_window_full_first and L == 0:
            return 0
        if self.sliding_window_full_last and L == self.n_layers - 1:
            return 0
        pattern = [int(v) for v in self.sliding_window.split(",")]
        w = pattern[(L - (1 if self.sliding_window_full_first else 0)) % len(pattern)]
        return 0 if w == -1 else w

    def rotary_dim(self):
        return int(self.head_dim * self.rope_partial)

    def rope_on(self, L):
        return self.rope == "all" or (self.rope == "windowed" and self.window(L) > 0)

    def has_router_bias(self):
        return self.router_bias_gamma > 0 or self.score_correction_bias

    def dense_layer_set(self):
        if self.dense_layers:
            return sorted({int(v) for v in self.dense_layers.split(",")})
        return list(range(self.n_dense_layers))

    def is_dense(self, L):
        return L in self.dense_layer_set()

    def moe_layers(self):
        dense = self.dense_layer_set()
        return [L for L in range(self.n_layers) if L not in dense]

    def validate(self):
        assert self.norm_placement in ("pre", "peri", "reordered")
        assert self.qk_norm in ("none", "full", "per_head")
        assert self.score_func in ("softmax", "sigmoid", "topk_softmax")
        assert self.shared_merge in ("sum", "v1")
        assert self.routing == "learned"
        assert self.n_heads % self.n_kv_heads == 0
        assert self.head_dim % 2 == 0
        assert 0 <= self.n_dense_layers <= self.n_layers
        assert 1 <= self.top_k < self.num_experts
        if self.dense_layers:
            assert self.n_dense_layers == 0, "dense_layers replaces n_dense_layers"
            idx = [int(v) for v in self.dense_layers.split(",")]
            assert len(set(idx)) == len(idx) and all(0 <= i < self.n_layers for i in idx)
            assert ",".join(str(i) for i in sorted(idx)) == self.dense_layers
        assert self.norm_topk_p > 0 and self.expert_weight_scale > 0 and self.sigmoid_eps >= 0
        assert self.original_top_k >= 0
        assert self.sigmoid_eps == 0 or self.score_func == "sigmoid"
        if self.sliding_window:
            assert all(int(v) > 0 or int(v) == -1 for v in self.sliding_window.split(","))
        assert (self.n_group == 0) == (self.topk_group == 0)
        assert self.rope in ("all", "none", "windowed")
        assert self.clip_qkv >= 0 and 0 < self.rope_partial <= 1
        assert self.rotary_dim() >= 2 and self.rotary_dim() % 2 == 0
        assert self.rope != "windowed" or self.sliding_window
        if self.n_group:
            assert self.num_experts % self.n_group == 0 and self.topk_group <= self.n_group
            assert self.score_func != "topk_softmax"
        assert self.shared_experts == 1 or self.shared_router
        assert not self.shared_router or (self.shared_hidden > 0 and self.shared_merge == "sum")
        assert self.shared_router_score in ("softmax", "sigmoid")
        assert self.shared_router_sigmoid_eps == 0 or self.shared_router_score == "sigmoid"
        assert self.shared_router or not (self.shared_router_bias or self.shared_router_norm_p
                                          or self.shared_router_score != "softmax")


def model_dict(cfg: ModelConfig, with_new_fields: bool = True) -> dict:
    """The config's fields as a dict (fixture metadata). with_new_fields=False leaves out the
    Olmo-core 3 fields (asserting they are at their defaults), so fixtures written before those
    options existed keep exactly their keys and bytes."""
    from dataclasses import asdict
    m = asdict(cfg)
    if not with_new_fields:
        for k in ModelConfig.NEW_FIELDS:
            assert m[k] == ModelConfig.__dataclass_fields__[k].default, (k, m[k])
            del m[k]
    return m


@dataclass
class LossConfig:
    lm_z_coef: float
    lbl_coef: float
    router_z_coef: float
    aux_divisor: str = "tokens"  # "labelled": Olmo-core 3's train module (loss_div_factor)
    lbl_granularity: str = "local_batch"  # "instance": Olmo-core's per-sequence load balancing


@dataclass
class OptimConfig:
    lr: float
    min_lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    no_decay_embeddings_norms: bool
    max_grad_norm: float
    schedule: str  # "cosine" | "linear" | "wsd" | "constant"
    warmup_steps: int
    decay_steps: int


@dataclass
class TrainConfig:
    steps: int
    seq_len: int
    batch_size: int
    micro_batch_size: int


def param_shapes(cfg: ModelConfig) -> "OrderedDict[str, tuple]":
    """MODEL.md's parameter table, in a fixed order."""
    D, V, H, G, hd = cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    E, Fe, Fd = cfg.num_experts, cfg.expert_hidden, cfg.dense_hidden
    Fs, Es = cfg.shared_experts * cfg.shared_hidden, cfg.shared_experts
    s = OrderedDict()
    s["embed"] = (V, D)
    if cfg.embedding_norm:
        s["embed_norm"] = (D,)
    in_norm = cfg.norm_placement in ("pre", "peri")  # sublayer input norms
    out_norm = cfg.norm_placement in ("peri", "reordered")  # sublayer output norms
    for L in range(cfg.n_layers):
        p = f"layers.{L}."
        if in_norm:
            s[p + "attn_norm"] = (D,)
        if out_norm:
            s[p + "attn_out_norm"] = (D,)
        s[p + "wq"] = (H * hd, D)
        s[p + "wk"] = (G * hd, D)
        s[p + "wv"] = (G * hd, D)
        s[p + "wo"] = (D, H * hd)
        if cfg.attention_bias:
            s[p + "bq"] = (H * hd,)
            s[p + "bk"] = (G * hd,)
            s[p + "bv"] = (G * hd,)
            s[p + "bo"] = (D,)
        if cfg.qk_norm == "full":
            s[p + "q_norm"] = (H * hd,)
            s[p + "k_norm"] = (G * hd,)
        elif cfg.qk_norm == "per_head":
            s[p + "q_norm"] = (hd,)
            s[p + "k_norm"] = (hd,)
        if in_norm:
            s[p + "ffn_norm"] = (D,)
        if out_norm:
            s[p + "ffn_out_norm"] = (D,)
        if cfg.is_dense(L):
            s[p + "mlp.gate"] = (Fd, D)
            s[p + "mlp.up"] = (Fd, D)
            s[p + "mlp.down"] = (D, Fd)
        else:
            s[p + "router"] = (E, D)
            if cfg.router_logit_bias:
                s[p + "router.bias"] = (E,)
            s[p + "experts.gate"] = (E, Fe, D)
            s[p + "experts.up"] = (E, Fe, D)
            s[p + "experts.down"] = (E, D, Fe)
            if cfg.shared_hidden > 0:
                s[p + "shared.gate"] = (Fs, D)
                s[p + "shared.up"] = (Fs, D)
                s[p + "shared.down"] = (D, Fs)
                if cfg.shared_router:
                    s[p + "shared.router"] = (Es, D)
                if cfg.shared_router_bias:
                    s[p + "shared.router.bias"] = (Es,)
    s["final_norm"] = (D,)
    if not cfg.tie_embeddings:
        s["lm_head"] = (V, D)
    return s


def is_no_decay(name: str) -> bool:
    """Embeddings and norm weights (MODEL.md: weight decay 0 when no_decay_embeddings_norms)."""
    return name == "embed" or name.endswith("norm")


# --------------------------------------------------------------------------- building blocks
def rmsnorm(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta, rd=None):
    """x (B, S, N, hd); rotate-halves on the first rd dims (default all), frequencies over rd;
    the rest pass through; position = index within the sequence."""
    B, S, N, hd = x.shape
    rd = hd if rd is None else rd
    half = rd // 2
    i = torch.arange(half, dtype=DTYPE)
    freq = theta ** (-2.0 * i / rd)  # (rd/2)
    ang = torch.arange(S, dtype=DTYPE)[:, None] * freq[None, :]  # (S, rd/2)
    cos = torch.cos(ang)[None, :, None, :]
    sin = torch.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:rd]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]], dim=-1)


def group_limited(sel, c):
    """Group-limited routing: sel (T,E) with the experts outside each token's topk_group groups
    (the groups whose two best selection values sum highest) set to -inf, and the per-token
    margin of the last chosen group over the next (None when every group is chosen or n_group = 0)."""
    if c.n_group == 0:
        return sel, None
    gs = sel.view(-1, c.n_group, c.num_experts // c.n_group)
    gsum = gs.topk(min(2, gs.shape[-1]), dim=-1)[0].sum(dim=-1)  # (T, n_group)
    gsorted = torch.sort(gsum, dim=-1, descending=True).values
    gap = gsorted[:, c.topk_group - 1] - gsorted[:, c.topk_group] if c.topk_group < c.n_group else None
    gidx = torch.sort(gsum, dim=-1, descending=True, stable=True).indices[:, : c.topk_group]
    allowed = torch.zeros_like(gsum, dtype=torch.bool).scatter_(1, gidx, True)
    allowed = allowed[:, :, None].expand_as(gs).reshape_as(sel)
    return sel.masked_fill(~allowed, float("-inf")), gap


def causal_gqa_attention(q, k, v, window=0):
    """q (B,S,H,hd), k v (B,S,G,hd) -> o (B,S,H,hd). Query head h reads kv head h // (H/G).
    window > 0: query i sees keys i - window + 1 .. i."""
    B, S, H, hd = q.shape
    G = k.shape[2]
    rep = H // G
    kv_of_h = torch.arange(H) // rep
    k = k[:, :, kv_of_h, :]
    v = v[:, :, kv_of_h, :]
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # (B,H,S,hd)
    sc = qh @ kh.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    if window > 0:
        mask &= torch.ones(S, S, dtype=torch.bool).triu(diagonal=-(window - 1))
    sc = sc.masked_fill(~mask, float("-inf"))
    p = torch.softmax(sc, dim=-1)
    return (p @ vh).permute(0, 2, 1, 3)


def swiglu_mlp(h, gate, up, down):
    return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


# --------------------------------------------------------------------------- the model
class MoEReference(torch.nn.Module):
    """Parameters are stored under mangled keys ('.' -> '__'); use .param(name) / .named_ref()."""

    def __init__(self, cfg: ModelConfig, params: dict):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.shapes = param_shapes(cfg)
        self.store = torch.nn.ParameterDict()
        for n, shp in self.shapes.items():
            t = params[n]
            assert tuple(t.shape) == shp, (n, tuple(t.shape), shp)
            self.store[n.replace(".", "__")] = torch.nn.Parameter(t.detach().clone().to(DTYPE))

    def param(self, name):
        return self.store[name.replace(".", "__")]

    def named_ref(self):
        return [(n, self.param(n)) for n in self.shapes]

    def _attention(self, L, h):
        c = self.cfg
        B, S, D = h.shape
        P = lambda n: self.param(f"layers.{L}.{n}")
        b = (lambda n: P(n)) if c.attention_bias else (lambda n: None)
        q = F.linear(h, P("wq"), b("bq"))
        k = F.linear(h, P("wk"), b("bk"))
        v = F.linear(h, P("wv"), b("bv"))
        if c.clip_qkv > 0:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        if c.qk_norm == "full":
            q = rmsnorm(q, P("q_norm"), c.norm_eps)
            k = rmsnorm(k, P("k_norm"), c.norm_eps)
        q = q.view(B, S, c.n_heads, c.head_dim)
        k = k.view(B, S, c.n_kv_heads, c.head_dim)
        v = v.view(B, S, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "per_head":
            q = rmsnorm(q, P("q_norm"), c.norm_eps)
            k = rmsnorm(k, P("k_norm"), c.norm_eps)
        if c.rope_on(L):
            q = rope(q, c.rope_theta, c.rotary_dim())
            k = rope(k, c.rope_theta, c.rotary_dim())
        o = causal_gqa_attention(q, k, v, c.window(L)).reshape(B, S, c.n_heads * c.head_dim)
        return F.linear(o, P("wo"), b("bo"))

    def _moe(self, L, h, router_bias, info):
        c = self.cfg
        B, S, D = h.shape
        P = lambda n: self.param(f"layers.{L}.{n}")
        x = h.reshape(B * S, D)
        z = F.linear(x, P("router"), P("router.bias") if c.router_logit_bias else None)  # (T, E)
        if c.score_func == "sigmoid":
            s = torch.sigmoid(z)
            if c.sigmoid_eps > 0:
                s = s + c.sigmoid_eps
        else:  # softmax, topk_softmax: the load-balancing loss uses the full softmax
            s = torch.softmax(z, dim=-1)
        # topk_softmax selects on the logits, the others on the scores
        sel = z.detach() if c.score_func == "topk_softmax" else s.detach()
        if router_bias is not None:
            sel = sel + router_bias[None, :]
        sel, group_gap = group_limited(sel, c)
        # Top-k of (selection + bias), ties to the lower expert id (stable descending sort).
        order = torch.sort(sel, dim=-1, descending=True, stable=True).indices
        idx = order[:, : c.top_k]  # (T, K)
        if c.score_func == "topk_softmax":
            w = torch.softmax(z.gather(1, idx), dim=-1)  # softmax over the selected logits
        else:
            w = s.gather(1, idx)  # unbiased scores
        if c.norm_topk_prob:
            if c.norm_topk_p == 1.0:
                w = w / w.sum(dim=-1, keepdim=True)
            else:
                w = w / torch.linalg.vector_norm(w, ord=c.norm_topk_p, dim=-1, keepdim=True)
        if c.restore_weight_scale:
            w = w * c.top_k
        if c.expert_weight_scale != 1.0:
            w = w * c.expert_weight_scale
        if c.original_top_k and c.original_top_k != c.top_k:
            w = w * math.sqrt(c.original_top_k / c.top_k)
        out = torch.zeros_like(x)
        gate_w, up_w, down_w = P("experts.gate"), P("experts.up"), P("experts.down")
        for e in range(c.num_experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            ye = swiglu_mlp(x[tok], gate_w[e], up_w[e], down_w[e])
            out = out.index_add(0, tok, ye * w[tok, slot][:, None])
        if c.shared_router:  # gated shared experts: each expert's output times its weight
            zs = F.linear(x, P("shared.router"),
                          P("shared.router.bias") if c.shared_router_bias else None)
            if c.shared_router_score == "sigmoid":
                ws = torch.sigmoid(zs) + c.shared_router_sigmoid_eps
            else:
                ws = torch.softmax(zs, dim=-1)
            if c.shared_router_norm_p:
                ws = ws / torch.linalg.vector_norm(ws, ord=c.shared_router_norm_p, dim=-1,
                                                   keepdim=True)
            H = c.shared_hidden
            for e in range(c.shared_experts):
                rows = slice(e * H, (e + 1) * H)
                ue = swiglu_mlp(x, P("shared.gate")[rows], P("shared.up")[rows],
                                P("shared.down")[:, rows])
                out = out + ws[:, e:e + 1] * ue
        elif c.shared_hidden > 0:
            u = swiglu_mlp(x, P("shared.gate"), P("shared.up"), P("shared.down"))
            if c.shared_merge == "sum":
                out = out + u
            else:  # "v1"
                out = u / (c.top_k + 1) + out * (c.top_k / (c.top_k + 1))
        # sorted selection scores, for the tie-gap check
        sel_sorted = torch.sort(sel, dim=-1, descending=True).values
        info.append(dict(layer=L, logits=z, scores=s, idx=idx, weights=w, sel_sorted=sel_sorted,
                         group_gap=group_gap))
        return out.view(B, S, D)

    def forward(self, ids, router_bias=None, hidden=None):
        """ids (B,S) int. router_bias: dict layer -> (E) tensor, or None. hidden: optional list
        that receives the residual stream after the embedding and after every layer.
        Returns logits (B,S,V) and a list of per-MoE-layer routing dicts."""
        c = self.cfg
        x = F.embedding(ids.long(), self.param("embed"))
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        if c.embedding_norm:
            x = rmsnorm(x, self.param("embed_norm"), c.norm_eps)
        info = []
        if hidden is not None:
            hidden.append(x)
        in_norm = c.norm_placement in ("pre", "peri")
        out_norm = c.norm_placement in ("peri", "reordered")
        for L in range(c.n_layers):
            P = lambda n: self.param(f"layers.{L}.{n}")
            a = self._attention(L, rmsnorm(x, P("attn_norm"), c.norm_eps) if in_norm else x)
            if out_norm:
                a = rmsnorm(a, P("attn_out_norm"), c.norm_eps)
            x = x + a
            h = rmsnorm(x, P("ffn_norm"), c.norm_eps) if in_norm else x
            if c.is_dense(L):
                f = swiglu_mlp(h, P("mlp.gate"), P("mlp.up"), P("mlp.down"))
            else:
                rb = None if router_bias is None else router_bias.get(L)
                f = self._moe(L, h, rb, info)
            if out_norm:
                f = rmsnorm(f, P("ffn_out_norm"), c.norm_eps)
            x = x + f
            if hidden is not None:
                hidden.append(x)
        x = rmsnorm(x, self.param("final_norm"), c.norm_eps)
        head = self.param("embed") if c.tie_embeddings else self.param("lm_head")
        return F.linear(x, head), info


# --------------------------------------------------------------------------- loss definitions
def lm_loss_sums(logits, labels):
    """Sums over labeled positions (label >= 0) of CE and of logsumexp^2 (MODEL.md)."""
    lg = logits.reshape(-1, logits.shape[-1])
    lb = labels.reshape(-1).long()
    m = lb >= 0
    lse = torch.logsumexp(lg[m], dim=-1)
    ce = lse - lg[m].gather(1, lb[m][:, None])[:, 0]
    return ce.sum(), lse.pow(2).sum()


def lbl_definition(scores, counts, top_k, score_func):
    """MODEL.md / op_list load_balance_loss for one micro-batch: E * sum_i f_i P_i."""
    T, E = scores.shape
    p = scores  # topk_softmax: the full softmax
    if score_func == "sigmoid":
        p = p / p.sum(dim=-1, keepdim=True)
    f = counts.to(scores.dtype) / (top_k * T)
    return E * (f * p.mean(dim=0)).sum()


def router_z_definition(logits):
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


# --------------------------------------------------------------------------- schedule
def lr_at(n: int, o: OptimConfig, total_steps: int) -> float:
    """LR at optimizer step n = 1, 2, ... (MODEL.md)."""
    W, N, peak, lo = o.warmup_steps, total_steps, o.lr, o.min_lr
    if W > 0 and n <= W:
        return peak * n / W
    if o.schedule == "constant":
        return peak
    if o.schedule == "wsd":
        if n <= N - o.decay_steps:
            return peak
        q = (n - (N - o.decay_steps)) / o.decay_steps
        return peak - (peak - lo) * q
    p = (n - W) / (N - W)
    if o.schedule == "cosine":
        return lo + (peak - lo) * (1 + math.cos(math.pi * p)) / 2
    if o.schedule == "linear":
        return peak - (peak - lo) * p
    raise ValueError(o.schedule)


def loss_free_bias_update(bias, step_counts, gamma):
    """bias_i += gamma * sign(mean(c) - c_i) (MODEL.md; olmo-core MoERouterV2.post_batch)."""
    c = step_counts.to(DTYPE)
    return bias + gamma * torch.sign(c.mean() - c)
