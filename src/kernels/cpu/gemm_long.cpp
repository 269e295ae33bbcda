// The bf16 long-reduction data gradient (gemm_long.h). A band of dx rows takes the reduction in
// chunks of kChunkPairs pairs: per chunk, every kR-row group of the band runs gemm_micro.h's
// kernel over each kCols column block, its broadcasts read straight from dy's rows (each 32-bit
// word of a bf16 row is a pair along n) and its lanes from the pair rows of w, whose chunk
// (kChunkPairs x k words) stays in L2 across the groups. The chains go on through dx between
// chunks (fp32 stores are exact).
#include "kernels/cpu/gemm_long.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "kernels/cpu/gemm_micro.h"

namespace moe::cpu::longred {
namespace {

using micro::kCols;
using micro::kR;
using micro::Store;

constexpr int64_t kChunkPairs = 256;  // 256 x 256 words of an LM head's w: 256 KiB

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a(p, q) = the 32-bit word p of row q: the pair (row[2p], row[2p+1]). memcpy: rows of an odd
// length are only 2-byte aligned.
struct RowPairs {
  const uint16_t* row[kR];
  uint32_t operator()(int64_t p, int q) const {
    uint32_t w;
    std::memcpy(&w, row[q] + 2 * p, sizeof w);
    return w;
  }
};

}  // namespace

bool available(DType t) {
#if defined(MOE_MICRO_BF16)
  return t == DType::kBF16;
#else
  (void)t;
  return false;
#endif
}

int64_t pair_stride(int64_t k) { return ceil_div(k, kCols) * kCols; }
int64_t pair_words(int64_t n, int64_t k) { return ceil_div(n, 2) * pair_stride(k); }

void pair_rows(const void* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint32_t* wp) {
#if defined(MOE_MICRO_BF16)
  const uint16_t* base = static_cast<const uint16_t*>(w);
  const int64_t ks = pair_stride(k);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* lo = base + 2 * p * k;
    const uint16_t* hi = 2 * p + 1 < n ? lo + k : nullptr;
    for (int64_t j = 0; j < ks; j += 16) {
      const __mmask16 m = first_lanes(k - j);
      const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, lo + j));
      const __m512i h = hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, hi + j)) : _mm512_setzero_si512();
      _mm512_storeu_si512(wp + p * ks + j, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
    }
  }
#else
  (void)w, (void)n, (void)k, (void)p0, (void)p1, (void)wp;
  MOE_CHECK(false, "longred::pair_rows: built without AVX512-BF16");
#endif
}

void band(const void* dy, int64_t ldy, const uint32_t* wp, int64_t n, int64_t k, int64_t rows, float* dx,
          int64_t ldc) {
#if defined(MOE_MICRO_BF16)
  const uint16_t* a = static_cast<const uint16_t*>(dy);
  const int64_t whole = n / 2, groups = ceil_div(rows, kR), blocks = ceil_div(k, kCols), ks = pair_stride(k);
  const auto nc_of = [&](int64_t jb) { return static_cast<int>(std::min<int64_t>(kCols, k - jb * kCols)); };
  const auto nr_of = [&](int64_t g) { return static_cast<int>(std::min<int64_t>(kR, rows - g * kR)); };
  // Group g's rows; past the band's last row, its first again (computed, never stored).
  const auto group_rows = [&](int64_t g, int64_t p0) {
    RowPairs r;
    for (int q = 0; q < kR; ++q) r.row[q] = a + (g * kR + std::min(q, nr_of(g) - 1)) * ldy + 2 * p0;
    return r;
  };
  for (int64_t p0 = 0; p0 < whole; p0 += kChunkPairs) {
    const int64_t pc = std::min(kChunkPairs, whole - p0);
    const Store st = p0 == 0 ? Store::kWrite : Store::kChain;
    for (int64_t g = 0; g < groups; ++g) {
      const RowPairs r = group_rows(g, p0);
      for (int64_t jb = 0; jb < blocks; ++jb)
        micro::micro_bf16(r, wp + p0 * ks + jb * kCols, ks, pc, dx + g * kR * ldc + jb * kCols, ldc, nr_of(g),
                          nc_of(jb), st);
    }
  }
  if (n % 2) {  // the last pair, (dy[.][n-1], 0), read from a panel: dy[.][n] does not exist
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t last[kR];
      for (int q = 0; q < kR; ++q) last[q] = a[(g * kR + std::min(q, nr_of(g) - 1)) * ldy + n - 1];
      for (int64_t jb = 0; jb < blocks; ++jb)
        micro::micro_bf16(micro::Panel<uint32_t>{last, 0}, wp + whole * ks + jb * kCols, ks, 1,
                          dx + g * kR * ldc + jb * kCols, ldc, nr_of(g), nc_of(jb),
                          whole == 0 ? Store::kWrite : Store::kChain);
    }
  }
#else
  (void)dy, (void)ldy, (void)wp, (void)n, (void)k, (void)rows, (void)dx, (void)ldc;
  MOE_CHECK(false, "longred::band: built without AVX512-BF16");
#endif
}

}  // namespace moe::cpu::longred
