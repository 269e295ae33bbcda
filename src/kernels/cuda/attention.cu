// Our own CUDA attention (fp32 storage): the parity path, and the kernel for shapes the cuDNN
// graph refuses. Causal grouped-query attention with optional intra-document masking
// (kernels/op_list.inc; reference: kernels/ref/attention.cpp).
//   forward   one warp per query row; keys in chunks of 32 (one per lane), online softmax.
//   backward  FlashAttention's form with delta = rowsum(dout * o): one warp per query row for dq,
//             one warp per key row for dk and dv (looping over the group's query heads and the
//             queries in order), so no output is written by two warps: no atomics, and a fixed
//             summation order.
// With bf16_products, q, k, v and dout are rounded to bf16 as they are loaded (as the reference
// does); products of bf16 values are exact in fp32, so only the summation order differs. q, k, v
// (Q) may be stored in bf16 (bf16 mode's saved operands), and o (O) too. In builds
// with cuDNN, bf16 products without document masking go to cuDNN's SDPA first (sdpa_cudnn.cpp).
#include <cmath>

#include "kernels/checks/attention_checks.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/ops.h"
#ifdef MOE_WITH_CUDNN
#include "kernels/cuda/sdpa_cudnn.h"
#endif

namespace moe::cuda {
namespace {

constexpr int kMaxHd = 256;
constexpr int kPerLane = kMaxHd / 32;
constexpr int kWarpsPerBlock = 4;

struct Dims {
  int64_t B, S, H, G, hd;
};

__device__ __forceinline__ float operand(float v, bool bf16_products) { return bf16_products ? bf16_value(bf16_round(v)) : v; }

__device__ __forceinline__ int64_t first_key(const int32_t* doc, const Dims& d, int64_t b, int64_t i, DeviceError* err,
                                             int op) {
  if (!doc) return 0;
  const int32_t j0 = doc[b * d.S + i];
  if (j0 < 0 || j0 > i) {
    report_error(err, op, j0, b * d.S + i);
    return i;
  }
  return j0;
}

// Dot product of a warp-shared row (smem, hd floats) with a row in global memory.
template <class R>
__device__ __forceinline__ float dot_row(const float* shared_row, const R* row, int64_t hd, bool bf16) {
  float s = 0;
  for (int64_t c = 0; c < hd; ++c) s = __fmaf_rn(shared_row[c], operand(load(row + c), bf16), s);
  return s;
}

template <class Q, class O>
__global__ void attention_fwd_kernel(Dims d, const Q* q, const Q* k, const Q* v, O* o, float* lse, const int32_t* doc,
                                     bool bf16, DeviceError* err) {
  __shared__ float qs[kWarpsPerBlock][kMaxHd];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;  // (b, i, h)
  if (row >= d.B * d.S * d.H) return;
  const int64_t h = row % d.H, i = (row / d.H) % d.S, b = row / (d.H * d.S);
  const int64_t g = h / (d.H / d.G), qstride = d.H * d.hd, kstride = d.G * d.hd;
  const float scale = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(d.hd)));
  const Q* qi = q + (b * d.S + i) * qstride + h * d.hd;
  for (int64_t c = lane; c < d.hd; c += 32) qs[warp][c] = operand(load(qi + c), bf16);
  __syncwarp();
  const Q* kb = k + b * d.S * kstride + g * d.hd;
  const Q* vb = v + b * d.S * kstride + g * d.hd;
  const int64_t j0 = first_key(doc, d, b, i, err, err_code(OpId::attention_fwd));
  float m = -INFINITY, l = 0, acc[kPerLane] = {};
  for (int64_t c0 = j0; c0 <= i; c0 += 32) {
    const int64_t j = c0 + lane;
    const float s = j <= i ? __fmul_rn(scale, dot_row(qs[warp], kb + j * kstride, d.hd, bf16)) : -INFINITY;
    const float m_new = fmaxf(m, warp_max(s));
    const float rescale = expf(__fsub_rn(m, m_new));  // 0 on the first chunk (m = -inf)
    const float p = j <= i ? expf(__fsub_rn(s, m_new)) : 0.0f;
    l = __fadd_rn(__fmul_rn(l, rescale), warp_sum(p));
    for (int u = 0; u < kPerLane; ++u) acc[u] = __fmul_rn(acc[u], rescale);
    const int64_t n = i - c0 + 1 < 32 ? i - c0 + 1 : 32;
    for (int64_t t = 0; t < n; ++t) {
      const float pt = __shfl_sync(0xffffffffu, p, static_cast<int>(t));
      const Q* vr = vb + (c0 + t) * kstride;
      for (int u = 0; u < kPerLane; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < d.hd) acc[u] = __fmaf_rn(pt, operand(load(vr + c), bf16), acc[u]);
      }
    }
    m = m_new;
  }
  O* oi = o + (b * d.S + i) * qstride + h * d.hd;
  for (int u = 0; u < kPerLane; ++u) {
    const int64_t c = lane + 32 * u;
    if (c < d.hd) store(oi + c, __fdiv_rn(acc[u], l));
  }
  if (lane == 0) lse[(b * d.H + h) * d.S + i] = __fadd_rn(m, logf(l));
}

// delta[b,h,i] = sum_c dout * o.
template <class O>
__global__ void attention_delta_kernel(Dims d, const float* dout, const O* o, float* delta, bool bf16) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;
  if (row >= d.B * d.S * d.H) return;
  const int64_t h = row % d.H, i = (row / d.H) % d.S, b = row / (d.H * d.S);
  const int64_t off = (b * d.S + i) * d.H * d.hd + h * d.hd;
  float s = 0;
  for (int64_t c = lane; c < d.hd; c += 32) s = __fmaf_rn(operand(dout[off + c], bf16), load(o + off + c), s);
  s = warp_sum(s);
  if (lane == 0) delta[(b * d.H + h) * d.S + i] = s;
}

template <class Q>
__global__ void attention_dq_kernel(Dims d, const float* dout, const Q* q, const Q* k, const Q* v, const float* lse,
                                    const float* delta, float* dq, const int32_t* doc, bool bf16, DeviceError* err) {
  __shared__ float qs[kWarpsPerBlock][kMaxHd], gs[kWarpsPerBlock][kMaxHd];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;
  if (row >= d.B * d.S * d.H) return;
  const int64_t h = row % d.H, i = (row / d.H) % d.S, b = row / (d.H * d.S);
  const int64_t g = h / (d.H / d.G), qstride = d.H * d.hd, kstride = d.G * d.hd;
  const float scale = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(d.hd)));
  const int64_t qoff = (b * d.S + i) * qstride + h * d.hd;
  for (int64_t c = lane; c < d.hd; c += 32) {
    qs[warp][c] = operand(load(q + qoff + c), bf16);
    gs[warp][c] = operand(dout[qoff + c], bf16);
  }
  __syncwarp();
  const Q* kb = k + b * d.S * kstride + g * d.hd;
  const Q* vb = v + b * d.S * kstride + g * d.hd;
  const float L = lse[(b * d.H + h) * d.S + i], D = delta[(b * d.H + h) * d.S + i];
  const int64_t j0 = first_key(doc, d, b, i, err, err_code(OpId::attention_bwd));
  float acc[kPerLane] = {};
  for (int64_t c0 = j0; c0 <= i; c0 += 32) {
    const int64_t j = c0 + lane;
    float ds = 0;
    if (j <= i) {
      const float s = __fmul_rn(scale, dot_row(qs[warp], kb + j * kstride, d.hd, bf16));
      const float dp = dot_row(gs[warp], vb + j * kstride, d.hd, bf16);
      const float p = expf(__fsub_rn(s, L));
      ds = __fmul_rn(p, __fsub_rn(dp, D));
    }
    const int64_t n = i - c0 + 1 < 32 ? i - c0 + 1 : 32;
    for (int64_t t = 0; t < n; ++t) {
      const float dst = __fmul_rn(scale, __shfl_sync(0xffffffffu, ds, static_cast<int>(t)));
      const Q* kr = kb + (c0 + t) * kstride;
      for (int u = 0; u < kPerLane; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < d.hd) acc[u] = __fmaf_rn(dst, operand(load(kr + c), bf16), acc[u]);
      }
    }
  }
  for (int u = 0; u < kPerLane; ++u) {
    const int64_t c = lane + 32 * u;
    if (c < d.hd) dq[qoff + c] = acc[u];
  }
}

// One warp per key row (b, j, g): dk and dv summed over the group's query heads (in order) and
// the queries that see key j (in order).
template <class Q>
__global__ void attention_dkdv_kernel(Dims d, const float* dout, const Q* q, const Q* k, const Q* v, const float* lse,
                                      const float* delta, float* dk, float* dv, const int32_t* doc, bool bf16) {
  __shared__ float ks[kWarpsPerBlock][kMaxHd], vs[kWarpsPerBlock][kMaxHd];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;  // (b, j, g)
  if (row >= d.B * d.S * d.G) return;
  const int64_t g = row % d.G, j = (row / d.G) % d.S, b = row / (d.G * d.S);
  const int64_t rep = d.H / d.G, qstride = d.H * d.hd, kstride = d.G * d.hd;
  const float scale = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(d.hd)));
  const int64_t koff = (b * d.S + j) * kstride + g * d.hd;
  for (int64_t c = lane; c < d.hd; c += 32) {
    ks[warp][c] = operand(load(k + koff + c), bf16);
    vs[warp][c] = operand(load(v + koff + c), bf16);
  }
  __syncwarp();
  float dk_acc[kPerLane] = {}, dv_acc[kPerLane] = {};
  for (int64_t r = 0; r < rep; ++r) {
    const int64_t h = g * rep + r;
    for (int64_t c0 = j; c0 < d.S; c0 += 32) {
      const int64_t i = c0 + lane;
      float p = 0, ds = 0;
      const bool sees = i < d.S && (!doc || (doc[b * d.S + i] <= j && doc[b * d.S + i] >= 0));
      if (sees) {
        const int64_t qoff = (b * d.S + i) * qstride + h * d.hd;
        const float s = __fmul_rn(scale, dot_row(ks[warp], q + qoff, d.hd, bf16));
        const float dp = dot_row(vs[warp], dout + qoff, d.hd, bf16);
        p = expf(__fsub_rn(s, lse[(b * d.H + h) * d.S + i]));
        ds = __fmul_rn(p, __fsub_rn(dp, delta[(b * d.H + h) * d.S + i]));
      }
      const int64_t n = d.S - c0 < 32 ? d.S - c0 : 32;
      for (int64_t t = 0; t < n; ++t) {
        const float pt = __shfl_sync(0xffffffffu, p, static_cast<int>(t));
        const float dst = __fmul_rn(scale, __shfl_sync(0xffffffffu, ds, static_cast<int>(t)));
        if (pt == 0.0f && dst == 0.0f) continue;  // the same in every lane: a masked query
        const int64_t qoff = (b * d.S + c0 + t) * qstride + h * d.hd;
        for (int u = 0; u < kPerLane; ++u) {
          const int64_t c = lane + 32 * u;
          if (c >= d.hd) continue;
          dk_acc[u] = __fmaf_rn(dst, operand(load(q + qoff + c), bf16), dk_acc[u]);
          dv_acc[u] = __fmaf_rn(pt, operand(dout[qoff + c], bf16), dv_acc[u]);
        }
      }
    }
  }
  for (int u = 0; u < kPerLane; ++u) {
    const int64_t c = lane + 32 * u;
    if (c < d.hd) {
      dk[koff + c] = dk_acc[u];
      dv[koff + c] = dv_acc[u];
    }
  }
}

Dims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  const AttentionShape a = check_attention_inputs(q, k, v, op);
  if (q.dtype != DType::kBF16) require_f32(q, op);
  const Dims d{a.B, a.S, a.H, a.G, a.hd};
  MOE_CHECK(d.hd >= 1 && d.hd <= kMaxHd, op, ": head dim ", d.hd, " outside the CUDA kernel's 1..", kMaxHd);
  return d;
}

void check_doc_start(const Tensor& doc_start, const Dims& d, const char* op) {
  if (doc_start.empty()) return;
  check_dtype(doc_start, DType::kI32, op);
  check_shape(doc_start, {d.B, d.S}, op);
}

unsigned warp_rows(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

void attention_fwd(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                   const Tensor& doc_start, bool bf16_products) {
  check_device({&q, &k, &v, &o, &lse, &doc_start}, "attention_fwd");
  const Dims d = check_attention(q, k, v, "attention_fwd");
  check_doc_start(doc_start, d, "attention_fwd doc_start");
  check_attention_outputs(d.B, d.S, d.H, d.hd, o, lse, /*backward=*/false);
  check_attention_dtypes(q, o, lse, bf16_products, {}, "attention_fwd");
  const int64_t rows = d.B * d.S * d.H;
  if (rows == 0) return;
  // An odd head dim has no bf16 pairs: fp32 products, as the cpu kernels compute (bitwise tested).
  bf16_products = bf16_products && d.hd % 2 == 0;
#ifdef MOE_WITH_CUDNN
  if (bf16_products && doc_start.empty() && d.hd % 8 == 0 && ctx.sdpa && ctx.sdpa->forward(ctx, q, k, v, o, lse)) {
    ++ctx.paths.attention_cudnn;
    return;
  }
#endif
  ++ctx.paths.attention_ours;
  dispatch_storage(q.dtype, "attention_fwd q", [&](auto* qtag) {
    using Q = std::remove_pointer_t<decltype(qtag)>;
    dispatch_storage(o.dtype, "attention_fwd o", [&](auto* otag) {
      using O = std::remove_pointer_t<decltype(otag)>;
      attention_fwd_kernel<<<warp_rows(rows), 32 * kWarpsPerBlock, 0, ctx.stream>>>(
          d, ptr<const Q>(q), ptr<const Q>(k), ptr<const Q>(v), ptr<O>(o), ptr<float>(lse), ptr<const int32_t>(doc_start),
          bf16_products, ctx.error);
    });
  });
  check_launch("attention_fwd");
}

void attention_bwd(Context& ctx, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                   const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& doc_start,
                   bool bf16_products) {
  check_device({&dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, &doc_start}, "attention_bwd");
  const Dims d = check_attention(q, k, v, "attention_bwd");
  check_doc_start(doc_start, d, "attention_bwd doc_start");
  check_attention_outputs(d.B, d.S, d.H, d.hd, o, lse, /*backward=*/true);
  check_attention_gradients(d.B, d.S, d.H, d.G, d.hd, dout, dq, dk, dv);
  check_attention_dtypes(q, o, lse, bf16_products, {&dout, &dq, &dk, &dv}, "attention_bwd");
  const int64_t rows = d.B * d.S * d.H;
  if (rows == 0) return;
  bf16_products = bf16_products && d.hd % 2 == 0;
#ifdef MOE_WITH_CUDNN
  if (bf16_products && doc_start.empty() && d.hd % 8 == 0 && ctx.sdpa &&
      ctx.sdpa->backward(ctx, dout, q, k, v, o, lse, dq, dk, dv)) {
    ++ctx.paths.attention_cudnn;
    return;
  }
#endif
  ++ctx.paths.attention_ours;
  float* delta = ctx.scratch_as<float>(static_cast<size_t>(rows), "attention_bwd");
  dispatch_storage(o.dtype, "attention_bwd o", [&](auto* otag) {
    using O = std::remove_pointer_t<decltype(otag)>;
    attention_delta_kernel<<<warp_rows(rows), 32 * kWarpsPerBlock, 0, ctx.stream>>>(d, ptr<const float>(dout), ptr<const O>(o),
                                                                                    delta, bf16_products);
  });
  dispatch_storage(q.dtype, "attention_bwd q", [&](auto* qtag) {
    using Q = std::remove_pointer_t<decltype(qtag)>;
    attention_dq_kernel<<<warp_rows(rows), 32 * kWarpsPerBlock, 0, ctx.stream>>>(
        d, ptr<const float>(dout), ptr<const Q>(q), ptr<const Q>(k), ptr<const Q>(v), ptr<const float>(lse), delta,
        ptr<float>(dq), ptr<const int32_t>(doc_start), bf16_products, ctx.error);
    attention_dkdv_kernel<<<warp_rows(d.B * d.S * d.G), 32 * kWarpsPerBlock, 0, ctx.stream>>>(
        d, ptr<const float>(dout), ptr<const Q>(q), ptr<const Q>(k), ptr<const Q>(v), ptr<const float>(lse), delta,
        ptr<float>(dk), ptr<float>(dv), ptr<const int32_t>(doc_start), bf16_products);
  });
  check_launch("attention_bwd");
}

}  // namespace moe::cuda
