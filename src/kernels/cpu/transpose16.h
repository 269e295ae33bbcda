// The transposed copy of a block of 16-bit elements (bf16 bits), which the AMX weight gradients
// take as their A (gemm_items.cpp: dw += dy^T x, with dy^T row-major). Pure data movement: the
// same bits whatever the path.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/cpu/avx512.h"

namespace moe::cpu {

#if defined(__AVX512BW__)
// The first n of 32 16-bit lanes (none for n <= 0, all for n >= 32).
inline __mmask32 first_lanes32(int64_t n) {
  return n >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((uint32_t{1} << (n > 0 ? n : 0)) - 1u);
}

// A 16 x 32 block of 16-bit lanes (r[i] lane c: row i, column c) transposed in place into
// r[j] = columns j (lanes 0..15) and j + 16 (lanes 16..31), each over rows 0..15. Four stages,
// each swapping one bit of the row index with the same bit of the column index (lane groups of 8,
// 4, 2, 1): 64 two-input shuffles, shifts and blends per 512 elements, all in 16 registers.
inline void transpose16x32_16(__m512i (&r)[16]) {
  const __m512i q8_lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i q8_hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int i = 0; i < 8; ++i) {  // 128-bit quarters: rows i, i + 8
    const __m512i a = r[i], b = r[i + 8];
    r[i] = _mm512_permutex2var_epi64(a, q8_lo, b);
    r[i + 8] = _mm512_permutex2var_epi64(a, q8_hi, b);
  }
  for (int i = 0; i < 16; ++i) {  // 64-bit words: rows with bit 2 clear
    if (i & 4) continue;
    const __m512i a = r[i], b = r[i + 4];
    r[i] = _mm512_unpacklo_epi64(a, b);
    r[i + 4] = _mm512_unpackhi_epi64(a, b);
  }
  for (int i = 0; i < 16; ++i) {  // 32-bit words: rows with bit 1 clear
    if (i & 2) continue;
    const __m512i a = r[i], b = r[i + 2];
    r[i] = _mm512_mask_blend_epi32(0xAAAA, a, _mm512_slli_epi64(b, 32));
    r[i + 2] = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(a, 32), b);
  }
  for (int i = 0; i < 16; i += 2) {  // 16-bit lanes: rows with bit 0 clear
    const __m512i a = r[i], b = r[i + 1];
    r[i] = _mm512_mask_blend_epi16(0xAAAAAAAAu, a, _mm512_slli_epi32(b, 16));
    r[i + 1] = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(a, 16), b);
  }
}
#endif

// dst (cols x rows at leading dimension dst_ld >= rows) = the transpose of the rows x cols block
// src at leading dimension src_ld, with zeros in dst's columns rows..dst_ld; dst's rows past cols
// are not touched. 16 x 32 blocks through registers where the build has AVX512-BW (whole 64-byte
// rows of src in, 32-byte rows of dst out), against 16 x 16 blocks widened to 32-bit lanes for
// transpose16 (Emerald Rapids, 2 threads, in the step, alternated): the weight gradients' time
// fine_grained bf16 60.3-62.2 -> 55.5-55.9 ms per step, olmoe_compat 30.2-33.5 -> 30.2-31.4. 32 x 32
// blocks (all 32 zmm registers: GCC kept the block on the stack) were faster alone but slower in the
// step (fine_grained 65.3-69.3, olmoe_compat 32.2-42.3 ms); software prefetch: no gain.
inline void transpose_block16(const uint16_t* src, int64_t src_ld, uint16_t* dst, int64_t dst_ld, int64_t rows,
                              int64_t cols) {
  if (dst_ld > rows)
    for (int64_t c = 0; c < cols; ++c)
      std::memset(dst + c * dst_ld + rows, 0, static_cast<size_t>(dst_ld - rows) * sizeof(uint16_t));
#if defined(__AVX512BW__)
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
    const __mmask16 out = first_lanes(nr);
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      const int64_t nc = cols - c0 < 32 ? cols - c0 : 32;
      const __mmask32 in = first_lanes32(nc);
      __m512i v[16];
      for (int i = 0; i < 16; ++i)
        v[i] = i < nr ? _mm512_maskz_loadu_epi16(in, src + (r0 + i) * src_ld + c0) : _mm512_setzero_si512();
      transpose16x32_16(v);  // v[j]: columns c0 + j and c0 + j + 16 at rows r0..r0+15
      for (int j = 0; j < 16 && j < nc; ++j) {
        _mm256_mask_storeu_epi16(dst + (c0 + j) * dst_ld + r0, out, _mm512_castsi512_si256(v[j]));
        if (j + 16 < nc)
          _mm256_mask_storeu_epi16(dst + (c0 + j + 16) * dst_ld + r0, out, _mm512_extracti64x4_epi64(v[j], 1));
      }
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_ld + r] = src[r * src_ld + c];
#endif
}

}  // namespace moe::cpu
