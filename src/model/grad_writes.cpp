#include "model/grad_writes.h"

#include <algorithm>

namespace moe {

GradWrites::GradWrites(const ParamLayout& layout, const Tensor& grad_flat, Backend& ops)
    : flat_(grad_flat), ops_(ops), written_(layout.entries().size(), 0) {
  for (const ParamInfo& p : layout.entries()) entries_.push_back({p.offset, p.numel, p.layer, p.name});
  std::sort(entries_.begin(), entries_.end(), [](const Entry& a, const Entry& b) { return a.offset < b.offset; });
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto at = static_cast<size_t>(entries_[i].layer + 1);
    if (by_layer_.size() <= at) by_layer_.resize(at + 1);
    by_layer_[at].push_back(i);
  }
  ops_.fill(flat_, 0.0);
}

void GradWrites::start_step() { std::fill(written_.begin(), written_.end(), uint8_t{0}); }

size_t GradWrites::entry_of(const Tensor& grad) const {
  const std::ptrdiff_t bytes = static_cast<const char*>(grad.data) - static_cast<const char*>(flat_.data);
  const int64_t offset = static_cast<int64_t>(bytes) / static_cast<int64_t>(dtype_size(flat_.dtype));
  const auto it = std::lower_bound(entries_.begin(), entries_.end(), offset,
                                   [](const Entry& e, int64_t off) { return e.offset < off; });
  if (bytes >= 0 && it != entries_.end() && it->offset == offset && it->numel == grad.numel())
    return static_cast<size_t>(it - entries_.begin());
  const auto in = std::upper_bound(entries_.begin(), entries_.end(), offset,
                                   [](int64_t off, const Entry& e) { return off < e.offset; });
  const std::string where = bytes >= 0 && in != entries_.begin() ? " (inside '" + std::prev(in)->name + "')" : "";
  MOE_FAIL("GradWrites: a gradient write of ", grad.numel(), " elements at element ", offset, where,
           " is not a whole parameter's gradient");
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
  auto zero = [&](size_t i) {
    if (written_[i]) return;
    ops_.fill(flat_.slice(entries_[i].offset, entries_[i].offset + entries_[i].numel), 0.0);
    written_[i] = 1;
  };
  if (layer == kEvery) {
    for (size_t i = 0; i < entries_.size(); ++i) zero(i);
  } else if (static_cast<size_t>(layer + 1) < by_layer_.size()) {
    for (size_t i : by_layer_[static_cast<size_t>(layer + 1)]) zero(i);
  }
}

}  // namespace moe
