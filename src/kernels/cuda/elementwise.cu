// CUDA elementwise ops: embedding, RoPE, SwiGLU, reductions to a scalar, axpy/scale/fill/convert,
// AdamW and the update ops gated by step_control. Same contracts as kernels/ref/elementwise.cpp.
// Reductions use a fixed partition that depends only on the element count (kernels/cuda/device.cuh):
// bitwise repeatable, with double accumulation as the contract says.
#include <cub/device/device_radix_sort.cuh>

#include <cmath>

#include "kernels/checks/elementwise_checks.h"
#include "kernels/checks/step_control_checks.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/step_control.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

// ---------------------------------------------------------------- embedding
template <class S> __global__ void embedding_fwd_kernel(const int32_t* ids, const S* table, S* y, int64_t n, int64_t vocab,
                                                        int64_t d, DeviceError* err) {
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int32_t id = ids[t];
    const bool ok = id >= 0 && id < vocab;
    if (!ok && threadIdx.x == 0) report_error(err, err_code(OpId::embedding_fwd), id, t);
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) y[t * d + j] = ok ? table[id * d + j] : S{};
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n) {
  MOE_GRID_LOOP(i, n) v[i] = static_cast<int32_t>(i);
}

// One warp per sorted position; the first position of each id's run adds that id's gradient rows
// into the table in token order (the sort is stable), exactly as the reference's loop does.
__global__ void embedding_bwd_kernel(const int32_t* sorted_ids, const int32_t* sorted_tok, const float* dy,
                                     float* dtable, int64_t n, int64_t vocab, int64_t d, int64_t pad_id,
                                     DeviceError* err) {
  const int lane = threadIdx.x & 31;
  MOE_WARP_LOOP(p, n) {
    const int32_t id = sorted_ids[p];
    if (p > 0 && sorted_ids[p - 1] == id) continue;
    if (id < 0 || id >= vocab) {
      if (lane == 0) report_error(err, err_code(OpId::embedding_bwd), id, sorted_tok[p]);
      continue;
    }
    if (id == pad_id) continue;
    int64_t end = p + 1;
    while (end < n && sorted_ids[end] == id) ++end;
    float* row = dtable + id * d;
    for (int64_t j = lane; j < d; j += 32) {
      float acc = row[j];
      for (int64_t q = p; q < end; ++q) acc += dy[sorted_tok[q] * d + j];
      row[j] = acc;
    }
  }
}

// ---------------------------------------------------------------- RoPE
// cos/sin table (S, rd/2): angle in double, then rounded to float, as the reference does.
__global__ void rope_table_kernel(float* cs, float* sn, int64_t ns, int64_t half, int64_t rd, double theta) {
  MOE_GRID_LOOP(i, ns * half) {
    const int64_t s = i / half, k = i % half;
    const double angle = static_cast<double>(s) * pow(theta, -2.0 * static_cast<double>(k) / static_cast<double>(rd));
    cs[i] = static_cast<float>(cos(angle));
    sn[i] = static_cast<float>(sin(angle));
  }
}

// Rotates dims [0, rd) of each head row of hd values (pairs k, k + rd/2); [rd, hd) pass through.
__global__ void rope_kernel(float* x, const float* cs, const float* sn, int64_t nb, int64_t ns, int64_t nh, int64_t hd,
                            int64_t rd, bool inverse) {
  const int64_t half = rd / 2;
  MOE_GRID_LOOP(i, nb * ns * nh * half) {
    const int64_t k = i % half, row = i / half;  // row = (b*ns + s)*nh + h
    const int64_t s = (row / nh) % ns;
    float* v = x + row * hd;
    const float c = cs[s * half + k], sg = sn[s * half + k];
    const float a = v[k], b = v[k + half];
    if (!inverse) {
      v[k] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sg));
      v[k + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sg));
    } else {
      v[k] = __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, sg));
      v[k + half] = __fsub_rn(__fmul_rn(b, c), __fmul_rn(a, sg));
    }
  }
}

// clip_qkv: y = min(max(x, -c), c); the gradient passes where -c <= x <= c (torch.clamp's).
__global__ void clamp_fwd_kernel(const float* x, float c, float* y, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const float v = x[i];
    y[i] = v < -c ? -c : (v > c ? c : v);  // a NaN stays NaN (fminf / fmaxf would drop it), as torch
  }
}

__global__ void clamp_bwd_kernel(const float* dy, const float* x, float c, float* dx, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const float v = x[i];
    dx[i] = (v >= -c && v <= c) ? dy[i] : 0.0f;
  }
}

// ---------------------------------------------------------------- SwiGLU
template <class H> __global__ void swiglu_fwd_kernel(const float* g, const float* u, H* h, bf16s* gc, bf16s* uc, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const float gi = g[i], ui = u[i];
    const float silu = __fdiv_rn(gi, __fadd_rn(1.0f, expf(-gi)));
    store(h + i, __fmul_rn(silu, ui));
    if (gc) {
      store(gc + i, gi);
      store(uc + i, ui);
    }
  }
}

template <class G, class D>
__global__ void swiglu_bwd_kernel(const float* dh, const G* g, const G* u, D* dg, D* du, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const float gi = load(g + i), ui = load(u + i);
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gi)));
    const float silu = __fmul_rn(gi, sig);
    const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(gi, __fsub_rn(1.0f, sig))));
    store(dg + i, __fmul_rn(__fmul_rn(dh[i], ui), dsilu));
    store(du + i, __fmul_rn(dh[i], silu));
  }
}

// ---------------------------------------------------------------- reductions to a scalar
// Partition of n elements into at most kParts block partials: element i goes to part
// (i / kThreads) % parts, thread i % kThreads; parts is a function of n alone, so sumsq_segments
// (which knows its slices' sizes only on the device) reproduces sumsq_to's order exactly.
constexpr int kParts = 128;
__host__ __device__ inline int parts_for(int64_t n) {
  const int64_t p = (n + 8 * kThreads - 1) / (8 * kThreads);
  return static_cast<int>(p < 1 ? 1 : (p > kParts ? kParts : p));
}

template <class S> __device__ double part_sum(const S* x, int64_t n, int part, int parts, bool square) {
  double acc = 0;
  for (int64_t i = static_cast<int64_t>(part) * kThreads + threadIdx.x; i < n; i += static_cast<int64_t>(parts) * kThreads) {
    const double v = static_cast<double>(load(x + i));
    acc += square ? v * v : v;
  }
  return block_sum(acc);
}

template <class S> __global__ void sum_parts_kernel(const S* x, int64_t n, int parts, bool square, double* partial) {
  const double s = part_sum(x, n, blockIdx.x, parts, square);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_finish_kernel(const double* partial, int parts, double scale, double* out) {
  double total = 0;
  for (int p = 0; p < parts; ++p) total += partial[p];
  out[0] += scale * total;
}

// grid (kParts, S): block (p, s) sums part p of segment s (parts beyond the segment's count idle).
template <class S>
__global__ void sumsq_segment_parts_kernel(const S* x, int64_t n, const int64_t* seg, int64_t nout, double* partial,
                                           DeviceError* err) {
  const int64_t s = blockIdx.y;
  const int64_t begin = seg[3 * s], end = seg[3 * s + 1], index = seg[3 * s + 2];
  if (!(0 <= begin && begin <= end && end <= n && 0 <= index && index < nout)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(err, err_code(OpId::sumsq_segments), 0, s);
    return;
  }
  const int parts = parts_for(end - begin);
  if (static_cast<int>(blockIdx.x) >= parts) return;
  const double v = part_sum(x + begin, end - begin, blockIdx.x, parts, true);
  if (threadIdx.x == 0) partial[s * kParts + blockIdx.x] = v;
}

__global__ void sumsq_segments_finish_kernel(const int64_t* seg, int64_t nseg, int64_t n, int64_t nout,
                                             const double* partial, double* out) {
  for (int64_t s = 0; s < nseg; ++s) {  // row order: a repeated index adds in that order
    const int64_t begin = seg[3 * s], end = seg[3 * s + 1], index = seg[3 * s + 2];
    if (!(0 <= begin && begin <= end && end <= n && 0 <= index && index < nout)) continue;
    const int parts = parts_for(end - begin);
    double total = 0;
    for (int p = 0; p < parts; ++p) total += partial[s * kParts + p];
    out[index] += total;
  }
}

// ---------------------------------------------------------------- axpy, scale, fill, convert
// C: the arithmetic type (double for f64 data, else float), as the reference computes.
template <class S> struct Arith { using type = float; };
template <> struct Arith<double> { using type = double; };
template <class S> using arith_t = typename Arith<S>::type;

template <class S> __global__ void axpy_kernel(arith_t<S> a, const S* x, S* y, int64_t n) {
  MOE_GRID_LOOP(i, n) store(y + i, add_rn(static_cast<arith_t<S>>(load(y + i)), mul_rn(a, static_cast<arith_t<S>>(load(x + i)))));
}
template <class S> __global__ void scale_kernel(S* x, arith_t<S> a, int64_t n) {
  MOE_GRID_LOOP(i, n) store(x + i, mul_rn(static_cast<arith_t<S>>(load(x + i)), a));
}
template <class S> __global__ void fill_kernel(S* x, arith_t<S> v, int64_t n) {
  MOE_GRID_LOOP(i, n) store(x + i, v);
}
__global__ void fill_i32_kernel(int32_t* x, int32_t v, int64_t n) {
  MOE_GRID_LOOP(i, n) x[i] = v;
}
// f64 -> bf16 rounds through f32, as the reference (and PyTorch) do.
template <class A, class B> __global__ void convert_kernel(const A* src, B* dst, int64_t n) {
  MOE_GRID_LOOP(i, n) store(dst + i, static_cast<arith_t<B>>(load(src + i)));
}

// ---------------------------------------------------------------- AdamW
struct AdamScalars {
  float decay, w1, b2, w2, step_size, bc2_sqrt, eps;
  bool small;
  float gscale;  // the gradient's clip coefficient (adamw_by_control sets it; 1 otherwise)
};

// Scalars as torch.optim.AdamW's single-tensor path forms them: in double, then rounded.
__host__ __device__ inline AdamScalars adam_scalars(double lr, double beta1, double beta2, double eps, double wd,
                                                    int64_t step) {
  AdamScalars s;
  s.decay = static_cast<float>(1 - lr * wd);
  s.w1 = static_cast<float>(1 - beta1);
  s.b2 = static_cast<float>(beta2);
  s.w2 = static_cast<float>(1 - beta2);
  s.step_size = static_cast<float>(lr / (1 - pow(beta1, static_cast<double>(step))));
  s.bc2_sqrt = static_cast<float>(sqrt(1 - pow(beta2, static_cast<double>(step))));
  s.eps = static_cast<float>(eps);
  s.small = fabs(1 - beta1) < 0.5;
  s.gscale = 1.0f;
  return s;
}

// One element's update, on values: the arithmetic of torch.optim.AdamW's single-tensor path.
__device__ __forceinline__ void adam_values(float& p, float g, float& m, float& v, const AdamScalars& s) {
  g = __fmul_rn(g, s.gscale);  // the clip (1 when not clipped: exact), rounded as scale() rounds it
  const float pi = __fmul_rn(p, s.decay);
  const float mn = s.small ? __fadd_rn(m, __fmul_rn(s.w1, __fsub_rn(g, m)))
                           : __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), __fsub_rn(1.0f, s.w1)));
  const float vn = __fadd_rn(__fmul_rn(v, s.b2), __fmul_rn(__fmul_rn(s.w2, g), g));
  m = mn;
  v = vn;
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vn), s.bc2_sqrt), s.eps);
  p = __fadd_rn(pi, __fmul_rn(-s.step_size, __fdiv_rn(mn, denom)));
}

// Every element of [0, n), each thread striding over the grid: four at a time in 16-byte loads
// where the four arrays allow it, the rest one by one (the same arithmetic either way). copy, when
// given, receives bf16(p) as convert rounds it.
__device__ __forceinline__ void adam_range(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s,
                                           bf16s* copy = nullptr) {
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(g) |
                              reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v);
  int64_t done = 0;
  if ((addresses & 15) == 0) {
    const int64_t quads = n / 4;
    for (int64_t q = first; q < quads; q += stride) {
      float4 pq = reinterpret_cast<const float4*>(p)[q], mq = reinterpret_cast<const float4*>(m)[q];
      float4 vq = reinterpret_cast<const float4*>(v)[q];
      const float4 gq = reinterpret_cast<const float4*>(g)[q];
      adam_values(pq.x, gq.x, mq.x, vq.x, s);
      adam_values(pq.y, gq.y, mq.y, vq.y, s);
      adam_values(pq.z, gq.z, mq.z, vq.z, s);
      adam_values(pq.w, gq.w, mq.w, vq.w, s);
      reinterpret_cast<float4*>(p)[q] = pq;
      reinterpret_cast<float4*>(m)[q] = mq;
      reinterpret_cast<float4*>(v)[q] = vq;
      if (copy) {
        store(copy + 4 * q, pq.x);
        store(copy + 4 * q + 1, pq.y);
        store(copy + 4 * q + 2, pq.z);
        store(copy + 4 * q + 3, pq.w);
      }
    }
    done = quads * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    adam_values(p[i], g[i], m[i], v[i], s);
    if (copy) store(copy + i, p[i]);
  }
}

// AdamW is memory-bound: a grid of a few blocks per multiprocessor, each thread striding over
// many elements (the first GPU run had one element per thread and AdamW at a quarter of the
// card's memory rate).
unsigned adam_blocks(const Context& ctx, int64_t n) {
  const int64_t per_sm = 8;
  return blocks_for((n + 3) / 4, kThreads, ctx.sm_count > 0 ? ctx.sm_count * per_sm : 1024);
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, AdamScalars s) {
  adam_range(p, g, m, v, n, s);
}

// The step's scalars come from the control block: thread 0 of each block forms them once (in
// double, as torch does: two pow calls) and shares them, rather than every thread doing so.
__global__ void adamw_by_control_kernel(float* p, const float* g, float* m, float* v, int64_t n, const double* c,
                                        double beta1, double beta2, double eps, double wd, bf16s* copy) {
  if (c[kCtlNonfinite] != 0) return;  // the same for every block
  __shared__ AdamScalars shared;
  if (threadIdx.x == 0) {
    shared = adam_scalars(c[kCtlLr], beta1, beta2, eps, wd, static_cast<int64_t>(c[kCtlUpdates]));
    shared.gscale = c[kCtlClipped] != 0 ? static_cast<float>(c[kCtlClipCoef]) : 1.0f;
  }
  __syncthreads();
  const AdamScalars s = shared;
  adam_range(p, g, m, v, n, s, copy);
}

}  // namespace

// ---------------------------------------------------------------- embedding
void embedding_fwd(Context& ctx, const Tensor& ids, const Tensor& table, const Tensor& y) {
  check_device({&ids, &table, &y}, "embedding_fwd");
  const EmbeddingDims dims = check_embedding_fwd(ids, table, y);
  const int64_t n = dims.tokens, vocab = dims.vocab, d = dims.dim;
  if (n == 0) return;
  dispatch_storage(table.dtype, "embedding_fwd", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    embedding_fwd_kernel<<<blocks_for(n, 1, 65535), kThreads, 0, ctx.stream>>>(ptr<const int32_t>(ids), ptr<const S>(table),
                                                                                ptr<S>(y), n, vocab, d, ctx.error);
  });
  check_launch("embedding_fwd");
}

void embedding_bwd(Context& ctx, const Tensor& ids, const Tensor& dy, const Tensor& dtable, int64_t pad_id) {
  check_device({&ids, &dy, &dtable}, "embedding_bwd");
  const EmbeddingDims dims = check_embedding_bwd(ids, dy, dtable);
  require_f32(dtable, "embedding_bwd");
  const int64_t n = dims.tokens, vocab = dims.vocab, d = dims.dim;
  if (n == 0) return;
  MOE_CHECK(n < (int64_t{1} << 31), "embedding_bwd: ", n, " tokens exceed the i32 sort");
  // Scratch: sorted ids, token order, sorted tokens, then CUB's temporary storage.
  size_t temp_bytes = 0;
  MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), static_cast<int>(n), 0, 32, ctx.stream));
  const size_t words = static_cast<size_t>((3 * n + 63) / 64 * 64);
  int32_t* sorted_ids = ctx.scratch_as<int32_t>(words + (temp_bytes + 3) / 4, "embedding_bwd");
  int32_t* tok = sorted_ids + n;
  int32_t* sorted_tok = tok + n;
  void* temp = sorted_ids + words;
  iota_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(tok, n);
  MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ptr<const int32_t>(ids), sorted_ids, tok, sorted_tok,
                                                 static_cast<int>(n), 0, 32, ctx.stream));
  embedding_bwd_kernel<<<warp_blocks(n, kThreads), kThreads, 0, ctx.stream>>>(
      sorted_ids, sorted_tok, ptr<const float>(dy), ptr<float>(dtable), n, vocab, d, pad_id, ctx.error);
  check_launch("embedding_bwd");
}

// ---------------------------------------------------------------- RoPE
namespace {
void rope_common(Context& ctx, const Tensor& x, double theta, int64_t rd, bool inverse, const char* op) {
  check_device(x, op);
  check_rope_args(x, theta, rd, op);
  require_f32(x, op);
  const int64_t nb = x.dim(0), ns = x.dim(1), nh = x.dim(2), hd = x.dim(3), half = rd / 2;
  if (x.numel() == 0) return;
  float* cs = ctx.scratch_as<float>(static_cast<size_t>(2 * ns * half), op);
  float* sn = cs + ns * half;
  rope_table_kernel<<<blocks_for(ns * half, kThreads), kThreads, 0, ctx.stream>>>(cs, sn, ns, half, rd, theta);
  rope_kernel<<<blocks_for(nb * ns * nh * half, kThreads), kThreads, 0, ctx.stream>>>(ptr<float>(x), cs, sn, nb, ns, nh,
                                                                                      hd, rd, inverse);
  check_launch(op);
}
}  // namespace

void rope_fwd(Context& ctx, const Tensor& x, double theta, int64_t rotary_dim) {
  rope_common(ctx, x, theta, rotary_dim, false, "rope_fwd");
}
void rope_bwd(Context& ctx, const Tensor& dx, double theta, int64_t rotary_dim) {
  rope_common(ctx, dx, theta, rotary_dim, true, "rope_bwd");
}

// ---------------------------------------------------------------- clamp (clip_qkv)
void clamp_fwd(Context& ctx, const Tensor& x, double limit, const Tensor& y) {
  check_device({&x, &y}, "clamp_fwd");
  check_clamp_args(nullptr, x, limit, y, "clamp_fwd");
  require_f32(x, "clamp_fwd");
  const int64_t n = x.numel();
  if (n == 0) return;
  clamp_fwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(ptr<const float>(x), static_cast<float>(limit),
                                                                          ptr<float>(y), n);
  check_launch("clamp_fwd");
}

void clamp_bwd(Context& ctx, const Tensor& dy, const Tensor& x, double limit, const Tensor& dx) {
  check_device({&dy, &x, &dx}, "clamp_bwd");
  check_clamp_args(&dy, x, limit, dx, "clamp_bwd");
  require_f32(x, "clamp_bwd");
  const int64_t n = x.numel();
  if (n == 0) return;
  clamp_bwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(
      ptr<const float>(dy), ptr<const float>(x), static_cast<float>(limit), ptr<float>(dx), n);
  check_launch("clamp_bwd");
}

// ---------------------------------------------------------------- SwiGLU
void swiglu_fwd(Context& ctx, const Tensor& g, const Tensor& u, const Tensor& h, const Tensor& g_copy,
                const Tensor& u_copy) {
  check_device({&g, &u, &h, &g_copy, &u_copy}, "swiglu_fwd");
  check_swiglu_fwd(g, u, h, g_copy, u_copy);
  require_f32(g, "swiglu_fwd");
  const int64_t n = g.numel();
  if (n == 0) return;
  dispatch_storage(h.dtype, "swiglu_fwd h", [&](auto* tag) {
    using H = std::remove_pointer_t<decltype(tag)>;
    swiglu_fwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(
        ptr<const float>(g), ptr<const float>(u), ptr<H>(h), ptr<bf16s>(g_copy), ptr<bf16s>(u_copy), n);
  });
  check_launch("swiglu_fwd");
}

void swiglu_bwd(Context& ctx, const Tensor& dh, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  check_device({&dh, &g, &u, &dg, &du}, "swiglu_bwd");
  check_swiglu_bwd(dh, g, u, dg, du);
  require_f32(dh, "swiglu_bwd");
  const int64_t n = g.numel();
  if (n == 0) return;
  dispatch_storage(g.dtype, "swiglu_bwd g", [&](auto* gtag) {
    using G = std::remove_pointer_t<decltype(gtag)>;
    dispatch_storage(dg.dtype, "swiglu_bwd dg", [&](auto* dtag) {
      using D = std::remove_pointer_t<decltype(dtag)>;
      swiglu_bwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(
          ptr<const float>(dh), ptr<const G>(g), ptr<const G>(u), ptr<D>(dg), ptr<D>(du), n);
    });
  });
  check_launch("swiglu_bwd");
}

// ---------------------------------------------------------------- reductions to a scalar
namespace {
void sum_common(Context& ctx, const Tensor& x, const Tensor& out, double scale, bool square, const char* op) {
  check_device({&x, &out}, op);
  check_sum_args(x, out, op);
  const int64_t n = x.numel();
  const int parts = parts_for(n);
  double* partial = ctx.scratch_as<double>(kParts, op);
  dispatch_any(x.dtype, op, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    sum_parts_kernel<<<parts, kThreads, 0, ctx.stream>>>(ptr<const S>(x), n, parts, square, partial);
  });
  sum_finish_kernel<<<1, 1, 0, ctx.stream>>>(partial, parts, scale, ptr<double>(out));
  check_launch(op);
}
}  // namespace

void sum_to(Context& ctx, const Tensor& x, double scale, const Tensor& out) { sum_common(ctx, x, out, scale, false, "sum_to"); }
void sumsq_to(Context& ctx, const Tensor& x, const Tensor& out) { sum_common(ctx, x, out, 1.0, true, "sumsq_to"); }

void sumsq_segments(Context& ctx, const Tensor& x, const Tensor& segments, const Tensor& out) {
  const char* op = "sumsq_segments";
  check_device({&x, &segments, &out}, op);
  check_sumsq_segments(x, segments, out);
  const int64_t nseg = segments.dim(0), n = x.numel(), nout = out.numel();
  if (nseg == 0) return;
  MOE_CHECK(nseg <= 65535, op, ": ", nseg, " segments exceed the grid (65535)");
  double* partial = ctx.scratch_as<double>(static_cast<size_t>(nseg * kParts), op);
  dispatch_any(x.dtype, op, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    sumsq_segment_parts_kernel<<<dim3(kParts, static_cast<unsigned>(nseg)), kThreads, 0, ctx.stream>>>(
        ptr<const S>(x), n, ptr<const int64_t>(segments), nout, partial, ctx.error);
  });
  sumsq_segments_finish_kernel<<<1, 1, 0, ctx.stream>>>(ptr<const int64_t>(segments), nseg, n, nout, partial,
                                                        ptr<double>(out));
  check_launch(op);
}

// ---------------------------------------------------------------- axpy, scale, fill, convert
void axpy(Context& ctx, double alpha, const Tensor& x, const Tensor& y) {
  check_device({&x, &y}, "axpy");
  check_axpy(x, y);
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_any(x.dtype, "axpy", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    axpy_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(static_cast<arith_t<S>>(alpha), ptr<const S>(x), ptr<S>(y), n);
  });
  check_launch("axpy");
}

void scale(Context& ctx, const Tensor& x, double alpha) {
  check_device(x, "scale");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_any(x.dtype, "scale", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    scale_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(ptr<S>(x), static_cast<arith_t<S>>(alpha), n);
  });
  check_launch("scale");
}

void fill(Context& ctx, const Tensor& x, double value) {
  check_device(x, "fill");
  check_fill(x, value);
  const int64_t n = x.numel();
  if (x.dtype == DType::kI32) {
    if (n > 0)
      fill_i32_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(ptr<int32_t>(x), static_cast<int32_t>(value), n);
    check_launch("fill");
    return;
  }
  if (n == 0) return;
  dispatch_any(x.dtype, "fill", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    fill_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(ptr<S>(x), static_cast<arith_t<S>>(value), n);
  });
  check_launch("fill");
}

void convert(Context& ctx, const Tensor& src, const Tensor& dst) {
  check_device({&src, &dst}, "convert");
  check_convert(src, dst);
  const int64_t n = src.numel();
  if (n == 0) return;
  dispatch_any(src.dtype, "convert src", [&](auto* stag) {
    using A = std::remove_pointer_t<decltype(stag)>;
    dispatch_any(dst.dtype, "convert dst", [&](auto* dtag) {
      using B = std::remove_pointer_t<decltype(dtag)>;
      convert_kernel<<<blocks_for(n, kThreads), kThreads, 0, ctx.stream>>>(ptr<const A>(src), ptr<B>(dst), n);
    });
  });
  check_launch("convert");
}

// ---------------------------------------------------------------- AdamW and the gated updates
void adamw(Context& ctx, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, double lr,
           double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  check_device({&param, &grad, &m, &v}, "adamw");
  check_adamw(param, grad, m, v, step);
  require_f32(param, "adamw");
  const int64_t n = param.numel();
  if (n == 0) return;
  adamw_kernel<<<adam_blocks(ctx, n), kThreads, 0, ctx.stream>>>(ptr<float>(param), ptr<const float>(grad),
                                                                     ptr<float>(m), ptr<float>(v), n,
                                                                     adam_scalars(lr, beta1, beta2, eps, weight_decay, step));
  check_launch("adamw");
}

void adamw_by_control(Context& ctx, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                      const Tensor& control, double beta1, double beta2, double eps, double weight_decay,
                      const Tensor& param_copy) {
  check_device({&param, &grad, &m, &v, &control, &param_copy}, "adamw_by_control");
  check_adamw_tensors(param, grad, m, v, "adamw_by_control param/grad/m/v");
  require_f32(param, "adamw_by_control");
  check_control(control, "adamw_by_control control");
  check_adamw_copy(param, param_copy);
  const int64_t n = param.numel();
  if (n == 0) return;
  adamw_by_control_kernel<<<adam_blocks(ctx, n), kThreads, 0, ctx.stream>>>(
      ptr<float>(param), ptr<const float>(grad), ptr<float>(m), ptr<float>(v), n, ptr<const double>(control), beta1, beta2,
      eps, weight_decay, param_copy.empty() ? nullptr : ptr<bf16s>(param_copy));
  check_launch("adamw_by_control");
}

}  // namespace moe::cuda
