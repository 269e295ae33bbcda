// CUDA RMSNorm and fused cross-entropy + z-loss (contracts: kernels/op_list.inc; reference:
// kernels/ref/norm_loss.cpp). One block per row; statistics in fp32 with block reductions in a
// fixed order; the weight gradient sums rows in fixed chunks, then the chunks in order.
#include "kernels/checks/norm_loss_checks.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowChunks = 128;  // dw partial sums: rows in at most this many chunks

__device__ __forceinline__ float rstd_of(float ss, int64_t c, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(c)), eps)));
}

template <class Y>
__global__ void rmsnorm_fwd_kernel(const float* x, const float* w, float eps, Y* y, float* rstd, int64_t n, int64_t c) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * c;
    float ss = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) ss = __fmaf_rn(xr[j], xr[j], ss);
    ss = block_sum(ss);
    const float rs = rstd_of(ss, c, eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) store(y + r * c + j, __fmul_rn(__fmul_rn(xr[j], rs), w[j]));
  }
}

// X: x's storage (f32, or bf16: bf16 mode's saved QK-norm input).
template <class X, class D>
__global__ void rmsnorm_bwd_dx_kernel(const float* dy, const X* x, const float* w, const float* rstd, D* dx,
                                      int64_t n, int64_t c, bool accumulate) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const X* xr = x + r * c;
    const float* gr = dy + r * c;
    const float rs = rstd[r];
    float dot = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) dot = __fmaf_rn(__fmul_rn(gr[j], w[j]), load(xr + j), dot);
    dot = block_sum(dot);
    const float k = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(rs, rs), rs), dot), static_cast<float>(c));
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float g = __fsub_rn(__fmul_rn(__fmul_rn(rs, w[j]), gr[j]), __fmul_rn(k, load(xr + j)));
      D* o = dx + r * c + j;
      store(o, accumulate ? __fadd_rn(load(o), g) : g);
    }
  }
}

// partial[p, j] = sum over rows of chunk p of dy[r,j] * x[r,j] * rstd[r], rows in order.
template <class X>
__global__ void rmsnorm_dw_parts_kernel(const float* dy, const X* x, const float* rstd, int64_t n, int64_t c,
                                        int chunks, float* partial) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int p = blockIdx.y;
  if (j >= c) return;
  const int64_t per = (n + chunks - 1) / chunks, r0 = p * per, r1 = r0 + per < n ? r0 + per : n;
  float acc = 0;
  for (int64_t r = r0; r < r1; ++r) acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(dy[r * c + j], load(x + r * c + j)), rstd[r]));
  partial[p * c + j] = acc;
}

__global__ void rmsnorm_dw_finish_kernel(const float* partial, int chunks, int64_t c, float* dw) {
  MOE_GRID_LOOP(j, c) {
    float acc = 0;
    for (int p = 0; p < chunks; ++p) acc = __fadd_rn(acc, partial[p * c + j]);
    dw[j] = __fadd_rn(dw[j], acc);
  }
}

template <class D>
__global__ void cross_entropy_kernel(const float* logits, const int32_t* labels, float scale, float zc2, D* dlogits,
                                     float* row_ce, float* row_z, int64_t n, int64_t vocab, DeviceError* err) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = logits + r * vocab;
    D* dr = dlogits + r * vocab;
    const int32_t label = labels[r];
    if (label < 0 || label >= vocab) {
      if (label >= vocab && threadIdx.x == 0) report_error(err, err_code(OpId::cross_entropy), label, r);
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) store(dr + j, 0.0f);
      if (threadIdx.x == 0) row_ce[r] = row_z[r] = 0;
      continue;
    }
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, xr[j]);
    mx = block_max(mx);
    float sum = 0;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) sum = __fadd_rn(sum, expf(__fsub_rn(xr[j], mx)));
    sum = block_sum(sum);
    const float lse = __fadd_rn(mx, logf(sum));
    const float target = xr[label];  // read before any thread overwrites it (dlogits may alias logits)
    __syncthreads();
    if (threadIdx.x == 0) {
      row_ce[r] = __fsub_rn(lse, target);
      row_z[r] = __fmul_rn(lse, lse);
    }
    const float zl = __fmul_rn(__fmul_rn(scale, zc2), lse);
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      const float p = expf(__fsub_rn(xr[j], lse));
      const float onehot = j == label ? 1.0f : 0.0f;
      store(dr + j, __fadd_rn(__fmul_rn(scale, __fsub_rn(p, onehot)), __fmul_rn(zl, p)));
    }
    __syncthreads();
  }
}

unsigned row_blocks(int64_t n) { return static_cast<unsigned>(n < 65535 * 4 ? n : 65535 * 4); }

}  // namespace

void rmsnorm_fwd(Context& ctx, const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd) {
  check_device({&x, &w, &y, &rstd}, "rmsnorm_fwd");
  check_rmsnorm_fwd(x, w, y, rstd);
  require_f32(x, "rmsnorm_fwd");
  const int64_t n = x.rows(), c = x.cols();
  if (n == 0) return;
  dispatch_storage(y.dtype, "rmsnorm_fwd y", [&](auto* tag) {
    using Y = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_fwd_kernel<<<row_blocks(n), kThreads, 0, ctx.stream>>>(ptr<const float>(x), ptr<const float>(w),
                                                                   static_cast<float>(eps), ptr<Y>(y), ptr<float>(rstd), n, c);
  });
  check_launch("rmsnorm_fwd");
}

void rmsnorm_bwd(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                 const Tensor& dw, bool accumulate) {
  check_device({&dy, &x, &w, &rstd, &dx, &dw}, "rmsnorm_bwd");
  check_rmsnorm_bwd(dy, x, w, rstd, dx, dw, accumulate);
  require_f32(dy, "rmsnorm_bwd");  // x: f32, or bf16 (the saved QK-norm input)
  const int64_t n = x.rows(), c = x.cols();
  if (n == 0) return;
  const int chunks = static_cast<int>(n < kRowChunks ? n : kRowChunks);
  float* partial = ctx.scratch_as<float>(static_cast<size_t>(chunks * c), "rmsnorm_bwd");
  dispatch_storage(x.dtype, "rmsnorm_bwd x", [&](auto* xtag) {
    using X = std::remove_pointer_t<decltype(xtag)>;
    dispatch_storage(dx.dtype, "rmsnorm_bwd dx", [&](auto* tag) {
      using D = std::remove_pointer_t<decltype(tag)>;
      rmsnorm_bwd_dx_kernel<<<row_blocks(n), kThreads, 0, ctx.stream>>>(ptr<const float>(dy), ptr<const X>(x),
                                                                        ptr<const float>(w), ptr<const float>(rstd),
                                                                        ptr<D>(dx), n, c, accumulate);
    });
    rmsnorm_dw_parts_kernel<<<dim3(blocks_for(c, kThreads), chunks), kThreads, 0, ctx.stream>>>(
        ptr<const float>(dy), ptr<const X>(x), ptr<const float>(rstd), n, c, chunks, partial);
  });
  rmsnorm_dw_finish_kernel<<<blocks_for(c, kThreads), kThreads, 0, ctx.stream>>>(partial, chunks, c, ptr<float>(dw));
  check_launch("rmsnorm_bwd");
}

void cross_entropy(Context& ctx, const Tensor& logits, const Tensor& labels, double loss_scale, double z_coef,
                   const Tensor& dlogits, const Tensor& row_ce, const Tensor& row_z) {
  check_device({&logits, &labels, &dlogits, &row_ce, &row_z}, "cross_entropy");
  const CrossEntropyDims d = check_cross_entropy(logits, labels, dlogits, row_ce, row_z);
  require_f32(logits, "cross_entropy");
  const int64_t n = d.rows, vocab = d.vocab;
  if (n == 0) return;
  dispatch_storage(dlogits.dtype, "cross_entropy dlogits", [&](auto* tag) {
    using D = std::remove_pointer_t<decltype(tag)>;
    cross_entropy_kernel<<<row_blocks(n), 512, 0, ctx.stream>>>(
        ptr<const float>(logits), ptr<const int32_t>(labels), static_cast<float>(loss_scale), static_cast<float>(2 * z_coef),
        ptr<D>(dlogits), ptr<float>(row_ce), ptr<float>(row_z), n, vocab, ctx.error);
  });
  check_launch("cross_entropy");
}

}  // namespace moe::cuda
