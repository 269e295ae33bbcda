// Weight-gradient micro-kernels (gemm_wgrad.h). Per call: a's columns (dw's rows) are packed in
// panels of kR, each panel r-major (kR values per row r, or per pair of rows for bf16), and b in
// one panel of kCols columns at a time; every kR x kCols block of dw is then one micro-kernel
// that keeps its 24 accumulators in registers over all the rows and adds them to dw once. The
// panels stay in L2 (a: rows x band, b: rows x kCols), read in order. The micro-kernels are
// gemm_micro.h's.
#include "kernels/cpu/gemm_wgrad.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/elem_common.h"
#include "kernels/cpu/gemm_micro.h"

namespace moe::cpu::wgrad {
namespace {

using micro::kCols;
using micro::kR;
using micro::kV;
using micro::Store;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Rows of the packed panels: rows (fp32) or pairs of rows (bf16).
int64_t panel_rows(DType t, int64_t rows) { return t == DType::kBF16 ? ceil_div(rows, 2) : rows; }

// Fetches `bytes` from p, a line at a time: the row of a that is packed a few rows later.
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, 3);
}
constexpr int kAhead = 8;  // rows of a fetched ahead of the packing
constexpr int64_t kPackedL1 = 32 << 10;  // bytes of an fp32 b panel worth packing (L1: 48 KiB)
constexpr int64_t kRowsFirstB = 512 << 10;  // bytes of b that take the rows-first order (L2: 1 MiB)

#if defined(__AVX512F__)
// a's rows, band values each, dense at the padded width bp = round_up(band, kR) (zeros past band).
void pack_a_f32(const float* a, int64_t lda, int64_t rows, int64_t band, int64_t bw, float* ap) {
  for (int64_t r = 0; r < rows; ++r) {
    if (r + kAhead < rows) prefetch_row(a + (r + kAhead) * lda, band * 4);
    std::memcpy(ap + r * bw, a + r * lda, static_cast<size_t>(band) * sizeof(float));
    for (int64_t i = band; i < bw; ++i) ap[r * bw + i] = 0.0f;
  }
}
void pack_b_f32(const float* b, int64_t ldb, int64_t rows, int64_t j0, int nc, float* bp) {
  const __mmask16 m[kV] = {first_lanes(nc), first_lanes(nc - 16), first_lanes(nc - 32), first_lanes(nc - 48)};
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < kV; ++v)
      _mm512_storeu_ps(bp + r * kCols + 16 * v, _mm512_maskz_loadu_ps(m[v], b + r * ldb + j0 + 16 * v));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Pair rows of a, band words each at the padded width bw: ap[p][i] = (a[2p][i], a[2p+1][i]).
void pack_a_bf16(const uint16_t* a, int64_t lda, int64_t rows, int64_t band, int64_t bw, uint32_t* ap) {
  for (int64_t p = 0; p < ceil_div(rows, 2); ++p) {
    const uint16_t* lo = a + 2 * p * lda;
    const uint16_t* hi = 2 * p + 1 < rows ? lo + lda : nullptr;
    for (int64_t r = 2 * p + kAhead; r < std::min(rows, 2 * p + kAhead + 2); ++r) prefetch_row(a + r * lda, band * 2);
    for (int64_t i = 0; i < bw; i += 16) {
      const __mmask16 m = first_lanes(band - i);
      const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, lo + i));
      const __m512i h = hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, hi + i)) : _mm512_setzero_si512();
      _mm512_mask_storeu_epi32(ap + p * bw + i, first_lanes(bw - i), _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
    }
  }
}
// Pair rows of b's columns [j0, j0 + nc), zero past nc: bp[p][j] = (b[2p][j0 + j], b[2p+1][j0 + j]).
void pack_b_bf16(const uint16_t* b, int64_t ldb, int64_t rows, int64_t j0, int nc, uint32_t* bp) {
  const int64_t pairs = ceil_div(rows, 2);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* lo = b + 2 * p * ldb + j0;
    const uint16_t* hi = 2 * p + 1 < rows ? lo + ldb : nullptr;
    for (int v = 0; v < kV; ++v) {
      const __mmask16 m = first_lanes(nc - 16 * v);
      const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, lo + 16 * v));
      const __m512i h = hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, hi + 16 * v)) : _mm512_setzero_si512();
      _mm512_storeu_si512(bp + p * kCols + 16 * v, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
    }
  }
}
#endif

}  // namespace

bool available(DType t) {
#if defined(__AVX512F__)
  if (t == DType::kF32) return true;
#endif
#if defined(MOE_MICRO_BF16)
  if (t == DType::kBF16) return true;
#endif
  (void)t;
  return false;
}

size_t scratch_bytes(DType t, int64_t rows, int64_t band, int64_t k) {
  const int64_t pr = panel_rows(t, rows);
  return static_cast<size_t>(ceil_div(band, kR) * kR * pr + pr * ceil_div(k, kCols) * kCols) * 4 + 64;
}

void chunk(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, int64_t rows, int64_t band, int64_t k,
           float* c, bool overwrite, void* scratch) {
  MOE_CHECK(available(t), "wgrad::chunk: no micro-kernel for ", dtype_name(t), " in this build");
  const int64_t pr = panel_rows(t, rows), groups = ceil_div(band, kR), bw = groups * kR;
  const int64_t blocks = ceil_div(k, kCols);
  const Store store = overwrite ? Store::kWrite : Store::kAdd;
  // 64-byte aligned panels: a's, then b's (every column block, one after the other).
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t{63});
  float* ap = reinterpret_cast<float*>(base);
  float* bp = ap + bw * pr;
  const auto nc_of = [&](int64_t jb) { return static_cast<int>(std::min<int64_t>(kCols, k - jb * kCols)); };
  const auto nr_of = [&](int64_t g) { return static_cast<int>(std::min<int64_t>(kR, band - g * kR)); };
  // Where b (every column block, as the kernel reads it) fits half of L2, every column block of a
  // group of dw rows runs before the next group: dw is written as kR streams of whole rows, in
  // order (column blocks outermost, fine_grained's bf16 expert phase ran 3.8% slower than on
  // oneDNN; this way 6.1% faster: tools/ab_bench.py, 3 rounds). A larger b (fp32 read in place,
  // 512 rows x 512 columns) stays outermost, one column block at a time in L2 (rows first there:
  // 2048x512x512 5.8% slower).
  const auto order = [&](bool rows_first, auto&& run) {
    if (rows_first) {
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t jb = 0; jb < blocks; ++jb) run(g, jb);
    } else {
      for (int64_t jb = 0; jb < blocks; ++jb)
        for (int64_t g = 0; g < groups; ++g) run(g, jb);
    }
  };
  const int64_t b_bytes = pr * blocks * kCols * 4;
#if defined(__AVX512F__)
  if (t == DType::kF32) {
    pack_a_f32(static_cast<const float*>(a), lda, rows, band, bw, ap);
    // b is copied where a block fits L1 packed (rows x 256 bytes): read in place, rows a power
    // of two apart fall into a few sets of L1. Longer blocks are read in place from L2 either
    // way, and their copy per band costs more than it saves where dw has few rows (the router's
    // 128: 340 -> 397 GFLOP/s, kernels_bench). A partial block is always copied, zero-padded.
    const bool packed = rows * kCols * 4 <= kPackedL1;
    for (int64_t jb = 0; jb < blocks; ++jb)
      if (packed || nc_of(jb) < kCols)
        pack_b_f32(static_cast<const float*>(b), ldb, rows, jb * kCols, nc_of(jb), bp + jb * pr * kCols);
    order(b_bytes <= kRowsFirstB, [&](int64_t g, int64_t jb) {
      const bool copy = packed || nc_of(jb) < kCols;
      const float* bj = copy ? bp + jb * pr * kCols : static_cast<const float*>(b) + jb * kCols;
      micro::micro_f32(micro::Panel<float>{ap + g * kR, bw}, bj, copy ? kCols : ldb, pr, c + g * kR * k + jb * kCols,
                       k, nr_of(g), nc_of(jb), store);
    });
    return;
  }
#endif
#if defined(MOE_MICRO_BF16)
  uint32_t* apw = reinterpret_cast<uint32_t*>(ap);
  uint32_t* bpw = reinterpret_cast<uint32_t*>(bp);
  pack_a_bf16(static_cast<const uint16_t*>(a), lda, rows, band, bw, apw);
  for (int64_t jb = 0; jb < blocks; ++jb)
    pack_b_bf16(static_cast<const uint16_t*>(b), ldb, rows, jb * kCols, nc_of(jb), bpw + jb * pr * kCols);
  order(b_bytes <= kRowsFirstB, [&](int64_t g, int64_t jb) {
    micro::micro_bf16(micro::Panel<uint32_t>{apw + g * kR, bw}, bpw + jb * pr * kCols, kCols, pr,
                      c + g * kR * k + jb * kCols, k, nr_of(g), nc_of(jb), store);
  });
#else
  (void)a, (void)lda, (void)b, (void)ldb, (void)c, (void)overwrite, (void)ap, (void)bp, (void)nc_of, (void)nr_of,
      (void)blocks, (void)store, (void)order, (void)b_bytes;
#endif
}

}  // namespace moe::cpu::wgrad
