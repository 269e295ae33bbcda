"""Plain float64 PyTorch reference of the moecore model (docs/MODEL.md).

This module is deliberately written from MODEL.md alone, without transformers or olmo-core, so that
it can be checked against both (see make_fixtures.py, which compares it with transformers'
OlmoeForCausalLM and uses olmo-core's loss functions). Parameter names are exactly MODEL.md's
(`embed`, `layers.0.wq`, `layers.1.experts.gate`, ...). Everything runs in float64.

Options covered: norm_placement pre|peri, qk_norm none|full|per_head, n_dense_layers, shared expert
(shared_merge sum|v1), score_func softmax|sigmoid, norm_topk_prob, router_bias (loss-free
balancing), tie_embeddings, GQA, RoPE rotate-halves with theta, head_dim != d_model / n_heads.

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

    def moe_layers(self):
        return [L for L in range(self.n_layers) if L >= self.n_dense_layers]

    def validate(self):
        assert self.norm_placement in ("pre", "peri")
        assert self.qk_norm in ("none", "full", "per_head")
        assert self.score_func in ("softmax", "sigmoid")
        assert self.shared_merge in ("sum", "v1")
        assert self.routing == "learned"
        assert self.n_heads % self.n_kv_heads == 0
        assert self.head_dim % 2 == 0
        assert 0 <= self.n_dense_layers <= self.n_layers
        assert 1 <= self.top_k < self.num_experts


@dataclass
class LossConfig:
    lm_z_coef: float
    lbl_coef: float
    router_z_coef: float


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
    E, Fe, Fd, Fs = cfg.num_experts, cfg.expert_hidden, cfg.dense_hidden, cfg.shared_hidden
    s = OrderedDict()
    s["embed"] = (V, D)
    for L in range(cfg.n_layers):
        p = f"layers.{L}."
        s[p + "attn_norm"] = (D,)
        if cfg.norm_placement == "peri":
            s[p + "attn_out_norm"] = (D,)
        s[p + "wq"] = (H * hd, D)
        s[p + "wk"] = (G * hd, D)
        s[p + "wv"] = (G * hd, D)
        s[p + "wo"] = (D, H * hd)
        if cfg.qk_norm == "full":
            s[p + "q_norm"] = (H * hd,)
            s[p + "k_norm"] = (G * hd,)
        elif cfg.qk_norm == "per_head":
            s[p + "q_norm"] = (hd,)
            s[p + "k_norm"] = (hd,)
        s[p + "ffn_norm"] = (D,)
        if cfg.norm_placement == "peri":
            s[p + "ffn_out_norm"] = (D,)
        if L < cfg.n_dense_layers:
            s[p + "mlp.gate"] = (Fd, D)
            s[p + "mlp.up"] = (Fd, D)
            s[p + "mlp.down"] = (D, Fd)
        else:
            s[p + "router"] = (E, D)
            s[p + "experts.gate"] = (E, Fe, D)
            s[p + "experts.up"] = (E, Fe, D)
            s[p + "experts.down"] = (E, D, Fe)
            if cfg.shared_hidden > 0:
                s[p + "shared.gate"] = (Fs, D)
                s[p + "shared.up"] = (Fs, D)
                s[p + "shared.down"] = (D, Fs)
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


def rope(x, theta):
    """x (B, S, N, hd); rotate-halves; position = index within the sequence."""
    B, S, N, hd = x.shape
    half = hd // 2
    i = torch.arange(half, dtype=DTYPE)
    freq = theta ** (-2.0 * i / hd)  # (hd/2)
    ang = torch.arange(S, dtype=DTYPE)[:, None] * freq[None, :]  # (S, hd/2)
    cos = torch.cos(ang)[None, :, None, :]
    sin = torch.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def causal_gqa_attention(q, k, v):
    """q (B,S,H,hd), k v (B,S,G,hd) -> o (B,S,H,hd). Query head h reads kv head h // (H/G)."""
    B, S, H, hd = q.shape
    G = k.shape[2]
    rep = H // G
    kv_of_h = torch.arange(H) // rep
    k = k[:, :, kv_of_h, :]
    v = v[:, :, kv_of_h, :]
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # (B,H,S,hd)
    sc = qh @ kh.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
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
        q = F.linear(h, P("wq"))
        k = F.linear(h, P("wk"))
        v = F.linear(h, P("wv"))
        if c.qk_norm == "full":
            q = rmsnorm(q, P("q_norm"), c.norm_eps)
            k = rmsnorm(k, P("k_norm"), c.norm_eps)
        q = q.view(B, S, c.n_heads, c.head_dim)
        k = k.view(B, S, c.n_kv_heads, c.head_dim)
        v = v.view(B, S, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "per_head":
            q = rmsnorm(q, P("q_norm"), c.norm_eps)
            k = rmsnorm(k, P("k_norm"), c.norm_eps)
        q = rope(q, c.rope_theta)
        k = rope(k, c.rope_theta)
        o = causal_gqa_attention(q, k, v).reshape(B, S, c.n_heads * c.head_dim)
        return F.linear(o, P("wo"))

    def _moe(self, L, h, router_bias, info):
        c = self.cfg
        B, S, D = h.shape
        P = lambda n: self.param(f"layers.{L}.{n}")
        x = h.reshape(B * S, D)
        z = F.linear(x, P("router"))  # (T, E) router logits
        s = torch.softmax(z, dim=-1) if c.score_func == "softmax" else torch.sigmoid(z)
        sel = s.detach()
        if router_bias is not None:
            sel = sel + router_bias[None, :]
        # Top-k of (scores + bias), ties to the lower expert id (stable descending sort).
        order = torch.sort(sel, dim=-1, descending=True, stable=True).indices
        idx = order[:, : c.top_k]  # (T, K)
        w = s.gather(1, idx)  # unbiased scores
        if c.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        gate_w, up_w, down_w = P("experts.gate"), P("experts.up"), P("experts.down")
        for e in range(c.num_experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            ye = swiglu_mlp(x[tok], gate_w[e], up_w[e], down_w[e])
            out = out.index_add(0, tok, ye * w[tok, slot][:, None])
        if c.shared_hidden > 0:
            u = swiglu_mlp(x, P("shared.gate"), P("shared.up"), P("shared.down"))
            if c.shared_merge == "sum":
                out = out + u
            else:  # "v1"
                out = u / (c.top_k + 1) + out * (c.top_k / (c.top_k + 1))
        # sorted selection scores, for the tie-gap check
        sel_sorted = torch.sort(sel, dim=-1, descending=True).values
        info.append(dict(layer=L, logits=z, scores=s, idx=idx, weights=w, sel_sorted=sel_sorted))
        return out.view(B, S, D)

    def forward(self, ids, router_bias=None, hidden=None):
        """ids (B,S) int. router_bias: dict layer -> (E) tensor, or None. hidden: optional list
        that receives the residual stream after the embedding and after every layer.
        Returns logits (B,S,V) and a list of per-MoE-layer routing dicts."""
        c = self.cfg
        x = F.embedding(ids.long(), self.param("embed"))
        info = []
        if hidden is not None:
            hidden.append(x)
        for L in range(c.n_layers):
            P = lambda n: self.param(f"layers.{L}.{n}")
            a = self._attention(L, rmsnorm(x, P("attn_norm"), c.norm_eps))
            if c.norm_placement == "peri":
                a = rmsnorm(a, P("attn_out_norm"), c.norm_eps)
            x = x + a
            h = rmsnorm(x, P("ffn_norm"), c.norm_eps)
            if L < c.n_dense_layers:
                f = swiglu_mlp(h, P("mlp.gate"), P("mlp.up"), P("mlp.down"))
            else:
                rb = None if router_bias is None else router_bias.get(L)
                f = self._moe(L, h, rb, info)
            if c.norm_placement == "peri":
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
    p = scores
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
