// The register-blocked micro-kernels of our own CPU GEMMs (gemm_wgrad.cpp, gemm_long.cpp): a
// kR x kCols block of C (24 zmm accumulators) over a run of the reduction, one step (fp32) or pair
// of steps (bf16, vdpbf16ps) at a time: a's kR values of each step are broadcast (read through an
// accessor, a(step, q): a packed panel or kR rows of a tensor), b's kCols values loaded from rows
// `bs` apart. Each C element is one chain over the reduction in order. Internal to kernels/cpu;
// AVX-512 only.
#pragma once

#include <cstdint>

#include "kernels/cpu/avx512.h"

namespace moe::cpu::micro {

constexpr int kR = 6;           // C rows per micro-kernel
constexpr int kV = 4;           // 16-lane vectors per micro-kernel row
constexpr int kCols = 16 * kV;  // C columns per micro-kernel

// a(step, q) from a panel: p[step * s + q].
template <class T> struct Panel {
  const T* p;
  int64_t s;
  T operator()(int64_t step, int q) const { return p[step * s + q]; }
};
// a(step, q) from kR rows of a tensor: row[q][step].
template <class T> struct Rows {
  const T* row[kR];
  T operator()(int64_t step, int q) const { return row[q][step]; }
};


// How a micro-kernel's sums reach C: added to it in one rounding (kAdd), written over it
// (kWrite), or started from it and written back (kChain: the chain goes on through C).
enum class Store { kAdd, kWrite, kChain };

// Fetches the lines of c that a micro-kernel will add to (with intent to write), as it starts:
// dw is cold (it is read back once per call). Fetched two micro-kernels ahead instead, the
// 64-row expert shapes ran 30-47% slower (kernels_bench).
inline void prefetch_block(const float* c, int64_t ldc, int nr, int nc) {
  for (int q = 0; q < nr; ++q)
    for (int j = 0; j < nc; j += 16) __builtin_prefetch(c + q * ldc + j, 1, 3);
}

#if defined(__AVX512F__)
using vf = __m512;
// Forces a loaded vector into a register: otherwise GCC folds the load into each FMA that reads
// it (the same trick as attention_simd.h).
inline void in_register(vf& x) { asm("" : "+v"(x)); }
inline void in_register(__m512i& x) { asm("" : "+v"(x)); }

// acc from c's rows q < nr, columns < nc (kChain), else zeros.
inline void load_block(vf (&acc)[kR][kV], const float* c, int64_t ldc, int nr, int nc, Store st) {
#pragma GCC unroll 8
  for (int q = 0; q < kR; ++q)
#pragma GCC unroll 4
    for (int v = 0; v < kV; ++v)
      acc[q][v] = st == Store::kChain && q < nr ? _mm512_maskz_loadu_ps(first_lanes(nc - 16 * v), c + q * ldc + 16 * v)
                                                : _mm512_setzero_ps();
}

// c rows q < nr, columns < nc: c = acc, or c + acc (kAdd).
inline void store_block(vf (&acc)[kR][kV], float* c, int64_t ldc, int nr, int nc, Store st) {
#pragma GCC unroll 8
  for (int q = 0; q < kR; ++q) {
    if (q >= nr) break;
    float* cq = c + q * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < kV; ++v) {
      const __mmask16 m = first_lanes(nc - 16 * v);
      if (!m) break;
      const vf s = st != Store::kAdd ? acc[q][v] : _mm512_add_ps(_mm512_maskz_loadu_ps(m, cq + 16 * v), acc[q][v]);
      _mm512_mask_storeu_ps(cq + 16 * v, m, s);
    }
  }
}

// One step of the chain, per element type: fp32 (an FMA per reduction step) and bf16 (a
// vdpbf16ps per pair of steps, a 32-bit word of two bf16 values in each operand lane).
struct F32Step {
  using Word = float;
  using Lanes = vf;
  static Lanes load(const float* p) { return _mm512_loadu_ps(p); }
  static Lanes broadcast(float x) { return _mm512_set1_ps(x); }
  static vf madd(vf acc, Lanes s, Lanes b) { return _mm512_fmadd_ps(s, b, acc); }
};

// acc[q][v] (+)= sum over steps i < n of a(i, q) * bp[i][16 v ..], one chain per element.
template <class Step, class A>
inline void micro(const A& a, const typename Step::Word* bp, int64_t bs, int64_t n, float* c, int64_t ldc, int nr,
                  int nc, Store st) {
  using L = typename Step::Lanes;
  prefetch_block(c, ldc, nr, nc);
  vf acc[kR][kV];
  load_block(acc, c, ldc, nr, nc, st);
  for (int64_t i = 0; i < n; ++i) {
    // Four named registers: an array here is stored to the stack by the in_register asm.
    L b0 = Step::load(bp + i * bs), b1 = Step::load(bp + i * bs + 16), b2 = Step::load(bp + i * bs + 32),
      b3 = Step::load(bp + i * bs + 48);
    in_register(b0), in_register(b1), in_register(b2), in_register(b3);
    const L b[kV] = {b0, b1, b2, b3};
#pragma GCC unroll 8
    for (int q = 0; q < kR; ++q) {
      const L s = Step::broadcast(a(i, q));
#pragma GCC unroll 4
      for (int v = 0; v < kV; ++v) acc[q][v] = Step::madd(acc[q][v], s, b[v]);
    }
  }
  store_block(acc, c, ldc, nr, nc, st);
}
template <class A>
inline void micro_f32(const A& a, const float* bp, int64_t bs, int64_t rows, float* c, int64_t ldc, int nr, int nc,
                      Store st) {
  micro<F32Step>(a, bp, bs, rows, c, ldc, nr, nc, st);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MOE_MICRO_BF16 1
struct Bf16Step {
  using Word = uint32_t;
  using Lanes = __m512i;
  static Lanes load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static Lanes broadcast(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static vf madd(vf acc, Lanes s, Lanes b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(s), reinterpret_cast<__m512bh&>(b));
  }
};
template <class A>
inline void micro_bf16(const A& a, const uint32_t* bp, int64_t bs, int64_t pairs, float* c, int64_t ldc, int nr,
                       int nc, Store st) {
  micro<Bf16Step>(a, bp, bs, pairs, c, ldc, nr, nc, st);
}
#endif
#endif

}  // namespace moe::cpu::micro
