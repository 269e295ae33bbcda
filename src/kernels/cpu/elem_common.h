// Helpers shared by the CPU elementwise / norm / loss kernels (elementwise.cpp, norm_loss.cpp):
// dtype dispatch, branch-free bf16 conversion, fixed-order lane sums, a vectorizable expf and
// per-thread scratch. Internal to kernels/cpu.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/avx512.h"
#if defined(__AVX__) && !defined(__AVX512F__)
#include <immintrin.h>  // stream_bf16x16 (avx512.h reads it only for AVX-512)
#endif
#include "kernels/host/dtype_dispatch.h"

namespace moe::cpu::elem {

// Work below this many elements runs on the calling thread (an OpenMP region costs ~ microseconds).
constexpr int64_t kParallelMin = 1 << 15;

template <class T> struct compute { using type = T; };
template <> struct compute<bf16> { using type = float; };
template <class T> using compute_t = typename compute<T>::type;

// bf16 <-> f32 without branches (vectorizes); identical to core/bf16.h, NaN stays a quiet NaN.
inline uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
inline float load(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }
inline float load(float x) { return x; }
inline double load(double x) { return x; }
inline void store(bf16* p, float v) { p->bits = bf16_bits(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(double* p, double v) { *p = v; }

// Sum of f(i), i in [0, n), in kLanes interleaved partial sums (a vector register's worth)
// combined by a fixed tree: the order depends on n only, never on threads or alignment.
constexpr int kLanes = 16;
// The fixed tree every lane sum ends with: halves added pairwise, lane 0 last.
template <class A> inline A tree_sum(A (&acc)[kLanes]) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}
template <class A, class F> inline A lane_sum(int64_t n, F f) {
  A acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += f(i + l);
  for (int l = 0; i + l < n; ++l) acc[l] += f(i + l);
  return tree_sum(acc);
}

// Max of x[0..n) (n >= 1) in lanes; NaN is not propagated here (the exp sum carries it).
template <class T> inline T lane_max(const T* x, int64_t n) {
  T acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = x[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  for (int l = 0; i + l < n; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  T m = acc[0];
  for (int l = 1; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return m;
}

// expf from arithmetic only, so loops over it vectorize (Cephes polynomial on
// r = x - n ln2, |r| <= ln2/2; max error ~2 ulp against glibc expf). exp(x) = 0 for
// x < -86.5 (true value < 3e-38), inf above 88.72; NaN in, NaN out. Its constants, shared with
// the zmm version below (fast_exp16), which must give the same bits:
struct ExpF {
  static constexpr float kHi = 88.7228391f, kLo = -86.5f;
  static constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  static constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = -0.693359375f, kLn2Lo = 2.12194440e-4f;
  static constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                         kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
};
inline float fast_exp(float x) {
  const float kHi = ExpF::kHi, kLo = ExpF::kLo, shifter = ExpF::kShifter;
  float xc = x > kHi ? kHi : x;
  xc = xc < kLo ? kLo : xc;
  // Explicit FMAs: the kernels build without contraction (CMakeLists.txt), so these are the
  // only fused operations, the same in the vector and scalar versions of every loop.
  const float t = std::fma(xc, ExpF::kLog2e, shifter);
  const int32_t n = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(shifter);
  const float fn = t - shifter;
  float r = std::fma(fn, ExpF::kLn2Hi, xc);
  r = std::fma(fn, ExpF::kLn2Lo, r);
  // Written out: a loop over an array of the coefficients kept the callers' loops (SwiGLU) from
  // vectorizing.
  float p = std::fma(ExpF::kP0, r, ExpF::kP1);
  p = std::fma(p, r, ExpF::kP2);
  p = std::fma(p, r, ExpF::kP3);
  p = std::fma(p, r, ExpF::kP4);
  p = std::fma(p, r, ExpF::kP5);
  p = std::fma(p * r, r, r) + 1.0f;
  // 2^n as 2^(n-1) * 2 so that n = 128 (x near the top) does not overflow the exponent field.
  const float scale = std::bit_cast<float>(static_cast<uint32_t>(n + 126) << 23);
  float y = p * scale * 2.0f;
  y = x < kLo ? 0.0f : y;
  y = x > kHi ? INFINITY : y;
  return x != x ? x : y;
}
inline double fast_exp(double x) { return std::exp(x); }

// e[j] = exp(x[j] - mx) written to d (which may be x itself), returning sum(e) in kLanes
// partial sums combined by a fixed tree. Each block of kLanes loads before it stores, so the
// exact in-place alias d == x vectorizes without an overlap check.
template <class T> T exp_store_sum(const T* x, T* d, int64_t n, T mx) {
  T acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    T e[kLanes];
    for (int l = 0; l < kLanes; ++l) e[l] = fast_exp(x[j + l] - mx);
    for (int l = 0; l < kLanes; ++l) {
      d[j + l] = e[l];
      acc[l] += e[l];
    }
  }
  for (int l = 0; j + l < n; ++l) {
    const T e = fast_exp(x[j + l] - mx);
    d[j + l] = e;
    acc[l] += e;
  }
  return tree_sum(acc);
}

#if defined(__AVX512F__)
// The float versions of the two row passes above, lane for lane the same arithmetic (so the same
// bits) in zmm registers: the compiler keeps lane_max's loop scalar (one vmaxss per element) and
// stores exp_store_sum's exponentials in five pieces per 16, the passes of a cross-entropy row.
// fast_exp's arithmetic on xc already clamped to [kLo, kHi].
inline __m512 exp16_clamped(__m512 xc) {
  const __m512 shifter = _mm512_set1_ps(ExpF::kShifter);
  const __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(ExpF::kLog2e), shifter);
  const __m512i n = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(shifter));
  const __m512 fn = _mm512_sub_ps(t, shifter);
  __m512 r = _mm512_fmadd_ps(fn, _mm512_set1_ps(ExpF::kLn2Hi), xc);
  r = _mm512_fmadd_ps(fn, _mm512_set1_ps(ExpF::kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(ExpF::kP0), r, _mm512_set1_ps(ExpF::kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpF::kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpF::kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpF::kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpF::kP5));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(126)), 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, scale), _mm512_set1_ps(2.0f));
}
inline __m512 fast_exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(ExpF::kHi), lo = _mm512_set1_ps(ExpF::kLo);
  const __mmask16 above = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), below = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  __m512 xc = _mm512_mask_mov_ps(x, above, hi);
  xc = _mm512_mask_mov_ps(xc, _mm512_cmp_ps_mask(xc, lo, _CMP_LT_OQ), lo);
  __m512 y = exp16_clamped(xc);
  y = _mm512_mask_mov_ps(y, below, _mm512_setzero_ps());
  y = _mm512_mask_mov_ps(y, above, _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
// fast_exp16 where no lane is above kHi or NaN (x - max over an ordinary row: <= 0, or -inf): the
// same bits with five of its instructions left out (a third of a cross-entropy's exp pass).
inline __m512 fast_exp16_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(ExpF::kLo);
  const __mmask16 below = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  return _mm512_mask_mov_ps(exp16_clamped(_mm512_max_ps(x, lo)), below, _mm512_setzero_ps());
}

// vmaxps(x, acc) is x > acc ? x : acc, lane by lane, NaN and signed zeros included. *ordinary:
// whether the row has no NaN and a finite max, so that every x - max is <= 0 or -inf, never NaN.
inline float lane_max_ordinary(const float* x, int64_t n, bool* ordinary) {
  __m512 acc = _mm512_set1_ps(x[0]);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc = _mm512_max_ps(v, acc);
  }
  const __mmask16 tail = first_lanes(n - i);
  const __m512 v = _mm512_maskz_loadu_ps(tail, x + i);
  nan |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
  acc = _mm512_mask_max_ps(acc, tail, v, acc);
  float a[kLanes];
  _mm512_storeu_ps(a, acc);
  float m = a[0];
  for (int l = 1; l < kLanes; ++l) m = a[l] > m ? a[l] : m;
  *ordinary = nan == 0 && std::isfinite(m);
  return m;
}
template <> inline float lane_max<float>(const float* x, int64_t n) {
  bool ordinary;
  return lane_max_ordinary(x, n, &ordinary);
}

// fast_exp16, or where every lane is known <= 0 or -inf (kNonPositive) fast_exp16_nonpositive.
template <bool kNonPositive> inline __m512 exp16(__m512 v) {
  return kNonPositive ? fast_exp16_nonpositive(v) : fast_exp16(v);
}

// exp_store_sum that also asks for next[0, n) in L2, a line per 16 values, while the exponentials
// keep the cores busy: the next cross-entropy row, whose max pass would otherwise wait on memory.
// ordinary (lane_max_ordinary's, mx its max): the exponentials by fast_exp16_nonpositive. Without
// kStore only their sum (d unused): a log-sum-exp's pass.
template <bool kNonPositive, bool kStore = true>
float exp_store_sum_rows(const float* x, float* d, int64_t n, float mx, const float* next) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(next + j), _MM_HINT_T1);
    const __m512 e = exp16<kNonPositive>(_mm512_sub_ps(_mm512_loadu_ps(x + j), m));
    if constexpr (kStore) _mm512_storeu_ps(d + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  const __mmask16 tail = first_lanes(n - j);
  const __m512 e = exp16<kNonPositive>(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + j), m));
  if constexpr (kStore) _mm512_mask_storeu_ps(d + j, tail, e);
  acc = _mm512_mask_add_ps(acc, tail, acc, e);
  float a[kLanes];
  _mm512_storeu_ps(a, acc);
  return tree_sum(a);
}
inline float exp_store_sum_ahead(const float* x, float* d, int64_t n, float mx, const float* next, bool ordinary) {
  return ordinary ? exp_store_sum_rows<true>(x, d, n, mx, next) : exp_store_sum_rows<false>(x, d, n, mx, next);
}
template <> inline float exp_store_sum<float>(const float* x, float* d, int64_t n, float mx) {
  return exp_store_sum_rows<false>(x, d, n, mx, x);
}
#endif
// Elsewhere (other dtypes, no AVX-512) the plain passes: no row is taken as ordinary.
template <class T> T lane_max_ordinary(const T* x, int64_t n, bool* ordinary) {
  *ordinary = false;
  return lane_max(x, n);
}
template <class T> T exp_store_sum_ahead(const T* x, T* d, int64_t n, T mx, const T*, bool) {
  return exp_store_sum(x, d, n, mx);
}

#if defined(__AVX__)
// 16 bf16 values (their bits) written around the cache when d is 32-byte aligned; returns whether
// it wrote them. For outputs nothing reads soon: a plain store first reads the line it fills. The
// writer fences (_mm_sfence) after its last.
inline bool stream_bf16x16(bf16* d, const uint16_t* bits) {
  if (reinterpret_cast<uintptr_t>(d) % 32 != 0) return false;
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits)));
  return true;
}
#endif

// Per-thread scratch owned by the calling thread, grown on demand and reused across calls, so
// steady-state training does not allocate. Only the thread that calls an op touches it.
template <class T> T* scratch(size_t n, int slot = 0) {
  thread_local std::vector<T> buf[2];
  if (buf[slot].size() < n) buf[slot].resize(n);
  return buf[slot].data();
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace moe::cpu::elem
