// Backend memory filled with N(0, 0.5) values in its dtype (bf16 or f32), for benchmarks
// (`moecore bench --kernels`, `moecore bench --calibrate`). The buffer is appended to `keep`.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "kernels/ops.h"

namespace moe {

inline Tensor random_tensor(Backend& ops, std::vector<Buffer>& keep, DType dtype, std::initializer_list<int64_t> dims,
                            uint64_t seed) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  keep.emplace_back(ops, static_cast<size_t>(n) * dtype_size(dtype));
  Tensor t = keep.back().view(dtype, dims);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.5f);
  if (dtype == DType::kBF16) {
    std::vector<bf16> h(static_cast<size_t>(n));
    for (bf16& x : h) x = bf16(dist(rng));
    ops.upload(h.data(), t);
  } else {
    std::vector<float> h(static_cast<size_t>(n));
    for (float& x : h) x = dist(rng);
    ops.upload(h.data(), t);
  }
  ops.synchronize();
  return t;
}

}  // namespace moe
