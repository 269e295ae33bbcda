// SIMD helpers of the CPU attention kernels (attention.cpp, attention_bf16.h): tile constants,
// 16-lane fp32 vectors (AVX-512, or a portable lane-by-lane fallback), masks, exp2, the forward
// softmax's passes by row groups, the 16 x 16 transposes that pack tiles into panels, and the
// backward's row sums D = rowsum(dO * O). Internal to kernels/cpu.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/bf16.h"
#include "kernels/cpu/avx512.h"

namespace moe::cpu::attn {

constexpr int kTile = 64;                // queries and keys per tile (measured: 32 is slower)
constexpr int kLanes = 16;               // fp32 lanes per vector
constexpr int kNV = kTile / kLanes;      // vectors per tile row
constexpr int kMR = 4;                   // rows per micro-kernel block (4 x kNV accumulators)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kTile % kLanes == 0, "tile must be a whole number of vectors");

// Which 16-lane vectors of a tile row a diagonal tile needs (see attention.cpp, micro-kernels).
enum Tri { kFull, kUpper, kLower };

// Fetches the cache line holding p into L1 ahead of its use. The products' broadcast operands are
// rows of a tensor heads x hd apart: the next block's rows (scores) or the next 16-column group of
// every row (accumulations) are fetched while the current block runs. kernels_bench, 1 thread,
// bf16 q, k, v (Zen 5): backward hd 64 188 -> 233 GFLOP/s, hd 128 218 -> 248; the forward -3 .. +5%.
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// ------------------------------------------------------------------ 16-lane fp32 vectors
#if defined(__AVX512F__)
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
// The first lanes of 16 values as fp32 lanes (the rest zero): fp32 as they are, bf16 (bf16 mode's
// saved q, k, v, o) widened exactly.
inline vf vload_any(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline vf vload_any(const bf16* p, __mmask16 lanes) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// Forces a loaded vector into a register: otherwise GCC folds the load into every FMA that uses
// it (one memory operand per FMA), and the micro-kernels become load-bound (the scores kernel
// alone, in L1: 62 -> 114 GFLOP/s).
inline void in_register(vf& x) { asm("" : "+v"(x)); }
// Lanes with index < t (t may be <= 0 or >= 16) become -inf.
inline vf vmask_lt(vf x, int t) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 m = _mm512_cmplt_epi32_mask(iota, _mm512_set1_epi32(t));
  return _mm512_mask_blend_ps(m, x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
}
// Lanes with index >= t become -inf.
inline vf vmask_ge(vf x, int t) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 m = _mm512_cmpge_epi32_mask(iota, _mm512_set1_epi32(t));
  return _mm512_mask_blend_ps(m, x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
}
// Lanes whose document start ds (as float) is after key position `key` become -inf.
inline vf vmask_doc(vf x, vf ds, float key) {
  __mmask16 m = _mm512_cmp_ps_mask(_mm512_set1_ps(key), ds, _CMP_LT_OQ);
  return _mm512_mask_blend_ps(m, x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
}
// 2^x: Cephes exp2f polynomial on the fraction (max rel. error ~2e-7), vscalefps for 2^n.
// x <= -200 (including -inf from the causal mask) gives exactly 0; NaN stays NaN.
// Lanes below -152 are set to 0 without computing 2^x, which would round to that 0 too (at most
// 2^-151.5, under half the smallest subnormal): on Intel cores an instruction whose result falls
// below the normal range takes a microcode assist, and the masked lanes (-inf) of every diagonal
// tile made one per row. The same bits as the polynomial on every lane (AttentionExp2 tests);
// kernels_bench, 1 thread, Emerald Rapids, alternated 3 times: the AMX forward 213-237 -> 293-317
// GFLOP/s, fp32 forward 108-119 -> 127-141.
inline vf vexp2(vf x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-152.0f), _CMP_LT_OQ);  // false for NaN
  x = _mm512_mask_mov_ps(x, tiny, _mm512_setzero_ps());
  x = _mm512_min_ps(_mm512_set1_ps(127.0f), x);  // NaN (the 2nd operand) is kept
  vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf f = _mm512_sub_ps(x, n);
  vf p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}
#else
// Portable fallback (builds without AVX-512): the same algorithm, lane by lane.
struct vf {
  float x[kLanes];
};
inline vf vload(const float* p) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = p[i];
  return r;
}
inline void vstore(float* p, vf a) {
  for (int i = 0; i < kLanes; ++i) p[i] = a.x[i];
}
inline vf vset1(float s) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = s;
  return r;
}
#define MOE_ATTN_LANEWISE(name, expr)            \
  inline vf name(vf a, vf b) {                   \
    vf r;                                        \
    for (int i = 0; i < kLanes; ++i) r.x[i] = expr; \
    return r;                                    \
  }
MOE_ATTN_LANEWISE(vmul, a.x[i] * b.x[i])
MOE_ATTN_LANEWISE(vadd, a.x[i] + b.x[i])
MOE_ATTN_LANEWISE(vsub, a.x[i] - b.x[i])
MOE_ATTN_LANEWISE(vmax, std::max(a.x[i], b.x[i]))
#undef MOE_ATTN_LANEWISE
inline vf vfma(vf a, vf b, vf c) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return r;
}
inline vf vmask_lt(vf a, int t) {
  for (int i = 0; i < kLanes; ++i)
    if (i < t) a.x[i] = -std::numeric_limits<float>::infinity();
  return a;
}
inline vf vmask_ge(vf a, int t) {
  for (int i = 0; i < kLanes; ++i)
    if (i >= t) a.x[i] = -std::numeric_limits<float>::infinity();
  return a;
}
inline vf vmask_doc(vf a, vf ds, float key) {
  for (int i = 0; i < kLanes; ++i)
    if (key < ds.x[i]) a.x[i] = -std::numeric_limits<float>::infinity();
  return a;
}
inline void in_register(vf&) {}
inline vf vexp2(vf a) {
  for (int i = 0; i < kLanes; ++i) a.x[i] = std::exp2(std::max(a.x[i], -200.0f));
  return a;
}
#endif

// The forward's two passes over a tile of scores (keys x query lanes), one row group of 16 keys
// at a time with its first lane vector V0 a constant (a diagonal tile's row group w needs vectors
// w..3), so that the lanes' maxima and sums stay in registers: with the first vector known only at
// run time GCC kept them on the stack, and the exp pass waited on its own stores (kernels_bench,
// 1 thread, Emerald Rapids, alternated 3 times: the AMX forward 187-219 -> 213-237 GFLOP/s). The
// same operations in the same order as one loop over the rows: the same bits. kMask: the diagonal
// tile (k0 == q0), key j masked for the query lanes before it.
template <int V0, bool kMask, bool kDoc>
[[gnu::always_inline]] inline void max_rows(float* s_tile, int j0, int j1, int64_t k0, const vf (&dsv)[kNV],
                                            vf (&mt)[kNV]) {
  for (int j = j0; j < j1; ++j)
#pragma GCC unroll 4
    for (int x = V0; x < kNV; ++x) {
      float* p = s_tile + j * kTile + x * kLanes;
      vf s = vload(p);
      if constexpr (kMask) s = vmask_lt(s, j - x * kLanes);  // query lane i is masked where j > x*16 + i
      if constexpr (kDoc) s = vmask_doc(s, dsv[x], static_cast<float>(k0 + j));  // key before its document
      if constexpr (kMask || kDoc) vstore(p, s);
      mt[x] = vmax(mt[x], s);
    }
}
template <int V0>
[[gnu::always_inline]] inline void exp_rows(float* s_tile, int j0, int j1, const vf (&m)[kNV], vf (&sum)[kNV]) {
  for (int j = j0; j < j1; ++j)
#pragma GCC unroll 4
    for (int x = V0; x < kNV; ++x) {
      float* p = s_tile + j * kTile + x * kLanes;
      const vf e = vexp2(vsub(vload(p), m[x]));
      vstore(p, e);
      sum[x] = vadd(sum[x], e);
    }
}
// Runs fn.template operator()<V0, kDiag>(j0, j1) for each row group of a diagonal tile (V0 = its
// index, kDiag true), or once over rows [0, nk) with V0 = 0, kDiag false.
template <class F>
[[gnu::always_inline]] inline void by_row_groups(bool diag, int nk, F&& fn) {
  if (!diag) return fn.template operator()<0, false>(0, nk);
  for (int w = 0; w * kLanes < nk; ++w) {
    const int j0 = w * kLanes, j1 = std::min(nk, j0 + kLanes);
    switch (w) {
      case 0: fn.template operator()<0, true>(j0, j1); break;
      case 1: fn.template operator()<1, true>(j0, j1); break;
      case 2: fn.template operator()<2, true>(j0, j1); break;
      default: fn.template operator()<3, true>(j0, j1); break;
    }
  }
}
static_assert(kNV == 4, "by_row_groups dispatches four row groups");

// Packs rows [0, n) of a strided (n x hd) block transposed into dst (hd x kTile), times mul;
// columns n..kTile-1 are zero.
// Writes dst row i (strided, i < n) = mul[i] * src[d*kTile + i] for d < hd; with stream, whole
// aligned lines around the cache (the backward's large dq, dk, dv: nothing reads them before
// the op ends, and a plain store first reads each line it fills; olmoe_compat bf16 attention_bwd
// -1.5 to -2 ms per step, rope_bwd and the QK-norm backward, which then read them from memory,
// +0.2 to +0.3).
// Both move 16 x 16 blocks through registers (transpose16, avx512.h; a scalar loop here cost ~18%
// of the forward).
#if defined(__AVX512F__)
inline void pack_transposed(const float* src, int64_t stride, int n, int hd, float mul, float* dst) {
  const vf m = vset1(mul);
  for (int d0 = 0; d0 < hd; d0 += kLanes) {
    const int nd = std::min(kLanes, hd - d0);
    const __mmask16 cols = first_lanes(nd);
    for (int i0 = 0; i0 < kTile; i0 += kLanes) {
      vf r[16];
      for (int i = 0; i < kLanes; ++i)
        r[i] = i0 + i < n ? _mm512_maskz_loadu_ps(cols, src + (i0 + i) * stride + d0)
                          : _mm512_setzero_ps();
      transpose16(r);
      for (int c = 0; c < nd; ++c) vstore(dst + (d0 + c) * kTile + i0, vmul(r[c], m));
    }
  }
}

inline void unpack_transposed(const float* src, int n, int hd, const float* mul, float* dst,
                              int64_t stride, bool stream) {
  for (int d0 = 0; d0 < hd; d0 += kLanes) {
    const int nd = std::min(kLanes, hd - d0);
    const __mmask16 cols = first_lanes(nd);
    for (int i0 = 0; i0 < n; i0 += kLanes) {
      vf r[16];
      for (int c = 0; c < kLanes; ++c)
        r[c] = c < nd ? vload(src + (d0 + c) * kTile + i0) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < std::min(kLanes, n - i0); ++i) {
        float* o = dst + (i0 + i) * stride + d0;
        const vf v = vmul(r[i], vset1(mul[i0 + i]));
        if (stream && nd == kLanes && reinterpret_cast<uintptr_t>(o) % 64 == 0) _mm512_stream_ps(o, v);
        else _mm512_mask_storeu_ps(o, cols, v);
      }
    }
  }
  if (stream) _mm_sfence();
}
#else
inline void pack_transposed(const float* src, int64_t stride, int n, int hd, float mul, float* dst) {
  for (int d = 0; d < hd; ++d) {
    float* row = dst + d * kTile;
    for (int i = 0; i < n; ++i) row[i] = src[i * stride + d] * mul;
    for (int i = n; i < kTile; ++i) row[i] = 0.0f;
  }
}

inline void unpack_transposed(const float* src, int n, int hd, const float* mul, float* dst,
                              int64_t stride, bool /*stream*/) {
  for (int i = 0; i < n; ++i) {
    float* row = dst + i * stride;
    for (int d = 0; d < hd; ++d) row[d] = src[d * kTile + i] * mul[i];
  }
}
#endif

// ------------------------------------------------------------------ D = rowsum(dO * O)
// One row of D = dO . O, summed in index order; not inlined, so that the fp32 and the bf16 o
// (widened) take the same instructions.
__attribute__((noinline)) inline float row_dot(const float* a, const float* c, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * c[i];
  return s;
}

// 16 rows of D at once, rows a..a+16*hd of dO against the same rows of o (fp32, or bf16 widened):
// each row's sum in the lanes of one vector, in row_dot's order and roundings (each product
// rounded, then added in index order: the same bits). Row by row, the dependent scalar adds had
// taken ~8% of the bf16 backward on AMX (Emerald Rapids).
#if defined(__AVX512F__)
constexpr int64_t kRowDots = 16;
template <class O>
inline void row_dots16(const float* a, const O* o, int64_t hd, float* out) {
  __m512 s = _mm512_setzero_ps();
  for (int64_t d0 = 0; d0 < hd; d0 += 16) {
    const int nd = static_cast<int>(std::min<int64_t>(16, hd - d0));
    const __mmask16 cols = first_lanes(nd);
    __m512 x[16], y[16];
    for (int r = 0; r < 16; ++r) {
      x[r] = vload_any(a + r * hd + d0, cols);
      y[r] = vload_any(o + r * hd + d0, cols);
    }
    transpose16(x);  // x[c]: column d0 + c of the 16 rows
    transpose16(y);
    for (int c = 0; c < nd; ++c) {
      __m512 p = _mm512_mul_ps(x[c], y[c]);
      in_register(p);  // rounded on its own, as row_dot's: never contracted into an FMA
      s = _mm512_add_ps(s, p);
    }
  }
  _mm512_storeu_ps(out, s);
}
#else
constexpr int64_t kRowDots = 0;  // row by row (row_dot)
template <class O>
inline void row_dots16(const float*, const O*, int64_t, float*) {}
#endif

}  // namespace moe::cpu::attn
