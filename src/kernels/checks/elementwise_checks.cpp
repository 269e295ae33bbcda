#include "kernels/checks/elementwise_checks.h"

#include <cmath>

namespace moe {

namespace {
// The (V,D) table and the (T,D) rows of an embedding op.
EmbeddingDims embedding_dims(const Tensor& ids, const Tensor& table, const Tensor& rows, const char* table_name,
                             const char* rows_name, const char* op) {
  check_dtype(ids, DType::kI32, op);
  check_shape(table, {-1, -1}, table_name);
  MOE_CHECK(is_float(table.dtype), op, ": ", table_name, " must be a float tensor, got ", dtype_name(table.dtype));
  const EmbeddingDims d{ids.numel(), table.dim(0), table.dim(1)};
  check_shape(rows, {d.tokens, d.dim}, rows_name);
  check_dtype(rows, table.dtype, rows_name);
  return d;
}
}  // namespace

EmbeddingDims check_embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& y) {
  return embedding_dims(ids, table, y, "embedding_fwd table", "embedding_fwd y", "embedding_fwd");
}

EmbeddingDims check_embedding_bwd(const Tensor& ids, const Tensor& dy, const Tensor& dtable) {
  return embedding_dims(ids, dtable, dy, "embedding_bwd dtable", "embedding_bwd dy", "embedding_bwd");
}

const int32_t* checked_ids(const Tensor& ids, int64_t vocab, const char* op) {
  const int32_t* id = ids.as<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    MOE_CHECK(id[t] >= 0 && id[t] < vocab, op, ": id ", id[t], " at position ", t, " is outside [0, ", vocab, ")");
  return id;
}

void check_rope_args(const Tensor& x, double theta, int64_t rotary_dim, const char* op) {
  check_shape(x, {-1, -1, -1, -1}, op);
  MOE_CHECK(x.dim(3) % 2 == 0, op, ": head dim ", x.dim(3), " must be even");
  MOE_CHECK(rotary_dim >= 2 && rotary_dim <= x.dim(3) && rotary_dim % 2 == 0, op, ": rotary_dim ", rotary_dim,
            " must be even and within [2, head dim ", x.dim(3), "]");
  MOE_CHECK(theta > 0, op, ": theta must be positive, got ", theta);
}

void check_clamp_args(const Tensor* dy, const Tensor& x, double limit, const Tensor& out, const char* op) {
  MOE_CHECK(std::isfinite(limit) && limit > 0, op, ": limit must be finite and positive, got ", limit);
  MOE_CHECK(x.dtype == DType::kF32 || x.dtype == DType::kF64, op, ": x must be f32 or f64, got ", dtype_name(x.dtype));
  check_same_shape(x, out, op);
  check_dtype(out, x.dtype, op);
  if (dy) {
    check_same_shape(x, *dy, op);
    check_dtype(*dy, x.dtype, op);
  }
}

void check_swiglu_fwd(const Tensor& g, const Tensor& u, const Tensor& h, const Tensor& g_copy, const Tensor& u_copy) {
  check_same_shape(g, u, "swiglu_fwd g/u");
  check_same_shape(g, h, "swiglu_fwd g/h");
  check_dtype(u, g.dtype, "swiglu_fwd u");
  check_output_dtype(h, g.dtype, "swiglu_fwd h");
  MOE_CHECK(g_copy.empty() == u_copy.empty(), "swiglu_fwd: g_copy and u_copy are given together");
  if (g_copy.empty()) return;
  check_dtype(g, DType::kF32, "swiglu_fwd g (with copies)");
  for (const Tensor* t : {&g_copy, &u_copy}) {
    check_dtype(*t, DType::kBF16, "swiglu_fwd copy");
    check_same_shape(g, *t, "swiglu_fwd g/copy");
  }
}

void check_swiglu_bwd(const Tensor& dh, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du) {
  for (const Tensor* t : {&dh, &u, &dg, &du}) check_same_shape(*t, g, "swiglu_bwd tensors");
  const DType compute = g.dtype == DType::kBF16 ? DType::kF32 : g.dtype;
  check_dtype(u, g.dtype, "swiglu_bwd u");
  check_dtype(dh, compute, "swiglu_bwd dh");
  check_output_dtype(dg, compute, "swiglu_bwd dg");
  check_dtype(du, dg.dtype, "swiglu_bwd du");
}

void check_sum_args(const Tensor& x, const Tensor& out, const char* op) {
  MOE_CHECK(is_float(x.dtype), op, ": x must be a float tensor, got ", dtype_name(x.dtype));
  check_shape(out, {1}, "sum_to/sumsq_to out");
  check_dtype(out, DType::kF64, "sum_to/sumsq_to out");
}

void check_sumsq_segments(const Tensor& x, const Tensor& segments, const Tensor& out) {
  MOE_CHECK(is_float(x.dtype), "sumsq_segments: x must be a float tensor, got ", dtype_name(x.dtype));
  check_shape(x, {-1}, "sumsq_segments x");
  check_shape(segments, {-1, 3}, "sumsq_segments segments");
  check_dtype(segments, DType::kI64, "sumsq_segments segments");
  check_shape(out, {-1}, "sumsq_segments out");
  check_dtype(out, DType::kF64, "sumsq_segments out");
}

void check_segments(const int64_t* segments, int64_t count, int64_t n, int64_t nout) {
  for (int64_t s = 0; s < count; ++s) {
    const int64_t begin = segments[3 * s], end = segments[3 * s + 1], index = segments[3 * s + 2];
    MOE_CHECK(0 <= begin && begin <= end && end <= n, "sumsq_segments: segment ", s, " [", begin, ", ", end,
              ") outside x of ", n, " elements");
    MOE_CHECK(0 <= index && index < nout, "sumsq_segments: segment ", s, " index ", index, " outside out of ", nout);
  }
}

void check_axpy(const Tensor& x, const Tensor& y) {
  check_same_shape(x, y, "axpy x/y");
  check_dtype(y, x.dtype, "axpy y");
}

void check_convert(const Tensor& src, const Tensor& dst) {
  MOE_CHECK(src.numel() == dst.numel(), "convert: src ", src.shape_str(), " and dst ", dst.shape_str(),
            " differ in size");
}

void check_fill(const Tensor& x, double value) {
  if (x.dtype != DType::kI32) return;
  MOE_CHECK(value == std::floor(value) && std::fabs(value) <= 2147483647.0, "fill: value ", value, " is not an i32");
}

void check_adamw_tensors(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const char* op) {
  for (const Tensor* t : {&grad, &m, &v}) {
    check_same_shape(*t, param, op);
    check_dtype(*t, param.dtype, op);
  }
}

void check_adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, int64_t step) {
  check_adamw_tensors(param, grad, m, v, "adamw param/grad/m/v");
  MOE_CHECK(step >= 1, "adamw: step counts from 1, got ", step);
}

}  // namespace moe
