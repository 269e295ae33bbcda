#include "model/model_state.h"

#include "core/fnv1a.h"
#include "core/rng.h"
#include "kernels/host_view.h"

namespace moe {

ModelState::ModelState(const ModelConfig& config, const ModelShard& shard, int64_t dense_chunks,
                       int64_t expert_chunks, DType compute, bool bf16_operands, Backend& ops)
    : cfg_(config), ops_(ops), layout_(config, shard, dense_chunks, expert_chunks), compute_(compute) {
  // In the backend's memory (zero-filled on the host backends; others leave it undefined, so
  // everything is written before it is read).
  const int64_t N = layout_.total();
  const size_t esize = dtype_size(compute);
  const AllocationScope scope("parameters, gradients and bf16 operand copies");
  param_mem_ = Buffer(ops, static_cast<size_t>(N) * esize);
  grad_mem_ = Buffer(ops, static_cast<size_t>(N) * esize);
  params_ = bind_weights(layout_, cfg_, param_mem_.view(compute, {N}));
  grads_ = bind_weights(layout_, cfg_, grad_mem_.view(compute, {N}));
  if (bf16_operands) {
    operand_mem_ = Buffer(ops, static_cast<size_t>(N) * dtype_size(DType::kBF16));
    operands_ = bind_weights(layout_, cfg_, operand_mem_.view(DType::kBF16, {N}));
  } else {
    operands_ = params_;
  }
  for (int64_t m = 0; m < cfg_.num_moe_layers(); ++m)
    router_bias_.emplace_back(ops, compute, std::initializer_list<int64_t>{cfg_.num_experts});
}

void ModelState::init_params(uint64_t seed) {
  // Host loop over the flat buffer (written in place on the host backends, else uploaded).
  HostView host(ops_, params_.flat, HostView::kWrite);
  for (const ParamInfo& info : layout_.entries()) {
    Tensor t = param_view(info, host.tensor());
    uint64_t stream = fnv1a(info.name);  // the name's hash: layout-independent streams
    stream = (stream << 8) | static_cast<uint64_t>(RngStream::kInit);
    for (int64_t i = 0; i < info.numel; ++i) {
      // Indexed by the element of the whole parameter: an expert shard draws its own slice.
      const auto index = static_cast<uint64_t>(info.global_begin + i);
      double v = info.is_norm ? 1.0 : cfg_.init_std * random_trunc_normal(seed, stream, index, 3.0);
      if (compute_ == DType::kF64) t.as<double>()[i] = v;
      else t.as<float>()[i] = static_cast<float>(v);
    }
  }
  host.commit();
  // The padding row starts at zero, as transformers' init does for padding_idx.
  if (cfg_.pad_id >= 0 && layout_.shard().first_stage()) {
    const ParamInfo& e = layout_.find("embed");
    Tensor t = param_view(e, params_.flat);
    ops_.fill(t.slice(cfg_.pad_id, cfg_.pad_id + 1), 0.0);
  }
  for (auto& b : router_bias_) ops_.fill(b.t, 0.0);
  refresh_operand_weights();
}

void ModelState::refresh_operand_weights() {
  if (operands_.flat.data != params_.flat.data) ops_.convert(params_.flat, operands_.flat);
}

void ModelState::zero_grads() { ops_.fill(grads_.flat, 0.0); }

}  // namespace moe
