// Sampling text from an in-memory model (byte-level vocabularies print as text).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/transformer.h"

namespace moe {

struct GenerateOptions {
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0 = greedy (argmax)
  int64_t top_k = 40;        // 0 = the whole vocabulary
  uint64_t seed = 0;         // draws are Philox(seed, stream, token position): deterministic
};

// Continues `prompt` (non-empty ids) by max_new_tokens tokens and returns only the new ones.
// Each token re-runs Transformer::forward_logits on the last seq_len tokens of the context,
// placed at the start of row 0 of a (batch, seq_len) micro-batch (the model's fixed shape;
// the rest is padding, which a causal model never attends to from earlier positions), and
// samples from the logits of the context's last position: O(seq_len) forwards of the whole
// micro-batch per token, simple and exact, fine for a demo (no KV cache).
std::vector<int32_t> generate(Transformer& model, int64_t batch, int64_t seq_len,
                              const std::vector<int32_t>& prompt, const GenerateOptions& options);

// Draws one token from logits (V) with temperature and top-k; u is uniform in [0, 1).
// Ties in top-k keep the lower id. Exposed for tests.
int32_t sample_token(const std::vector<double>& logits, double temperature, int64_t top_k, double u);

// Bytes <-> ids for byte-level models (vocab_size 256).
std::vector<int32_t> bytes_to_ids(const std::string& text);
std::string ids_to_bytes(const std::vector<int32_t>& ids);

}  // namespace moe
