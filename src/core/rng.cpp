#include "core/rng.h"

#include <cmath>

#include "core/philox.h"

namespace moe {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  const philox::Words w = philox::philox4x32(philox::Words{{ctr[0], ctr[1], ctr[2], ctr[3]}}, key[0], key[1]);
  return {w.w[0], w.w[1], w.w[2], w.w[3]};
}

std::array<uint32_t, 4> random_words(uint64_t seed, uint64_t stream, uint64_t index) {
  const philox::Words w = philox::random_words(seed, stream, index);
  return {w.w[0], w.w[1], w.w[2], w.w[3]};
}

static double to_unit(uint32_t hi, uint32_t lo) { return philox::to_unit(hi, lo); }

double random_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox::random_uniform(seed, stream, index);
}

double random_trunc_normal(uint64_t seed, uint64_t stream, uint64_t index, double bound) {
  // Redraws use the upper counter word, so index spaces of different draws never overlap.
  for (uint32_t attempt = 0;; ++attempt) {
    auto w = philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                         static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32) ^
                                                            (attempt << 16)},
                        {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    double u1 = 1.0 - to_unit(w[0], w[1]);  // (0, 1]
    double u2 = to_unit(w[2], w[3]);
    double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    if (std::fabs(z) <= bound) return z;
  }
}

}  // namespace moe
