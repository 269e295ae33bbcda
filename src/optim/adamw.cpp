#include "optim/adamw.h"

#include <algorithm>

namespace moe {
namespace {
std::vector<StateSlice> owned_slices(const ParamLayout& layout, std::vector<std::pair<int64_t, int64_t>> owned) {
  if (owned.empty()) owned.emplace_back(0, layout.total());
  std::vector<StateSlice> out;
  int64_t state = 0;
  for (const auto& [b, e] : owned)
    for (const ParamInfo& p : layout.entries()) {
      const int64_t lo = std::max(b, p.offset), hi = std::min(e, p.offset + p.numel);
      if (lo >= hi) continue;
      out.push_back({&p, lo - p.offset, hi - lo, state});
      state += hi - lo;
    }
  return out;
}
int64_t state_numel(const std::vector<StateSlice>& s) { return s.empty() ? 1 : s.back().state_offset + s.back().count; }
}  // namespace

AdamW::AdamW(Backend& ops, const ParamLayout& layout, const OptimConfig& config, DType dtype,
             std::vector<std::pair<int64_t, int64_t>> owned)
    : config_(config),
      slices_(owned_slices(layout, std::move(owned))),
      m_(ops, dtype, {state_numel(slices_)}),
      v_(ops, dtype, {state_numel(slices_)}) {
  ops.fill(m_.t, 0.0);
  ops.fill(v_.t, 0.0);
}

void AdamW::step_by_control(Backend& ops, const Weights& params, const Weights& grads, const Tensor& control,
                            const Weights* copies) const {
  for (const StateSlice& s : slices_) {
    const bool no_decay = config_.no_decay_embeddings_norms && (s.param->is_norm || s.param->is_embedding);
    const int64_t f = s.flat_offset();
    ops.adamw_by_control(params.flat.slice(f, f + s.count), grads.flat.slice(f, f + s.count),
                         m_.t.slice(s.state_offset, s.state_offset + s.count),
                         v_.t.slice(s.state_offset, s.state_offset + s.count), control, config_.beta1, config_.beta2,
                         config_.eps, no_decay ? 0.0 : config_.weight_decay,
                         copies ? copies->flat.slice(f, f + s.count) : Tensor());
  }
}

}  // namespace moe
