// CPU RMSNorm and fused cross-entropy + z-loss. OpenMP over rows, fixed-order lane sums inside a
// row, fp32 statistics for f32 tensors; f64 tensors work too (with libm exp). Every reduction's
// order depends on the shapes only, never on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/checks/norm_loss_checks.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elem_common.h"
#include "kernels/host/host_args.h"

namespace moe::cpu {
using namespace elem;

namespace {

// rmsnorm_bwd's dw: rows are cut into chunks of this many (whatever the thread count); each
// chunk's partial dw is summed over its rows in order, and partials are added in chunk order.
constexpr int64_t kRowChunk = 16;

// d[j] = bf16(e[j] * coef) for j < n, the label's element apart (its value given), as
// elem::store rounds. Whole 32-byte-aligned blocks of 16 are streamed around the cache: the LM
// head's GEMMs read the gradient from memory anyway at a large vocabulary (103 MB per
// fine_grained micro-batch), and a plain store first reads each line it fills (fine_grained bf16
// cross_entropy -1.3 to -2.5 ms per step, its data and weight gradients no slower).
void scale_round_row(const float* e, bf16* d, int64_t n, float coef, int64_t label, float label_value) {
  int64_t j = 0;
#if defined(__AVX__)
  for (; j < n && reinterpret_cast<uintptr_t>(d + j) % 32 != 0; ++j) store(d + j, e[j] * coef);
  for (; j + 16 <= n; j += 16) {
    uint16_t bits[16];
#pragma omp simd
    for (int l = 0; l < 16; ++l) bits[l] = bf16_bits(e[j + l] * coef);
    if (label >= j && label < j + 16) bits[label - j] = bf16_bits(label_value);
    stream_bf16x16(d + j, bits);  // aligned: the loop above reached a 32-byte boundary
  }
  _mm_sfence();
#endif
  for (; j < n; ++j) store(d + j, e[j] * coef);
  store(d + label, label_value);
}

}  // namespace

// ---------------------------------------------------------------- RMSNorm
void rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, const Tensor& y,
                 const Tensor& rstd) {
  check_host({&x, &w, &y, &rstd}, "rmsnorm_fwd");
  check_rmsnorm_fwd(x, w, y, rstd);
  dispatch_real(x.dtype, "rmsnorm_fwd", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = x.rows(), c = x.cols();
    const T* px = x.as<T>();
    const T* pw = w.as<T>();
    T* pr = rstd.as<T>();
    const T e = static_cast<T>(eps);
    auto run = [&](auto* py) {
#pragma omp parallel for schedule(static) if (n * c >= kParallelMin)
      for (int64_t r = 0; r < n; ++r) {
        const T* xr = px + r * c;
        auto* yr = py + r * c;
        const T ss = lane_sum<T>(c, [&](int64_t j) { return xr[j] * xr[j]; });
        const T rs = T(1) / std::sqrt(ss / static_cast<T>(c) + e);
        pr[r] = rs;
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) store(yr + j, xr[j] * rs * pw[j]);
      }
    };
    if constexpr (std::is_same_v<T, float>) {
      if (y.dtype == DType::kBF16) return run(y.as<bf16>());
    }
    run(y.as<T>());
  });
}

void rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                 const Tensor& dx, const Tensor& dw, bool accumulate) {
  check_host({&dy, &x, &w, &rstd, &dx, &dw}, "rmsnorm_bwd");
  check_rmsnorm_bwd(dy, x, w, rstd, dx, dw, accumulate);
  // A bf16 x (bf16 mode's saved QK-norm input) is read widened: without contraction (this file's
  // flags) the same arithmetic as an f32 x of those values.
  const bool x16 = x.dtype == DType::kBF16;
  dispatch_real(x16 ? DType::kF32 : x.dtype, "rmsnorm_bwd", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = x.rows(), c = x.cols(), nchunks = ceil_div(n, kRowChunk);
    const T* pdy = dy.as<T>();
    const T* pw = w.as<T>();
    const T* pr = rstd.as<T>();
    T* pdw = dw.as<T>();
    T* part = scratch<T>(static_cast<size_t>(nchunks * c));
    const bool par = n * c >= kParallelMin;
    // Rows of dx: written (D = T or bf16, rounded) or added to (kAdd), from x of T or bf16.
    auto rows = [&](const auto* px, auto* pdx, auto add_tag, int64_t ch) {
      constexpr bool kAdd = decltype(add_tag)::value;
      T* pc = part + ch * c;
      std::fill(pc, pc + c, T(0));
      for (int64_t r = ch * kRowChunk; r < std::min(n, (ch + 1) * kRowChunk); ++r) {
        const auto* xr = px + r * c;
        const T* gr = pdy + r * c;
        auto* dr = pdx + r * c;
        const T rs = pr[r];
        const T dot = lane_sum<T>(c, [&](int64_t j) { return gr[j] * pw[j] * static_cast<T>(load(xr[j])); });
        const T k = rs * rs * rs * dot / static_cast<T>(c);
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) {
          const T xj = static_cast<T>(load(xr[j]));
          const T g = rs * pw[j] * gr[j] - k * xj;
          if constexpr (kAdd) dr[j] += g;
          else store(dr + j, g);
          pc[j] += gr[j] * xj * rs;
        }
      }
    };
    auto rows_of = [&](const auto* px, int64_t ch) {
      if (accumulate) rows(px, dx.as<T>(), std::true_type{}, ch);
      else if constexpr (std::is_same_v<T, float>) {
        if (dx.dtype == DType::kBF16) rows(px, dx.as<bf16>(), std::false_type{}, ch);
        else rows(px, dx.as<T>(), std::false_type{}, ch);
      } else {
        rows(px, dx.as<T>(), std::false_type{}, ch);
      }
    };
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
      for (int64_t ch = 0; ch < nchunks; ++ch) {
        if constexpr (std::is_same_v<T, float>) {
          if (x16) {
            rows_of(x.as<bf16>(), ch);
            continue;
          }
        }
        rows_of(x.as<T>(), ch);
      }
      // Column blocks of dw; the partials of each column are added in chunk order, in double.
      constexpr int64_t kCols = 64;
#pragma omp for schedule(static)
      for (int64_t j0 = 0; j0 < c; j0 += kCols) {
        const int64_t j1 = std::min(c, j0 + kCols);
        double acc[kCols] = {};
        for (int64_t ch = 0; ch < nchunks; ++ch) {
          const T* pc = part + ch * c;
          for (int64_t j = j0; j < j1; ++j) acc[j - j0] += static_cast<double>(pc[j]);
        }
        for (int64_t j = j0; j < j1; ++j)
          pdw[j] = static_cast<T>(static_cast<double>(pdw[j]) + acc[j - j0]);
      }
    }
  });
}

// ---------------------------------------------------------------- cross-entropy + z-loss
// Per row, three passes that stay in L2 after the first: max; e = exp(x - max) stored into
// dlogits and summed; dlogits = e * (scale (1 + 2 z lse) / sum), the label's element apart. One
// exp per element. The label's logit is read before the row is overwritten, so dlogits may
// alias logits. The exp pass also asks for the next row in L2 (at a 50k vocabulary a row is 200
// KB from memory, which the max pass would otherwise wait on: -17% of the op on fine_grained).
void cross_entropy(const Tensor& logits, const Tensor& labels, double loss_scale, double z_coef,
                   const Tensor& dlogits, const Tensor& row_ce, const Tensor& row_z) {
  check_host({&logits, &labels, &dlogits, &row_ce, &row_z}, "cross_entropy");
  const CrossEntropyDims dims = check_cross_entropy(logits, labels, dlogits, row_ce, row_z);
  const int64_t n = dims.rows, vocab = dims.vocab;
  const int32_t* lab = checked_labels(labels, vocab);
  const bool rounded = dlogits.dtype != logits.dtype;  // bf16 dlogits
  dispatch_real(logits.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    T* px = logits.as<T>();
    T* pce = row_ce.as<T>();
    T* pz = row_z.as<T>();
    const T scale = static_cast<T>(loss_scale), zc2 = static_cast<T>(2 * z_coef);
    auto run = [&](auto* pd) {
#pragma omp parallel for schedule(static) if (n * vocab >= kParallelMin)
      for (int64_t r = 0; r < n; ++r) {
        T* xr = px + r * vocab;
        auto* dr = pd + r * vocab;
        // The exponentials go to the output row, or, when the output is rounded (they must stay
        // fp32 until scaled), to the thread's row of scratch, which stays in L2: over the logits
        // row they would send it back to memory (fine_grained bf16: -2.5 ms per step).
        T* er = nullptr;
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(*dr)>, T>) er = dr;
        else er = scratch<T>(static_cast<size_t>(vocab));
        const int32_t label = lab[r];
        if (label < 0) {
#pragma omp simd
          for (int64_t j = 0; j < vocab; ++j) store(dr + j, T(0));
          pce[r] = 0;
          pz[r] = 0;
          continue;
        }
        bool ordinary = false;
        const T mx = lane_max_ordinary(xr, vocab, &ordinary);
        const T x_label = xr[label];
        const T sum = exp_store_sum_ahead(xr, er, vocab, mx, r + 1 < n ? xr + vocab : xr, ordinary);
        const T log_sum = std::log(sum);
        const T lse = mx + log_sum;
        pce[r] = log_sum + (mx - x_label);
        pz[r] = lse * lse;
        const T p_label = er[label] / sum;
        const T coef = scale * (T(1) + zc2 * lse) / sum;
        // The label's element as scale ((p - 1) + 2 z lse p): p - 1 is exact when p is near 1
        // (V = 1 gives exactly scale 2 z lse), where p (1 + 2 z lse) - 1 would cancel.
        const T d_label = scale * ((p_label - T(1)) + zc2 * lse * p_label);
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(*dr)>, bf16>) {
          scale_round_row(er, dr, vocab, coef, label, d_label);
        } else {
#pragma omp simd
          for (int64_t j = 0; j < vocab; ++j) store(dr + j, er[j] * coef);
          store(dr + label, d_label);
        }
      }
    };
    if constexpr (std::is_same_v<T, float>) {
      if (rounded) return run(dlogits.as<bf16>());
    }
    run(dlogits.as<T>());
  });
}

}  // namespace moe::cpu
