// The small MoE model the in-process GPU tests train (cupti_test, graph_test): 2 layers, 8 experts
// top-2, sequences of 64, 2 micro-batches of 2, on the cuda backend.
#pragma once

#include <string>

#include "config/config.h"

namespace moe::test {

inline Config small_cuda_config(const std::string& precision = "fp32") {
  Config c;
  c.model.vocab_size = 64;
  c.model.d_model = 64;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.num_experts = 8;
  c.model.top_k = 2;
  c.model.expert_hidden = 64;
  c.optim.warmup_steps = 2;
  c.train.seq_len = 64;
  c.train.batch_size = 4;
  c.train.micro_batch_size = 2;
  c.train.steps = 8;
  c.train.backend = "cuda";
  c.train.precision = precision;
  return c;
}

}  // namespace moe::test
