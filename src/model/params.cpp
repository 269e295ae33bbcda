#include "model/params.h"

namespace moe {

ParamLayout::ParamLayout(const ModelConfig& c) {
  const int64_t D = c.d_model, hd = c.hd(), q = c.n_heads * hd, kv = c.n_kv_heads * hd;
  add("embed", {c.vocab_size, D}, false, true);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn_norm", {D}, true);
    if (c.norm_placement == "peri") add(p + "attn_out_norm", {D}, true);
    add(p + "wq", {q, D});
    add(p + "wk", {kv, D});
    add(p + "wv", {kv, D});
    add(p + "wo", {D, q});
    if (c.qk_norm == "full") {
      add(p + "q_norm", {q}, true);
      add(p + "k_norm", {kv}, true);
    } else if (c.qk_norm == "per_head") {
      add(p + "q_norm", {hd}, true);
      add(p + "k_norm", {hd}, true);
    }
    add(p + "ffn_norm", {D}, true);
    if (c.norm_placement == "peri") add(p + "ffn_out_norm", {D}, true);
    if (!c.is_moe_layer(l)) {
      const int64_t F = c.dense_width();
      add(p + "mlp.gate", {F, D});
      add(p + "mlp.up", {F, D});
      add(p + "mlp.down", {D, F});
    } else {
      const int64_t E = c.num_experts, F = c.expert_hidden;
      add(p + "router", {E, D});
      add(p + "experts.gate", {E, F, D});
      add(p + "experts.up", {E, F, D});
      add(p + "experts.down", {E, D, F});
      if (c.shared_hidden > 0) {
        add(p + "shared.gate", {c.shared_hidden, D});
        add(p + "shared.up", {c.shared_hidden, D});
        add(p + "shared.down", {D, c.shared_hidden});
      }
    }
  }
  add("final_norm", {D}, true);
  if (!c.tie_embeddings) add("lm_head", {c.vocab_size, D});
}

void ParamLayout::add(std::string name, std::vector<int64_t> shape, bool is_norm, bool is_embedding) {
  ParamInfo info;
  info.name = std::move(name);
  info.shape = std::move(shape);
  info.numel = 1;
  for (int64_t d : info.shape) info.numel *= d;
  // Each parameter starts on a 64-byte boundary (16 floats), good for SIMD and bf16 copies.
  total_ = (total_ + 15) / 16 * 16;
  info.offset = total_;
  info.is_norm = is_norm;
  info.is_embedding = is_embedding;
  total_ += info.numel;
  entries_.push_back(std::move(info));
}

bool ParamLayout::contains(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return true;
  return false;
}

const ParamInfo& ParamLayout::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return e;
  MOE_FAIL("no parameter named '", name, "' in this model");
}

Tensor param_view(const ParamInfo& info, void* base, DType dtype) {
  Tensor t(static_cast<char*>(base) + static_cast<size_t>(info.offset) * dtype_size(dtype), dtype, {1});
  t.ndim = static_cast<int>(info.shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = info.shape[static_cast<size_t>(i)];
  return t;
}

Weights bind_weights(const ParamLayout& layout, const ModelConfig& c, void* base, DType dtype) {
  Weights w;
  auto get = [&](const std::string& name) {
    return layout.contains(name) ? param_view(layout.find(name), base, dtype) : Tensor();
  };
  w.embed = get("embed");
  w.final_norm = get("final_norm");
  w.lm_head = c.tie_embeddings ? w.embed : get("lm_head");
  w.flat = Tensor(base, dtype, {layout.total()});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerWeights L;
    L.attn_norm = get(p + "attn_norm");
    L.attn_out_norm = get(p + "attn_out_norm");
    L.wq = get(p + "wq");
    L.wk = get(p + "wk");
    L.wv = get(p + "wv");
    L.wo = get(p + "wo");
    L.q_norm = get(p + "q_norm");
    L.k_norm = get(p + "k_norm");
    L.ffn_norm = get(p + "ffn_norm");
    L.ffn_out_norm = get(p + "ffn_out_norm");
    L.mlp_gate = get(p + "mlp.gate");
    L.mlp_up = get(p + "mlp.up");
    L.mlp_down = get(p + "mlp.down");
    L.router = get(p + "router");
    L.exp_gate = get(p + "experts.gate");
    L.exp_up = get(p + "experts.up");
    L.exp_down = get(p + "experts.down");
    L.shared_gate = get(p + "shared.gate");
    L.shared_up = get(p + "shared.up");
    L.shared_down = get(p + "shared.down");
    w.layers.push_back(L);
  }
  return w;
}

}  // namespace moe
