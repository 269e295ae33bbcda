// Fast MoE routing kernels: OpenMP over tokens (every output row is owned by one iteration), and
// reductions over tokens in fixed-size chunks combined in chunk order, so that results do not
// depend on the thread count. Same semantics as kernels/ref/moe_routing.cpp; the same bits except
// in the score rows (softmax / sigmoid, the z-loss), vectorized here (see "score rows").
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/checks/routing_checks.h"
#include "kernels/cpu/avx512.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elem_common.h"
#include "kernels/host/dtype_dispatch.h"
#include "kernels/host/routing_ops.h"
#include "kernels/math/routing_rows.h"
#include "kernels/ref/ref_ops.h"

namespace moe::cpu {
namespace rows = routing_rows;
namespace {

constexpr int64_t kChunk = 256;  // tokens per reduction chunk (fixed: independent of threads)

// n T's of the calling thread's scratch number kSlot, kept across calls: grown in the first step,
// so later steps allocate nothing. Contents are unspecified (callers initialize what they read).
// OpenMP's pool threads persist, and with them their buffers.
template <class T, int kSlot> T* scratch(int64_t n) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// Repeated selection of the maximum, ties to the lower index, O(K*E): the definition (a NaN is
// chosen only where it is the first expert not yet chosen, since nothing compares greater).
template <class T> void topk_row_by_selection(const T* sel, int64_t E, int64_t K, int32_t* out) {
  uint64_t taken_small = 0;
  char* taken_big = nullptr;
  if (E > 64) {
    taken_big = scratch<char, 0>(E);
    std::fill(taken_big, taken_big + E, char{0});
  }
  for (int64_t j = 0; j < K; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool used = E > 64 ? taken_big[e] != 0 : ((taken_small >> e) & 1u) != 0;
      if (!used && (best < 0 || sel[e] > sel[best])) best = e;
    }
    out[j] = static_cast<int32_t>(best);
    if (E > 64) taken_big[best] = 1;
    else taken_small |= 1ull << best;
  }
}

// The same choice in one pass for K <= kTopkInsertMax (128 experts at top-4: ~4x faster): the K
// best so far kept in the selection's order, value descending and, among equal values, index
// ascending; an expert enters only if strictly greater than the K-th, so a later equal one never
// displaces an earlier one. Without NaNs that is exactly the repeated selection's sequence; a
// row holding a NaN is handed to it.
constexpr int64_t kTopkInsertMax = 16;
template <class T> struct TopkInsert {
  T best[kTopkInsertMax];
  int64_t n = 0;
  // Expert e with score x, in index order.
  void offer(T x, int64_t e, int64_t K, int32_t* out) {
    if (n == K && !(x > best[K - 1])) return;
    int64_t j = n < K ? n++ : K - 1;  // the slot freed: the end, or the K-th (dropped)
    for (; j > 0 && x > best[j - 1]; --j) {
      best[j] = best[j - 1];
      out[j] = out[j - 1];
    }
    best[j] = x;
    out[j] = static_cast<int32_t>(e);
  }
};
template <class T> void topk_row_scalar(const T* sel, int64_t E, int64_t K, int32_t* out) {
  if (K > kTopkInsertMax) return topk_row_by_selection(sel, E, K, out);
  TopkInsert<T> top;
  for (int64_t e = 0; e < E; ++e) {
    const T x = sel[e];
    if (x != x) return topk_row_by_selection(sel, E, K, out);
    top.offer(x, e, K, out);
  }
}
template <class T> void topk_row(const T* sel, int64_t E, int64_t K, int32_t* out) { topk_row_scalar(sel, E, K, out); }
#if defined(__AVX512F__)
// fp32 rows of up to 256 experts, 16 at a time. The K-th largest of the 16 lane maxima (lane l:
// experts l, l+16, ...) is a lower bound of the row's K-th largest value (those K maxima are K
// of the row's experts), so every expert of the top K is >= it: only those candidates, in index
// order, go through the insertion loop, whose choice among them is the choice among the whole
// row (the K best by value, then by lower index). The same result, bit for bit.
template <> void topk_row<float>(const float* sel, int64_t E, int64_t K, int32_t* out) {
  constexpr int64_t kMaxE = 256;
  if (K > kTopkInsertMax || E <= K || E > kMaxE) return topk_row_scalar(sel, E, K, out);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  __m512 lane_max = ninf;
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 live = first_lanes(E - e);
    const __m512 x = _mm512_mask_loadu_ps(ninf, live, sel + e);
    nan |= _mm512_mask_cmp_ps_mask(live, x, x, _CMP_UNORD_Q);
    lane_max = _mm512_mask_max_ps(lane_max, live, lane_max, x);
  }
  if (nan) return topk_row_by_selection(sel, E, K, out);
  // Remove the largest K-1 times (one lane each), then the largest left is the K-th.
  for (int64_t j = 0; j + 1 < K; ++j) {
    const __mmask16 top = _mm512_cmp_ps_mask(lane_max, _mm512_set1_ps(_mm512_reduce_max_ps(lane_max)), _CMP_EQ_OQ);
    lane_max = _mm512_mask_mov_ps(lane_max, static_cast<__mmask16>(top & -top), ninf);
  }
  const __m512 bound = _mm512_set1_ps(_mm512_reduce_max_ps(lane_max));
  alignas(64) float value[kMaxE];
  alignas(64) int32_t index[kMaxE];
  int64_t n = 0;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 live = first_lanes(E - e);
    const __m512 x = _mm512_mask_loadu_ps(ninf, live, sel + e);
    const __mmask16 cand = _mm512_mask_cmp_ps_mask(live, x, bound, _CMP_GE_OQ);
    _mm512_mask_compressstoreu_ps(value + n, cand, x);
    _mm512_mask_compressstoreu_epi32(index + n, cand, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(e))));
    n += std::popcount(static_cast<uint32_t>(cand));
  }
  TopkInsert<float> top;
  int32_t pos[kTopkInsertMax];
  for (int64_t c = 0; c < n; ++c) top.offer(value[c], c, K, pos);
  for (int64_t j = 0; j < K; ++j) out[j] = index[pos[j]];
}
#endif

// routing_ops' loop of rows: split over the OpenMP threads, each with its own scratch.
struct ParallelRows {
  template <class F> void operator()(int64_t n, F&& f) const {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t) f(t);
  }
  template <class S, class F> void with_scratch(int64_t n, int64_t count, F&& f) const {
#pragma omp parallel
    {
      S* scratch_row = scratch<S, 2>(count);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < n; ++t) f(t, scratch_row);
    }
  }
};

// ------------------------------------------------------------------ score rows
// A token's scores, z-loss and their backward over its E logits, vectorized: exp is
// elem::fast_exp (arithmetic only, ~2 ulp) and every sum over experts runs in elem::kLanes
// partial sums combined by a fixed tree, so a row's bits depend on E only (never on the thread
// count or on which of a loop's vector or scalar versions runs: this file builds without
// contraction). The reference (routing_rows.h, std::exp, sums in order) agrees to a few ulp;
// at 128 experts its scalar exp and serial sums were most of the router's element-wise time.

// s = exp(z - max z) / sum.
template <class T> void softmax_row(const T* z, int64_t E, T* s) {
  bool ordinary;  // float rows with AVX-512: no NaN and a finite max leave out exp's clamps
  const T mx = elem::lane_max_ordinary(z, E, &ordinary);
  const T sum = elem::exp_store_sum_ahead(z, s, E, mx, z, ordinary);
  const T inv = T(1) / sum;
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) s[e] *= inv;
}

// s = sigmoid(z) + eps.
template <class T> void sigmoid_row(const T* z, int64_t E, T eps, T* s) {
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) s[e] = T(1) / (T(1) + elem::fast_exp(-z[e])) + eps;
}

// dz += the softmax's backward: s (ds - sum(ds s)).
template <class T> void softmax_bwd_row(const T* ds, const T* s, int64_t E, T* dz) {
  const T dot = elem::lane_sum<T>(E, [&](int64_t e) { return ds[e] * s[e]; });
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) dz[e] += s[e] * (ds[e] - dot);
}

// The row's log-sum-exp.
template <class T> T log_sum_exp_row(const T* z, int64_t E) {
  const T mx = elem::lane_max(z, E);
  return mx + std::log(elem::lane_sum<T>(E, [&](int64_t e) { return elem::fast_exp(z[e] - mx); }));
}

// routing_ops' score rows (the reference's are RefScoreRows).
struct VectorScoreRows {
  template <class T> static void fwd(const T* z, int64_t E, ScoreKind kind, double eps, T* s) {
    if (kind == ScoreKind::kSigmoid) return sigmoid_row(z, E, static_cast<T>(eps), s);
    softmax_row(z, E, s);
  }
  template <class T> static void bwd(const T* ds, const T* s, ScoreKind kind, double eps, int64_t E, T* dz) {
    if (kind == ScoreKind::kSigmoid) return rows::scores_bwd(ds, s, kind, eps, E, dz);  // no reduction: vectorizes
    softmax_bwd_row(ds, s, E, dz);
  }
};

// dz += grad_scale * d (lse^2 / tokens) / dz (routing_rows::z_loss_grad, vectorized).
template <class T> void z_loss_grad_row(const T* z, T lse, double grad_scale, int64_t tokens, int64_t E, T* dz) {
  const T g = static_cast<T>(grad_scale) * T(2) * lse / static_cast<T>(tokens);
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) dz[e] += g * elem::fast_exp(z[e] - lse);
}

#if defined(__AVX512F__)
// The float rows in zmm registers, lane for lane the arithmetic above (the same bits): where a
// row is ordinary (elem::lane_max_ordinary: no NaN, a finite max) every z - max is <= 0 or -inf,
// and so is every z - lse (lse = max + log(sum), sum >= 1: a finite lse is >= every z), so the
// exponentials leave out fast_exp's upper clamp and NaN test (elem::fast_exp16_nonpositive). The
// z-loss is the router's costliest element-wise op (two exponentials per logit): kernels_bench
// 16384 x 128, 2 threads, alternated 3 times, 1.13-1.17 -> 0.93-1.05 ms (softmax 0.69 -> 0.59-0.66).
template <> float log_sum_exp_row<float>(const float* z, int64_t E) {
  bool ordinary;
  const float mx = elem::lane_max_ordinary(z, E, &ordinary);
  const float sum = ordinary ? elem::exp_store_sum_rows<true, false>(z, nullptr, E, mx, z)
                             : elem::exp_store_sum_rows<false, false>(z, nullptr, E, mx, z);
  return mx + std::log(sum);
}
template <bool kNonPositive> void z_loss_grad_lanes(const float* z, float lse, float g, int64_t E, float* dz) {
  const __m512 l = _mm512_set1_ps(lse), gv = _mm512_set1_ps(g);
  for (int64_t e = 0; e < E; e += elem::kLanes) {
    const __mmask16 live = first_lanes(E - e);
    const __m512 x = elem::exp16<kNonPositive>(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, z + e), l));
    _mm512_mask_storeu_ps(dz + e, live, _mm512_add_ps(_mm512_maskz_loadu_ps(live, dz + e), _mm512_mul_ps(gv, x)));
  }
}
template <>
void z_loss_grad_row<float>(const float* z, float lse, double grad_scale, int64_t tokens, int64_t E, float* dz) {
  const float g = static_cast<float>(grad_scale) * 2.0f * lse / static_cast<float>(tokens);
  if (std::isfinite(lse)) return z_loss_grad_lanes<true>(z, lse, g, E, dz);
  z_loss_grad_lanes<false>(z, lse, g, E, dz);
}
#endif

}  // namespace

void router_scores_fwd(const Tensor& logits, ScoreKind kind, double eps, const Tensor& scores) {
  routing_ops::scores_fwd(logits, kind, eps, scores, ParallelRows{}, VectorScoreRows{});
}

void router_scores_bwd(const Tensor& dscores, const Tensor& scores, ScoreKind kind, double eps, const Tensor& dlogits) {
  routing_ops::scores_bwd(dscores, scores, kind, eps, dlogits, ParallelRows{}, VectorScoreRows{});
}

void router_topk(const Tensor& scores, const Tensor& bias, int64_t n_group, int64_t topk_group, const Tensor& expert_idx) {
  const RoutingDims dims = check_router_topk(scores, bias, n_group, topk_group, expert_idx);
  const int64_t N = dims.T, E = dims.E, K = dims.K;
  dispatch_real(scores.dtype, __func__, [&](auto zero) {
    using T = decltype(zero);
    const T* s = scores.as<T>();
    const T* b = bias.empty() ? nullptr : bias.as<T>();
    int32_t* idx = expert_idx.as<int32_t>();
#pragma omp parallel
    {
      T* sel = scratch<T, 1>(E);
      uint32_t* allowed = scratch<uint32_t, 5>((n_group + 31) / 32 + 1);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < N; ++t) {
        const T* row = s + t * E;
        if (b || n_group > 0) {
          for (int64_t e = 0; e < E; ++e) sel[e] = row[e] + (b ? b[e] : T(0));
          row = sel;
        }
        if (n_group > 0) {  // experts outside the chosen groups cannot be chosen
          allowed_groups([&](int64_t e) { return sel[e]; }, E, n_group, topk_group, allowed);
          rows::mask_outside_groups(allowed, E, n_group, sel);
        }
        topk_row(row, E, K, idx + t * K);
      }
    }
  });
}

void router_assign(RouterAssignment kind, uint64_t seed, uint64_t stream, int64_t token_base, int num_experts,
                   const Tensor& expert_idx) {
  routing_ops::assign(kind, seed, stream, token_base, num_experts, expert_idx, ParallelRows{},
                      [](const double* draw, int64_t E, int64_t K, int32_t* out) { topk_row(draw, E, K, out); });
}

void router_gather(const Tensor& scores, const Tensor& expert_idx, const ExpertWeightRule& rule, const Tensor& weights) {
  routing_ops::gather(scores, expert_idx, rule, weights, ParallelRows{});
}

void router_gather_bwd(const Tensor& dweights, const Tensor& scores, const Tensor& expert_idx,
                       const ExpertWeightRule& rule, const Tensor& dscores) {
  routing_ops::gather_bwd(dweights, scores, expert_idx, rule, dscores, ParallelRows{});
}

void router_bias_update(const Tensor& step_counts, double gamma, const Tensor& bias) {
  ref::router_bias_update(step_counts, gamma, bias);  // E values, once per step: nothing to speed up
}

void add_counts(const Tensor& counts, const Tensor& total) { ref::add_counts(counts, total); }
// B small (T*K) integer loop, not hot: the reference's.
void expert_counts(const Tensor& expert_idx, const Tensor& counts) { ref::expert_counts(expert_idx, counts); }

void moe_plan(const Tensor& expert_idx, const Tensor& counts, const Tensor& offsets,
              const Tensor& sorted_slot, const Tensor& slot_pos) {
  check_moe_plan(expert_idx, counts, offsets, sorted_slot, slot_pos);
  const int64_t R = expert_idx.numel(), E = counts.numel();
  const int32_t* idx = expert_idx.as<int32_t>();
  // Parallel stable counting sort: per-chunk histograms, an exclusive scan in (expert, chunk)
  // order, then each chunk scatters its slots in order. The result is the unique stable order.
  const int64_t chunk = 4096, num_chunks = (R + chunk - 1) / chunk;
  const int64_t hist_len = std::max<int64_t>(num_chunks, 1) * E;
  int32_t* hist = scratch<int32_t, 3>(hist_len);
  std::fill(hist, hist + hist_len, 0);
  bool bad = false;
#pragma omp parallel for schedule(static) reduction(|| : bad)
  for (int64_t c = 0; c < num_chunks; ++c) {
    int32_t* h = hist + c * E;
    for (int64_t r = c * chunk; r < std::min(R, (c + 1) * chunk); ++r) {
      if (idx[r] < 0 || idx[r] >= E) { bad = true; continue; }
      ++h[idx[r]];
    }
  }
  if (bad) check_expert_ids(idx, R, E, "moe_plan");  // names the first bad id
  int32_t* cnt = counts.as<int32_t>();
  int32_t* off = offsets.as<int32_t>();
  int32_t running = 0;
  for (int64_t e = 0; e < E; ++e) {
    off[e] = running;
    for (int64_t c = 0; c < num_chunks; ++c) {
      int32_t n = hist[c * E + e];
      hist[c * E + e] = running;
      running += n;
    }
    cnt[e] = running - off[e];
  }
  off[E] = running;
  int32_t* sorted = sorted_slot.as<int32_t>();
  int32_t* pos = slot_pos.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < num_chunks; ++c) {
    int32_t* next = hist + c * E;
    for (int64_t r = c * chunk; r < std::min(R, (c + 1) * chunk); ++r) {
      int32_t p = next[idx[r]]++;
      sorted[p] = static_cast<int32_t>(r);
      pos[r] = p;
    }
  }
}

namespace {
// The permutation's rows are read (or written) in another order than they are stored: at E
// experts a loop over tokens walks E streams of expert rows, more than the hardware prefetchers
// follow (128 experts: the permute and combine phases 10-30% slower than at 8). The gather and
// the two backward loops ask for the rows of the iteration kAhead ahead; the forward combine does
// not (its prefetch measured 3-20% slower: kernels_bench --benchmark_filter=MoePermute).
constexpr int64_t kAhead = 4;
template <int kWrite = 0> inline void prefetch_row(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, kWrite);
}
}  // namespace

void moe_gather(const Tensor& x, const Tensor& sorted_slot, const Tensor& xs) {
  const PermuteDims dims = check_moe_gather(x, sorted_slot, xs);
  const int64_t D = dims.D, K = dims.K, R = dims.T * K;
  const size_t row = static_cast<size_t>(D) * dtype_size(x.dtype);
  const int32_t* sorted = sorted_slot.as<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < R; ++p) {
    if (p + 2 * kAhead < R) prefetch_row(static_cast<const char*>(x.data) + sorted[p + 2 * kAhead] / K * row, row);
    const int64_t t = sorted[p] / K;
    std::memcpy(static_cast<char*>(xs.data) + p * row, static_cast<const char*>(x.data) + t * row, row);
  }
}

void moe_gather_bwd(const Tensor& dxs, const Tensor& slot_pos, const Tensor& dx) {
  const PermuteDims dims = check_moe_gather_bwd(dxs, slot_pos, dx);
  const int64_t T = dims.T, D = dims.D, K = dims.K;
  dispatch_real(dx.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* g = dxs.as<F>();
    F* out = dx.as<F>();
    const int32_t* pos = slot_pos.as<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        if (t + kAhead < T) prefetch_row(g + pos[(t + kAhead) * K + j] * D, sizeof(F) * static_cast<size_t>(D));
        const F* src = g + pos[t * K + j] * D;
        F* dst = out + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] += src[d];
      }
  });
}

void moe_combine(const Tensor& ys, const Tensor& slot_pos, const Tensor& weights, const Tensor& out,
                 bool accumulate) {
  const PermuteDims dims = check_moe_combine(ys, slot_pos, weights, out);
  const int64_t T = dims.T, D = dims.D, K = dims.K;
  dispatch_real(out.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* y = ys.as<F>();
    const F* w = weights.as<F>();
    const int32_t* pos = slot_pos.as<int32_t>();
    F* o = out.as<F>();
    // Each element in the reference's order (0, then + w_j y_j for j in order, then onto out when
    // accumulating), every product and sum rounded (this file compiles without contraction);
    // 16 elements at a time, the loop over j outside the lanes (a per-element j loop kept the
    // compiler scalar: 2.5 ms of an olmoe_compat bf16 step, now 0.7-1.0).
    constexpr int64_t kW = 16;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      F* dst = o + t * D;
      int64_t d0 = 0;
      for (; d0 + kW <= D; d0 += kW) {
        F acc[kW] = {};
        for (int64_t j = 0; j < K; ++j) {
          const F wj = w[t * K + j];
          const F* yj = y + pos[t * K + j] * D + d0;
#pragma omp simd
          for (int64_t l = 0; l < kW; ++l) acc[l] += wj * yj[l];
        }
#pragma omp simd
        for (int64_t l = 0; l < kW; ++l) dst[d0 + l] = accumulate ? dst[d0 + l] + acc[l] : acc[l];
      }
      for (int64_t d = d0; d < D; ++d) {
        F acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += w[t * K + j] * y[pos[t * K + j] * D + d];
        dst[d] = accumulate ? dst[d] + acc : acc;
      }
    }
  });
}

void moe_combine_bwd(const Tensor& dout, const Tensor& ys, const Tensor& slot_pos,
                     const Tensor& weights, const Tensor& dys, const Tensor& dweights) {
  const PermuteDims dims = check_moe_combine_bwd(dout, ys, slot_pos, weights, dys, dweights);
  const int64_t T = dims.T, D = dims.D, K = dims.K;
  // ys may be stored in bf16 (bf16 mode's saved expert outputs); gradients stay in F, except dys,
  // which may be bf16 (rounded as it is stored: the experts' GEMM operand).
  auto run = [&](auto zero, auto ys_zero, auto* dy) {
    using F = decltype(zero);
    using Y = decltype(ys_zero);
    const F* g = dout.as<F>();
    const Y* y = ys.as<Y>();
    const F* w = weights.as<F>();
    const int32_t* pos = slot_pos.as<int32_t>();
    F* dw = dweights.as<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        if (t + kAhead < T) {
          const int64_t q = pos[(t + kAhead) * K + j];
          prefetch_row(y + q * D, sizeof(Y) * static_cast<size_t>(D));
          prefetch_row<1>(dy + q * D, sizeof(*dy) * static_cast<size_t>(D));
        }
        const int64_t p = pos[t * K + j];
        const F wt = w[t * K + j];
        F dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) {
          elem::store(dy + p * D + d, wt * g[t * D + d]);
          dot += g[t * D + d] * static_cast<F>(to_float(y[p * D + d]));
        }
        dw[t * K + j] = dot;
      }
  };
  if (dys.dtype == DType::kBF16) {
    check_dtype(dout, DType::kF32, "moe_combine_bwd dout (dys in bf16)");
    if (ys.dtype == DType::kBF16) run(float{}, bf16{}, dys.as<bf16>());
    else run(float{}, float{}, dys.as<bf16>());
  } else if (ys.dtype == DType::kBF16) {
    check_dtype(dout, DType::kF32, "moe_combine_bwd dout");
    run(float{}, bf16{}, dys.as<float>());
  } else {
    dispatch_real(dout.dtype, __func__, [&](auto zero) { run(zero, zero, dys.as<decltype(zero)>()); });
  }
}

void load_balance_loss(const Tensor& scores, const Tensor& counts, ScoreKind kind, int top_k,
                       double value_scale, double grad_scale, const Tensor& out,
                       const Tensor& dscores, const Tensor& mean_prob) {
  const RoutingDims dims = check_load_balance_loss(scores, counts, kind, top_k, out, dscores, mean_prob);
  const int64_t T = dims.T, E = dims.E;
  dispatch_real(scores.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* s = scores.as<F>();
    const int32_t* c = counts.as<int32_t>();
    F* ds = dscores.empty() ? nullptr : dscores.as<F>();
    F* P = mean_prob.as<F>();
    F* f = scratch<F, 4>(E);
    rows::expert_fractions(c, E, top_k, T, f);
    const int64_t num_chunks = (T + kChunk - 1) / kChunk;
    F* partial = scratch<F, 5>(num_chunks * E);
    std::fill(partial, partial + num_chunks * E, F(0));
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < num_chunks; ++ch) {
      F* acc = partial + ch * E;
      for (int64_t t = ch * kChunk; t < std::min(T, (ch + 1) * kChunk); ++t) rows::add_score_shares(s + t * E, kind, E, acc);
    }
    F loss = 0;
    for (int64_t e = 0; e < E; ++e) {
      F sum = 0;
      for (int64_t ch = 0; ch < num_chunks; ++ch) sum += partial[ch * E + e];
      P[e] = sum / static_cast<F>(T);
      loss += f[e] * P[e];
    }
    out.as<double>()[0] += value_scale * static_cast<double>(static_cast<F>(E) * loss);
    if (!ds) return;
    const F gscale = static_cast<F>(grad_scale) * static_cast<F>(E) / static_cast<F>(T);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) rows::load_balance_grad(s + t * E, f, kind, gscale, E, ds + t * E);
  });
}

void router_z_loss(const Tensor& logits, double value_scale, double grad_scale, const Tensor& out,
                   const Tensor& dlogits) {
  const RoutingDims dims = check_router_z_loss(logits, out, dlogits);
  const int64_t T = dims.T, E = dims.E;
  dispatch_real(logits.dtype, __func__, [&](auto zero) {
    using F = decltype(zero);
    const F* z = logits.as<F>();
    F* dz = dlogits.empty() ? nullptr : dlogits.as<F>();
    const int64_t num_chunks = (T + kChunk - 1) / kChunk;
    double* partial = scratch<double, 6>(num_chunks);
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < num_chunks; ++ch) {
      double acc = 0;
      for (int64_t t = ch * kChunk; t < std::min(T, (ch + 1) * kChunk); ++t) {
        const F lse = log_sum_exp_row(z + t * E, E);
        acc += static_cast<double>(lse) * static_cast<double>(lse);
        if (dz) z_loss_grad_row(z + t * E, lse, grad_scale, T, E, dz + t * E);
      }
      partial[ch] = acc;
    }
    double total = 0;
    for (int64_t ch = 0; ch < num_chunks; ++ch) total += partial[ch];
    out.as<double>()[0] += value_scale * total / static_cast<double>(T);
  });
}

}  // namespace moe::cpu
