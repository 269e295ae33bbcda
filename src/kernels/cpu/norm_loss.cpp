// CPU RMSNorm, SwiGLU and fused cross-entropy + z-loss. OpenMP over rows (or elements), fixed-
// order lane sums inside a row, fp32 statistics for f32 tensors; f64 tensors work too (with
// libm exp). Every reduction's order depends on the shapes only, never on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elem_common.h"

namespace moe::cpu {
using namespace elem;

namespace {

void check_norm_shapes(const Tensor& x, const Tensor& w, const Tensor& rstd) {
  MOE_CHECK(x.ndim >= 1, "rmsnorm: x must have at least one dimension");
  check_shape(w, {x.cols()}, "rmsnorm w");
  check_shape(rstd, {x.rows()}, "rmsnorm rstd");
}

// rmsnorm_bwd's dw: rows are cut into chunks of this many (whatever the thread count); each
// chunk's partial dw is summed over its rows in order, and partials are added in chunk order.
constexpr int64_t kRowChunk = 16;

}  // namespace

// ---------------------------------------------------------------- RMSNorm
void rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, const Tensor& y,
                 const Tensor& rstd) {
  check_args({&x, &w, &y, &rstd}, x.dtype, "rmsnorm_fwd");
  check_norm_shapes(x, w, rstd);
  check_same_shape(x, y, "rmsnorm_fwd x/y");
  dispatch_real(x.dtype, "rmsnorm_fwd", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = x.rows(), c = x.cols();
    const T* px = x.as<T>();
    const T* pw = w.as<T>();
    T* py = y.as<T>();
    T* pr = rstd.as<T>();
    const T e = static_cast<T>(eps);
#pragma omp parallel for schedule(static) if (n * c >= kParallelMin)
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = px + r * c;
      T* yr = py + r * c;
      const T ss = lane_sum<T>(c, [&](int64_t j) { return xr[j] * xr[j]; });
      const T rs = T(1) / std::sqrt(ss / static_cast<T>(c) + e);
      pr[r] = rs;
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) yr[j] = xr[j] * rs * pw[j];
    }
  });
}

void rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                 const Tensor& dx, const Tensor& dw) {
  check_args({&dy, &x, &w, &rstd, &dx, &dw}, x.dtype, "rmsnorm_bwd");
  check_norm_shapes(x, w, rstd);
  check_same_shape(x, dy, "rmsnorm_bwd x/dy");
  check_same_shape(x, dx, "rmsnorm_bwd x/dx");
  check_same_shape(w, dw, "rmsnorm_bwd w/dw");
  dispatch_real(x.dtype, "rmsnorm_bwd", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = x.rows(), c = x.cols(), nchunks = ceil_div(n, kRowChunk);
    const T* pdy = dy.as<T>();
    const T* px = x.as<T>();
    const T* pw = w.as<T>();
    const T* pr = rstd.as<T>();
    T* pdx = dx.as<T>();
    T* pdw = dw.as<T>();
    T* part = scratch<T>(static_cast<size_t>(nchunks * c));
    const bool par = n * c >= kParallelMin;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
      for (int64_t ch = 0; ch < nchunks; ++ch) {
        T* pc = part + ch * c;
        std::fill(pc, pc + c, T(0));
        for (int64_t r = ch * kRowChunk; r < std::min(n, (ch + 1) * kRowChunk); ++r) {
          const T* xr = px + r * c;
          const T* gr = pdy + r * c;
          T* dr = pdx + r * c;
          const T rs = pr[r];
          const T dot = lane_sum<T>(c, [&](int64_t j) { return gr[j] * pw[j] * xr[j]; });
          const T k = rs * rs * rs * dot / static_cast<T>(c);
#pragma omp simd
          for (int64_t j = 0; j < c; ++j) {
            dr[j] = rs * pw[j] * gr[j] - k * xr[j];
            pc[j] += gr[j] * xr[j] * rs;
          }
        }
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

// ---------------------------------------------------------------- SwiGLU
void swiglu_fwd(const Tensor& g, const Tensor& u, const Tensor& h) {
  check_args({&g, &u, &h}, g.dtype, "swiglu_fwd");
  check_same_shape(g, u, "swiglu_fwd g/u");
  check_same_shape(g, h, "swiglu_fwd g/h");
  dispatch_real(g.dtype, "swiglu_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = g.as<T>();
    const T* pu = u.as<T>();
    T* ph = h.as<T>();
    const int64_t n = g.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) ph[i] = pg[i] / (T(1) + fast_exp(-pg[i])) * pu[i];
  });
}

namespace {
// One element of the SwiGLU backward; G is the stored type of g and u (bf16 in bf16 mode).
template <class T, class G>
void swiglu_bwd_loop(const T* pdh, const G* pg, const G* pu, T* pdg, T* pdu, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T gi = static_cast<T>(to_float(pg[i])), ui = static_cast<T>(to_float(pu[i])), dhi = pdh[i];
    const T e = fast_exp(-gi);
    const T sig = T(1) / (T(1) + e);
    // 1 - sig = e sig, exact for g > 0 where 1 - sig would cancel (e < 1 there, no overflow).
    const T one_minus_sig = gi > T(0) ? e * sig : T(1) - sig;
    const T dsilu = sig * (T(1) + gi * one_minus_sig);
    pdg[i] = dhi * ui * dsilu;
    pdu[i] = dhi * (gi * sig);
  }
}
}  // namespace

void swiglu_bwd(const Tensor& dh, const Tensor& g, const Tensor& u, const Tensor& dg,
                const Tensor& du) {
  for (const Tensor* t : {&dh, &u, &dg, &du}) check_same_shape(*t, g, "swiglu_bwd tensors");
  if (g.dtype == DType::kBF16) {  // saved activations in bf16, gradients in f32
    check_args({&g, &u}, DType::kBF16, "swiglu_bwd");
    check_args({&dh, &dg, &du}, DType::kF32, "swiglu_bwd");
    swiglu_bwd_loop(dh.as<float>(), g.as<bf16>(), u.as<bf16>(), dg.as<float>(), du.as<float>(), g.numel());
    return;
  }
  check_args({&dh, &g, &u, &dg, &du}, g.dtype, "swiglu_bwd");
  dispatch_real(g.dtype, "swiglu_bwd", [&](auto tag) {
    using T = decltype(tag);
    swiglu_bwd_loop(dh.as<T>(), g.as<T>(), u.as<T>(), dg.as<T>(), du.as<T>(), g.numel());
  });
}

// ---------------------------------------------------------------- cross-entropy + z-loss
namespace {
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
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}
}  // namespace

// Per row, three passes that stay in L2 after the first: max; e = exp(x - max) stored into
// dlogits and summed; dlogits = e * (scale (1 + 2 z lse) / sum), the label's element apart. One
// exp per element. The label's logit is read before the row is overwritten, so dlogits may
// alias logits.
void cross_entropy(const Tensor& logits, const Tensor& labels, double loss_scale, double z_coef,
                   const Tensor& dlogits, const Tensor& row_ce, const Tensor& row_z) {
  check_args({&logits, &dlogits, &row_ce, &row_z}, logits.dtype, "cross_entropy");
  check_args({&labels}, DType::kI32, "cross_entropy labels");
  check_shape(logits, {-1, -1}, "cross_entropy logits");
  const int64_t n = logits.dim(0), vocab = logits.dim(1);
  check_same_shape(logits, dlogits, "cross_entropy logits/dlogits");
  check_shape(labels, {n}, "cross_entropy labels");
  check_shape(row_ce, {n}, "cross_entropy row_ce");
  check_shape(row_z, {n}, "cross_entropy row_z");
  const int32_t* lab = labels.as<int32_t>();
  for (int64_t r = 0; r < n; ++r)
    MOE_CHECK(lab[r] < vocab, "cross_entropy: label ", lab[r], " at row ", r,
              " is out of range for vocab size ", vocab);
  dispatch_real(logits.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    const T* px = logits.as<T>();
    T* pd = dlogits.as<T>();
    T* pce = row_ce.as<T>();
    T* pz = row_z.as<T>();
    const T scale = static_cast<T>(loss_scale), zc2 = static_cast<T>(2 * z_coef);
#pragma omp parallel for schedule(static) if (n * vocab >= kParallelMin)
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = px + r * vocab;
      T* dr = pd + r * vocab;
      const int32_t label = lab[r];
      if (label < 0) {
        std::fill(dr, dr + vocab, T(0));
        pce[r] = 0;
        pz[r] = 0;
        continue;
      }
      const T mx = lane_max(xr, vocab);
      const T x_label = xr[label];
      const T sum = exp_store_sum(xr, dr, vocab, mx);
      const T log_sum = std::log(sum);
      const T lse = mx + log_sum;
      pce[r] = log_sum + (mx - x_label);
      pz[r] = lse * lse;
      const T p_label = dr[label] / sum;
      const T coef = scale * (T(1) + zc2 * lse) / sum;
#pragma omp simd
      for (int64_t j = 0; j < vocab; ++j) dr[j] *= coef;
      // The label's element as scale ((p - 1) + 2 z lse p): p - 1 is exact when p is near 1
      // (V = 1 gives exactly scale 2 z lse), where p (1 + 2 z lse) - 1 would cancel.
      dr[label] = scale * ((p_label - T(1)) + zc2 * lse * p_label);
    }
  });
}

}  // namespace moe::cpu
