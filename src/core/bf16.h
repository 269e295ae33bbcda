// bfloat16 storage type: the upper 16 bits of an IEEE float, rounded to nearest even.
// Used for GEMM operands and saved activations in bf16 compute mode; arithmetic is fp32.
#pragma once

#include <cstdint>
#include <cstring>

namespace moe {

struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float f) : bits(round(f)) {}
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }

  static uint16_t round(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return static_cast<uint16_t>((u >> 16) | 0x0040u);  // keep NaN a (quiet) NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<uint16_t>(u >> 16);
  }
};

inline float to_float(bf16 x) { return static_cast<float>(x); }
inline float to_float(float x) { return x; }
inline double to_float(double x) { return x; }

}  // namespace moe
