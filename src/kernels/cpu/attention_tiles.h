// The tile products of the CPU attention (attention.cpp, its one includer): two register-blocked
// fp32 micro-kernels (scores and accumulate, with the diagonal tile's triangular shapes) and the
// policies every pass is written over: fp32 products, bf16 products (vdpbf16ps,
// attention_bf16.h), bf16 products on AMX tiles (attention_amx.h, where oneDNN uses AMX too) and,
// without AVX512-BF16, bf16-rounded operands multiplied in fp32. In an unnamed namespace as they
// were inside attention.cpp: the same code, compiled in that one unit.
#pragma once

#include <bit>
#include <cstdint>

#include "core/buffer.h"
#include "core/tensor.h"
#include "kernels/cpu/attention_amx.h"
#include "kernels/cpu/attention_bf16.h"
#include "kernels/cpu/attention_simd.h"
#include "kernels/cpu/elem_common.h"

namespace moe::cpu {
namespace {

using namespace attn;  // NOLINT: the kernels' own vocabulary

// ------------------------------------------------------------------ micro-kernels
// On the diagonal tile (first key == first query) a quarter of the products is fully masked at
// 16-lane granularity and skipped ("triangular" shapes), with rows taken in 16-row groups w:
//   kUpper: rows are keys, lanes are queries: row group w needs lane vectors w..kNV-1;
//   kLower: rows are queries, lanes are keys: row group w needs lane vectors 0..w.
// Skipped lanes are neither written by the scores kernel nor read by the accumulate kernel.
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
void scores_f32(const float* a, int64_t astride, int rows, const float* bt, int hd, float* c,
                Tri tri) {
  int r = 0;
  for (; r + kMR <= rows; r += kMR) {
    for (int i = r + kMR; i < std::min(rows, r + 2 * kMR); ++i)  // the next block's rows (prefetch)
      for (int j = 0; j < hd; j += kLanes) prefetch(a + i * astride + j);
    scores_rows<kMR>(a + r * astride, astride, bt, hd, c + r * kTile, tri, r / kLanes);
  }
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

// Whether the fp32 accumulations fetch the next 16 columns of their A rows ahead (heads x hd
// apart in the tensor). On a Zen 5 that took the backward +13.8% (one thread, hd 64;
// PERFORMANCE_HISTORY.md, #30 seventh pass); on an Emerald Rapids Xeon, whose L2 streamer
// follows the rows by itself, the prefetches cost 0-13% (forward and backward, hd 64 and 128, 1
// and 2 threads; #30 sixteenth pass). The products and their order are the same either way.
bool prefetch_accum_rows() {
  static const bool intel = __builtin_cpu_is("intel");
  return !intel;
}

// C (hd x kTile) = C (* alpha) + A^T (rows x hd, strided) * P (rows x kTile).
void accum_f32(const float* a, int64_t astride, int rows, const float* p, int hd, float* c,
               const vf* alpha, Tri tri) {
  const bool ahead = prefetch_accum_rows();
  int d = 0;
  for (; d + kMR <= hd; d += kMR) {
    if (ahead && d % kLanes == 0 && d + kLanes < hd)  // the next 16 columns of every row (prefetch)
      for (int r = 0; r < rows; ++r) prefetch(a + r * astride + d + kLanes);
    accum_block<kMR>(a + d, astride, rows, p, c + d * kTile, alpha, tri);
  }
  switch (hd - d) {
    case 3: accum_block<3>(a + d, astride, rows, p, c + d * kTile, alpha, tri); break;
    case 2: accum_block<2>(a + d, astride, rows, p, c + d * kTile, alpha, tri); break;
    case 1: accum_block<1>(a + d, astride, rows, p, c + d * kTile, alpha, tri); break;
    default: break;
  }
}

// ------------------------------------------------------------------ tile products
// The three tile operations every pass is made of, in fp32 or bf16 (attention_bf16.h). `panel`
// packs rows of a tensor as the B operand of `scores` (lanes = those rows), times mul in fp32;
// bf16 cannot pre-scale before rounding, so `scores` applies the same mul to its output there:
// a scores call passes the mul of the panel it reads. `extra`: the policy's packing area.
struct F32Products {
  using Operand = const float*;  // rows of the fp32 tensor
  static void panel(const float* src, int64_t stride, int n, int hd, float mul, float* dst, float*) {
    pack_transposed(src, stride, n, hd, mul, dst);
  }
  static void scores(const float* a, int64_t astride, int rows, const float* panel, int hd,
                     float /*mul, in the panel*/, float* c, Tri tri, float*) {
    scores_f32(a, astride, rows, panel, hd, c, tri);
  }
  static void accum(const float* a, int64_t astride, int rows, const float* p, int hd, float* c,
                    const vf* alpha, Tri tri, float*) {
    accum_f32(a, astride, rows, p, hd, c, alpha, tri);
  }
  // The backward's pass 1 keeps each tile's ds (queries x keys) for pass 2 in the form pass 2's
  // accumulation (dq^T += k^T ds) reads: here keys x queries, query lanes past nq zero.
  static void keep_ds(const float* ds, int nq, int nk, float* dst, float*) {
    pack_transposed(ds, kTile, nq, nk, 1.0f, dst);
  }
  static void accum_kept(const float* a, int64_t astride, int rows, float* kept, int hd, float* c, Tri tri,
                         float* extra) {
    accum(a, astride, rows, kept, hd, c, nullptr, tri, extra);
  }
};

#if defined(MOE_ATTENTION_BF16)
struct Bf16Products {
  using Operand = Bf16Operand;  // the tensor packed once per op (Bf16Tensor)
  static uint32_t* words(float* x) { return reinterpret_cast<uint32_t*>(x); }
  static const uint32_t* words(const float* x) { return reinterpret_cast<const uint32_t*>(x); }
  static void panel(Operand src, int64_t stride, int n, int hd, float /*mul: in scores*/, float* dst,
                    float*) {
    pack_word_panel(src.row_words(), stride / 2, n, hd / 2, words(dst));
  }
  static void scores(Operand a, int64_t astride, int rows, const float* panel, int hd, float mul,
                     float* c, Tri tri, float*) {
    scores_bf16(a.row_words(), astride / 2, rows, words(panel), hd / 2, mul, c, tri);
  }
  static void accum(Operand a, int64_t /*astride: a.pair_stride()*/, int rows, const float* p, int hd,
                    float* c, const vf* alpha, Tri tri, float* extra) {
    uint32_t* p2 = words(extra);
    pack_pair_rows(p, kTile, rows, kTile, p2);
    accum_bf16(a.pair_words(), a.pair_stride(), rows, p2, hd, c, alpha, tri);
  }
  // ds kept as pass 2's accumulation reads it: pair rows of keys (bf16 words, lanes = queries,
  // query lanes past nq zero), so pass 2 packs nothing and the store holds half the bytes. A key
  // lane past nk holds the masked ds = +-0 where the fp32 form held 0: the same sums.
  static void keep_ds(const float* ds, int nq, int /*nk*/, float* dst, float* extra) {
    uint32_t* rows = words(extra);  // nq rows of kTile / 2 words: each row's ds as bf16, in order
    round_rows_bf16(ds, kTile, nq, kTile, rows);
    pack_word_panel(rows, kTile / 2, nq, kTile / 2, words(dst));
  }
  static void accum_kept(Operand a, int64_t /*astride: a.pair_stride()*/, int rows, float* kept, int hd, float* c,
                         Tri tri, float*) {
    accum_bf16(a.pair_words(), a.pair_stride(), rows, words(kept), hd, c, nullptr, tri);
  }
};
#endif

#if defined(MOE_ATTENTION_AMX)
// bf16 products on AMX tiles (attention_amx.h): Bf16Products' operands, panels and kept ds, the
// products on tiles. Rows a multiple of 16 and hd of 32 (use_amx). enter/leave: per thread and
// parallel region (the tile shapes).
struct AmxProducts : Bf16Products {
  static void enter() { amx_enter(); }
  static void leave() { amx_leave(); }
  static void scores(Operand a, int64_t astride, int rows, const float* panel, int hd, float mul, float* c, Tri tri,
                     float*) {
    scores_amx(a.row_words(), astride / 2, rows, words(panel), hd / 2, mul, c, tri);
  }
  static void accum(Operand a, int64_t /*astride: a.t->sp*/, int rows, const float* p, int hd, float* c,
                    const vf* alpha, Tri tri, float* extra) {
    uint32_t* p2 = words(extra);
    pack_pair_rows(p, kTile, rows, kTile, p2);
    clear_unused_pairs(p2, rows, tri);
    accum_amx(a.col_words(), a.t->sp, amx_steps(rows), p2, hd, c, alpha);
  }
  static void accum_kept(Operand a, int64_t /*astride*/, int rows, float* kept, int hd, float* c, Tri tri, float*) {
    clear_unused_pairs(words(kept), rows, tri);  // its only reader
    accum_amx(a.col_words(), a.t->sp, amx_steps(rows), words(kept), hd, c, nullptr);
  }
};
#endif

// A policy's per-thread setup of a parallel region, where it has one (AmxProducts).
template <class P>
void enter_products() {
  if constexpr (requires { P::enter(); }) P::enter();
}
template <class P>
void leave_products() {
  if constexpr (requires { P::leave(); }) P::leave();
}

inline float bf16_rounded(float x) { return std::bit_cast<float>(static_cast<uint32_t>(elem::bf16_bits(x)) << 16); }

// q, k, v or dO (slot 0..3) as fp32 rows: x itself when it is fp32 and not to be rounded, else a
// copy in a grow-only buffer on the calling thread (bf16: widened exactly; fp32 with round:
// rounded to bf16, as the bf16 products take it). As many bytes as the bf16 path's packed
// copies: the memory estimate's formula covers both.
const float* f32_operand(int slot, const Tensor& x, bool round) {
  if (x.dtype == DType::kF32 && !round) return x.as<float>();
  thread_local Buffer bufs[4];
  const auto n = static_cast<int64_t>(x.numel());
  Buffer& buf = bufs[slot];
  if (buf.bytes() < static_cast<size_t>(n) * sizeof(float)) buf = Buffer(static_cast<size_t>(n) * sizeof(float));
  auto* dst = static_cast<float*>(buf.data());
  if (x.dtype == DType::kBF16) {
    const bf16* src = x.as<bf16>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) dst[i] = elem::load(src[i]);
  } else {
    const float* src = x.as<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_rounded(src[i]);
  }
  return dst;
}

#if !defined(MOE_ATTENTION_BF16)
// bf16 products on a CPU without AVX512-BF16: every tile-product operand rounded to bf16 as the
// bf16 path rounds it (q, k, v, dO once per op, by f32_operand; p and ds per tile here) and
// multiplied in fp32, where a product of two bf16 values is exact; sums in fp32. The same
// arithmetic as vdpbf16ps but for summation order and subnormals (kept, not flushed).
struct RoundedProducts {
  using Operand = const float*;  // rows of the op's rounded copy
  static void panel(const float* src, int64_t stride, int n, int hd, float /*mul: in scores*/, float* dst,
                    float*) {
    pack_transposed(src, stride, n, hd, 1.0f, dst);  // bf16 rounds before it scales: no pre-scale
  }
  static void scores(const float* a, int64_t astride, int rows, const float* panel, int hd, float mul,
                     float* c, Tri tri, float*) {
    scores_f32(a, astride, rows, panel, hd, c, tri);
    if (mul != 1.0f)
      for (int64_t i = 0; i < static_cast<int64_t>(rows) * kTile; ++i) c[i] *= mul;
  }
  static void accum(const float* a, int64_t astride, int rows, const float* p, int hd, float* c,
                    const vf* alpha, Tri tri, float*) {
    // p is the pass's own tile (probabilities or score gradients), not read after this product.
    float* pw = const_cast<float*>(p);
    for (int64_t i = 0; i < static_cast<int64_t>(rows) * kTile; ++i) pw[i] = bf16_rounded(pw[i]);
    accum_f32(a, astride, rows, p, hd, c, alpha, tri);
  }
  static void keep_ds(const float* ds, int nq, int nk, float* dst, float* extra) {
    F32Products::keep_ds(ds, nq, nk, dst, extra);  // kept fp32: rounded where accum reads it
  }
  static void accum_kept(const float* a, int64_t astride, int rows, float* kept, int hd, float* c, Tri tri,
                         float* extra) {
    accum(a, astride, rows, kept, hd, c, nullptr, tri, extra);  // rounds the kept tile: its only reader
  }
};
#endif

}  // namespace
}  // namespace moe::cpu
