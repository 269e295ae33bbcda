#include "model/model_state.h"

#include <algorithm>
#include <tuple>

#include "core/fnv1a.h"
#include "core/mxfp8.h"
#include "core/phase_timer.h"
#include "core/rng.h"
#include "kernels/host_view.h"
#include "model/activations.h"

namespace moe {

namespace {
// Carves a layer's MXFP8 caches out of `at` (bytes), advancing it.
MxExpertWeights carve_mx(char*& at, Device device, int64_t El, int64_t F, int64_t D) {
  auto take = [&](DType dt, std::initializer_list<int64_t> dims) {
    Tensor t(at, dt, dims, device);
    at += t.nbytes();
    return t;
  };
  const int64_t b = mx::kBlock;
  MxExpertWeights w;
  for (auto [q, qs, t, ts, N, K] : {std::tuple{&w.gate_q, &w.gate_qs, &w.gate_t, &w.gate_ts, F, D},
                                    std::tuple{&w.up_q, &w.up_qs, &w.up_t, &w.up_ts, F, D},
                                    std::tuple{&w.down_q, &w.down_qs, &w.down_t, &w.down_ts, D, F}}) {
    *q = take(DType::kE4M3, {El, N, K});
    *qs = take(DType::kE8M0, {El, N, K / b});
    *t = take(DType::kE4M3, {El, K, N});
    *ts = take(DType::kE8M0, {El, K, N / b});
  }
  return w;
}
MxAttentionWeights carve_mx_attention(char*& at, Device device, const ModelConfig& c) {
  const int64_t D = c.d_model, Hd = c.n_heads * c.hd(), Gd = c.n_kv_heads * c.hd(), b = mx::kBlock;
  MxAttentionWeights w;
  for (auto [copies, N, K] : {std::tuple{&w.wq, Hd, D}, std::tuple{&w.wk, Gd, D}, std::tuple{&w.wv, Gd, D},
                              std::tuple{&w.wo, D, Hd}}) {
    auto take = [&](DType dt, std::initializer_list<int64_t> dims) {
      Tensor t(at, dt, dims, device);
      at += t.nbytes();
      return t;
    };
    copies->q = take(DType::kE4M3, {N, K});
    copies->qs = take(DType::kE8M0, {N, K / b});
    copies->t = take(DType::kE4M3, {K, N});
    copies->ts = take(DType::kE8M0, {K, N / b});
  }
  return w;
}
}  // namespace

ModelState::ModelState(const ModelConfig& config, const ModelShard& shard, int64_t dense_chunks,
                       int64_t expert_chunks, DType compute, bool bf16_operands, Backend& ops,
                       std::optional<mx::ScaleRule> mx_rule, bool mx_experts, bool mx_attention)
    : cfg_(config), ops_(ops), layout_(config, shard, dense_chunks, expert_chunks), compute_(compute),
      mx_rule_(mx_rule) {
  // In the backend's memory (zero-filled on the host backends; others leave it undefined, so
  // everything is written before it is read).
  const int64_t N = layout_.total();
  const size_t esize = dtype_size(compute);
  const AllocationScope scope("parameters, gradients and bf16 operand copies");
  param_mem_ = Buffer(ops, static_cast<size_t>(N) * esize);
  grad_mem_ = Buffer(ops, static_cast<size_t>(N) * esize);
  params_ = bind_weights(layout_, cfg_, param_mem_.view(compute, {N}));
  grads_ = bind_weights(layout_, cfg_, grad_mem_.view(compute, {N}));
  grad_writes_.emplace(layout_, grads_.flat, ops_);
  if (bf16_operands) {
    operand_mem_ = Buffer(ops, static_cast<size_t>(N) * dtype_size(DType::kBF16));
    operands_ = bind_weights(layout_, cfg_, operand_mem_.view(DType::kBF16, {N}));
  } else {
    operands_ = params_;
  }
  for (int64_t m = 0; m < cfg_.num_moe_layers(); ++m)
    router_bias_.emplace_back(ops, compute, std::initializer_list<int64_t>{cfg_.num_experts});
  if (mx_rule_ && (mx_experts || mx_attention)) {
    const ModelShard& held = layout_.shard();  // -1s resolved
    const int64_t El = held.num_local_experts;
    int64_t moe_layers = 0;
    for (int64_t l = 0; l < cfg_.n_layers; ++l) moe_layers += held.holds_layer(l) && cfg_.is_moe_layer(l) ? 1 : 0;
    const int64_t bytes = (mx_experts ? moe_layers * mx_expert_cache_bytes(cfg_, El) : 0) +
                          (mx_attention ? held.held_layers() * mx_attention_cache_bytes(cfg_) : 0);
    const AllocationScope mx_scope("MXFP8 weight caches");
    mx_mem_ = Buffer(ops, static_cast<size_t>(std::max<int64_t>(1, bytes)));
    char* at = static_cast<char*>(mx_mem_.data());
    if (mx_experts) mx_.resize(static_cast<size_t>(cfg_.n_layers));
    if (mx_attention) mx_attn_.resize(static_cast<size_t>(cfg_.n_layers));
    for (int64_t l = 0; l < cfg_.n_layers; ++l) {
      if (!held.holds_layer(l)) continue;
      if (mx_experts && cfg_.is_moe_layer(l))
        mx_[static_cast<size_t>(l)] = carve_mx(at, ops.device(), El, cfg_.expert_hidden, cfg_.d_model);
      if (mx_attention) mx_attn_[static_cast<size_t>(l)] = carve_mx_attention(at, ops.device(), cfg_);
    }
  }
}

void ModelState::init_params(uint64_t seed) {
  // Host loop over the flat buffer (written in place on the host backends, else uploaded), on the
  // host's threads: each value is a pure function of (seed, name, index), so any thread count
  // writes the same bytes (~57 ns an element on one thread: minutes for billions of parameters).
  HostView host(ops_, params_.flat, HostView::kWrite);
  for (const ParamInfo& info : layout_.entries()) {
    Tensor t = param_view(info, host.tensor());
    uint64_t stream = fnv1a(info.name);  // the name's hash: layout-independent streams
    stream = (stream << 8) | static_cast<uint64_t>(RngStream::kInit);
    const bool f64 = compute_ == DType::kF64;
#pragma omp parallel for schedule(static) if (info.numel >= 65536)
    for (int64_t i = 0; i < info.numel; ++i) {
      // Indexed by the element of the whole parameter: an expert shard draws its own slice.
      const auto index = static_cast<uint64_t>(info.global_begin + i);
      // Norms start at 1, biases at 0 (Olmo-core 3's init_linear and init_moe_v2), the rest truncated normal.
      double v = info.is_norm ? 1.0 : info.is_bias ? 0.0 : cfg_.init_std * random_trunc_normal(seed, stream, index, 3.0);
      if (f64) t.as<double>()[i] = v;
      else t.as<float>()[i] = static_cast<float>(v);
    }
  }
  host.commit();
  // The padding row starts at zero, as transformers' init does for padding_idx.
  if (cfg_.pad_id >= 0 && layout_.shard().first_stage()) {
    const ParamInfo e = layout_.find("embed");  // a copy: no reference to a call given a temporary
    Tensor t = param_view(e, params_.flat);
    ops_.fill(t.slice(cfg_.pad_id, cfg_.pad_id + 1), 0.0);
  }
  for (auto& b : router_bias_) ops_.fill(b.t, 0.0);
  refresh_operand_weights();
}

void ModelState::refresh_operand_weights(bool bf16_done) {
  if (!bf16_done && bf16_operands()) ops_.convert(params_.flat, operands_.flat);
  PhaseScope phase(Phase::kQuantize);  // within the optimizer's phase when it refreshes them
  for (size_t l = 0; l < mx_.size(); ++l) {
    const MxExpertWeights& q = mx_[l];
    if (q.gate_q.empty()) continue;
    const LayerWeights& w = params_.layers[l];
    const std::pair<const Tensor*, const Tensor*> pairs[] = {{&w.exp_gate, &q.gate_q}, {&w.exp_up, &q.up_q},
                                                              {&w.exp_down, &q.down_q}};
    const Tensor* t[] = {&q.gate_t, &q.up_t, &q.down_t};
    const Tensor* ts[] = {&q.gate_ts, &q.up_ts, &q.down_ts};
    const Tensor* qs[] = {&q.gate_qs, &q.up_qs, &q.down_qs};
    for (int i = 0; i < 3; ++i) {
      const Tensor& master = *pairs[i].first;  // (El,N,K)
      const int64_t El = master.shape[0], N = master.shape[1], K = master.shape[2];
      ops_.mx_quantize(master.view({El * N, K}), false, *mx_rule_, pairs[i].second->view({El * N, K}),
                       qs[i]->view({El * N, K / mx::kBlock}), Tensor(), Tensor());
      ops_.mx_quantize(master, true, *mx_rule_, *t[i], *ts[i], Tensor(), Tensor());
    }
  }
  for (size_t l = 0; l < mx_attn_.size(); ++l) {
    const MxAttentionWeights& q = mx_attn_[l];
    if (q.wq.q.empty()) continue;
    const LayerWeights& w = params_.layers[l];
    for (auto [master, copies] : {std::pair{&w.wq, &q.wq}, std::pair{&w.wk, &q.wk}, std::pair{&w.wv, &q.wv},
                                  std::pair{&w.wo, &q.wo}}) {
      ops_.mx_quantize(*master, false, *mx_rule_, copies->q, copies->qs, Tensor(), Tensor());
      ops_.mx_quantize(*master, true, *mx_rule_, copies->t, copies->ts, Tensor(), Tensor());
    }
  }
}

}  // namespace moe
