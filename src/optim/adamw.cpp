#include "optim/adamw.h"

namespace moe {

AdamW::AdamW(const ParamLayout& layout, const OptimConfig& config, DType dtype)
    : layout_(layout), config_(config), dtype_(dtype), m_(dtype, {layout.total()}), v_(dtype, {layout.total()}) {}

void AdamW::step(Backend& ops, const Weights& params, const Weights& grads, double lr) {
  ++step_;
  for (const ParamInfo& info : layout_.entries()) {
    const bool no_decay = config_.no_decay_embeddings_norms && (info.is_norm || info.is_embedding);
    ops.adamw(param_view(info, params.flat.data, dtype_), param_view(info, grads.flat.data, dtype_),
              param_view(info, m_.t.data, dtype_), param_view(info, v_.t.data, dtype_), lr,
              config_.beta1, config_.beta2, config_.eps, no_decay ? 0.0 : config_.weight_decay, step_);
  }
}

}  // namespace moe
