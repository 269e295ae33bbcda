// Reference elementwise ops: embedding, RoPE, SwiGLU, reductions to a scalar, axpy/scale/fill,
// dtype conversion and AdamW. Plain loops in the tensor's own precision (f32 or f64); the
// dtype-agnostic ops (sum_to, sumsq_to, axpy, scale, fill, convert) also take bf16.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/checks/elementwise_checks.h"
#include "kernels/host/dtype_dispatch.h"
#include "kernels/host/host_args.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/ref/rounded_output.h"

namespace moe::ref {
namespace {



// Arithmetic type of a storage type: bf16 computes in float.
template <class T> struct compute { using type = T; };
template <> struct compute<bf16> { using type = float; };
template <class T> using compute_t = typename compute<T>::type;

inline float load(bf16 x) { return static_cast<float>(x); }
inline float load(float x) { return x; }
inline double load(double x) { return x; }
inline void store(bf16* p, float v) { *p = bf16(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(double* p, double v) { *p = v; }

// Chunk size of sum_to / sumsq_to: each chunk is summed on its own, chunks are added in order.
constexpr int64_t kSumChunk = 4096;

}  // namespace

// ---------------------------------------------------------------- embedding
void embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& y) {
  check_host({&ids, &table, &y}, "embedding_fwd");
  const EmbeddingDims dims = check_embedding_fwd(ids, table, y);
  const int64_t n = dims.tokens, vocab = dims.vocab, d = dims.dim;
  const int32_t* id = checked_ids(ids, vocab, "embedding_fwd");
  dispatch_real(table.dtype, "embedding_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* w = table.as<T>();
    T* out = y.as<T>();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < d; ++j) out[t * d + j] = w[id[t] * d + j];
  });
}

void embedding_bwd(const Tensor& ids, const Tensor& dy, const Tensor& dtable, int64_t pad_id) {
  check_host({&ids, &dy, &dtable}, "embedding_bwd");
  const EmbeddingDims dims = check_embedding_bwd(ids, dy, dtable);
  const int64_t n = dims.tokens, vocab = dims.vocab, d = dims.dim;
  const int32_t* id = checked_ids(ids, vocab, "embedding_bwd");
  dispatch_real(dtable.dtype, "embedding_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* g = dy.as<T>();
    T* dw = dtable.as<T>();
    for (int64_t t = 0; t < n; ++t) {  // token order
      if (id[t] == pad_id) continue;
      for (int64_t j = 0; j < d; ++j) dw[id[t] * d + j] += g[t * d + j];
    }
  });
}

// ---------------------------------------------------------------- RoPE
namespace {
template <class T> void rope_apply(const Tensor& x, double theta, int64_t rd, bool inverse) {
  const int64_t nb = x.dim(0), ns = x.dim(1), nh = x.dim(2), hd = x.dim(3), half = rd / 2;
  std::vector<T> cs(static_cast<size_t>(ns * half)), sn(cs.size());
  for (int64_t s = 0; s < ns; ++s)
    for (int64_t i = 0; i < half; ++i) {
      // Angle in double, then rounded: f32 and f64 paths see the same rotation up to rounding.
      const double angle = static_cast<double>(s) * std::pow(theta, -2.0 * static_cast<double>(i) /
                                                                        static_cast<double>(rd));
      cs[s * half + i] = static_cast<T>(std::cos(angle));
      sn[s * half + i] = static_cast<T>(std::sin(angle));
    }
  T* p = x.as<T>();
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t s = 0; s < ns; ++s)
      for (int64_t h = 0; h < nh; ++h) {
        T* v = p + ((b * ns + s) * nh + h) * hd;  // dims [rd, hd) pass through
        const T* c = cs.data() + s * half;
        const T* sg = sn.data() + s * half;
        for (int64_t i = 0; i < half; ++i) {
          const T a = v[i], bb = v[i + half];
          if (!inverse) {
            v[i] = a * c[i] - bb * sg[i];
            v[i + half] = bb * c[i] + a * sg[i];
          } else {
            v[i] = a * c[i] + bb * sg[i];
            v[i + half] = bb * c[i] - a * sg[i];
          }
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
    for (int64_t i = 0; i < x.numel(); ++i) out[i] = std::min(std::max(in[i], -c), c);
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
    for (int64_t i = 0; i < x.numel(); ++i) out[i] = (in[i] >= -c && in[i] <= c) ? g[i] : T(0);
  });
}

// ---------------------------------------------------------------- SwiGLU
void swiglu_fwd(const Tensor& g, const Tensor& u, const Tensor& h, const Tensor& g_copy,
                const Tensor& u_copy) {
  check_host({&g, &u, &h, &g_copy, &u_copy}, "swiglu_fwd");
  check_swiglu_fwd(g, u, h, g_copy, u_copy);
  if (!g_copy.empty()) {
    convert(g, g_copy);
    convert(u, u_copy);
  }
  const RoundedOutput out(h, g.dtype, "swiglu_fwd h");
  dispatch_real(g.dtype, "swiglu_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = g.as<T>();
    const T* pu = u.as<T>();
    T* ph = out.work().as<T>();
    for (int64_t i = 0; i < g.numel(); ++i) {
      const T silu = pg[i] / (T(1) + std::exp(-pg[i]));
      ph[i] = silu * pu[i];
    }
  });
  out.finish();
}

namespace {
template <class T, class G>
void swiglu_bwd_loop(const T* pdh, const G* pg, const G* pu, T* pdg, T* pdu, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = static_cast<T>(to_float(pg[i])), ui = static_cast<T>(to_float(pu[i]));
    const T sig = T(1) / (T(1) + std::exp(-gi));
    const T silu = gi * sig;
    const T dsilu = sig * (T(1) + gi * (T(1) - sig));
    pdg[i] = pdh[i] * ui * dsilu;
    pdu[i] = pdh[i] * silu;
  }
}
}  // namespace

// g and u may be bf16 (saved activations of bf16 mode; dh is then f32); dg and du may be bf16
// (rounded).
void swiglu_bwd(const Tensor& dh, const Tensor& g, const Tensor& u, const Tensor& dg,
                const Tensor& du) {
  check_host({&dh, &g, &u, &dg, &du}, "swiglu_bwd");
  check_swiglu_bwd(dh, g, u, dg, du);
  const DType compute = g.dtype == DType::kBF16 ? DType::kF32 : g.dtype;
  const RoundedOutput odg(dg, compute, "swiglu_bwd dg"), odu(du, compute, "swiglu_bwd du");
  if (g.dtype == DType::kBF16) {
    swiglu_bwd_loop(dh.as<float>(), g.as<bf16>(), u.as<bf16>(), odg.work().as<float>(), odu.work().as<float>(), g.numel());
  } else {
    dispatch_real(g.dtype, "swiglu_bwd", [&](auto tag) {
      using T = decltype(tag);
      swiglu_bwd_loop(dh.as<T>(), g.as<T>(), u.as<T>(), odg.work().as<T>(), odu.work().as<T>(), g.numel());
    });
  }
  odg.finish();
  odu.finish();
}

// ---------------------------------------------------------------- reductions to a scalar
namespace {
void sum_common(const Tensor& x, const Tensor& out, double scale, bool square, const char* op) {
  check_host({&x, &out}, op);
  check_sum_args(x, out, op);
  dispatch_any_float(x.dtype, op, [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.data);
    const int64_t n = x.numel();
    double total = 0;
    for (int64_t c = 0; c < n; c += kSumChunk) {
      double s = 0;
      for (int64_t i = c; i < std::min(n, c + kSumChunk); ++i) {
        const double v = static_cast<double>(load(p[i]));
        s += square ? v * v : v;
      }
      total += s;
    }
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
  const auto* seg = static_cast<const int64_t*>(segments.data);
  check_segments(seg, segments.dim(0), x.numel(), out.numel());
  for (int64_t s = 0; s < segments.dim(0); ++s) {
    const int64_t begin = seg[3 * s], end = seg[3 * s + 1], index = seg[3 * s + 2];
    sum_common(x.slice(begin, end), out.slice(index, index + 1), 1.0, true, op);
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
    for (int64_t i = 0; i < x.numel(); ++i) store(py + i, load(py[i]) + a * load(px[i]));
  });
}

void scale(const Tensor& x, double alpha) {
  check_host({&x}, "scale");
  dispatch_any_float(x.dtype, "scale", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* p = static_cast<T*>(x.data);
    const C a = static_cast<C>(alpha);
    for (int64_t i = 0; i < x.numel(); ++i) store(p + i, load(p[i]) * a);
  });
}

void fill(const Tensor& x, double value) {
  check_host({&x}, "fill");
  check_fill(x, value);
  if (x.dtype == DType::kI32) {
    int32_t* p = x.as<int32_t>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = static_cast<int32_t>(value);
    return;
  }
  dispatch_any_float(x.dtype, "fill", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* p = static_cast<T*>(x.data);
    for (int64_t i = 0; i < x.numel(); ++i) store(p + i, static_cast<C>(value));
  });
}

void convert(const Tensor& src, const Tensor& dst) {
  check_host({&src, &dst}, "convert");
  check_convert(src, dst);
  dispatch_any_float(src.dtype, "convert src", [&](auto stag) {
    using S = decltype(stag);
    dispatch_any_float(dst.dtype, "convert dst", [&](auto dtag) {
      using D = decltype(dtag);
      using C = compute_t<D>;
      const S* ps = static_cast<const S*>(src.data);
      D* pd = static_cast<D*>(dst.data);
      // f64 -> bf16 rounds through f32, as PyTorch's conversion does.
      for (int64_t i = 0; i < src.numel(); ++i) store(pd + i, static_cast<C>(load(ps[i])));
    });
  });
}

// ---------------------------------------------------------------- AdamW
void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, double lr,
           double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  check_host({&param, &grad, &m, &v}, "adamw");
  check_adamw(param, grad, m, v, step);
  dispatch_real(param.dtype, "adamw", [&](auto tag) {
    using T = decltype(tag);
    T* p = param.as<T>();
    const T* g = grad.as<T>();
    T* pm = m.as<T>();
    T* pv = v.as<T>();
    // Scalars as torch.optim.AdamW (single-tensor path) forms them: in double, then rounded.
    const T decay = static_cast<T>(1 - lr * weight_decay);
    const T w1 = static_cast<T>(1 - beta1);  // exp_avg.lerp_(grad, 1 - beta1)
    const T b2 = static_cast<T>(beta2), w2 = static_cast<T>(1 - beta2);
    const T step_size = static_cast<T>(lr / (1 - std::pow(beta1, static_cast<double>(step))));
    const T bc2_sqrt = static_cast<T>(std::sqrt(1 - std::pow(beta2, static_cast<double>(step))));
    const T e = static_cast<T>(eps);
    const bool small = std::fabs(1 - beta1) < 0.5;
    for (int64_t i = 0; i < param.numel(); ++i) {
      p[i] *= decay;
      // torch's lerp: self + w*(end-self) for |w| < 0.5, else end - (end-self)*(1-w).
      pm[i] = small ? pm[i] + w1 * (g[i] - pm[i]) : g[i] - (g[i] - pm[i]) * (T(1) - w1);
      pv[i] = pv[i] * b2 + w2 * g[i] * g[i];
      const T denom = std::sqrt(pv[i]) / bc2_sqrt + e;
      p[i] = p[i] + (-step_size) * (pm[i] / denom);
    }
  });
}

}  // namespace moe::ref
