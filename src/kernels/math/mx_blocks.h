// One MXFP8 block at a time (core/mxfp8.h), shared by the ref and cpu kernels so both write the
// same bytes by construction; the fixtures (tests/kernels/mxfp8_test.cpp) check the bytes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/bf16.h"
#include "core/mx_scale_layout.h"
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

// Quantizes the kBlock consecutive values x[0..31] into codes[0..31]; returns the block's scale.
// The per-value work is a multiply, a clamp and encode's selects: the loops vectorize.
template <class T>
uint8_t quantize_block(const T* x, Elem e, ScaleRule rule, uint8_t* codes, BlockStats& st) {
  float v[kBlock];
  for (int i = 0; i < kBlock; ++i) v[i] = load(x + i);
  // |x| as bits: for non-negative floats the integer order is the value order (NaN above Inf).
  uint32_t bits[kBlock];
  std::memcpy(bits, v, sizeof bits);
  uint32_t amax_bits = 0, finite_bits = 0;
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t a = bits[i] & 0x7fffffffu;
    const uint32_t finite = a < 0x7f800000u ? a : 0u;
    amax_bits = a > amax_bits ? a : amax_bits;
    finite_bits = finite > finite_bits ? finite : finite_bits;
  }
  const bool nan = amax_bits > 0x7f800000u;
  const float amax = bits_float(amax_bits);
  st.amax = std::fmax(st.amax, static_cast<double>(bits_float(finite_bits)));
  st.values += kBlock;
  const uint8_t s = block_scale(nan ? NAN : amax, e, rule);
  if (s == kScaleNaN) {  // a NaN block: NaN codes (rceil) or its values times 0 (floor); not counted
    for (int i = 0; i < kBlock; ++i) codes[i] = quantize(v[i], s, e, rule);
    return s;
  }
  const float rcp = reciprocal(s, rule), m = elem_max(e);
  int saturated = 0, underflow = 0;
  for (int i = 0; i < kBlock; ++i) {
    const float y = v[i] * rcp;
    const uint8_t c = encode(clamp_elem(y, e), e);
    codes[i] = c;
    saturated += std::fabs(y) > m ? 1 : 0;
    underflow += (v[i] != 0 && (c & 0x7f) == 0) ? 1 : 0;
  }
  st.saturated += saturated;
  st.underflow += underflow;
  return s;
}

// mx_quantize_swizzled's rows [r0, r1) of one group: codes row-major, each scale at its tile
// offset in the group's padded rows (padded_before: the padded rows of the groups before it).
template <class T>
void quantize_rows_swizzled(const T* x, int64_t c, int64_t group_begin, int64_t r0, int64_t r1, int64_t padded_before,
                            Elem e, ScaleRule rule, uint8_t* codes, uint8_t* scales) {
  const int64_t kb = c / kBlock;
  BlockStats st;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < kb; ++j)
      scales[swizzled_scale_offset(padded_before + r - group_begin, j, kb)] =
          quantize_block(x + r * c + j * kBlock, e, rule, codes + r * c + j * kBlock, st);
}

// The same over x's dtype (f64, f32 or bf16): rows [r0, r1) of group g of mx_quantize_swizzled,
// whose begin (G+1) and padded_before (G) the argument check computed.
inline void quantize_rows_swizzled(const Tensor& x, const int64_t* begin, const int64_t* padded_before, int64_t g,
                                   int64_t r0, int64_t r1, Elem e, ScaleRule rule, uint8_t* codes, uint8_t* scales) {
  const int64_t c = x.shape[1];
  if (x.dtype == DType::kF64)
    quantize_rows_swizzled(x.as<double>(), c, begin[g], r0, r1, padded_before[g], e, rule, codes, scales);
  else if (x.dtype == DType::kF32)
    quantize_rows_swizzled(x.as<float>(), c, begin[g], r0, r1, padded_before[g], e, rule, codes, scales);
  else
    quantize_rows_swizzled(x.as<bf16>(), c, begin[g], r0, r1, padded_before[g], e, rule, codes, scales);
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
