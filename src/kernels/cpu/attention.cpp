// Fast causal grouped-query attention on CPUs, FlashAttention-2 style, fp32.
//
// Tiles of kTile queries x kTile keys. Each tile's scores are a kTile x kTile block in per-thread
// scratch (never an S x S matrix); fully masked tiles (keys after every query of the tile) are
// skipped, and on the diagonal tile the 16-lane blocks that are entirely masked are skipped too.
// Scores are kept in base-2 units (q pre-scaled by log2(e)/sqrt(hd)) so the softmax uses exp2;
// lse is saved in natural-log units as the op list says.
//
// Layout trick: every tile product is vectorized along a 64-wide tile dimension (queries or keys)
// rather than along hd, so any hd works at full vector width (hd = 8 in tests, 64/128 in models).
// One operand is packed transposed (hd x kTile, zero padded); the other is read row by row from the
// tensor and broadcast. Two register-blocked micro-kernels (4 rows x 64 lanes, 16 accumulators)
// cover every product:
//   scores:     C[r][x]  = sum_d A_r[d] * Bt[d][x]             (r < R rows of a tensor)
//   accumulate: C[d][x] += sum_r A_r[d] * P[r][x]              (C is hd x kTile)
//
// Forward: parallel over (batch, head, query tile); online softmax per query lane.
// Backward, no atomics, every output element written by exactly one work item in a fixed order:
//   pass 0: D = rowsum(dO * O)                            parallel over (batch, position)
//   pass 1: dk, dv, parallel over (batch, kv head, key tile), looping over the group's query heads
//           and then query tiles in a fixed order; scores recomputed from q, k and lse.
//   pass 2: dq, parallel over (batch, head, query tile), looping over key tiles; recomputes the
//           scores and dp (7 tile matmuls in all instead of 5: the price of no atomics).
// So results are bitwise identical for any thread count.
// Intra-document masking (doc_start given): key tiles wholly before every query's document are
// skipped, and inside a tile keys before a query's document start are masked to -inf like the
// causal ones. Work items are scheduled dynamically,
// longest first; each item's arithmetic does not depend on which thread runs it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/buffer.h"
#include "kernels/attention_checks.h"
#include "kernels/cpu/cpu_ops.h"

#if defined(__AVX512F__)
// GCC 12 raises -Wmaybe-uninitialized inside avx512fintrin.h for intrinsics whose pass-through
// operand is _mm512_undefined_ps() (max, unpack, shuffle, ...): a known false positive. The state
// must be set before the header is read, since the warning is located in the header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif

namespace moe::cpu {
namespace {

constexpr int kTile = 64;                // queries and keys per tile (measured: 32 is slower)
constexpr int kLanes = 16;               // fp32 lanes per vector
constexpr int kNV = kTile / kLanes;      // vectors per tile row
constexpr int kMR = 4;                   // rows per micro-kernel block (4 x kNV accumulators)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kTile % kLanes == 0, "tile must be a whole number of vectors");

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
inline vf vexp2(vf x) {
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);  // NaN (the 2nd operand) is kept
  x = _mm512_min_ps(_mm512_set1_ps(127.0f), x);
  vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf f = _mm512_sub_ps(x, n);
  vf p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
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

// ------------------------------------------------------------------ micro-kernels
// On the diagonal tile (first key == first query) a quarter of the products is fully masked at
// 16-lane granularity and skipped ("triangular" shapes), with rows taken in 16-row groups w:
//   kUpper: rows are keys, lanes are queries: row group w needs lane vectors w..kNV-1;
//   kLower: rows are queries, lanes are keys: row group w needs lane vectors 0..w.
// Skipped lanes are neither written by the scores kernel nor read by the accumulate kernel.
enum Tri { kFull, kUpper, kLower };
static_assert(kNV == 4 && kLanes % kMR == 0, "triangular dispatch below assumes 4 vectors/row");

// Scores: C[r*kTile + x] = sum_{d<hd} A[r*astride + d] * Bt[d*kTile + x], r < MR, for lane
// vectors V0..V1.
template <int MR, int V0, int V1>
inline void scores_block(const float* a, int64_t astride, const float* bt, int hd, float* c) {
  vf acc[MR][kNV];
  for (int r = 0; r < MR; ++r)
    for (int v = V0; v <= V1; ++v) acc[r][v] = vset1(0.0f);
  for (int d = 0; d < hd; ++d) {
    vf b[kNV];
    for (int v = V0; v <= V1; ++v) {
      b[v] = vload(bt + d * kTile + v * kLanes);
      in_register(b[v]);
    }
    for (int r = 0; r < MR; ++r) {
      vf ar = vset1(a[r * astride + d]);
      for (int v = V0; v <= V1; ++v) acc[r][v] = vfma(ar, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = V0; v <= V1; ++v) vstore(c + r * kTile + v * kLanes, acc[r][v]);
}

template <int MR>
void scores_rows(const float* a, int64_t astride, const float* bt, int hd, float* c, Tri tri,
                 int w) {
  if (tri == kUpper) {
    switch (w) {
      case 0: return scores_block<MR, 0, 3>(a, astride, bt, hd, c);
      case 1: return scores_block<MR, 1, 3>(a, astride, bt, hd, c);
      case 2: return scores_block<MR, 2, 3>(a, astride, bt, hd, c);
      default: return scores_block<MR, 3, 3>(a, astride, bt, hd, c);
    }
  } else if (tri == kLower) {
    switch (w) {
      case 0: return scores_block<MR, 0, 0>(a, astride, bt, hd, c);
      case 1: return scores_block<MR, 0, 1>(a, astride, bt, hd, c);
      case 2: return scores_block<MR, 0, 2>(a, astride, bt, hd, c);
      default: return scores_block<MR, 0, 3>(a, astride, bt, hd, c);
    }
  }
  scores_block<MR, 0, 3>(a, astride, bt, hd, c);
}

// C (rows x kTile) = A (rows x hd, strided) * Bt (hd x kTile).
void scores(const float* a, int64_t astride, int rows, const float* bt, int hd, float* c,
            Tri tri) {
  int r = 0;
  for (; r + kMR <= rows; r += kMR)
    scores_rows<kMR>(a + r * astride, astride, bt, hd, c + r * kTile, tri, r / kLanes);
  const float* ar = a + r * astride;
  float* cr = c + r * kTile;
  switch (rows - r) {  // blocks start at multiples of kMR, so a block never straddles a group
    case 3: scores_rows<3>(ar, astride, bt, hd, cr, tri, r / kLanes); break;
    case 2: scores_rows<2>(ar, astride, bt, hd, cr, tri, r / kLanes); break;
    case 1: scores_rows<1>(ar, astride, bt, hd, cr, tri, r / kLanes); break;
    default: break;
  }
  static_assert(kMR == 4, "remainder cases above assume kMR == 4");
}

// acc[m][v] += sum_{r0<=r<r1} A[r*astride + m] * P[r*kTile + v*kLanes ...], v in V0..V1.
template <int MR, int V0, int V1>
[[gnu::always_inline]] inline void accum_rows(vf (&acc)[MR][kNV], const float* a, int64_t astride,
                                              int r0, int r1, const float* p) {
  for (int r = r0; r < r1; ++r) {
    vf pv[kNV];
    for (int v = V0; v <= V1; ++v) {
      pv[v] = vload(p + r * kTile + v * kLanes);
      in_register(pv[v]);
    }
    for (int m = 0; m < MR; ++m) {
      vf am = vset1(a[r * astride + m]);
      for (int v = V0; v <= V1; ++v) acc[m][v] = vfma(am, pv[v], acc[m][v]);
    }
  }
}

// Accumulate: C[m*kTile + x] = C[m*kTile + x] (* alpha[x] if given)
//                              + sum_{r<rows} A[r*astride + m] * P[r*kTile + x],   m < MR.
template <int MR>
inline void accum_block(const float* a, int64_t astride, int rows, const float* p, float* c,
                        const vf* alpha, Tri tri) {
  vf acc[MR][kNV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v) {
      acc[m][v] = vload(c + m * kTile + v * kLanes);
      if (alpha) acc[m][v] = vmul(acc[m][v], alpha[v]);
    }
  auto end = [rows](int w) { return std::min(rows, w * kLanes); };
  if (tri == kUpper) {
    accum_rows<MR, 0, 3>(acc, a, astride, 0, end(1), p);
    accum_rows<MR, 1, 3>(acc, a, astride, end(1), end(2), p);
    accum_rows<MR, 2, 3>(acc, a, astride, end(2), end(3), p);
    accum_rows<MR, 3, 3>(acc, a, astride, end(3), rows, p);
  } else if (tri == kLower) {
    accum_rows<MR, 0, 0>(acc, a, astride, 0, end(1), p);
    accum_rows<MR, 0, 1>(acc, a, astride, end(1), end(2), p);
    accum_rows<MR, 0, 2>(acc, a, astride, end(2), end(3), p);
    accum_rows<MR, 0, 3>(acc, a, astride, end(3), rows, p);
  } else {
    accum_rows<MR, 0, 3>(acc, a, astride, 0, rows, p);
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v) vstore(c + m * kTile + v * kLanes, acc[m][v]);
}

// C (hd x kTile) = C (* alpha) + A^T (rows x hd, strided) * P (rows x kTile).
void accum(const float* a, int64_t astride, int rows, const float* p, int hd, float* c,
           const vf* alpha, Tri tri) {
  int d = 0;
  for (; d + kMR <= hd; d += kMR)
    accum_block<kMR>(a + d, astride, rows, p, c + d * kTile, alpha, tri);
  switch (hd - d) {
    case 3: accum_block<3>(a + d, astride, rows, p, c + d * kTile, alpha, tri); break;
    case 2: accum_block<2>(a + d, astride, rows, p, c + d * kTile, alpha, tri); break;
    case 1: accum_block<1>(a + d, astride, rows, p, c + d * kTile, alpha, tri); break;
    default: break;
  }
}

// Packs rows [0, n) of a strided (n x hd) block transposed into dst (hd x kTile), times mul;
// columns n..kTile-1 are zero.
// Writes dst row i (strided, i < n) = mul[i] * src[d*kTile + i] for d < hd.
// Both move 16 x 16 blocks through registers (a scalar loop here cost ~18% of the forward).
#if defined(__AVX512F__)
// In place: r[c] lane i <- r[i] lane c.
inline void transpose16(vf r[16]) {
  vf t[16];
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
    vf x0 = _mm512_shuffle_f32x4(t[k], t[4 + k], 0x88), x1 = _mm512_shuffle_f32x4(t[k], t[4 + k], 0xDD);
    vf y0 = _mm512_shuffle_f32x4(t[8 + k], t[12 + k], 0x88),
       y1 = _mm512_shuffle_f32x4(t[8 + k], t[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[k + 4] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[k + 12] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

inline __mmask16 first_lanes(int n) {
  return n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << std::max(n, 0)) - 1u);
}

void pack_transposed(const float* src, int64_t stride, int n, int hd, float mul, float* dst) {
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

void unpack_transposed(const float* src, int n, int hd, const float* mul, float* dst,
                       int64_t stride) {
  for (int d0 = 0; d0 < hd; d0 += kLanes) {
    const int nd = std::min(kLanes, hd - d0);
    const __mmask16 cols = first_lanes(nd);
    for (int i0 = 0; i0 < n; i0 += kLanes) {
      vf r[16];
      for (int c = 0; c < kLanes; ++c)
        r[c] = c < nd ? vload(src + (d0 + c) * kTile + i0) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < std::min(kLanes, n - i0); ++i)
        _mm512_mask_storeu_ps(dst + (i0 + i) * stride + d0, cols, vmul(r[i], vset1(mul[i0 + i])));
    }
  }
}
#else
void pack_transposed(const float* src, int64_t stride, int n, int hd, float mul, float* dst) {
  for (int d = 0; d < hd; ++d) {
    float* row = dst + d * kTile;
    for (int i = 0; i < n; ++i) row[i] = src[i * stride + d] * mul;
    for (int i = n; i < kTile; ++i) row[i] = 0.0f;
  }
}

void unpack_transposed(const float* src, int n, int hd, const float* mul, float* dst,
                       int64_t stride) {
  for (int i = 0; i < n; ++i) {
    float* row = dst + i * stride;
    for (int d = 0; d < hd; ++d) row[d] = src[d * kTile + i] * mul[i];
  }
}
#endif

// Per-thread scratch, grown (never per tile) to the largest size an op has asked for.
float* thread_scratch(size_t floats) {
  thread_local Buffer buf;
  if (buf.bytes() < floats * sizeof(float)) buf = Buffer(floats * sizeof(float));
  return static_cast<float*>(buf.data());
}

// ------------------------------------------------------------------ shapes
struct Dims {
  int64_t B, S, H, G;
  int hd;
  const int32_t* doc = nullptr;  // (B,S) document starts, or null for plain causal
  int64_t rep() const { return H / G; }
  int64_t qstride() const { return H * hd; }  // between positions in q, o, dout, dq
  int64_t kstride() const { return G * hd; }  // between positions in k, v, dk, dv
  int64_t tiles() const { return (S + kTile - 1) / kTile; }
};

Dims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  MOE_CHECK(q.dtype != DType::kF64, "cpu backend does not support f64 (", op,
            "; use the ref backend for the f64 path)");
  MOE_CHECK(q.dtype == DType::kF32, op, ": cpu backend supports f32 only, got ",
            dtype_name(q.dtype));
  MOE_CHECK(q.ndim == 4, op, ": q must be (B,S,H,hd), got ", q.shape_str());
  Dims d{q.dim(0), q.dim(1), q.dim(2), k.ndim == 4 ? k.dim(2) : 0, static_cast<int>(q.dim(3))};
  MOE_CHECK(d.G > 0 && d.H % d.G == 0, op, ": query heads H=", d.H,
            " must be a multiple of kv heads G=", d.G, " (q ", q.shape_str(), ", k ",
            k.shape_str(), ")");
  MOE_CHECK(q.dim(3) >= 1 && q.dim(3) <= 4096, op, ": head dim ", q.dim(3), " out of range");
  check_shape(k, {d.B, d.S, d.G, d.hd}, "attention k");
  check_shape(v, {d.B, d.S, d.G, d.hd}, "attention v");
  check_dtype(k, DType::kF32, "attention k");
  check_dtype(v, DType::kF32, "attention v");
  return d;
}
// With document starts: the first key tile any query of tile [q0, q0+nq) reads (key tiles wholly
// before every query's document are skipped), and each query lane's start as float (0 for
// padding lanes) in lanes_out. Without: 0.
int64_t first_key_tile(const Dims& d, int64_t b, int64_t q0, int nq, float* lanes_out) {
  if (!d.doc) return 0;
  const int32_t* ds = d.doc + b * d.S + q0;
  int64_t lo = q0 + nq;
  for (int i = 0; i < kTile; ++i) {
    lanes_out[i] = i < nq ? static_cast<float>(ds[i]) : 0.0f;
    if (i < nq) lo = std::min<int64_t>(lo, ds[i]);
  }
  return lo / kTile * kTile;
}

// Scratch layout for every pass, in floats: four hd x kTile panels, two kTile x kTile tiles and
// four kTile vectors. O(tile^2 + tile*hd) per thread.
size_t scratch_floats(int hd) { return (4 * size_t(hd) + 2 * kTile + 4) * kTile; }

// ------------------------------------------------------------------ forward
// kDoc: intra-document masking (d.doc set); a template parameter so the plain causal path
// compiles exactly as without it.
template <bool kDoc>
void forward_tile(const Dims& d, const float* q, const float* k, const float* v, float* o,
                  float* lse, int64_t b, int64_t h, int64_t qt, float* ws) {
  const int hd = d.hd;
  const int64_t g = h / d.rep(), q0 = qt * kTile;
  const int nq = static_cast<int>(std::min<int64_t>(kTile, d.S - q0));
  float* qt_panel = ws;                     // hd x kTile: q^T * log2(e)/sqrt(hd)
  float* o_panel = ws + hd * kTile;         // hd x kTile: unnormalized o^T
  float* s_tile = ws + 4 * hd * kTile;      // keys x queries: scores, then probabilities
  float* lanes = s_tile + 2 * kTile * kTile;  // kTile floats of per-query scalars
  const float c = kLog2e / std::sqrt(static_cast<float>(hd));

  const float* qb = q + ((b * d.S + q0) * d.H + h) * hd;
  pack_transposed(qb, d.qstride(), nq, hd, c, qt_panel);
  std::fill(o_panel, o_panel + hd * kTile, 0.0f);
  float ds_lanes[kTile];
  const int64_t kfirst = kDoc ? first_key_tile(d, b, q0, nq, ds_lanes) : 0;
  vf m[kNV], l[kNV], dsv[kNV];
  // With document masks a query lane may see a wholly masked key tile before its document
  // starts: a finite initial max keeps alpha = exp2(m - mnew) = 1 there instead of NaN.
  const float m0 = kDoc ? -1e30f : -std::numeric_limits<float>::infinity();
  for (int x = 0; x < kNV; ++x) {
    m[x] = vset1(m0);
    l[x] = vset1(0.0f);
    if constexpr (kDoc) dsv[x] = vload(ds_lanes + x * kLanes);
  }
  for (int64_t k0 = kfirst; k0 < q0 + nq; k0 += kTile) {  // key tiles past the last query: skipped
    const int nk = static_cast<int>(std::min<int64_t>(kTile, d.S - k0));
    const float* kb = k + ((b * d.S + k0) * d.G + g) * hd;
    const float* vb = v + ((b * d.S + k0) * d.G + g) * hd;
    // Only the diagonal tile (k0 == q0) has keys after queries: mask key > query there, and
    // skip the lane vectors of row j below j/16 (all masked) everywhere.
    const bool diag = k0 == q0;
    const Tri tri = diag ? kUpper : kFull;
    scores(kb, d.kstride(), nk, qt_panel, hd, s_tile, tri);  // s_tile[j][i]
    vf mt[kNV];
    for (int x = 0; x < kNV; ++x) mt[x] = vset1(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < nk; ++j)
      for (int x = diag ? j / kLanes : 0; x < kNV; ++x) {
        float* p = s_tile + j * kTile + x * kLanes;
        vf s = vload(p);
        // query lane i is masked where k0 + j > q0 + x*16 + i
        if (diag) s = vmask_lt(s, static_cast<int>(k0 + j - q0 - x * kLanes));
        if constexpr (kDoc) s = vmask_doc(s, dsv[x], static_cast<float>(k0 + j));  // key before its document
        if (diag || kDoc) vstore(p, s);
        mt[x] = vmax(mt[x], s);
      }
    vf alpha[kNV], sum[kNV];
    for (int x = 0; x < kNV; ++x) {
      vf mnew = vmax(m[x], mt[x]);
      alpha[x] = vexp2(vsub(m[x], mnew));
      m[x] = mnew;
      sum[x] = vset1(0.0f);
    }
    for (int j = 0; j < nk; ++j)
      for (int x = diag ? j / kLanes : 0; x < kNV; ++x) {
        float* p = s_tile + j * kTile + x * kLanes;
        vf e = vexp2(vsub(vload(p), m[x]));
        vstore(p, e);
        sum[x] = vadd(sum[x], e);
      }
    for (int x = 0; x < kNV; ++x) l[x] = vfma(l[x], alpha[x], sum[x]);
    accum(vb, d.kstride(), nk, s_tile, hd, o_panel, alpha, tri);  // o^T = alpha o^T + v^T p
  }
  // lse = ln2 * (m + log2 l); o = o^T / l.
  float mv[kTile];
  for (int x = 0; x < kNV; ++x) {
    vstore(lanes + x * kLanes, l[x]);
    vstore(mv + x * kLanes, m[x]);
  }
  float* lse_row = lse + (b * d.H + h) * d.S + q0;
  for (int i = 0; i < nq; ++i) {
    lse_row[i] = kLn2 * (mv[i] + std::log2(lanes[i]));
    lanes[i] = 1.0f / lanes[i];
  }
  unpack_transposed(o_panel, nq, hd, lanes, o + ((b * d.S + q0) * d.H + h) * hd, d.qstride());
}

// ------------------------------------------------------------------ backward
// Pass 1: dk and dv of key tile kt of kv head g, summed over the group's query heads in order.
template <bool kDoc>
void backward_kv_tile(const Dims& d, const float* dout, const float* q, const float* k,
                      const float* v, const float* lse, const float* D, float* dk, float* dv,
                      int64_t b, int64_t g, int64_t kt, float* ws) {
  const int hd = d.hd;
  const int64_t k0 = kt * kTile;
  const int nk = static_cast<int>(std::min<int64_t>(kTile, d.S - k0));
  float* kt_panel = ws;                    // hd x kTile: k^T * log2(e)/sqrt(hd)
  float* vt_panel = ws + hd * kTile;       // hd x kTile: v^T
  float* dk_panel = ws + 2 * hd * kTile;   // hd x kTile: dk^T / scale
  float* dv_panel = ws + 3 * hd * kTile;   // hd x kTile: dv^T
  float* p_tile = ws + 4 * hd * kTile;     // queries x keys: scores, then probabilities
  float* ds_tile = p_tile + kTile * kTile; // queries x keys: dp, then ds
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd)), c = kLog2e * scale;

  const int64_t kvoff = ((b * d.S + k0) * d.G + g) * hd;
  pack_transposed(k + kvoff, d.kstride(), nk, hd, c, kt_panel);
  pack_transposed(v + kvoff, d.kstride(), nk, hd, 1.0f, vt_panel);
  std::fill(dk_panel, dk_panel + 2 * hd * kTile, 0.0f);  // dk and dv panels
  for (int64_t h = g * d.rep(); h < (g + 1) * d.rep(); ++h)
    for (int64_t q0 = k0; q0 < d.S; q0 += kTile) {  // query tiles before the keys: skipped
      const int nq = static_cast<int>(std::min<int64_t>(kTile, d.S - q0));
      const int64_t qoff = ((b * d.S + q0) * d.H + h) * hd;
      const float* lse_row = lse + (b * d.H + h) * d.S + q0;
      const float* D_row = D + (b * d.H + h) * d.S + q0;
      const int32_t* ds_row = kDoc ? d.doc + b * d.S + q0 : nullptr;
      if (kDoc && *std::min_element(ds_row, ds_row + nq) >= k0 + nk) continue;  // all before the documents
      // Only the diagonal tile (q0 == k0) has keys after queries (padding past S included):
      // mask there, and skip the lane vectors of row i above i/16 (all masked) everywhere.
      const bool diag = q0 == k0;
      const Tri tri = diag ? kLower : kFull;
      scores(q + qoff, d.qstride(), nq, kt_panel, hd, p_tile, tri);    // s[i][j]
      scores(dout + qoff, d.qstride(), nq, vt_panel, hd, ds_tile, tri);  // dp[i][j]
      for (int i = 0; i < nq; ++i) {
        const vf l2 = vset1(lse_row[i] * kLog2e), Di = vset1(D_row[i]);
        for (int x = 0; x < (diag ? i / kLanes + 1 : kNV); ++x) {
          float* ps = p_tile + i * kTile + x * kLanes;
          float* dps = ds_tile + i * kTile + x * kLanes;
          vf s = vload(ps);
          // key lane j is masked where k0 + x*16 + j > q0 + i
          if (diag) s = vmask_ge(s, static_cast<int>(q0 + i - k0 - x * kLanes + 1));
          // key lane j is masked where k0 + x*16 + j < doc_start of query q0 + i
          if constexpr (kDoc) s = vmask_lt(s, static_cast<int>(ds_row[i] - k0 - x * kLanes));
          vf p = vexp2(vsub(s, l2));
          vstore(ps, p);
          vstore(dps, vmul(p, vsub(vload(dps), Di)));
        }
      }
      accum(dout + qoff, d.qstride(), nq, p_tile, hd, dv_panel, nullptr, tri);  // dv^T += dO^T p
      accum(q + qoff, d.qstride(), nq, ds_tile, hd, dk_panel, nullptr, tri);    // dk^T += q^T ds
    }
  float mul[kTile];
  std::fill(mul, mul + kTile, scale);
  unpack_transposed(dk_panel, nk, hd, mul, dk + kvoff, d.kstride());
  std::fill(mul, mul + kTile, 1.0f);
  unpack_transposed(dv_panel, nk, hd, mul, dv + kvoff, d.kstride());
}

// Pass 2: dq of query tile qt of head h, summed over key tiles in order.
template <bool kDoc>
void backward_q_tile(const Dims& d, const float* dout, const float* q, const float* k,
                     const float* v, const float* lse, const float* D, float* dq, int64_t b,
                     int64_t h, int64_t qt, float* ws) {
  const int hd = d.hd;
  const int64_t g = h / d.rep(), q0 = qt * kTile;
  const int nq = static_cast<int>(std::min<int64_t>(kTile, d.S - q0));
  float* qt_panel = ws;                    // hd x kTile: q^T * log2(e)/sqrt(hd)
  float* dot_panel = ws + hd * kTile;      // hd x kTile: dO^T
  float* dq_panel = ws + 2 * hd * kTile;   // hd x kTile: dq^T / scale
  float* p_tile = ws + 4 * hd * kTile;     // keys x queries: scores, then probabilities
  float* ds_tile = p_tile + kTile * kTile; // keys x queries: dp, then ds
  float* lanes = ds_tile + kTile * kTile;  // lse*log2(e), then D, for each query
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd)), c = kLog2e * scale;

  const int64_t qoff = ((b * d.S + q0) * d.H + h) * hd;
  pack_transposed(q + qoff, d.qstride(), nq, hd, c, qt_panel);
  pack_transposed(dout + qoff, d.qstride(), nq, hd, 1.0f, dot_panel);
  std::fill(dq_panel, dq_panel + hd * kTile, 0.0f);
  const float* lse_row = lse + (b * d.H + h) * d.S + q0;
  const float* D_row = D + (b * d.H + h) * d.S + q0;
  for (int i = 0; i < kTile; ++i) {
    lanes[i] = i < nq ? lse_row[i] * kLog2e : 0.0f;
    lanes[kTile + i] = i < nq ? D_row[i] : 0.0f;
  }
  float ds_lanes[kTile];
  const int64_t kfirst = kDoc ? first_key_tile(d, b, q0, nq, ds_lanes) : 0;
  vf l2[kNV], Dv[kNV], dsv[kNV];
  for (int x = 0; x < kNV; ++x) {
    l2[x] = vload(lanes + x * kLanes);
    Dv[x] = vload(lanes + kTile + x * kLanes);
    if constexpr (kDoc) dsv[x] = vload(ds_lanes + x * kLanes);
  }
  for (int64_t k0 = kfirst; k0 < q0 + nq; k0 += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, d.S - k0));
    const float* kb = k + ((b * d.S + k0) * d.G + g) * hd;
    const float* vb = v + ((b * d.S + k0) * d.G + g) * hd;
    const bool diag = k0 == q0;  // as in the forward
    const Tri tri = diag ? kUpper : kFull;
    scores(kb, d.kstride(), nk, qt_panel, hd, p_tile, tri);    // s[j][i]
    scores(vb, d.kstride(), nk, dot_panel, hd, ds_tile, tri);  // dp[j][i]
    for (int j = 0; j < nk; ++j)
      for (int x = diag ? j / kLanes : 0; x < kNV; ++x) {
        vf s = vload(p_tile + j * kTile + x * kLanes);
        if (diag) s = vmask_lt(s, static_cast<int>(k0 + j - q0 - x * kLanes));
        if constexpr (kDoc) s = vmask_doc(s, dsv[x], static_cast<float>(k0 + j));
        vf p = vexp2(vsub(s, l2[x]));
        float* dps = ds_tile + j * kTile + x * kLanes;
        vstore(dps, vmul(p, vsub(vload(dps), Dv[x])));
      }
    accum(kb, d.kstride(), nk, ds_tile, hd, dq_panel, nullptr, tri);  // dq^T += k^T ds
  }
  float mul[kTile];
  std::fill(mul, mul + kTile, scale);
  unpack_transposed(dq_panel, nq, hd, mul, dq + qoff, d.qstride());
}

// Grow-only buffer on the calling thread for D (B*H*S floats).
float* caller_buffer(size_t floats) {
  thread_local Buffer buf;
  if (buf.bytes() < floats * sizeof(float)) buf = Buffer(floats * sizeof(float));
  return static_cast<float*>(buf.data());
}

}  // namespace

void attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                   const Tensor& lse, const Tensor& doc_start) {
  Dims d = check_attention(q, k, v, "attention_fwd");
  d.doc = checked_doc_start(doc_start, d.B, d.S, "attention_fwd doc_start");
  check_shape(o, {d.B, d.S, d.H, d.hd}, "attention_fwd o");
  check_shape(lse, {d.B, d.H, d.S}, "attention_fwd lse");
  check_dtype(o, DType::kF32, "attention_fwd o");
  check_dtype(lse, DType::kF32, "attention_fwd lse");
  const float *qp = q.as<float>(), *kp = k.as<float>(), *vp = v.as<float>();
  float *op = o.as<float>(), *lp = lse.as<float>();
  const int64_t nt = d.tiles(), bh = d.B * d.H;
#pragma omp parallel
  {
    float* ws = thread_scratch(scratch_floats(d.hd));
    // Longest items (last query tiles) first; each item's result is independent of the schedule.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nt * bh; ++item) {
      const int64_t qt = nt - 1 - item / bh, r = item % bh;
      if (d.doc) forward_tile<true>(d, qp, kp, vp, op, lp, r / d.H, r % d.H, qt, ws);
      else forward_tile<false>(d, qp, kp, vp, op, lp, r / d.H, r % d.H, qt, ws);
    }
  }
}

void attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& o, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                   const Tensor& dv, const Tensor& doc_start) {
  Dims d = check_attention(q, k, v, "attention_bwd");
  d.doc = checked_doc_start(doc_start, d.B, d.S, "attention_bwd doc_start");
  check_shape(dout, {d.B, d.S, d.H, d.hd}, "attention_bwd dout");
  check_shape(o, {d.B, d.S, d.H, d.hd}, "attention_bwd o");
  check_shape(lse, {d.B, d.H, d.S}, "attention_bwd lse");
  check_shape(dq, {d.B, d.S, d.H, d.hd}, "attention_bwd dq");
  check_shape(dk, {d.B, d.S, d.G, d.hd}, "attention_bwd dk");
  check_shape(dv, {d.B, d.S, d.G, d.hd}, "attention_bwd dv");
  for (const Tensor* t : {&dout, &o, &lse, &dq, &dk, &dv})
    check_dtype(*t, DType::kF32, "attention_bwd argument");
  const float *dop = dout.as<float>(), *qp = q.as<float>(), *kp = k.as<float>(),
              *vp = v.as<float>(), *op = o.as<float>(), *lp = lse.as<float>();
  float *dqp = dq.as<float>(), *dkp = dk.as<float>(), *dvp = dv.as<float>();
  const int64_t nt = d.tiles(), hd = d.hd;
  float* D = caller_buffer(static_cast<size_t>(d.B * d.H * d.S));

  // Pass 0: D[b,h,s] = dO . O, each row summed in index order.
#pragma omp parallel for schedule(static)
  for (int64_t bs = 0; bs < d.B * d.S; ++bs)
    for (int64_t h = 0; h < d.H; ++h) {
      const float* a = dop + (bs * d.H + h) * hd;
      const float* c = op + (bs * d.H + h) * hd;
      float s = 0.0f;
      for (int64_t i = 0; i < hd; ++i) s += a[i] * c[i];
      D[((bs / d.S) * d.H + h) * d.S + bs % d.S] = s;
    }

#pragma omp parallel
  {
    float* ws = thread_scratch(scratch_floats(d.hd));
    // Pass 1: dk, dv. Item (kt, b, g); the first key tiles see the most query tiles: first.
    const int64_t bg = d.B * d.G;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nt * bg; ++item) {
      const int64_t kt = item / bg, r = item % bg;
      if (d.doc) backward_kv_tile<true>(d, dop, qp, kp, vp, lp, D, dkp, dvp, r / d.G, r % d.G, kt, ws);
      else backward_kv_tile<false>(d, dop, qp, kp, vp, lp, D, dkp, dvp, r / d.G, r % d.G, kt, ws);
    }
    // Pass 2: dq. Item (qt, b, h); the last query tiles see the most key tiles: first.
    const int64_t bh = d.B * d.H;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nt * bh; ++item) {
      const int64_t qt = nt - 1 - item / bh, r = item % bh;
      if (d.doc) backward_q_tile<true>(d, dop, qp, kp, vp, lp, D, dqp, r / d.H, r % d.H, qt, ws);
      else backward_q_tile<false>(d, dop, qp, kp, vp, lp, D, dqp, r / d.H, r % d.H, qt, ws);
    }
  }
}

}  // namespace moe::cpu
