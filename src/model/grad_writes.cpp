#include "model/grad_writes.h"

#include <algorithm>

namespace moe {

GradWrites::GradWrites(const ParamLayout& layout, const Tensor& grad_flat, Backend& ops)
    : layout_(layout), flat_(grad_flat), ops_(ops), written_(layout.entries().size(), 0) {
  const auto& e = layout_.entries();
  by_offset_.resize(e.size());
  for (size_t i = 0; i < e.size(); ++i) by_offset_[i] = i;
  std::sort(by_offset_.begin(), by_offset_.end(), [&](size_t a, size_t b) { return e[a].offset < e[b].offset; });
  ops_.fill(flat_, 0.0);
}

void GradWrites::start_step() { std::fill(written_.begin(), written_.end(), uint8_t{0}); }

size_t GradWrites::entry_of(const Tensor& grad) const {
  const auto& e = layout_.entries();
  const std::ptrdiff_t bytes = static_cast<const char*>(grad.data) - static_cast<const char*>(flat_.data);
  const int64_t offset = static_cast<int64_t>(bytes) / static_cast<int64_t>(dtype_size(flat_.dtype));
  const auto it = std::lower_bound(by_offset_.begin(), by_offset_.end(), offset,
                                   [&](size_t i, int64_t off) { return e[i].offset < off; });
  MOE_CHECK(bytes >= 0 && it != by_offset_.end() && e[*it].offset == offset && e[*it].numel == grad.numel(),
            "GradWrites: a gradient write of ", grad.numel(), " elements at element ", offset,
            " of the gradient buffer is not a whole parameter's gradient");
  return *it;
}

bool GradWrites::accumulate(const Tensor& grad) {
  uint8_t& w = written_[entry_of(grad)];
  const bool added = w != 0;
  w = 1;
  return added;
}

void GradWrites::prepare(const Tensor& grad) {
  if (!accumulate(grad)) ops_.fill(grad, 0.0);
}

void GradWrites::zero_unwritten(int64_t layer) {
  const auto& e = layout_.entries();
  for (size_t i = 0; i < e.size(); ++i) {
    if (written_[i] || (layer != kEvery && e[i].layer != layer)) continue;
    ops_.fill(param_view(e[i], flat_), 0.0);
    written_[i] = 1;
  }
}

}  // namespace moe
