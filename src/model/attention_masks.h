// The first key each query may attend to, for every attention kind of the model: intra-document
// masking and sliding windows both reduce to it (the attention ops' doc_start table), so the
// kernels' tile skipping serves both. Built on the host from the batch's document starts (host
// data: no device read) and uploaded once per batch.
#pragma once

#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "kernels/ops.h"

namespace moe {

struct MicroBatch;

class AttentionMasks {
 public:
  // windows: ModelConfig::attention_windows(). host_doc: (B,S) i32 document starts in host
  // memory, or empty (plain causal). After it, rows [b0, b1) of each table are doc_start(b0, b1)
  // and window_start(w, b0, b1). Buffers are kept between calls of the same shape.
  void build(Backend& ops, const std::vector<int64_t>& windows, const Tensor& host_doc, int64_t B, int64_t S);
  // Document starts of sequences [b0, b1), or empty (plain causal).
  Tensor doc_start(int64_t b0, int64_t b1) const;
  // The first keys of window windows[w] (document starts included) of sequences [b0, b1).
  Tensor window_start(size_t w, int64_t b0, int64_t b1) const;
  size_t num_windows() const { return windows_.size(); }
  // mb.doc_start and mb.window_start: the tables of sequences [b0, b1).
  void fill(MicroBatch& mb, int64_t b0, int64_t b1) const;

 private:
  std::vector<int64_t> windows_;
  bool has_doc_ = false;
  int64_t B_ = 0, S_ = 0;
  OwnedTensor host_, device_;  // (1 + windows, B, S) i32: document starts, then each window's table
  Tensor tables_;              // host_ or device_, as the backend reads it
};

// out[b,s] = max(doc_start[b,s] (0 when doc_start is null), s - window + 1, 0).
void window_first_keys(const int32_t* doc_start, int64_t B, int64_t S, int64_t window, int32_t* out);

}  // namespace moe
