// Argument contracts of the elementwise ops (op_list.inc: embedding, RoPE, clamp, SwiGLU, the
// reductions to a scalar, axpy, convert, fill, AdamW), checked once for every backend: shapes,
// the dtypes the contract ties together and scalar ranges. Device rules and the dtypes a backend
// takes are its own; checks of values only the host can read are for the host backends.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moe {

struct EmbeddingDims {
  int64_t tokens = 0, vocab = 0, dim = 0;
};
// embedding_fwd: ids (T) i32, table (V,D) of a float dtype, y (T,D) of the table's dtype.
EmbeddingDims check_embedding_fwd(const Tensor& ids, const Tensor& table, const Tensor& y);
// embedding_bwd: ids (T) i32, dtable (V,D) of a float dtype, dy (T,D) of dtable's dtype.
EmbeddingDims check_embedding_bwd(const Tensor& ids, const Tensor& dy, const Tensor& dtable);
// Host ids, each in [0, vocab): their data.
const int32_t* checked_ids(const Tensor& ids, int64_t vocab, const char* op);

// rope_fwd / rope_bwd: x (B,S,N,hd), hd even, rotary_dim even in [2, hd], theta > 0.
void check_rope_args(const Tensor& x, double theta, int64_t rotary_dim, const char* op);
// clamp_fwd (dy = nullptr) / clamp_bwd: x, out (and dy) of one shape and one float dtype, limit
// finite and > 0.
void check_clamp_args(const Tensor* dy, const Tensor& x, double limit, const Tensor& out, const char* op);

// swiglu_fwd: g, u and h of one shape, u of g's dtype, h of it or bf16 (rounded); g_copy and
// u_copy both empty, or (g f32) bf16 tensors of g's shape.
void check_swiglu_fwd(const Tensor& g, const Tensor& u, const Tensor& h, const Tensor& g_copy, const Tensor& u_copy);
// swiglu_bwd: every tensor of g's shape; u of g's dtype; dh of the compute dtype (f32 for bf16
// g and u); dg of it or bf16 (rounded), du of dg's dtype.
void check_swiglu_bwd(const Tensor& dh, const Tensor& g, const Tensor& u, const Tensor& dg, const Tensor& du);

// sum_to / sumsq_to: x of a float dtype, out one f64 value.
void check_sum_args(const Tensor& x, const Tensor& out, const char* op);
// sumsq_segments: x (N) of a float dtype, segments (S,3) i64, out (P) f64.
void check_sumsq_segments(const Tensor& x, const Tensor& segments, const Tensor& out);
// Host segments (count rows of begin, end, index): [begin, end) within x's n elements, index
// within out's nout.
void check_segments(const int64_t* segments, int64_t count, int64_t n, int64_t nout);

// axpy: x and y of one shape and dtype.
void check_axpy(const Tensor& x, const Tensor& y);
// convert: src and dst of one element count.
void check_convert(const Tensor& src, const Tensor& dst);
// fill: an i32 x takes only an integer in its range.
void check_fill(const Tensor& x, double value);
// adamw, adamw_by_control (op): param, grad, m and v of one shape and dtype.
void check_adamw_tensors(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const char* op);
// adamw: the tensors as above and step >= 1.
void check_adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, int64_t step);

}  // namespace moe
