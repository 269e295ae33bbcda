// CPU RMSNorm, SwiGLU and fused cross-entropy + z-loss. OpenMP over rows (or elements), fixed-
// order lane sums inside a row, fp32 statistics for f32 tensors; f64 tensors work too (with
// libm exp). Every reduction's order depends on the shapes only, never on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

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
  check_args({&x, &w, &rstd}, x.dtype, "rmsnorm_fwd");
  check_output_dtype(y, x.dtype, "rmsnorm_fwd y");
  check_norm_shapes(x, w, rstd);
  check_same_shape(x, y, "rmsnorm_fwd x/y");
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
  check_args({&dy, &x, &w, &rstd, &dw}, x.dtype, "rmsnorm_bwd");
  if (accumulate) check_args({&dx}, x.dtype, "rmsnorm_bwd dx (accumulated)");
  else check_output_dtype(dx, x.dtype, "rmsnorm_bwd dx");
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
    T* pdw = dw.as<T>();
    T* part = scratch<T>(static_cast<size_t>(nchunks * c));
    const bool par = n * c >= kParallelMin;
    // Rows of dx: written (D = T or bf16, rounded) or added to (kAdd).
    auto rows = [&](auto* pdx, auto add_tag, int64_t ch) {
      constexpr bool kAdd = decltype(add_tag)::value;
      T* pc = part + ch * c;
      std::fill(pc, pc + c, T(0));
      for (int64_t r = ch * kRowChunk; r < std::min(n, (ch + 1) * kRowChunk); ++r) {
        const T* xr = px + r * c;
        const T* gr = pdy + r * c;
        auto* dr = pdx + r * c;
        const T rs = pr[r];
        const T dot = lane_sum<T>(c, [&](int64_t j) { return gr[j] * pw[j] * xr[j]; });
        const T k = rs * rs * rs * dot / static_cast<T>(c);
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) {
          const T g = rs * pw[j] * gr[j] - k * xr[j];
          if constexpr (kAdd) dr[j] += g;
          else store(dr + j, g);
          pc[j] += gr[j] * xr[j] * rs;
        }
      }
    };
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
      for (int64_t ch = 0; ch < nchunks; ++ch) {
        if (accumulate) rows(dx.as<T>(), std::true_type{}, ch);
        else if constexpr (std::is_same_v<T, float>) {
          if (dx.dtype == DType::kBF16) rows(dx.as<bf16>(), std::false_type{}, ch);
          else rows(dx.as<T>(), std::false_type{}, ch);
        } else {
          rows(dx.as<T>(), std::false_type{}, ch);
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
namespace {
// h = silu(g) u, stored as H (f32 / f64, or bf16 rounded); with copies, g and u rounded to bf16.
template <class T, class H, bool kCopies>
void swiglu_fwd_loop(const T* pg, const T* pu, H* ph, bf16* pgc, bf16* puc, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T gi = pg[i], ui = pu[i];
    store(ph + i, gi / (T(1) + fast_exp(-gi)) * ui);
    if constexpr (kCopies) {
      store(pgc + i, gi);
      store(puc + i, ui);
    }
  }
}
}  // namespace

void swiglu_fwd(const Tensor& g, const Tensor& u, const Tensor& h, const Tensor& g_copy,
                const Tensor& u_copy) {
  check_args({&g, &u}, g.dtype, "swiglu_fwd");
  check_output_dtype(h, g.dtype, "swiglu_fwd h");
  check_same_shape(g, u, "swiglu_fwd g/u");
  check_same_shape(g, h, "swiglu_fwd g/h");
  const bool copies = !g_copy.empty();
  MOE_CHECK(copies == !u_copy.empty(), "swiglu_fwd: g_copy and u_copy are given together");
  if (copies) {
    check_args({&g}, DType::kF32, "swiglu_fwd with copies");
    check_args({&g_copy, &u_copy}, DType::kBF16, "swiglu_fwd copies");
    check_same_shape(g, g_copy, "swiglu_fwd g/g_copy");
    check_same_shape(g, u_copy, "swiglu_fwd g/u_copy");
  }
  const int64_t n = g.numel();
  if (h.dtype == DType::kBF16 && g.dtype == DType::kF32) {
    if (copies) swiglu_fwd_loop<float, bf16, true>(g.as<float>(), u.as<float>(), h.as<bf16>(), g_copy.as<bf16>(), u_copy.as<bf16>(), n);
    else swiglu_fwd_loop<float, bf16, false>(g.as<float>(), u.as<float>(), h.as<bf16>(), nullptr, nullptr, n);
    return;
  }
  dispatch_real(g.dtype, "swiglu_fwd", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      if (copies) {
        swiglu_fwd_loop<T, T, true>(g.as<T>(), u.as<T>(), h.as<T>(), g_copy.as<bf16>(), u_copy.as<bf16>(), n);
        return;
      }
    }
    swiglu_fwd_loop<T, T, false>(g.as<T>(), u.as<T>(), h.as<T>(), nullptr, nullptr, n);
  });
}

namespace {
// One element of the SwiGLU backward; G is the stored type of g and u (bf16 in bf16 mode), O
// that of dg and du (bf16 rounded when they are the next GEMMs' operands).
template <class T, class G, class O>
void swiglu_bwd_loop(const T* pdh, const G* pg, const G* pu, O* pdg, O* pdu, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T gi = static_cast<T>(to_float(pg[i])), ui = static_cast<T>(to_float(pu[i])), dhi = pdh[i];
    const T e = fast_exp(-gi);
    const T sig = T(1) / (T(1) + e);
    // 1 - sig = e sig, exact for g > 0 where 1 - sig would cancel (e < 1 there, no overflow).
    const T one_minus_sig = gi > T(0) ? e * sig : T(1) - sig;
    const T dsilu = sig * (T(1) + gi * one_minus_sig);
    store(pdg + i, dhi * ui * dsilu);
    store(pdu + i, dhi * (gi * sig));
  }
}

template <class G>
void swiglu_bwd_f32(const Tensor& dh, const G* pg, const G* pu, const Tensor& dg, const Tensor& du) {
  if (dg.dtype == DType::kBF16) swiglu_bwd_loop(dh.as<float>(), pg, pu, dg.as<bf16>(), du.as<bf16>(), dh.numel());
  else swiglu_bwd_loop(dh.as<float>(), pg, pu, dg.as<float>(), du.as<float>(), dh.numel());
}
}  // namespace

void swiglu_bwd(const Tensor& dh, const Tensor& g, const Tensor& u, const Tensor& dg,
                const Tensor& du) {
  for (const Tensor* t : {&dh, &u, &dg, &du}) check_same_shape(*t, g, "swiglu_bwd tensors");
  const DType compute = g.dtype == DType::kBF16 ? DType::kF32 : g.dtype;
  check_args({&u}, g.dtype, "swiglu_bwd u");
  check_args({&dh}, compute, "swiglu_bwd dh");
  check_output_dtype(dg, compute, "swiglu_bwd dg");
  check_args({&du}, dg.dtype, "swiglu_bwd du");
  if (g.dtype == DType::kBF16) {  // saved activations in bf16
    swiglu_bwd_f32(dh, g.as<bf16>(), u.as<bf16>(), dg, du);
  } else if (compute == DType::kF32) {
    swiglu_bwd_f32(dh, g.as<float>(), u.as<float>(), dg, du);
  } else {
    check_args({&g}, DType::kF64, "swiglu_bwd g");
    swiglu_bwd_loop(dh.as<double>(), g.as<double>(), u.as<double>(), dg.as<double>(), du.as<double>(), g.numel());
  }
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
  check_args({&logits, &row_ce, &row_z}, logits.dtype, "cross_entropy");
  check_output_dtype(dlogits, logits.dtype, "cross_entropy dlogits");
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
        // The exponentials go to the output row, or to the logits row when the output is rounded
        // (they must stay fp32 until scaled).
        T* er = xr;
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(*dr)>, T>) er = dr;
        const int32_t label = lab[r];
        if (label < 0) {
#pragma omp simd
          for (int64_t j = 0; j < vocab; ++j) store(dr + j, T(0));
          pce[r] = 0;
          pz[r] = 0;
          continue;
        }
        const T mx = lane_max(xr, vocab);
        const T x_label = xr[label];
        const T sum = exp_store_sum(xr, er, vocab, mx);
        const T log_sum = std::log(sum);
        const T lse = mx + log_sum;
        pce[r] = log_sum + (mx - x_label);
        pz[r] = lse * lse;
        const T p_label = er[label] / sum;
        const T coef = scale * (T(1) + zc2 * lse) / sum;
#pragma omp simd
        for (int64_t j = 0; j < vocab; ++j) store(dr + j, er[j] * coef);
        // The label's element as scale ((p - 1) + 2 z lse p): p - 1 is exact when p is near 1
        // (V = 1 gives exactly scale 2 z lse), where p (1 + 2 z lse) - 1 would cancel.
        store(dr + label, scale * ((p_label - T(1)) + zc2 * lse * p_label));
      }
    };
    if constexpr (std::is_same_v<T, float>) {
      if (rounded) return run(dlogits.as<bf16>());
    }
    run(dlogits.as<T>());
  });
}

}  // namespace moe::cpu
