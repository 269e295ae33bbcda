// One MXFP8 block at a time (core/mxfp8.h), shared by the ref and cpu kernels so both write the
// same bytes by construction; the fixtures (tests/kernels/mxfp8_test.cpp) check the bytes.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/bf16.h"
#include "core/mxfp8.h"
#include "core/tensor.h"

namespace moe::mx {

// What a quantization saw: the mx_quantize op's stats tensor, [amax, saturated, underflowed, values].
struct BlockStats {
  double amax = 0;        // largest finite |x|
  double saturated = 0;   // |x| / scale past the element's max (clamped); not in NaN blocks
  double underflow = 0;   // nonzero x whose code is zero; not in NaN blocks
  double values = 0;

  void add(const BlockStats& o) {
    amax = std::fmax(amax, o.amax);
    saturated += o.saturated;
    underflow += o.underflow;
    values += o.values;
  }
};

inline float load(const float* p) { return *p; }
inline float load(const double* p) { return static_cast<float>(*p); }
inline float load(const bf16* p) { return static_cast<float>(*p); }

// Quantizes the kBlock values x[0], x[stride], ... into codes[0], codes[code_stride], ...;
// returns the block's scale.
template <class T>
uint8_t quantize_block(const T* x, int64_t stride, Elem e, ScaleRule rule, uint8_t* codes,
                       int64_t code_stride, BlockStats& st) {
  float v[kBlock];
  float amax = 0;
  bool nan = false;
  for (int i = 0; i < kBlock; ++i) {
    v[i] = load(x + i * stride);
    const float a = std::fabs(v[i]);
    nan |= std::isnan(a);
    amax = a > amax ? a : amax;
    if (std::isfinite(a)) st.amax = std::fmax(st.amax, static_cast<double>(a));
  }
  const uint8_t s = block_scale(nan ? NAN : amax, e, rule);
  const float m = elem_max(e);
  for (int i = 0; i < kBlock; ++i) {
    const float y = scaled(v[i], s, rule);
    const uint8_t c = encode(clamp_elem(y, e), e);
    codes[i * code_stride] = c;
    if (s != kScaleNaN) {  // a NaN block is NaN: neither saturated nor underflowed
      st.saturated += std::fabs(y) > m ? 1 : 0;
      st.underflow += (v[i] != 0 && (c & 0x7f) == 0) ? 1 : 0;
    }
  }
  st.values += kBlock;
  return s;
}

// 256-entry decode table of an element: code -> value (fp32).
struct DecodeTable {
  float v[256];
  explicit DecodeTable(Elem e) {
    for (int c = 0; c < 256; ++c) v[c] = decode(static_cast<uint8_t>(c), e);
  }
};
inline const DecodeTable& decode_table(Elem e) {
  static const DecodeTable e4m3(Elem::kE4M3), e5m2(Elem::kE5M2);
  return e == Elem::kE4M3 ? e4m3 : e5m2;
}

// The stats tensor's update (host memory, 4 doubles).
inline void update_stats(double* out, const BlockStats& st) {
  out[0] = std::fmax(out[0], st.amax);
  out[1] += st.saturated;
  out[2] += st.underflow;
  out[3] += st.values;
}

}  // namespace moe::mx
