// CPU elementwise ops: embedding, RoPE, clamp, SwiGLU, reductions to a scalar, axpy/scale/fill,
// dtype conversion and AdamW. OpenMP over independent outputs (no atomics), vectorizable inner
// loops. Every op here takes f32 and f64; embedding_fwd, sum_to, sumsq_to, axpy, scale, fill and
// convert also take bf16 (arithmetic in f32), fill also i32; SwiGLU also bf16 saved activations.
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/checks/elementwise_checks.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elem_common.h"
#include "kernels/host/host_args.h"

namespace moe::cpu {
using namespace elem;

namespace {

// Chunk size of sum_to / sumsq_to: each chunk is summed on its own, chunks are added in order.
constexpr int64_t kSumChunk = 4096;
// sumsq_segments sums this many chunks at once, each in its own lanes: one read stream per core
// fetched 13-17 GB/s on 2 Emerald Rapids cores, eight in lockstep 20-24 (kernels_bench
// GradSumsq, the gradient norm's pass over olmoe_compat's 63 M gradients; software prefetch
// did not help). The same sums in the same order.
constexpr int64_t kSumStreams = 8;
// Software prefetch distance of AdamW's pass over every parameter, in elements.
constexpr int64_t kAdamWAhead = 1024;

}  // namespace

// ---------------------------------------------------------------- embedding
void embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& y) {
  check_host({&ids, &table, &y}, "embedding_fwd");
  const EmbeddingDims dims = check_embedding_fwd(ids, table, y);
  const int64_t n = dims.tokens, vocab = dims.vocab, d = dims.dim;
  const int32_t* id = checked_ids(ids, vocab, "embedding_fwd");
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(table.dtype);
  const char* src = static_cast<const char*>(table.data);
  char* dst = static_cast<char*>(y.data);
#pragma omp parallel for schedule(static) if (n * d >= kParallelMin)
  for (int64_t t = 0; t < n; ++t)
    std::memcpy(dst + static_cast<size_t>(t) * row_bytes,
                src + static_cast<size_t>(id[t]) * row_bytes, row_bytes);
}

// Threads own disjoint column blocks of dtable and walk all tokens in order, so every element
// accumulates in token order whatever the thread count (no atomics, no scratch).
void embedding_bwd(const Tensor& ids, const Tensor& dy, const Tensor& dtable, int64_t pad_id) {
  check_host({&ids, &dy, &dtable}, "embedding_bwd");
  const EmbeddingDims dims = check_embedding_bwd(ids, dy, dtable);
  const int64_t n = dims.tokens, vocab = dims.vocab, d = dims.dim;
  const int32_t* id = checked_ids(ids, vocab, "embedding_bwd");
  dispatch_real(dtable.dtype, "embedding_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* g = dy.as<T>();
    T* dw = dtable.as<T>();
    // Block width: a multiple of a cache line, about one block per thread (the width changes
    // only which thread adds, never the order of additions into an element).
    constexpr int64_t kLine = 64 / sizeof(T);
    const int64_t nt = omp_get_max_threads();
    const int64_t cb = std::max(kLine, ceil_div(ceil_div(d, nt), kLine) * kLine);
    const int64_t nblocks = ceil_div(d, cb);
#pragma omp parallel for schedule(static) if (n * d >= kParallelMin)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t j0 = blk * cb, j1 = std::min(d, j0 + cb);
      for (int64_t t = 0; t < n; ++t) {
        if (id[t] == pad_id) continue;
        T* dst = dw + id[t] * d;
        const T* src = g + t * d;
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) dst[j] += src[j];
      }
    }
  });
}

// ---------------------------------------------------------------- RoPE
namespace {
// The cos/sin table (S, rd/2) of a rope: cs then sn, rounded to T. Position s = c*64 + k: cos/sin
// of c*64*f and of k*f come from libm, the table from the angle-sum formulas in double (~2 ulp),
// so only (64 + S/64) rd/2 libm pairs are evaluated, not S rd/2. Kept on the calling thread for
// the last (S, rd, theta) asked for: every rope of a step shares it (it cost as much as the
// rotation itself, again at every call).
template <class T> const T* rope_table(int64_t ns, double theta, int64_t rd) {
  struct Table {
    int64_t ns = -1, rd = -1;
    double theta = 0;
    std::vector<T> cs_sn;
  };
  thread_local Table table;
  if (table.ns == ns && table.rd == rd && table.theta == theta) return table.cs_sn.data();
  const int64_t half = rd / 2;
  constexpr int64_t kFine = 64;
  const int64_t ncoarse = ceil_div(ns, kFine), nrows = kFine + ncoarse;
  std::vector<double> base(static_cast<size_t>(2 * nrows * half));
#pragma omp parallel for schedule(static) if (nrows * half >= 4096)
  for (int64_t row = 0; row < nrows; ++row) {
    const double pos = static_cast<double>(row < kFine ? row : (row - kFine) * kFine);
    for (int64_t i = 0; i < half; ++i) {
      const double angle =
          pos * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rd));
      base[static_cast<size_t>(2 * (row * half + i))] = std::cos(angle);
      base[static_cast<size_t>(2 * (row * half + i) + 1)] = std::sin(angle);
    }
  }
  table.cs_sn.assign(static_cast<size_t>(2 * ns * half), T(0));
  T* cs = table.cs_sn.data();
  T* sn = cs + ns * half;
#pragma omp parallel for schedule(static) if (ns * half >= 4096)
  for (int64_t s = 0; s < ns; ++s) {
    const double* f = base.data() + 2 * (s % kFine) * half;
    const double* c = base.data() + 2 * (kFine + s / kFine) * half;
    for (int64_t i = 0; i < half; ++i) {
      const double cf = f[2 * i], sf = f[2 * i + 1], cc = c[2 * i], sc = c[2 * i + 1];
      cs[s * half + i] = static_cast<T>(cc * cf - sc * sf);
      sn[s * half + i] = static_cast<T>(sc * cf + cc * sf);
    }
  }
  table.ns = ns, table.rd = rd, table.theta = theta;
  return cs;
}

template <class T> void rope_apply(const Tensor& x, double theta, int64_t rd, bool inverse) {
  // Dims [rd, hd) of each head pass through (partial RoPE).
  const int64_t nb = x.dim(0), ns = x.dim(1), nh = x.dim(2), hd = x.dim(3), half = rd / 2;
  const T* cs = rope_table<T>(ns, theta, rd);
  const T* sn = cs + ns * half;
  T* p = x.as<T>();
  const T sign = inverse ? T(-1) : T(1);
  const int64_t rows = nb * ns * nh;
#pragma omp parallel for schedule(static) if (rows * hd >= kParallelMin)
  for (int64_t q = 0; q < rows; ++q) {
    const int64_t s = (q / nh) % ns;
    T* lo = p + q * hd;
    T* hi = lo + half;
    const T* c = cs + s * half;
    const T* sg = sn + s * half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const T a = lo[i], b = hi[i], si = sign * sg[i];  // inverse rotation: sin -> -sin
      lo[i] = a * c[i] - b * si;
      hi[i] = b * c[i] + a * si;
    }
  }
}

void rope_common(const Tensor& x, double theta, int64_t rotary_dim, bool inverse, const char* op) {
  check_host({&x}, op);
  check_rope_args(x, theta, rotary_dim, op);
  dispatch_real(x.dtype, op, [&](auto tag) { rope_apply<decltype(tag)>(x, theta, rotary_dim, inverse); });
}
}  // namespace

void rope_fwd(const Tensor& x, double theta, int64_t rotary_dim) { rope_common(x, theta, rotary_dim, false, "rope_fwd"); }
void rope_bwd(const Tensor& dx, double theta, int64_t rotary_dim) { rope_common(dx, theta, rotary_dim, true, "rope_bwd"); }

// ---------------------------------------------------------------- clamp (clip_qkv)
void clamp_fwd(const Tensor& x, double limit, const Tensor& y) {
  check_host({&x, &y}, "clamp_fwd");
  check_clamp_args(nullptr, x, limit, y, "clamp_fwd");
  dispatch_real(x.dtype, "clamp_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* in = x.as<T>();
    T* out = y.as<T>();
    const T c = static_cast<T>(limit);
    const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) out[i] = std::min(std::max(in[i], -c), c);
  });
}

void clamp_bwd(const Tensor& dy, const Tensor& x, double limit, const Tensor& dx) {
  check_host({&dy, &x, &dx}, "clamp_bwd");
  check_clamp_args(&dy, x, limit, dx, "clamp_bwd");
  dispatch_real(x.dtype, "clamp_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* g = dy.as<T>();
    const T* in = x.as<T>();
    T* out = dx.as<T>();
    const T c = static_cast<T>(limit);
    const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) out[i] = (in[i] >= -c && in[i] <= c) ? g[i] : T(0);  // torch: bounds pass
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
  check_host({&g, &u, &h, &g_copy, &u_copy}, "swiglu_fwd");
  check_swiglu_fwd(g, u, h, g_copy, u_copy);
  const bool copies = !g_copy.empty();
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
  check_host({&dh, &g, &u, &dg, &du}, "swiglu_bwd");
  check_swiglu_bwd(dh, g, u, dg, du);
  const DType compute = g.dtype == DType::kBF16 ? DType::kF32 : g.dtype;
  if (g.dtype == DType::kBF16) {  // saved activations in bf16
    swiglu_bwd_f32(dh, g.as<bf16>(), u.as<bf16>(), dg, du);
  } else if (compute == DType::kF32) {
    swiglu_bwd_f32(dh, g.as<float>(), u.as<float>(), dg, du);
  } else {
    check_dtype(g, DType::kF64, "swiglu_bwd g");
    swiglu_bwd_loop(dh.as<double>(), g.as<double>(), u.as<double>(), dg.as<double>(), du.as<double>(), g.numel());
  }
}

// ---------------------------------------------------------------- reductions to a scalar
namespace {
void sum_common(const Tensor& x, const Tensor& out, double scale, bool square, const char* op) {
  check_host({&x, &out}, op);
  check_sum_args(x, out, op);
  dispatch_any_float(x.dtype, op, [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.data);
    const int64_t n = x.numel(), nchunks = ceil_div(n, kSumChunk);
    double* part = scratch<double>(static_cast<size_t>(nchunks));
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t c = 0; c < nchunks; ++c) {
      const T* pc = p + c * kSumChunk;
      const int64_t len = std::min(kSumChunk, n - c * kSumChunk);
      part[c] = square ? lane_sum<double>(len, [&](int64_t i) {
        const double v = static_cast<double>(load(pc[i]));
        return v * v;
      })
                       : lane_sum<double>(len, [&](int64_t i) {
                           return static_cast<double>(load(pc[i]));
                         });
    }
    double total = 0;
    for (int64_t c = 0; c < nchunks; ++c) total += part[c];
    out.as<double>()[0] += scale * total;
  });
}
}  // namespace

void sum_to(const Tensor& x, double scale, const Tensor& out) {
  sum_common(x, out, scale, false, "sum_to");
}
void sumsq_to(const Tensor& x, const Tensor& out) { sum_common(x, out, 1.0, true, "sumsq_to"); }

void sumsq_segments(const Tensor& x, const Tensor& segments, const Tensor& out) {
  const char* op = "sumsq_segments";
  check_host({&x, &segments, &out}, op);
  check_sumsq_segments(x, segments, out);
  const int64_t S = segments.dim(0);
  const auto* seg = static_cast<const int64_t*>(segments.data);
  check_segments(seg, S, x.numel(), out.numel());
  // Every segment's chunks in one parallel loop (chunk k of all segments' chunks in row order),
  // then each segment's parts added in order: the parts and their order are sumsq_to's.
  int64_t* first = scratch<int64_t>(static_cast<size_t>(S + 1));
  first[0] = 0;
  for (int64_t s = 0; s < S; ++s) first[s + 1] = first[s] + ceil_div(seg[3 * s + 1] - seg[3 * s], kSumChunk);
  const int64_t nchunks = first[S];
  double* part = scratch<double>(static_cast<size_t>(nchunks));
  dispatch_any_float(x.dtype, op, [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.data);
#pragma omp parallel for schedule(static) if (nchunks * kSumChunk >= kParallelMin)
    for (int64_t g = 0; g < ceil_div(nchunks, kSumStreams); ++g) {
      const T* full[kSumStreams];  // this group's whole chunks, summed together below
      int64_t at[kSumStreams], count = 0;
      for (int64_t k = g * kSumStreams; k < std::min(nchunks, (g + 1) * kSumStreams); ++k) {
        const int64_t s = std::upper_bound(first, first + S + 1, k) - first - 1;
        const int64_t begin = seg[3 * s] + (k - first[s]) * kSumChunk, len = std::min(kSumChunk, seg[3 * s + 1] - begin);
        const T* pc = p + begin;
        if (len == kSumChunk) {
          full[count] = pc;
          at[count++] = k;
          continue;
        }
        part[k] = lane_sum<double>(len, [&](int64_t i) {
          const double v = static_cast<double>(load(pc[i]));
          return v * v;
        });
      }
      // lane_sum's order for each chunk (the same bits), the chunks read in lockstep.
      double acc[kSumStreams][kLanes] = {};
      for (int64_t i = 0; i < kSumChunk; i += kLanes)
        for (int64_t c = 0; c < count; ++c)
          for (int l = 0; l < kLanes; ++l) {
            const double v = static_cast<double>(load(full[c][i + l]));
            acc[c][l] += v * v;
          }
      for (int64_t c = 0; c < count; ++c) part[at[c]] = tree_sum(acc[c]);
    }
  });
  double* o = static_cast<double*>(out.data);
  for (int64_t s = 0; s < S; ++s) {
    double total = 0;
    for (int64_t k = first[s]; k < first[s + 1]; ++k) total += part[k];
    o[seg[3 * s + 2]] += 1.0 * total;
  }
}

// ---------------------------------------------------------------- axpy, scale, fill, convert
void axpy(double alpha, const Tensor& x, const Tensor& y) {
  check_host({&x, &y}, "axpy");
  check_axpy(x, y);
  dispatch_any_float(x.dtype, "axpy", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* px = static_cast<const T*>(x.data);
    T* py = static_cast<T*>(y.data);
    const C a = static_cast<C>(alpha);
    const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) store(py + i, load(py[i]) + a * load(px[i]));
  });
}

void scale(const Tensor& x, double alpha) {
  check_host({&x}, "scale");
  dispatch_any_float(x.dtype, "scale", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* p = static_cast<T*>(x.data);
    const C a = static_cast<C>(alpha);
    const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) store(p + i, load(p[i]) * a);
  });
}

void fill(const Tensor& x, double value) {
  check_host({&x}, "fill");
  check_fill(x, value);
  const int64_t n = x.numel();
  if (x.dtype == DType::kI32) {
    int32_t* p = x.as<int32_t>();
    const int32_t v = static_cast<int32_t>(value);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) p[i] = v;
    return;
  }
  dispatch_any_float(x.dtype, "fill", [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(x.data);
    T v;
    store(&v, static_cast<compute_t<T>>(value));
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  });
}

void convert(const Tensor& src, const Tensor& dst) {
  check_host({&src, &dst}, "convert");
  check_convert(src, dst);
  const int64_t n = src.numel();
  if (src.dtype == dst.dtype && is_float(src.dtype)) {
    std::memcpy(dst.data, src.data, src.nbytes());
    return;
  }
  dispatch_any_float(src.dtype, "convert src", [&](auto stag) {
    using S = decltype(stag);
    dispatch_any_float(dst.dtype, "convert dst", [&](auto dtag) {
      using D = decltype(dtag);
      using C = compute_t<D>;
      const S* ps = static_cast<const S*>(src.data);
      D* pd = static_cast<D*>(dst.data);
      // f64 -> bf16 rounds through f32, as PyTorch's conversion does.
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
      for (int64_t i = 0; i < n; ++i) store(pd + i, static_cast<C>(load(ps[i])));
    });
  });
}

// ---------------------------------------------------------------- AdamW
namespace {
// sqrt of 16 values at once. GCC keeps a libm call for errno next to every scalar sqrt (this
// project builds without -fno-math-errno), which keeps a loop over std::sqrt from vectorizing:
// the scalar AdamW loop ran at ~9 ns per element, this block form at ~1.7.
inline void sqrt16(float* x) {
#if defined(__AVX512F__)
  // The masked form: GCC 12's _mm512_sqrt_ps trips -Wuninitialized on its undefined source.
  const __m512 a = _mm512_loadu_ps(x);
  _mm512_storeu_ps(x, _mm512_mask_sqrt_ps(a, 0xffff, a));
#elif defined(__AVX__)
  _mm256_storeu_ps(x, _mm256_sqrt_ps(_mm256_loadu_ps(x)));
  _mm256_storeu_ps(x + 8, _mm256_sqrt_ps(_mm256_loadu_ps(x + 8)));
#else
  for (int l = 0; l < 16; ++l) x[l] = std::sqrt(x[l]);
#endif
}
inline void sqrt16(double* x) {
#if defined(__AVX512F__)
  const __m512d a = _mm512_loadu_pd(x), b = _mm512_loadu_pd(x + 8);
  _mm512_storeu_pd(x, _mm512_mask_sqrt_pd(a, 0xff, a));
  _mm512_storeu_pd(x + 8, _mm512_mask_sqrt_pd(b, 0xff, b));
#else
  for (int l = 0; l < 16; ++l) x[l] = std::sqrt(x[l]);
#endif
}

// Same scalars and operation order as kernels/ref (torch.optim.AdamW, single-tensor path),
// over elements [i0, i0 + len), len <= 16. The gradient is read times gscale (1, or the clip
// coefficient: bitwise scale() then this), and `copy`, when given, receives bf16(p) as convert()
// rounds it: one pass instead of three.
template <class T, bool kSmallW1> struct AdamWStep {
  T decay, wa, b2, w2, step_size, bc2_sqrt, e, gscale = T(1);

  void run(T* p, const T* g, T* pm, T* pv, bf16* copy, int64_t i0, int len) const {
    T mi[16], vi[16], s[16] = {};
    for (int l = 0; l < len; ++l) {
      const T gi = g[i0 + l] * gscale, m0 = pm[i0 + l];
      // torch's lerp: m + w (g - m) for w < 0.5, else g - (g - m)(1 - w).
      mi[l] = kSmallW1 ? m0 + wa * (gi - m0) : gi - (gi - m0) * wa;
      vi[l] = pv[i0 + l] * b2 + w2 * gi * gi;
      s[l] = vi[l];
    }
    sqrt16(s);
    for (int l = 0; l < len; ++l) {
      const T denom = s[l] / bc2_sqrt + e;
      const T pi = p[i0 + l] * decay;
      pm[i0 + l] = mi[l];
      pv[i0 + l] = vi[l];
      p[i0 + l] = pi + (-step_size) * (mi[l] / denom);
    }
    if (!copy) return;
    uint16_t bits[16];
#pragma omp simd
    for (int l = 0; l < 16; ++l) bits[l] = bf16_bits(static_cast<float>(p[i0 + (l < len ? l : 0)]));
#if defined(__AVX__)
    // A whole aligned block goes around the cache: nothing reads the copy before the next
    // forward, and a plain store would first read the line it fills (2 of AdamW's 32 bytes per
    // parameter). adamw_loop fences after its stores.
    if (len == 16 && stream_bf16x16(copy + i0, bits)) return;
#endif
    std::memcpy(copy + i0, bits, static_cast<size_t>(len) * sizeof(uint16_t));
  }
};

// AdamW runs with flush-to-zero and denormals-are-zero set on its threads (MXCSR; restored as the
// scope ends): moments below the normal range (2^-126) count as zero. Long runs make them where
// a gradient stays zero (the embedding rows of tokens absent for some 700 steps: m shrinks by
// beta1 a step, v by beta2), and on Intel cores an instruction on a subnormal operand or result
// takes a microcode assist: with every moment subnormal, the fused pass over olmoe_compat's 63 M
// parameters took 549-567 ms instead of 60-62 (kernels_bench OptimizerSubnormal, Emerald Rapids;
// now 60-62). The parameters keep their bits: an update from a subnormal m is at most
// step_size 2^-126 / eps (with step_size <= 1 and eps = 1e-8, under 2^-99), below half an ulp of
// any |p| >= 2^-75; a subnormal v leaves denom = eps, and a subnormal gradient leaves m as it was
// unless m is itself below 2^-100 (CpuAdamW tests). Every backend thread and layout runs the same
// mode, so the bitwise properties hold; the cuda kernels keep subnormals (no assists there).
class FlushSubnormals {
 public:
#if defined(__SSE__)
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtz = 0x8000, kDaz = 0x0040;
  unsigned saved_;
#endif
};

template <class T, bool kSmallW1>
void adamw_loop(T* p, const T* g, T* pm, T* pv, bf16* copy, int64_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, double grad_scale) {
  const T w1 = static_cast<T>(1 - beta1);
  const AdamWStep<T, kSmallW1> op{
      static_cast<T>(1 - lr * weight_decay),
      kSmallW1 ? w1 : T(1) - w1,
      static_cast<T>(beta2),
      static_cast<T>(1 - beta2),
      static_cast<T>(lr / (1 - std::pow(beta1, static_cast<double>(step)))),
      static_cast<T>(std::sqrt(1 - std::pow(beta2, static_cast<double>(step)))),
      static_cast<T>(eps),
      static_cast<T>(grad_scale)};
  const int64_t nblk = n / 16;
#pragma omp parallel if (n >= kParallelMin)
  {
    const FlushSubnormals flush;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblk; ++b) {
      // Each of the four streams asked for 4 KiB (fp32) ahead, a line per block of 16: Intel's
      // prefetchers leave the loop short of the bandwidth by themselves (Emerald Rapids,
      // kernels_bench OptimizerStep fused, fp32 / with bf16 copies: 38.9-40.2 -> 32.5-32.6 ms,
      // 39.6-41.1 -> 35.4-35.7; 16 KiB ahead was slower than none). The same bits.
      const uintptr_t j = static_cast<uintptr_t>(b * 16 + kAdamWAhead) * sizeof(T);  // may pass the end
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + j), 1, 0);
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(g) + j), 0, 0);
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(pm) + j), 1, 0);
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(pv) + j), 1, 0);
      op.run(p, g, pm, pv, copy, b * 16, 16);
    }
#if defined(__AVX__)
    _mm_sfence();  // the copies' streaming stores, ordered before the region's end
#endif
  }
  if (n > nblk * 16) {
    const FlushSubnormals flush;
    op.run(p, g, pm, pv, copy, nblk * 16, static_cast<int>(n - nblk * 16));
  }
}

}  // namespace

void adamw_clipped_with_copy(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                             const Tensor& copy, double lr, double beta1, double beta2, double eps,
                             double weight_decay, int64_t step, double grad_scale) {
  check_host({&param, &grad, &m, &v, &copy}, "adamw");
  check_adamw(param, grad, m, v, step);
  dispatch_real(param.dtype, "adamw", [&](auto tag) {
    using T = decltype(tag);
    auto loop = std::fabs(1 - beta1) < 0.5 ? adamw_loop<T, true> : adamw_loop<T, false>;
    loop(param.as<T>(), grad.as<T>(), m.as<T>(), v.as<T>(), copy.empty() ? nullptr : copy.as<bf16>(), param.numel(),
         lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  });
}

void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, double lr,
           double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  adamw_clipped_with_copy(param, grad, m, v, Tensor(), lr, beta1, beta2, eps, weight_decay, step, 1.0);
}

}  // namespace moe::cpu
