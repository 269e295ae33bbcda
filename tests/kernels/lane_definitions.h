// The cpu kernels' fixed-order row passes written out lane by lane (kernels/cpu/elem_common.h):
// element i goes to partial result i % kLanes, the partials combine by halves, lane 0 last. The
// vectorized passes must give these bits (elem_rows_test, routing_rows_test).
#pragma once

#include <cstdint>

#include "kernels/cpu/elem_common.h"

namespace moe::test {

using cpu::elem::kLanes;

// The kLanes partial results combined by halves.
inline float tree_definition(float (&acc)[kLanes]) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// max of x[0, n) in kLanes interleaved maxima (n >= 1).
inline float lane_max_definition(const float* x, int64_t n) {
  float acc[kLanes];
  for (float& a : acc) a = x[0];
  for (int64_t i = 0; i < n; ++i) acc[i % kLanes] = x[i] > acc[i % kLanes] ? x[i] : acc[i % kLanes];
  float m = acc[0];
  for (int l = 1; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return m;
}

}  // namespace moe::test
