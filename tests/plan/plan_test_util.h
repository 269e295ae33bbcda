// What the planner's tests share: a small MoE model's config and the message of an error.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/check.h"

namespace moe::test {

// 4 layers (one dense), d 32, 8 experts top-2, sequences of 16, batches of 8 in micro-batches of
// `micro`; extra overrides last.
inline Config small_plan_config(int64_t micro, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"model.vocab_size=96", "model.d_model=32", "model.n_layers=4", "model.n_heads=4",
                                "model.n_kv_heads=2", "model.n_dense_layers=1", "model.num_experts=8", "model.top_k=2",
                                "model.expert_hidden=24", "train.seq_len=16",
                                "train.micro_batch_size=" + std::to_string(micro), "train.batch_size=8"};
  o.insert(o.end(), extra.begin(), extra.end());
  return parse_config("", o);
}

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace moe::test
