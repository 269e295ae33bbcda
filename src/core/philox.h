// Philox4x32-10 and the uniform draw built on it, as inline functions the CPU (core/rng.cpp) and
// the CUDA kernels (kernels/cuda) compile from this one text, so random routing makes the same
// choices on every backend (tests/core/core_test.cpp checks the host side against the
// published Philox test vectors).
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moe::philox {

struct Words {
  uint32_t w[4];
};

MOE_HD inline Words philox4x32(Words ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr.w[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr.w[2];
    ctr = Words{{static_cast<uint32_t>(p1 >> 32) ^ ctr.w[1] ^ k0, static_cast<uint32_t>(p1),
                 static_cast<uint32_t>(p0 >> 32) ^ ctr.w[3] ^ k1, static_cast<uint32_t>(p0)}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// Counter (index, stream), key seed.
MOE_HD inline Words random_words(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32(Words{{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                           static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}},
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// 53 random bits as a double in [0, 1).
MOE_HD inline double to_unit(uint32_t hi, uint32_t lo) {
  const uint64_t bits = (static_cast<uint64_t>(hi) << 21) ^ (lo >> 11);
  return static_cast<double>(bits & ((1ull << 53) - 1)) * 0x1.0p-53;
}

MOE_HD inline double random_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  const Words w = random_words(seed, stream, index);
  return to_unit(w.w[0], w.w[1]);
}

}  // namespace moe::philox
