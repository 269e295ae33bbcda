// MXFP8 (OCP Microscaling Formats v1.0): blocks of kMxBlock consecutive values along a GEMM's
// reduction dimension share one E8M0 scale (a power of two, 2^(s-127); s = 255 is NaN), and each
// value is an FP8 element, E4M3 (max 448, no Inf, NaN = S.1111.111) or E5M2 (max 57344, IEEE-like
// Inf and NaN). A block is quantized in three steps: its amax picks the scale, every value is
// scaled and clamped to the element's largest finite magnitude (saturation), then rounded to the
// nearest element, ties to even.
//
// Bit-for-bit what the code we are checked against does (tests/kernels/mxfp8_fixture_test.cpp,
// fixtures from torchao 0.18 in tools/reference/make_mx_fixtures.py), with two stated exceptions
// where that code departs from its own documented rule:
// - rceil (NVIDIA's rule; TransformerEngine's kernels, cuBLAS's "1D block quantization", and
//   torchao's default for MXFP8 training): descale = amax / max_elem in fp32, s = that rounded UP
//   to a power of two (cvt.rp.satfinite.ue8m0 on Blackwell), so no value overflows. The reciprocal
//   the values are multiplied by is 2^(127-s), except s = 0 (scale clamped at 2^-127: reciprocal
//   1, as TransformerEngine's exp2f_rcp and torchao do) and s = 254 (amax Inf: 2^-127).
//   Exception: torchao's eager (CPU) fallback rounds up through ceil(log2f(descale)), and an fp32
//   log2 of a descale a few ulps above 2^k rounds to exactly k, so torchao keeps 2^k and saturates
//   the amax; we (and the hardware instruction) take 2^(k+1).
// - floor (the OCP rule): s = floor(log2(amax)) - emax_elem (8 for E4M3, 15 for E5M2), clamped to
//   [-127, 128] (+128 only reached by Inf/NaN amax: scale 255 means NaN), and the values are
//   divided by 2^s. Exception: torchao divides by 2^-126, not 2^-127, when s clamps at -127 (its
//   comment: a Triton workaround), which halves every value of such a block; we divide by 2^-127.
// A NaN anywhere in a block makes its amax NaN, so its scale is 255 (NaN) under both rules and the
// whole block dequantizes to NaN (its codes: all 0x7f under rceil; under floor its values divided
// by +Inf, so +-0 and its NaN lanes NaN). An Inf amax gives scale 254 under rceil (values times
// 2^-127, Inf saturating to the max) and 2^120 / 2^113 under floor. Under train.on_nonfinite the
// NaN reaches the loss or the gradient norm, which the step's non-finite check sees.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace moe::mx {

constexpr int kBlock = 32;            // values per scale
constexpr uint8_t kScaleNaN = 255;    // E8M0 NaN
constexpr int kScaleBias = 127;

enum class Elem : uint8_t { kE4M3, kE5M2 };
enum class ScaleRule : uint8_t { kRceil, kFloor };

MOE_HD inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
MOE_HD inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Largest finite magnitude, and floor(log2) of it.
MOE_HD constexpr float elem_max(Elem e) { return e == Elem::kE4M3 ? 448.0f : 57344.0f; }
MOE_HD constexpr int elem_emax(Elem e) { return e == Elem::kE4M3 ? 8 : 15; }

// ---------------------------------------------------------------- elements
// fp32 -> FP8 code, round to nearest even; |f| must already be clamped to elem_max (NaN passes as
// NaN: 0x7f | sign for both elements, the code torch's casts give). Subnormal elements are
// formed by one fp32 addition of a power of two that moves the value's bits into the element's
// mantissa field (the fp32 adder rounds to nearest even; needs the default rounding mode and no
// flush-to-zero, which nothing in moecore sets); normal ones by rounding the fp32 mantissa.
MOE_HD inline uint8_t encode(float f, Elem e) {
  const int mbits = e == Elem::kE4M3 ? 3 : 2;
  const int bias = e == Elem::kE4M3 ? 7 : 15;
  const int shift = 23 - mbits;
  uint32_t u = float_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // Both paths computed and one selected, so the loops over blocks vectorize (no branches).
  const uint32_t odd = (u >> shift) & 1u;
  const uint32_t normal = (u + (static_cast<uint32_t>(bias - 127) << 23) + ((1u << (shift - 1)) - 1) + odd) >> shift;
  const uint32_t denorm = static_cast<uint32_t>(127 - bias + shift + 1) << 23;
  const uint32_t sub = float_bits(bits_float(u) + bits_float(denorm)) - denorm;
  const uint32_t min_normal = static_cast<uint32_t>(127 + 1 - bias) << 23;
  const uint32_t code = u > 0x7f800000u ? 0x7fu : (u < min_normal ? sub : normal);
  return static_cast<uint8_t>((code & 0xffu) | (sign >> 24));
}

// FP8 code -> its exact value (E4M3: 0x7f/0xff are NaN; E5M2: 0x7c/0xfc Inf, above them NaN).
MOE_HD inline float decode(uint8_t code, Elem e) {
  const int mbits = e == Elem::kE4M3 ? 3 : 2;
  const int bias = e == Elem::kE4M3 ? 7 : 15;
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  const int mag = code & 0x7f;
  const int exp = mag >> mbits, man = mag & ((1 << mbits) - 1);
  if (e == Elem::kE4M3 && mag == 0x7f) return NAN;
  if (e == Elem::kE5M2 && exp == 31) return man == 0 ? sign * INFINITY : NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), 1 - bias - mbits);
  return sign * std::ldexp(static_cast<float>((1 << mbits) | man), exp - bias - mbits);
}

// ---------------------------------------------------------------- scales
// The E8M0 scale of a block from its amax (max |x|, fp32; NaN if any value is NaN).
MOE_HD inline uint8_t block_scale(float amax, Elem e, ScaleRule rule) {
  if (std::isnan(amax)) return kScaleNaN;
  int s;
  if (rule == ScaleRule::kRceil) {
    const float descale = amax / elem_max(e);
    if (std::isinf(descale)) return 254;
    const uint32_t u = float_bits(descale);
    const int field = static_cast<int>(u >> 23);
    // ceil(log2(descale)) exactly: the exponent, +1 unless a power of two. A subnormal descale
    // is m * 2^-149: its top bit's position, +1 unless m is a power of two (zero clamps).
    const uint32_t man = u & 0x7fffffu;
    if (field != 0) {
      s = field - 127 + (man != 0 ? 1 : 0);
    } else if (man == 0) {
      s = -127;
    } else {
      int top = 0;
      while ((man >> (top + 1)) != 0) ++top;
      s = -149 + top + ((man & (man - 1)) != 0 ? 1 : 0);
    }
    s = s < -127 ? -127 : (s > 127 ? 127 : s);
  } else {
    const int field = static_cast<int>((float_bits(amax) >> 23) & 0xff);
    s = field - 127 - elem_emax(e);
    s = s < -127 ? -127 : (s > 128 ? 128 : s);
  }
  return static_cast<uint8_t>(s + kScaleBias);
}

// 2^(s-127) as a double (NaN for 255): the scale's exact value.
MOE_HD inline double scale_value(uint8_t s) {
  return s == kScaleNaN ? NAN : std::ldexp(1.0, static_cast<int>(s) - kScaleBias);
}

// What a block's values are multiplied by before clamping and rounding, for scale s.
// rceil: 2^(127-s), except s = 0 (1, as TransformerEngine's exp2f_rcp and torchao: the clamped
// 2^-127 scale leaves the values as they are) and s = 254 (amax Inf: 2^-127). A NaN block (s =
// 255) does not multiply: its codes are all 0x7f (see scaled()).
// floor: x / 2^(s-127) as a multiply by the exact reciprocal 2^(127-s) (2^127 for s = 0; 2^-127,
// a subnormal, for s = 254): the same correctly rounded result, and it vectorizes. s = 255
// divides by +Inf (its bit pattern), as the rule's arithmetic gives, i.e. multiplies by 0: finite
// values become zeros of their sign, NaN and Inf become NaN; the NaN scale decides anyway.
MOE_HD inline float reciprocal(uint8_t s, ScaleRule rule) {
  if (s == kScaleNaN) return rule == ScaleRule::kRceil ? NAN : 0.0f;
  if (s == 254) return bits_float(1u << 22);  // 2^-127
  if (s == 0 && rule == ScaleRule::kRceil) return 1.0f;
  return bits_float(static_cast<uint32_t>(254 - s) << 23);
}

// One value of a block whose scale is s, scaled (not yet clamped). Under rceil a NaN block's
// values all become the reciprocal's (positive) NaN, whatever their own sign (torchao: the NaN
// descale is the multiply's NaN operand).
MOE_HD inline float scaled(float x, uint8_t s, ScaleRule rule) {
  if (s == kScaleNaN && rule == ScaleRule::kRceil) return NAN;
  return x * reciprocal(s, rule);
}

// Saturation: clamped to the element's largest finite magnitude (NaN compares false: stays NaN).
MOE_HD inline float clamp_elem(float y, Elem e) {
  const float m = elem_max(e);
  return y > m ? m : (y < -m ? -m : y);
}

MOE_HD inline uint8_t quantize(float x, uint8_t s, Elem e, ScaleRule rule) {
  return encode(clamp_elem(scaled(x, s, rule), e), e);
}

// The dequantized value code * 2^(s-127), exact in double (NaN for a NaN scale or code).
MOE_HD inline double dequantize(uint8_t code, uint8_t s, Elem e) {
  return static_cast<double>(decode(code, e)) * scale_value(s);
}

// ---------------------------------------------------------------- exact bf16 products
// Where a bf16 dot product with fp32 accumulation (the cpu kernels' vdpbf16ps) computes every
// product of two dequantized elements exactly: each operand code * 2^(s-127) must be a normal
// bf16 (the instruction reads bf16 subnormals as zero) and each product a normal fp32 (it
// flushes subnormal results) below fp32's overflow. In unbiased exponents, per operand
// [-126 - log2(smallest subnormal), 127 - floor(log2(max))] and per pair of operands
// [-126 - both smallest-subnormal exponents, 127 - floor(log2(max_a * max_b))]. E4M3: per operand
// [-117, 119], per pair [-108, 110]; E5M2: [-110, 112] and [-94, 96]; mixed: [-101, 103].
// tests/kernels/mxfp8_test.cpp derives these from every code pair and the instruction itself.
MOE_HD constexpr int min_subnormal_exp(Elem e) { return e == Elem::kE4M3 ? -9 : -16; }
MOE_HD constexpr int bf16_exact_min(Elem e) { return -126 - min_subnormal_exp(e); }
MOE_HD constexpr int bf16_exact_max(Elem e) { return 127 - elem_emax(e); }
MOE_HD constexpr int product_exact_min(Elem a, Elem b) {
  return -126 - min_subnormal_exp(a) - min_subnormal_exp(b);
}
// floor(log2(max_a * max_b)): 448^2 = 1.53 * 2^17, 448 * 57344 = 1.53 * 2^24, 57344^2 = 1.53 * 2^31.
MOE_HD constexpr int product_exact_max(Elem a, Elem b) {
  return 127 - (elem_emax(a) + elem_emax(b) + 1);
}

}  // namespace moe::mx
