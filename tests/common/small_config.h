// The small MoE model the training tests start from, and the learnable synthetic batches they feed
// it. A test sets on top what it is about (tests/train/step_test.cpp, tests/checkpoint/).
#pragma once

#include <cstdint>

#include "config/config.h"
#include "core/buffer.h"
#include "core/rng.h"

namespace moe::test {

// 2 layers of 4 query and 2 key/value heads, d 32, 4 experts top-2 of width 24 with a shared
// expert of 8, the z-loss on, warmup 2, clipping at 0.5, 4 sequences of 24 tokens in micro-batches
// of 2, 6 steps.
inline Config small_config() {
  Config c;
  ModelConfig& m = c.model;
  m.vocab_size = 64;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.num_experts = 4;
  m.top_k = 2;
  m.expert_hidden = 24;
  m.shared_hidden = 8;
  c.loss.lm_z_coef = 1e-3;
  c.optim.warmup_steps = 2;
  c.optim.max_grad_norm = 0.5;
  c.train.seq_len = 24;
  c.train.batch_size = 4;
  c.train.micro_batch_size = 2;
  c.train.steps = 6;
  return c;
}

// A learnable synthetic stream with an entropy floor near 1.2 nats: token t+1 = (5 t + 3) mod V
// with probability 0.6, else one of four neighbours of t; (B, S) ids and their next-token labels
// (the last position unlabeled), a pure function of (seed, step).
inline void synthetic_batch(int64_t B, int64_t S, int64_t V, uint64_t seed, int64_t step, OwnedTensor& ids,
                            OwnedTensor& labels, int64_t first_token_shift = 0) {
  ids = OwnedTensor(DType::kI32, {B, S});
  labels = OwnedTensor(DType::kI32, {B, S});
  for (int64_t b = 0; b < B; ++b) {
    int64_t tok = (b * 7 + step * 13 + first_token_shift) % V;
    for (int64_t s = 0; s < S; ++s) {
      ids.as<int32_t>()[b * S + s] = static_cast<int32_t>(tok);
      const double u = random_uniform(seed, 77, static_cast<uint64_t>((step * B + b) * S + s));
      tok = u < 0.6 ? (5 * tok + 3) % V : (tok + 1 + static_cast<int64_t>((u - 0.6) * 10)) % V;
    }
    for (int64_t s = 0; s < S; ++s) labels.as<int32_t>()[b * S + s] = s + 1 < S ? ids.as<int32_t>()[b * S + s + 1] : -1;
  }
}

// The batch of a config's step: (train.batch_size, train.seq_len) from train.seed.
inline void synthetic_batch(const Config& c, int64_t step, OwnedTensor& ids, OwnedTensor& labels) {
  synthetic_batch(c.train.batch_size, c.train.seq_len, c.model.vocab_size, c.train.seed, step, ids, labels);
}

}  // namespace moe::test
