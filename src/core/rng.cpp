#include "core/rng.h"

#include <cmath>

namespace moe {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kM0) * ctr[0];
    uint64_t p1 = static_cast<uint64_t>(kM1) * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<uint32_t>(p0)};
    key[0] += kW0;
    key[1] += kW1;
  }
  return ctr;
}

std::array<uint32_t, 4> random_words(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                     static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)},
                    {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

static double to_unit(uint32_t hi, uint32_t lo) {
  uint64_t bits = (static_cast<uint64_t>(hi) << 21) ^ (lo >> 11);  // 53 random bits
  return static_cast<double>(bits & ((1ull << 53) - 1)) * 0x1.0p-53;
}

double random_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  auto w = random_words(seed, stream, index);
  return to_unit(w[0], w[1]);
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
