// <immintrin.h> for the cpu kernels' AVX-512 code (attention_simd.h, moe_routing.cpp), read with
// GCC 12's false -W(maybe-)uninitialized off: it raises them inside avx512fintrin.h for
// intrinsics whose pass-through operand is _mm512_undefined_ps() (max, unpack, shuffle, the
// reductions, ...). The state must be set before the header is read, since the warning is located
// in the header. Nothing without AVX-512. Also the one mask every 16-lane loop's tail takes, and
// the 16 x 16 transpose the attention's panels and the GEMMs' transposed copies use.
#pragma once

#if defined(__AVX512F__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace moe::cpu {
// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1u);
}
// A 16 x 16 block of 32-bit lanes transposed through registers (shuffles only: any bit patterns).
// In place: r[c] lane i <- r[i] lane c.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // lane L of each 128-bit quarter: rows 2i, 2i+1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i+k], quarter Q: rows 4i..4i+3 of column 4Q+k
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) t[k] = r[k], t[4 + k] = r[4 + k], t[8 + k] = r[8 + k], t[12 + k] = r[12 + k];
  for (int k = 0; k < 4; ++k) {  // column 4Q+k gathers quarter Q of r[k], r[4+k], r[8+k], r[12+k]
    __m512 x0 = _mm512_shuffle_f32x4(t[k], t[4 + k], 0x88), x1 = _mm512_shuffle_f32x4(t[k], t[4 + k], 0xDD);
    __m512 y0 = _mm512_shuffle_f32x4(t[8 + k], t[12 + k], 0x88),
       y1 = _mm512_shuffle_f32x4(t[8 + k], t[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[k + 4] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[k + 12] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}
}  // namespace moe::cpu
#endif
