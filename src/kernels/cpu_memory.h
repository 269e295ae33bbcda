// Host memory the cpu backend's attention holds beside the model's own buffers, stated once so
// that the memory estimate (plan/memory.cpp) counts what the kernels allocate
// (kernels/cpu/attention.cpp). No kernel headers: the estimate is made in every build.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "core/check.h"

namespace moe {

constexpr int64_t kCpuAttentionTile = 64;  // queries and keys per tile (attn::kTile)

// The attention backward keeps each tile's score gradients (ds) from its dk/dv pass for its dq
// pass instead of recomputing the scores and dp there: 5 tile products instead of 7. It holds
// the tiles of as many (batch, kv head) pairs at a time as MOE_CPU_ATTENTION_STORE_MB allows
// (MiB, a non-negative number; default 16; 0: never), and recomputes where one pair alone does
// not fit (long sequences).
inline double cpu_attention_store_mb() {
  const char* v = std::getenv("MOE_CPU_ATTENTION_STORE_MB");
  if (!v || !*v) return 16.0;
  char* end = nullptr;
  const double mb = std::strtod(v, &end);
  MOE_CHECK(end && *end == '\0' && mb >= 0 && mb < 1e9, "MOE_CPU_ATTENTION_STORE_MB = \"", v,
            "\" is not a non-negative number of MiB");
  return mb;
}

// One (batch, kv head) pair's tiles: its H/G query heads x the causal tile pairs x tile^2 floats.
inline uint64_t cpu_attention_pair_bytes(int64_t H, int64_t G, int64_t S) {
  const auto t = static_cast<uint64_t>((S + kCpuAttentionTile - 1) / kCpuAttentionTile);
  return static_cast<uint64_t>(H / G) * (t * (t + 1) / 2) * kCpuAttentionTile * kCpuAttentionTile * 4;
}

// How many (batch, kv head) pairs one round of the backward stores: 0 = recompute. As few rounds
// as the bound allows, evenly filled (32 pairs of which 27 fit: 2 rounds of 16, not 27 and 5).
inline int64_t cpu_attention_store_pairs(int64_t B, int64_t H, int64_t G, int64_t S) {
  const double bound = cpu_attention_store_mb() * 1048576.0;
  const double pair = static_cast<double>(cpu_attention_pair_bytes(H, G, S));
  const int64_t pairs = B * G;
  if (pairs <= 0 || pair > bound) return 0;
  const int64_t fit = std::min<int64_t>(pairs, static_cast<int64_t>(bound / pair));
  const int64_t rounds = (pairs + fit - 1) / fit;
  return (pairs + rounds - 1) / rounds;
}

// The backward's buffers on the calling thread, grow-only: the store, and D = rowsum(dO * O).
inline uint64_t cpu_attention_backward_bytes(int64_t B, int64_t H, int64_t G, int64_t S) {
  return static_cast<uint64_t>(cpu_attention_store_pairs(B, H, G, S)) * cpu_attention_pair_bytes(H, G, S) +
         static_cast<uint64_t>(B * H * S) * 4;
}

// The cpu GEMMs take a data gradient whose reduction is at least this long in chunks
// (kernels/cpu/gemm_tiles.cpp): an LM head's, over the vocabulary. In bf16 with AVX512-BF16 it
// runs on our own kernel (kernels/cpu/gemm_long.h), which pairs the weight (n x k) once per op
// into a grow-only buffer: ceil(n/2) rows of k rounded up to 64 words (elsewhere: not made).
constexpr int64_t kCpuLongReduction = 4096;
inline uint64_t cpu_long_reduction_pairs_bytes(int64_t n, int64_t k) {
  if (n < kCpuLongReduction) return 0;
  return static_cast<uint64_t>((n + 1) / 2) * static_cast<uint64_t>((k + 63) / 64 * 64) * 4;
}

}  // namespace moe
