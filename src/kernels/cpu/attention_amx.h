// bf16 tile products of the CPU attention on AMX tiles (tdpbf16ps), where oneDNN runs its bf16
// GEMMs on them too (gemm::amx_bf16): the same operands, roundings and masks as the vdpbf16ps
// kernels of attention_bf16.h, whose rate is the fp32 FMAs' on Sapphire and Emerald Rapids (one
// vdpbf16ps a cycle against two FMAs), while a tdpbf16ps does 16 x 16 x 32 products in 16 cycles.
//
// Every tile is 16 rows x 64 bytes: tiles 0-3 hold a 16 x 64 block of fp32 results (four 16 x 16
// blocks, one per 16-lane vector of a tile row), tile 4 the A operand (16 rows x 32 bf16 along
// the reduction), tiles 5-7 the B operands (16 pair rows x 16 words, "VNNI"). The two products:
//  - scores, C[r][x] = mul * sum_d A[r][d] B[x][d]: A is the tensor's bf16 rows (row pairs, as
//    attention_bf16.h broadcasts them) and B the transposed word panel (hp x kTile words) that
//    the vdpbf16ps kernel reads: both are already in AMX's layouts;
//  - accumulate, C[m][x] += sum_r A[r][m] P[r][x] (C hd x kTile): B is P's pair rows
//    (pack_pair_rows, or the kept ds), A must hold rows m with r along them: the tensor's
//    columns, packed once per op per (batch, head) as hd rows of positions (Bf16Tensor::cols).
// The reduction of an accumulation runs in steps of 16 pairs (32 rows r): pair rows past a
// tile's rows are zeroed, and so are the lanes a diagonal tile never computed (Tri), which the
// vdpbf16ps kernel skips instead; a zero P times a finite operand adds nothing.
// Taken where the head dim is a multiple of 32 and the sequence of 16 (whole A and B tiles);
// otherwise the vdpbf16ps kernels run. Internal to kernels/cpu.
#pragma once

#include <cstring>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/attention_bf16.h"

#if defined(MOE_ATTENTION_BF16)
#define MOE_ATTENTION_AMX 1
#define MOE_AMX_FN __attribute__((target("amx-tile,amx-bf16"), noinline))

namespace moe::cpu::attn {

constexpr int kAmxPairs = 16;  // pair rows per reduction step (32 rows r, 64 bytes of bf16)

// Loads the tile shapes on the calling thread: once per thread and parallel region, since
// oneDNN's AMX kernels load their own between the attention ops.
inline void amx_enter() { amx::load_full_tiles(); }
MOE_AMX_FN inline void amx_leave() { _tile_release(); }

// Scores, rows a multiple of 16: C (rows x kTile) = mul * A (row pairs, rows `as` words apart,
// hp words used, a multiple of 16) * Bt (hp x kTile words). Lane blocks a triangular tile does
// not need are neither computed nor written (as scores_bf16).
MOE_AMX_FN inline void scores_amx(const uint32_t* a, int64_t as, int rows, const uint32_t* bt, int hp, float mul,
                                  float* c, Tri tri) {
  constexpr int kLd = kTile * 4;  // bytes between rows of Bt and of C
  for (int r0 = 0; r0 < rows; r0 += 16) {
    const int g = r0 / 16, v0 = tri == kUpper ? g : 0, v1 = tri == kLower ? g : kNV - 1;
    float* cr = c + r0 * kTile;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int j0 = 0; j0 < hp; j0 += 16) {
      _tile_loadd(4, a + r0 * as + j0, as * 4);
      const uint32_t* b = bt + j0 * kTile;
      if (v0 <= 0) {
        _tile_loadd(5, b, kLd);
        _tile_dpbf16ps(0, 4, 5);
      }
      if (v0 <= 1 && v1 >= 1) {
        _tile_loadd(6, b + 16, kLd);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (v0 <= 2 && v1 >= 2) {
        _tile_loadd(7, b + 32, kLd);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (v1 >= 3) {
        _tile_loadd(5, b + 48, kLd);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    if (v0 <= 0) _tile_stored(0, cr, kLd);
    if (v0 <= 1 && v1 >= 1) _tile_stored(1, cr + 16, kLd);
    if (v0 <= 2 && v1 >= 2) _tile_stored(2, cr + 32, kLd);
    if (v1 >= 3) _tile_stored(3, cr + 48, kLd);
    if (mul != 1.0f) {
      const vf s = vset1(mul);
      for (int i = 0; i < 16; ++i)
        for (int v = v0; v <= v1; ++v) vstore(cr + i * kTile + v * kLanes, vmul(vload(cr + i * kTile + v * kLanes), s));
    }
  }
}

// Accumulate: C (hd x kTile, hd a multiple of 16) = C (* alpha) + A^T P over `steps` steps of
// kAmxPairs pair rows; A as columns (row m at acol + m * lda bf16, positions along it), P2 pair
// rows of kTile words (every pair row of the steps written: clear_unused_pairs).
MOE_AMX_FN inline void accum_amx(const uint16_t* acol, int64_t lda, int steps, const uint32_t* p2, int hd, float* c,
                                 const vf* alpha) {
  constexpr int kLd = kTile * 4;
  if (alpha)
    for (int m = 0; m < hd; ++m)
      for (int v = 0; v < kNV; ++v) {
        float* cv = c + m * kTile + v * kLanes;
        vstore(cv, vmul(vload(cv), alpha[v]));
      }
  for (int m0 = 0; m0 < hd; m0 += 16) {
    float* cm = c + m0 * kTile;
    _tile_loadd(0, cm, kLd);
    _tile_loadd(1, cm + 16, kLd);
    _tile_loadd(2, cm + 32, kLd);
    _tile_loadd(3, cm + 48, kLd);
    for (int s = 0; s < steps; ++s) {
      _tile_loadd(4, acol + m0 * lda + 2 * kAmxPairs * s, lda * 2);
      const uint32_t* b = p2 + kAmxPairs * s * kTile;
      _tile_loadd(5, b, kLd);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 16, kLd);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 32, kLd);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 48, kLd);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, cm, kLd);
    _tile_stored(1, cm + 16, kLd);
    _tile_stored(2, cm + 32, kLd);
    _tile_stored(3, cm + 48, kLd);
  }
}

// Reduction steps for an accumulation over `rows` rows r.
inline int amx_steps(int rows) { return ((rows + 1) / 2 + kAmxPairs - 1) / kAmxPairs; }

// Zeroes, in pair rows of kTile words, the rows past `rows` rows r up to the steps' end, and the
// lanes a diagonal tile never computed (kUpper: row group g needs lane vectors g.., kLower ..g).
inline void clear_unused_pairs(uint32_t* p2, int rows, Tri tri) {
  const int pairs = (rows + 1) / 2, padded = amx_steps(rows) * kAmxPairs;
  std::memset(p2 + pairs * kTile, 0, static_cast<size_t>(padded - pairs) * kTile * sizeof(uint32_t));
  if (tri == kFull) return;
  for (int p = 0; p < pairs; ++p) {
    const int g = 2 * p / kLanes;  // rows 2p, 2p+1 are in one row group
    for (int v = 0; v < kNV; ++v)
      if (tri == kUpper ? v < g : v > g) _mm512_storeu_si512(p2 + p * kTile + v * kLanes, _mm512_setzero_si512());
  }
}

// Columns of x (B, S, heads x hd), fp32 (rounded as the rows form rounds) or bf16 (copied): per
// (batch, head), hd rows of `sp` positions (sp >= S, a multiple of 16; positions past S zero).
template <class X>
inline void pack_bf16_cols(const X* x, int64_t B, int64_t S, int64_t row, int64_t hd, int64_t sp, uint16_t* cols) {
  const int64_t heads = row / hd, blocks = sp / kLanes;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < B * heads * blocks; ++item) {
    const int64_t b = item / (heads * blocks), h = item / blocks % heads, s0 = item % blocks * kLanes;
    for (int64_t m0 = 0; m0 < hd; m0 += kLanes) {
      const __mmask16 lanes = first_lanes(hd - m0);
      vf r[16];
      for (int i = 0; i < kLanes; ++i)
        r[i] = s0 + i < S ? vload_any(x + (b * S + s0 + i) * row + h * hd + m0, lanes) : _mm512_setzero_ps();
      transpose16(r);  // r[c]: column m0 + c at positions s0..s0+15
      for (int c = 0; c < std::min<int64_t>(kLanes, hd - m0); ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(cols + ((b * heads + h) * hd + m0 + c) * sp + s0),
                            round_words(r[c]));
    }
  }
}

}  // namespace moe::cpu::attn

#endif
