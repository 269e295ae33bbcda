#include "model/sublayer.h"

namespace moe {

namespace {
Tensor filled_ones(Backend& ops, const Scratch& scratch, int64_t rows) {
  const Tensor ones = scratch.ones_T1.slice(0, rows);
  ops.fill(ones, 1.0);
  return ones;
}
}  // namespace

void SublayerContext::add_row_bias(const Tensor& b, const Tensor& y) const {
  if (!b.empty()) ops.linear_fwd(filled_ones(ops, scratch, y.dim(0)), b.view({b.numel(), 1}), y, true);
}

void SublayerContext::row_bias_grad(const Tensor& dy, const Tensor& db) const {
  if (!db.empty())
    ops.linear_bwd_weight(dy, filled_ones(ops, scratch, dy.dim(0)), db.view({db.numel(), 1}), accumulate_grad(db));
}

GradWrites& SublayerContext::writes() const {
  MOE_CHECK(grad_writes, "a sublayer backward without the step's gradient writes (SublayerContext::grad_writes)");
  return *grad_writes;
}
bool SublayerContext::accumulate_grad(const Tensor& grad) const { return writes().accumulate(grad); }
void SublayerContext::prepare_grad(const Tensor& grad) const { writes().prepare(grad); }

Tensor SublayerContext::operand(const Tensor& x, const Tensor& store) const {
  if (dims.adt == x.dtype) return x;
  Tensor out = store;
  out.ndim = x.ndim;
  out.shape = x.shape;
  MOE_CHECK(out.numel() <= store.numel(), "operand store too small");
  ops.convert(x, out);
  return out;
}

Tensor SublayerContext::operand_grad(const Tensor& dy) const {
  if (dims.adt == dy.dtype) return dy;
  return operand(dy, scratch.dy_operand_N);
}

Tensor SublayerContext::grad_operand_store(const Tensor& store, int64_t rows, int64_t cols, const Tensor& fp32) const {
  return moe::grad_operand_store(dims, store, rows, cols, fp32);
}

Tensor grad_operand_store(const Dims& dims, const Tensor& store, int64_t rows, int64_t cols, const Tensor& fp32) {
  if (dims.adt == dims.cdt) return fp32;
  MOE_CHECK(rows * cols * static_cast<int64_t>(dtype_size(dims.adt)) <= static_cast<int64_t>(store.nbytes()),
            "operand gradient store too small");
  return Tensor(store.data, dims.adt, {rows, cols}, store.device);
}

Tensor SublayerContext::norm_input(const Tensor& x_in, const Tensor& w, const Tensor& rstd, const Tensor& h,
                                   const Tensor& h_act) const {
  if (!choice.input_norm()) return operand(x_in, h_act);  // reordered norms: f(x), no input norm
  if (h.empty()) {
    ops.rmsnorm_fwd(x_in, w, cfg.norm_eps, h_act, rstd);
    return h_act;
  }
  ops.rmsnorm_fwd(x_in, w, cfg.norm_eps, h, rstd);
  return operand(h, h_act);
}

void SublayerContext::finish_sublayer(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out,
                                      const Tensor& x_in, const Tensor& x_out) const {
  if (choice.output_norm()) ops.rmsnorm_fwd(y, out_norm, cfg.norm_eps, x_out, rstd_out);
  ops.axpy(1.0, x_in, x_out);
}

Tensor SublayerContext::sublayer_output_grad(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out,
                                             const Tensor& dout_norm_w) const {
  if (!choice.output_norm()) return scratch.dresid_TD;
  prepare_grad(dout_norm_w);
  ops.rmsnorm_bwd(scratch.dresid_TD, y, out_norm, rstd_out, scratch.dy_TD, dout_norm_w, false);
  return scratch.dy_TD;
}

void SublayerContext::norm_input_backward(const Tensor& dh, const Tensor& x_in, const Tensor& w, const Tensor& rstd,
                                          const Tensor& dw) const {
  if (!choice.input_norm()) {
    ops.axpy(1.0, dh, scratch.dresid_TD);
    return;
  }
  prepare_grad(dw);
  ops.rmsnorm_bwd(dh, x_in, w, rstd, scratch.dresid_TD, dw, /*accumulate=*/true);  // residual + norm path
}

}  // namespace moe
