#include "model/attention_masks.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "model/transformer.h"

namespace moe {

void window_first_keys(const int32_t* doc_start, int64_t B, int64_t S, int64_t window, int32_t* out) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t doc = doc_start ? doc_start[b * S + s] : 0;
      out[b * S + s] = static_cast<int32_t>(std::max<int64_t>(doc, s - window + 1));
    }
}

void AttentionMasks::build(Backend& ops, const std::vector<int64_t>& windows, const Tensor& host_doc, int64_t B,
                           int64_t S) {
  if (host_doc.data) {
    check_shape(host_doc, {B, S}, "doc_start");
    check_dtype(host_doc, DType::kI32, "doc_start");
    MOE_CHECK(host_doc.device == Device::kCpu, "doc_start: the batch's document starts must be in host memory");
  }
  windows_ = windows;
  has_doc_ = host_doc.data != nullptr;
  B_ = B;
  S_ = S;
  if (!has_doc_ && windows_.empty()) return;
  const int64_t n = 1 + static_cast<int64_t>(windows_.size());
  if (host_.t.numel() != n * B * S) host_ = OwnedTensor(DType::kI32, {n, B, S});
  host_.t = host_.t.view({n, B, S});
  int32_t* h = host_.as<int32_t>();
  const int32_t* doc = has_doc_ ? host_doc.as<int32_t>() : nullptr;
  if (doc) std::memcpy(h, doc, static_cast<size_t>(B * S) * sizeof(int32_t));
  for (size_t w = 0; w < windows_.size(); ++w)
    window_first_keys(doc, B, S, windows_[w], h + static_cast<int64_t>(w + 1) * B * S);
  if (ops.host_addressable()) {
    tables_ = host_.t;
    return;
  }
  if (device_.t.numel() != n * B * S) device_ = OwnedTensor(ops, DType::kI32, {n, B, S});
  device_.t = device_.t.view({n, B, S});
  ops.upload(host_.t.data, device_.t);
  tables_ = device_.t;
}

Tensor AttentionMasks::doc_start(int64_t b0, int64_t b1) const {
  if (!has_doc_) return Tensor();
  MOE_CHECK(b0 >= 0 && b0 <= b1 && b1 <= B_, "attention masks: sequences [", b0, ", ", b1, ") of ", B_);
  return tables_.slice(0, 1).view({B_, S_}).slice(b0, b1);
}

Tensor AttentionMasks::window_start(size_t w, int64_t b0, int64_t b1) const {
  MOE_CHECK(w < windows_.size(), "attention masks: window ", w, " of ", windows_.size());
  MOE_CHECK(b0 >= 0 && b0 <= b1 && b1 <= B_, "attention masks: sequences [", b0, ", ", b1, ") of ", B_);
  const int64_t i = static_cast<int64_t>(w) + 1;
  return tables_.slice(i, i + 1).view({B_, S_}).slice(b0, b1);
}

void AttentionMasks::fill(MicroBatch& mb, int64_t b0, int64_t b1) const {
  mb.doc_start = doc_start(b0, b1);
  mb.window_start.resize(windows_.size());
  for (size_t w = 0; w < windows_.size(); ++w) mb.window_start[w] = window_start(w, b0, b1);
}

}  // namespace moe
