// Routing arithmetic one text serves the ref, cpu and cuda kernels with (kernels/op_list.inc):
// the p-norm of a token's chosen scores (router_gather; p = 1 and p = 2, the common cases, are
// exact sums and a square root; other p go through pow in double), and the groups of
// group-limited routing (router_topk).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/host_device.h"

namespace moe {

// x^q for x >= 0 (q = 0 gives 1, also at x = 0).
template <class T> MOE_HD inline T norm_power(T x, double q) {
  if (q == 0) return T(1);
  if (q == 1) return x;
  return static_cast<T>(pow(static_cast<double>(x), q));
}

// ||v||_p over n non-negative values.
template <class T> MOE_HD inline T topk_norm(const T* v, int64_t n, double p) {
  T acc = 0;
  if (p == 1) {
    for (int64_t i = 0; i < n; ++i) acc += v[i];
    return acc;
  }
  if (p == 2) {
    for (int64_t i = 0; i < n; ++i) acc += v[i] * v[i];
    return static_cast<T>(sqrt(static_cast<double>(acc)));
  }
  for (int64_t i = 0; i < n; ++i) acc += norm_power(v[i], p);
  return static_cast<T>(pow(static_cast<double>(acc), 1.0 / p));
}

// Group-limited routing (DeepSeek-V3, Olmo-core 3's n_group / topk_group): the E experts form
// n_group equal groups of consecutive ids; a group's score is the sum of its two largest
// selection values (its largest when a group holds one expert); the topk_group groups with the
// largest scores stay, ties to the lower group. Sets bit g of `allowed` (ceil(n_group / 32)
// words, cleared here) for each group that stays.
template <class Value> MOE_HD inline void allowed_groups(Value value, int64_t E, int64_t n_group, int64_t topk_group,
                                                         uint32_t* allowed) {
  const int64_t per = E / n_group;
  for (int64_t w = 0; w < (n_group + 31) / 32; ++w) allowed[w] = 0;
  for (int64_t pick = 0; pick < topk_group; ++pick) {
    int64_t best = -1;
    double best_score = 0;
    for (int64_t g = 0; g < n_group; ++g) {
      if (allowed[g >> 5] & (1u << (g & 31))) continue;
      int64_t first = -1;
      for (int64_t e = g * per; e < (g + 1) * per; ++e)
        if (first < 0 || value(e) > value(first)) first = e;
      auto score = value(first);
      if (per > 1) {
        int64_t second = -1;
        for (int64_t e = g * per; e < (g + 1) * per; ++e)
          if (e != first && (second < 0 || value(e) > value(second))) second = e;
        score = score + value(second);
      }
      if (best < 0 || static_cast<double>(score) > best_score) {
        best = g;
        best_score = static_cast<double>(score);
      }
    }
    allowed[best >> 5] |= 1u << (best & 31);
  }
}

}  // namespace moe
