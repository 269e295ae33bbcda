// Reference RMSNorm and fused cross-entropy + z-loss. Plain loops; statistics (mean square,
// max, sum of exponentials, log-sum-exp) in the tensor's own precision (f32 or f64).
#include <cmath>
#include <vector>

#include "kernels/checks/norm_loss_checks.h"
#include "kernels/host/dtype_dispatch.h"
#include "kernels/host/host_args.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/ref/rounded_output.h"

namespace moe::ref {

// ---------------------------------------------------------------- RMSNorm
void rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, const Tensor& y,
                 const Tensor& rstd) {
  check_host({&x, &w, &y, &rstd}, "rmsnorm_fwd");
  check_rmsnorm_fwd(x, w, y, rstd);
  const RoundedOutput out(y, x.dtype, "rmsnorm_fwd y");
  dispatch_real(x.dtype, "rmsnorm_fwd", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = x.rows(), c = x.cols();
    const T* px = x.as<T>();
    const T* pw = w.as<T>();
    T* py = out.work().as<T>();
    T* pr = rstd.as<T>();
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = px + r * c;
      T ss = 0;
      for (int64_t j = 0; j < c; ++j) ss += xr[j] * xr[j];
      const T rs = T(1) / std::sqrt(ss / static_cast<T>(c) + static_cast<T>(eps));
      pr[r] = rs;
      for (int64_t j = 0; j < c; ++j) py[r * c + j] = xr[j] * rs * pw[j];
    }
  });
  out.finish();
}

void rmsnorm_bwd(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                 const Tensor& dx, const Tensor& dw, bool accumulate) {
  check_host({&dy, &x, &w, &rstd, &dx, &dw}, "rmsnorm_bwd");
  check_rmsnorm_bwd(dy, x, w, rstd, dx, dw, accumulate);
  // A bf16 x (bf16 mode's saved QK-norm input) is widened to f32 first.
  OwnedTensor wide;
  if (x.dtype == DType::kBF16) {
    wide = OwnedTensor(DType::kF32, {x.numel()});
    convert(x.view({x.numel()}), wide);
  }
  const Tensor& xc = wide.t.empty() ? x : wide.t;
  const RoundedOutput out(dx, xc.dtype, "rmsnorm_bwd dx");
  dispatch_real(xc.dtype, "rmsnorm_bwd", [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = x.rows(), c = x.cols();
    const T* pdy = dy.as<T>();
    const T* px = xc.as<T>();
    const T* pw = w.as<T>();
    const T* pr = rstd.as<T>();
    T* pdx = out.work().as<T>();
    T* pdw = dw.as<T>();
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = px + r * c;
      const T* gr = pdy + r * c;
      const T rs = pr[r];
      // y_j = x_j rs w_j, d rs / d x_j = -rs^3 x_j / C.
      T dot = 0;
      for (int64_t j = 0; j < c; ++j) dot += gr[j] * pw[j] * xr[j];
      const T k = rs * rs * rs * dot / static_cast<T>(c);
      for (int64_t j = 0; j < c; ++j) {
        const T g = rs * pw[j] * gr[j] - k * xr[j];
        pdx[r * c + j] = accumulate ? pdx[r * c + j] + g : g;
        pdw[j] += gr[j] * xr[j] * rs;  // rows in order
      }
    }
  });
  out.finish();
}

// ---------------------------------------------------------------- cross-entropy + z-loss
void cross_entropy(const Tensor& logits, const Tensor& labels, double loss_scale, double z_coef,
                   const Tensor& dlogits, const Tensor& row_ce, const Tensor& row_z) {
  check_host({&logits, &labels, &dlogits, &row_ce, &row_z}, "cross_entropy");
  const CrossEntropyDims dims = check_cross_entropy(logits, labels, dlogits, row_ce, row_z);
  const int64_t n = dims.rows, vocab = dims.vocab;
  const int32_t* lab = checked_labels(labels, vocab);
  const RoundedOutput dout(dlogits, logits.dtype, "cross_entropy dlogits");
  dispatch_real(logits.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    const T* px = logits.as<T>();  // may alias pd: each element is read before it is written
    T* pd = dout.work().as<T>();
    T* pce = row_ce.as<T>();
    T* pz = row_z.as<T>();
    const T scale = static_cast<T>(loss_scale), zc2 = static_cast<T>(2 * z_coef);
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = px + r * vocab;
      T* dr = pd + r * vocab;
      const int32_t label = lab[r];
      if (label < 0) {
        for (int64_t j = 0; j < vocab; ++j) dr[j] = 0;
        pce[r] = 0;
        pz[r] = 0;
        continue;
      }
      T mx = xr[0];
      for (int64_t j = 1; j < vocab; ++j) mx = xr[j] > mx ? xr[j] : mx;
      T sum = 0;
      for (int64_t j = 0; j < vocab; ++j) sum += std::exp(xr[j] - mx);
      const T lse = mx + std::log(sum);
      pce[r] = lse - xr[label];
      pz[r] = lse * lse;
      for (int64_t j = 0; j < vocab; ++j) {
        const T p = std::exp(xr[j] - lse);
        const T onehot = j == label ? T(1) : T(0);
        dr[j] = scale * (p - onehot) + scale * zc2 * lse * p;
      }
    }
  });
  dout.finish();
}

}  // namespace moe::ref
