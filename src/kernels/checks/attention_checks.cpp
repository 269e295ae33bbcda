#include "kernels/checks/attention_checks.h"

#include "core/check.h"

namespace moe {

AttentionShape check_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  MOE_CHECK(q.ndim == 4, op, ": q must be (B,S,H,hd), got ", q.shape_str());
  const AttentionShape d{q.dim(0), q.dim(1), q.dim(2), k.ndim == 4 ? k.dim(2) : 0, q.dim(3)};
  MOE_CHECK(d.G > 0 && d.H % d.G == 0, op, ": query heads H=", d.H, " must be a multiple of kv heads G=", d.G, " (q ",
            q.shape_str(), ", k ", k.shape_str(), ")");
  check_shape(k, {d.B, d.S, d.G, d.hd}, "attention k");
  check_shape(v, {d.B, d.S, d.G, d.hd}, "attention v");
  check_dtype(k, q.dtype, "attention k");
  check_dtype(v, q.dtype, "attention v");
  return d;
}

const int32_t* checked_doc_start(const Tensor& doc_start, int64_t B, int64_t S, const char* op) {
  if (doc_start.data == nullptr) return nullptr;
  check_shape(doc_start, {B, S}, op);
  check_dtype(doc_start, DType::kI32, op);
  MOE_CHECK(doc_start.device == Device::kCpu, op, ": doc_start must be a host tensor");
  const int32_t* ds = doc_start.as<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      MOE_CHECK(ds[b * S + s] >= 0 && ds[b * S + s] <= s, op, ": doc_start[", b, ",", s, "] = ", ds[b * S + s],
                " outside [0, ", s, "]");
  return ds;
}

void check_attention_outputs(int64_t B, int64_t S, int64_t H, int64_t hd, const Tensor& o, const Tensor& lse,
                             bool backward) {
  // Literal names: this runs in every step, where building a message string would allocate.
  check_shape(o, {B, S, H, hd}, backward ? "attention_bwd o" : "attention_fwd o");
  check_shape(lse, {B, H, S}, backward ? "attention_bwd lse" : "attention_fwd lse");
}

DType check_attention_dtypes(const Tensor& q, const Tensor& o, const Tensor& lse, bool bf16_products,
                             std::initializer_list<const Tensor*> grads, const char* op) {
  const bool stored = q.dtype == DType::kBF16;
  MOE_CHECK(!stored || bf16_products, op, ": bf16 q, k and v need bf16_products");
  const DType c = stored ? DType::kF32 : q.dtype;
  MOE_CHECK(o.dtype == c || (c == DType::kF32 && o.dtype == DType::kBF16), op, ": o is ", dtype_name(o.dtype),
            " with q in ", dtype_name(q.dtype));
  check_dtype(lse, c, "attention lse");
  for (const Tensor* g : grads) check_dtype(*g, c, "attention dout / dq / dk / dv");
  return c;
}

void check_attention_gradients(int64_t B, int64_t S, int64_t H, int64_t G, int64_t hd, const Tensor& dout,
                               const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  check_shape(dout, {B, S, H, hd}, "attention_bwd dout");
  check_shape(dq, {B, S, H, hd}, "attention_bwd dq");
  check_shape(dk, {B, S, G, hd}, "attention_bwd dk");
  check_shape(dv, {B, S, G, hd}, "attention_bwd dv");
}

}  // namespace moe
