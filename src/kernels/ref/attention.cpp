// Reference causal grouped-query attention: one query row at a time, its full row of scores
// (from its document start with intra-document masking, else from position 0) materialized, in the tensors' own precision (f32 or f64). Written to be obviously right; the
// fast kernel in kernels/cpu/attention.cpp is tested against it, and the f64 path against
// PyTorch fixtures and finite differences.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/bf16.h"
#include "core/buffer.h"
#include "kernels/checks/attention_checks.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/ref/rounded_output.h"

namespace moe::ref {
namespace {

struct Dims {
  int64_t B, S, H, G, hd;
};

// Checks q, k and v (their contract, then the dtypes this backend takes); returns the dimensions.
Dims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  const AttentionShape a = check_attention_inputs(q, k, v, op);
  MOE_CHECK(q.dtype == DType::kF32 || q.dtype == DType::kF64 || q.dtype == DType::kBF16, op,
            ": ref backend supports f32, f64 and bf16, got ", dtype_name(q.dtype));
  return {a.B, a.S, a.H, a.G, a.hd};
}

template <class T> T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Scaled scores of query row i against keys j0..i into s[j0..i]; returns their max.
template <class T>
T row_scores(const T* qi, const T* kbase, int64_t kstride, int64_t j0, int64_t i, int64_t hd, T scale,
             std::vector<T>& s) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = j0; j <= i; ++j) {
    s[j] = scale * dot(qi, kbase + j * kstride, hd);
    m = std::max(m, s[j]);
  }
  return m;
}

// First key position query (b, i) may attend to: 0, or doc_start[b, i].
int64_t first_key(const int32_t* ds, const Dims& d, int64_t b, int64_t i) {
  return ds ? ds[b * d.S + i] : 0;
}
template <class T>
void fwd(const Dims& d, const T* q, const T* k, const T* v, T* o, T* lse, const int32_t* doc) {
  const T scale = T(1) / std::sqrt(T(d.hd));
  const int64_t rep = d.H / d.G, qstride = d.H * d.hd, kstride = d.G * d.hd;
  std::vector<T> s(static_cast<size_t>(d.S));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t g = h / rep;
      const T* kb = k + b * d.S * kstride + g * d.hd;
      const T* vb = v + b * d.S * kstride + g * d.hd;
      for (int64_t i = 0; i < d.S; ++i) {
        const T* qi = q + (b * d.S + i) * qstride + h * d.hd;
        T* oi = o + (b * d.S + i) * qstride + h * d.hd;
        const int64_t j0 = first_key(doc, d, b, i);
        T m = row_scores(qi, kb, kstride, j0, i, d.hd, scale, s);
        T sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += std::exp(s[j] - m);
        for (int64_t c = 0; c < d.hd; ++c) oi[c] = 0;
        for (int64_t j = j0; j <= i; ++j) {
          T p = std::exp(s[j] - m) / sum;
          for (int64_t c = 0; c < d.hd; ++c) oi[c] += p * vb[j * kstride + c];
        }
        lse[(b * d.H + h) * d.S + i] = m + std::log(sum);
      }
    }
}

// The softmax is recomputed from q and k (o and lse are only shape-checked), so this oracle does
// not depend on the forward's saved values.
template <class T>
void bwd(const Dims& d, const T* dout, const T* q, const T* k, const T* v, T* dq, T* dk, T* dv,
         const int32_t* doc) {
  const T scale = T(1) / std::sqrt(T(d.hd));
  const int64_t rep = d.H / d.G, qstride = d.H * d.hd, kstride = d.G * d.hd;
  for (int64_t i = 0; i < d.B * d.S * d.H * d.hd; ++i) dq[i] = 0;
  for (int64_t i = 0; i < d.B * d.S * d.G * d.hd; ++i) dk[i] = dv[i] = 0;
  std::vector<T> s(static_cast<size_t>(d.S)), dp(static_cast<size_t>(d.S));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t g = h / rep;
      const int64_t kvoff = b * d.S * kstride + g * d.hd;
      for (int64_t i = 0; i < d.S; ++i) {
        const int64_t qoff = (b * d.S + i) * qstride + h * d.hd;
        const int64_t j0 = first_key(doc, d, b, i);
        T m = row_scores(q + qoff, k + kvoff, kstride, j0, i, d.hd, scale, s);
        T sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += std::exp(s[j] - m);
        // p_j = softmax; dp_j = dO_i . v_j; ds_j = p_j (dp_j - sum_l p_l dp_l).
        T pdp = 0;
        for (int64_t j = j0; j <= i; ++j) {
          s[j] = std::exp(s[j] - m) / sum;
          dp[j] = dot(dout + qoff, v + kvoff + j * kstride, d.hd);
          pdp += s[j] * dp[j];
        }
        for (int64_t j = j0; j <= i; ++j) {
          const T p = s[j], ds = p * (dp[j] - pdp);
          const int64_t kj = kvoff + j * kstride;
          for (int64_t c = 0; c < d.hd; ++c) {
            dq[qoff + c] += scale * ds * k[kj + c];
            dk[kj + c] += scale * ds * q[qoff + c];
            dv[kj + c] += p * dout[qoff + c];
          }
        }
      }
    }
}

// bf16_products: the operand rounded to bf16 and back in f32 (a bf16 tensor: widened, exactly),
// else a view of it.
struct Operand {
  OwnedTensor rounded;
  Tensor t;
  Operand(const Tensor& x, bool bf16_products, const char* op) : t(x) {
    if (!bf16_products) return;
    MOE_CHECK(x.dtype == DType::kF32 || x.dtype == DType::kBF16, op, ": bf16_products needs f32 or bf16 tensors, got ",
              dtype_name(x.dtype));
    rounded = OwnedTensor(DType::kF32, {x.dim(0), x.dim(1), x.dim(2), x.dim(3)});
    convert(x, rounded);
    if (x.dtype == DType::kF32)
      for (int64_t i = 0; i < x.numel(); ++i) rounded.as<float>()[i] = static_cast<float>(bf16(rounded.as<float>()[i]));
    t = rounded.t;
  }
};

}  // namespace

void attention_fwd(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& o,
                   const Tensor& lse, const Tensor& doc_start, bool bf16_products) {
  Dims d = check_attention(q_in, k_in, v_in, "attention_fwd");
  const Operand qo(q_in, bf16_products, "attention_fwd"), ko(k_in, bf16_products, "attention_fwd"),
      vo(v_in, bf16_products, "attention_fwd");
  const Tensor &q = qo.t, &k = ko.t, &v = vo.t;
  const int32_t* ds = checked_doc_start(doc_start, d.B, d.S, "attention_fwd doc_start");
  check_attention_outputs(d.B, d.S, d.H, d.hd, o, lse, /*backward=*/false);
  const DType c = check_attention_dtypes(q_in, o, lse, bf16_products, {}, "attention_fwd");
  const RoundedOutput oo(o, c, "attention_fwd o");  // o may be bf16 (rounded)
  if (c == DType::kF64)
    fwd(d, q.as<double>(), k.as<double>(), v.as<double>(), oo.work().as<double>(), lse.as<double>(), ds);
  else
    fwd(d, q.as<float>(), k.as<float>(), v.as<float>(), oo.work().as<float>(), lse.as<float>(), ds);
  oo.finish();
}

void attention_bwd(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                   const Tensor& o, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                   const Tensor& dv, const Tensor& doc_start, bool bf16_products) {
  Dims d = check_attention(q_in, k_in, v_in, "attention_bwd");
  check_shape(dout_in, {d.B, d.S, d.H, d.hd}, "attention_bwd dout");
  const Operand qo(q_in, bf16_products, "attention_bwd"), ko(k_in, bf16_products, "attention_bwd"),
      vo(v_in, bf16_products, "attention_bwd"), doo(dout_in, bf16_products, "attention_bwd");
  const Tensor &q = qo.t, &k = ko.t, &v = vo.t, &dout = doo.t;
  const int32_t* ds = checked_doc_start(doc_start, d.B, d.S, "attention_bwd doc_start");
  check_attention_outputs(d.B, d.S, d.H, d.hd, o, lse, /*backward=*/true);
  check_attention_gradients(d.B, d.S, d.H, d.G, d.hd, dout, dq, dk, dv);
  // o is not read: the reference recomputes every probability.
  const DType c = check_attention_dtypes(q_in, o, lse, bf16_products, {&dout_in, &dq, &dk, &dv}, "attention_bwd");
  if (c == DType::kF64)
    bwd(d, dout.as<double>(), q.as<double>(), k.as<double>(), v.as<double>(), dq.as<double>(),
        dk.as<double>(), dv.as<double>(), ds);
  else
    bwd(d, dout.as<float>(), q.as<float>(), k.as<float>(), v.as<float>(), dq.as<float>(),
        dk.as<float>(), dv.as<float>(), ds);
}

}  // namespace moe::ref
