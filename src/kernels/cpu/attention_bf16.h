// bf16 tile products of the CPU attention (attention ops with bf16_products): every operand of a
// tile product (q, k, v, dO, and the probabilities p and score gradients ds) is rounded to bf16
// (nearest even; an fp32 subnormal to zero, see pair_lanes) and multiplied with vdpbf16ps, which
// adds a pair of products into each fp32 accumulator lane: half the instructions of fp32 FMAs for
// the same products. The online softmax, lse, D, every accumulator and every output stay fp32.
//
// A dpbf16 needs its pairs side by side in both operands, along the reduction dimension:
//  - scores, C[r][x] = sum_d A[r][d] B[x][d] (reduction over the head dim): "row pairs", the
//    (d, d+1) values of one row in one 32-bit word, i.e. the bf16 copy of the tensor; B is
//    transposed once per tile into a panel (hd/2 x kTile words, lanes = its rows), A's words are
//    broadcast;
//  - accumulate, C[m][x] += sum_r A[r][m] P[r][x] (reduction over tile rows): "pair rows", the
//    values of rows (2p, 2p+1) in one word, for A (broadcast; packed once per op, Bf16Tensor)
//    and P (lanes; packed per product, it is computed data).
// A missing odd row is a zero. Internal to kernels/cpu; built only with AVX512-BF16 (else the
// ops fall back to fp32 products, see attention.cpp).
#pragma once

#include "kernels/cpu/attention_simd.h"
#include "kernels/cpu/elem_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MOE_ATTENTION_BF16 1

namespace moe::cpu::attn {

using vi = __m512i;
inline void in_register(vi& x) { asm("" : "+v"(x)); }
inline __m512bh as_bh(vi x) { return reinterpret_cast<__m512bh&>(x); }

// fp32 -> bf16 by the AVX512-BF16 conversions (vcvtne2ps2bf16, vcvtneps2bf16): round to nearest
// even, NaN a quiet NaN, as elem::bf16_bits, except that an fp32 subnormal becomes a signed zero.
// Every value rounded here is only ever a vdpbf16ps operand, which reads a bf16 subnormal as zero
// anyway: the one difference that reaches a product is an fp32 value within 2^-134 below 2^-126,
// which elem::bf16_bits rounds up to the smallest normal. One instruction instead of eight per 16
// values (the emulation was a fifth of the bf16 backward's instructions outside its products).
// Lane i: bf16(a[i]) in the low half, bf16(b[i]) in the high half.
inline vi pair_lanes(vf a, vf b) {
  const vi words = reinterpret_cast<const vi&>(static_cast<const __m512bh&>(_mm512_cvtne2ps_pbh(b, a)));
  // words 0..15 = bf16(a), 16..31 = bf16(b): interleaved to a0 b0 a1 b1 ...
  const vi order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                    21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, words);
}
// 16 values as 16 bf16 words, in order.
inline __m256i round_words(vf x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  return reinterpret_cast<const __m256i&>(h);
}

// Pair rows of rows [0, n) of a strided (n x w) fp32 block: dst[p * w + m] = (A[2p][m],
// A[2p+1][m]) for p < (n + 1) / 2 (a missing row 2p+1 is zero). Used for probability tiles
// (w = kTile; lanes the accumulate never reads are paired too, harmlessly).
inline void pack_pair_rows(const float* src, int64_t stride, int n, int w, uint32_t* dst) {
  for (int p = 0; 2 * p < n; ++p) {
    const float* a = src + (2 * p) * stride;
    const float* b = 2 * p + 1 < n ? a + stride : nullptr;
    uint32_t* o = dst + p * w;
    for (int m = 0; m < w; m += kLanes) {
      const __mmask16 lanes = first_lanes(w - m);
      const vf bv = b ? _mm512_maskz_loadu_ps(lanes, b + m) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(o + m, lanes, pair_lanes(_mm512_maskz_loadu_ps(lanes, a + m), bv));
    }
  }
}

// Rows [0, n) of a strided fp32 block, w values each (w a multiple of 16), as bf16 in order:
// dst row r = w / 2 words, word j = (A[r][2j], A[r][2j+1]).
inline void round_rows_bf16(const float* src, int64_t stride, int n, int w, uint32_t* dst) {
  for (int r = 0; r < n; ++r)
    for (int m = 0; m < w; m += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(dst + r * (w / 2)) + m),
                          round_words(vload(src + r * stride + m)));
}

// Scores, rows r < MR, lane vectors V0..V1: C[r*kTile + x] = mul * sum_j dot2(A[r][j], Bt[j][x]).
template <int MR, int V0, int V1>
inline void scores_block_bf16(const uint32_t* a, int64_t as, int hp, const uint32_t* bt, float mul,
                              float* c) {
  vf acc[MR][kNV];
  for (int r = 0; r < MR; ++r)
    for (int v = V0; v <= V1; ++v) acc[r][v] = vset1(0.0f);
  for (int j = 0; j < hp; ++j) {
    vi b[kNV];
    for (int v = V0; v <= V1; ++v) {
      b[v] = _mm512_loadu_si512(bt + j * kTile + v * kLanes);
      in_register(b[v]);
    }
    for (int r = 0; r < MR; ++r) {
      const vi ar = _mm512_set1_epi32(static_cast<int>(a[r * as + j]));
      for (int v = V0; v <= V1; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], as_bh(ar), as_bh(b[v]));
    }
  }
  const vf s = vset1(mul);
  for (int r = 0; r < MR; ++r)
    for (int v = V0; v <= V1; ++v) vstore(c + r * kTile + v * kLanes, vmul(acc[r][v], s));
}

template <int MR>
void scores_rows_bf16(const uint32_t* a, int64_t as, int hp, const uint32_t* bt, float mul, float* c,
                      Tri tri, int w) {
  if (tri == kUpper) {
    switch (w) {
      case 0: return scores_block_bf16<MR, 0, 3>(a, as, hp, bt, mul, c);
      case 1: return scores_block_bf16<MR, 1, 3>(a, as, hp, bt, mul, c);
      case 2: return scores_block_bf16<MR, 2, 3>(a, as, hp, bt, mul, c);
      default: return scores_block_bf16<MR, 3, 3>(a, as, hp, bt, mul, c);
    }
  } else if (tri == kLower) {
    switch (w) {
      case 0: return scores_block_bf16<MR, 0, 0>(a, as, hp, bt, mul, c);
      case 1: return scores_block_bf16<MR, 0, 1>(a, as, hp, bt, mul, c);
      case 2: return scores_block_bf16<MR, 0, 2>(a, as, hp, bt, mul, c);
      default: return scores_block_bf16<MR, 0, 3>(a, as, hp, bt, mul, c);
    }
  }
  scores_block_bf16<MR, 0, 3>(a, as, hp, bt, mul, c);
}

// C (rows x kTile) = mul * A (row pairs: rows of hp words, `as` words apart) * Bt (hp x kTile).
inline void scores_bf16(const uint32_t* a, int64_t as, int rows, const uint32_t* bt, int hp, float mul,
                        float* c, Tri tri) {
  int r = 0;
  for (; r + kMR <= rows; r += kMR) {
    for (int i = r + kMR; i < std::min(rows, r + 2 * kMR); ++i)  // the next block's rows (prefetch)
      for (int j = 0; j < hp; j += kLanes) prefetch(a + i * as + j);
    scores_rows_bf16<kMR>(a + r * as, as, hp, bt, mul, c + r * kTile, tri, r / kLanes);
  }
  const uint32_t* ar = a + r * as;
  float* cr = c + r * kTile;
  switch (rows - r) {
    case 3: scores_rows_bf16<3>(ar, as, hp, bt, mul, cr, tri, r / kLanes); break;
    case 2: scores_rows_bf16<2>(ar, as, hp, bt, mul, cr, tri, r / kLanes); break;
    case 1: scores_rows_bf16<1>(ar, as, hp, bt, mul, cr, tri, r / kLanes); break;
    default: break;
  }
}

// acc[m][v] += sum over pairs p in [p0, p1) of dot2(A2[p][m], P2[p][v lanes]), v in V0..V1.
template <int MR, int V0, int V1>
[[gnu::always_inline]] inline void accum_pairs_bf16(vf (&acc)[MR][kNV], const uint32_t* a2, int w,
                                                    int p0, int p1, const uint32_t* p2) {
  for (int p = p0; p < p1; ++p) {
    vi pv[kNV];
    for (int v = V0; v <= V1; ++v) {
      pv[v] = _mm512_loadu_si512(p2 + p * kTile + v * kLanes);
      in_register(pv[v]);
    }
    for (int m = 0; m < MR; ++m) {
      const vi am = _mm512_set1_epi32(static_cast<int>(a2[p * w + m]));
      for (int v = V0; v <= V1; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], as_bh(am), as_bh(pv[v]));
    }
  }
}

// Accumulate, m < MR: C[m*kTile + x] = C (* alpha[x]) + sum_{r<rows} A[r][m] P[r][x], with A and
// P as pair rows (A2 at column m0 already, row length w; P2 rows of kTile words).
template <int MR>
inline void accum_block_bf16(const uint32_t* a2, int w, int rows, const uint32_t* p2, float* c,
                             const vf* alpha, Tri tri) {
  vf acc[MR][kNV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v) {
      acc[m][v] = vload(c + m * kTile + v * kLanes);
      if (alpha) acc[m][v] = vmul(acc[m][v], alpha[v]);
    }
  // Row group g (rows 16g..16g+15) is pairs 8g..8g+7: a pair never straddles two groups.
  auto end = [rows](int g) { return (std::min(rows, g * kLanes) + 1) / 2; };
  const int last = (rows + 1) / 2;
  if (tri == kUpper) {
    accum_pairs_bf16<MR, 0, 3>(acc, a2, w, 0, end(1), p2);
    accum_pairs_bf16<MR, 1, 3>(acc, a2, w, end(1), end(2), p2);
    accum_pairs_bf16<MR, 2, 3>(acc, a2, w, end(2), end(3), p2);
    accum_pairs_bf16<MR, 3, 3>(acc, a2, w, end(3), last, p2);
  } else if (tri == kLower) {
    accum_pairs_bf16<MR, 0, 0>(acc, a2, w, 0, end(1), p2);
    accum_pairs_bf16<MR, 0, 1>(acc, a2, w, end(1), end(2), p2);
    accum_pairs_bf16<MR, 0, 2>(acc, a2, w, end(2), end(3), p2);
    accum_pairs_bf16<MR, 0, 3>(acc, a2, w, end(3), last, p2);
  } else {
    accum_pairs_bf16<MR, 0, 3>(acc, a2, w, 0, last, p2);
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v) vstore(c + m * kTile + v * kLanes, acc[m][v]);
}

// C (hd x kTile) = C (* alpha) + A^T P; A2: pair rows, `w` words apart (hd used of each);
// P2: pair rows of kTile words.
inline void accum_bf16(const uint32_t* a2, int64_t w, int rows, const uint32_t* p2, int hd, float* c,
                       const vf* alpha, Tri tri) {
  int d = 0;
  const int pairs = (rows + 1) / 2;
  for (; d + kMR <= hd; d += kMR) {
    if (d % kLanes == 0 && d + kLanes < hd)  // the next 16 columns of every pair row (prefetch)
      for (int p = 0; p < pairs; ++p) prefetch(a2 + p * w + d + kLanes);
    accum_block_bf16<kMR>(a2 + d, w, rows, p2, c + d * kTile, alpha, tri);
  }
  switch (hd - d) {
    case 3: accum_block_bf16<3>(a2 + d, w, rows, p2, c + d * kTile, alpha, tri); break;
    case 2: accum_block_bf16<2>(a2 + d, w, rows, p2, c + d * kTile, alpha, tri); break;
    case 1: accum_block_bf16<1>(a2 + d, w, rows, p2, c + d * kTile, alpha, tri); break;
    default: break;
  }
}

// ------------------------------------------------------------------ operands packed once per op
// A (B, S, heads, hd) tensor for the bf16 products: its bf16 copy, whose words at even offsets
// are the row pairs the score products broadcast, and its pair rows (positions 2i and 2i+1 of a
// sequence in one word per head and d; a missing last position is zero), which the
// accumulations broadcast. Packed once per op instead of once per tile and use (every tile of
// q, k, v and dO takes part in many tile products). The pair rows are head-major, (B, heads,
// ceil(S/2), hd): an accumulation walks one head's pair rows hd words apart, where the tensor's
// order put them heads x hd apart, a power of two (2 KiB at 8 heads of 64) that maps them all to
// two sets of L1 (kernels_bench, bf16 products, hd 64, 2 threads: see docs/PERFORMANCE_HISTORY.md).
struct Bf16Tensor {
  const uint16_t* rows = nullptr;   // B * S * row (a bf16 input's own storage); null: not packed
  const uint32_t* pairs = nullptr;  // B * heads * ceil(S/2) * hd; null: not packed
  int64_t S = 0, row = 0, hd = 0;   // positions per sequence; elements per position (heads x hd)
  // The AMX accumulations' form (attention_amx.h): B * heads * hd rows of `sp` positions.
  const uint16_t* cols = nullptr;
  int64_t sp = 0;
};

// A position in a Bf16Tensor: element offset ((b * S + s) * heads + h) * hd (s even: tiles
// start at multiples of kTile), moved like a pointer.
struct Bf16Operand {
  const Bf16Tensor* t = nullptr;
  int64_t off = 0;
  Bf16Operand operator+(int64_t o) const { return {t, off + o}; }
  const uint32_t* row_words() const { return reinterpret_cast<const uint32_t*>(t->rows + off); }
  // The pair row of this position's head, pair_stride() words from the next pair's.
  const uint32_t* pair_words() const {
    const int64_t pos = off / t->row, within = off % t->row, b = pos / t->S, s = pos % t->S;
    const int64_t heads = t->row / t->hd, h = within / t->hd;
    return t->pairs + ((b * heads + h) * ((t->S + 1) / 2) + s / 2) * t->hd + within % t->hd;
  }
  int64_t pair_stride() const { return t->hd; }
  // This position's column in the AMX form (its head's hd rows of t->sp positions, row 0).
  const uint16_t* col_words() const {
    const int64_t pos = off / t->row, within = off % t->row, b = pos / t->S, s = pos % t->S;
    const int64_t heads = t->row / t->hd;
    return t->cols + ((b * heads + within / t->hd) * t->hd + within % t->hd) * t->sp + s;
  }
};

// Packs x (B, S, heads x hd), fp32 (rounded) or bf16 (copied), into rows (B*S*row bf16) and
// head-major pairs (B*heads*ceil(S/2)*hd words); a null destination is a form not wanted.
template <class X>
inline void pack_bf16_tensor(const X* x, int64_t B, int64_t S, int64_t row, int64_t hd, uint16_t* rows,
                             uint32_t* pairs) {
  const int64_t n = B * S * row, sp = (S + 1) / 2, heads = row / hd;
#pragma omp parallel
  {
    if (rows) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 lanes = first_lanes(n - i);
        _mm256_mask_storeu_epi16(rows + i, lanes, round_words(vload_any(x + i, lanes)));
      }
    }
    if (pairs) {
#pragma omp for schedule(static)
      for (int64_t bp = 0; bp < B * sp; ++bp) {
        const int64_t b = bp / sp, p = bp % sp, s = 2 * p;
        const X* a = x + (b * S + s) * row;
        const X* c = s + 1 < S ? a + row : nullptr;
        for (int64_t h = 0; h < heads; ++h) {
          uint32_t* o = pairs + ((b * heads + h) * sp + p) * hd;
          for (int64_t j = 0; j < hd; j += kLanes) {
            const __mmask16 lanes = first_lanes(hd - j);
            const vf cv = c ? vload_any(c + h * hd + j, lanes) : _mm512_setzero_ps();
            _mm512_mask_storeu_epi32(o + j, lanes, pair_lanes(vload_any(a + h * hd + j, lanes), cv));
          }
        }
      }
    }
  }
}

// The scores' B panel from row pairs: rows [0, n) of hp words each, `as` words apart, transposed
// to hp x kTile words (lanes n..kTile-1 zero).
inline void pack_word_panel(const uint32_t* src, int64_t as, int n, int hp, uint32_t* dst) {
  for (int p0 = 0; p0 < hp; p0 += kLanes) {
    const int np = std::min(kLanes, hp - p0);
    const __mmask16 cols = first_lanes(np);
    for (int i0 = 0; i0 < kTile; i0 += kLanes) {
      vf r[16];  // words moved as float bit patterns: the shuffles do no arithmetic
      for (int i = 0; i < kLanes; ++i)
        r[i] = i0 + i < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(cols, src + (i0 + i) * as + p0))
                          : _mm512_setzero_ps();
      transpose16(r);
      for (int c = 0; c < np; ++c)
        _mm512_storeu_si512(dst + (p0 + c) * kTile + i0, _mm512_castps_si512(r[c]));
    }
  }
}

}  // namespace moe::cpu::attn

#endif
