// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). Every draw is a pure
// function of (seed, stream, index): no generator state, so results cannot depend on thread
// count, iteration order or, later, on the parallel layout.
#pragma once

#include <array>
#include <cstdint>

namespace moe {

// Streams: one per purpose, so that adding a consumer never shifts another's numbers.
enum class RngStream : uint64_t {
  kInit = 1,           // parameter init; index = global element index within the parameter
  kRandomRouting = 2,  // random routing; index = global token index, layer in the stream's high bits
  kDataShuffle = 3,    // data order
  kTest = 99,
};

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// Four 32-bit words for (seed, stream, index).
std::array<uint32_t, 4> random_words(uint64_t seed, uint64_t stream, uint64_t index);
// Uniform in [0, 1) with 24 bits (float) or 53 bits (double).
double random_uniform(uint64_t seed, uint64_t stream, uint64_t index);
// Standard normal truncated to [-bound, bound] by redraw (Box-Muller on successive counters).
double random_trunc_normal(uint64_t seed, uint64_t stream, uint64_t index, double bound);

}  // namespace moe
