#include "model/mx_experts.h"

#include "core/mxfp8.h"
#include "core/phase_timer.h"

namespace moe {
namespace {

Tensor scale_rows(const Tensor& scales, int64_t rows) { return scales.slice(0, rows); }

// The quantization work, booked to its own phase (moecore bench's table).
void quantize(Backend& ops, const Tensor& x, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales, const Tensor& stats,
              const Tensor& row_end) {
  PhaseScope phase(Phase::kQuantize);
  ops.mx_quantize(x, false, rule, codes, scales, stats, row_end);
}
void dequantize(Backend& ops, const Tensor& codes, const Tensor& scales, const Tensor& y, const Tensor& row_end) {
  PhaseScope phase(Phase::kQuantize);
  ops.mx_dequantize(codes, scales, y, row_end);
}
Tensor fwd_stats(const Tensor& stats) { return stats.empty() ? Tensor() : stats.slice(0, 4); }
Tensor bwd_stats(const Tensor& stats) { return stats.empty() ? Tensor() : stats.slice(4, 8); }

}  // namespace

Tensor mx_experts_forward(const SublayerContext& ctx, const MxExpertWeights& w, const MoeExchangeStep& ex,
                          const Tensor& xs, const Tensor& stats, FfnActs& a) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const Dims& d = ctx.dims;
  const mx::ScaleRule rule = d.mx.rule;
  const bool bf16 = ctx.bf16_operands();
  const Tensor st = fwd_stats(stats);
  int64_t rows = d.R;
  if (!ex.exchange) {
    quantize(ops, xs, rule, a.xr_q.slice(0, rows), scale_rows(a.xr_qs, rows), st, Tensor());
  } else {
    rows = d.Rx;
    if (d.mx.dispatch) {  // quantized once on the sending rank; codes and scales cross
      quantize(ops, xs, rule, s.mx_xs_q, s.mx_xs_qs, st, Tensor());
      ex.exchange->send_to_experts(ex.slot, ex.moe_layer, s.mx_xs_q, a.xr_q, s.ep_slabs);
      ex.exchange->send_to_experts(ex.slot, ex.moe_layer, s.mx_xs_qs, a.xr_qs, s.ep_slabs);
    } else {  // bf16 crosses, the experts' rank quantizes the rows it received
      ex.exchange->send_to_experts(ex.slot, ex.moe_layer, xs, s.mx_xr_XD, s.ep_slabs);
      quantize(ops, s.mx_xr_XD, rule, a.xr_q, a.xr_qs, st, a.recv_offsets);
    }
  }
  const int64_t F = a.eg.dim(1);
  const Tensor xq = a.xr_q.slice(0, rows), xqs = scale_rows(a.xr_qs, rows);
  // The GEMMs write fp32 (f64 on the reference path); bf16 mode's one SwiGLU pass saves bf16 g
  // and u, and its fp32 output is what the down projection's input is quantized from.
  const Tensor eg = bf16 ? rows_view(s.gate_f32_W, rows, F) : a.eg.slice(0, rows);
  const Tensor eu = bf16 ? rows_view(s.up_f32_W, rows, F) : a.eu.slice(0, rows);
  ops.mx_grouped_linear(xq, xqs, w.gate_q, w.gate_qs, a.recv_offsets, eg);
  ops.mx_grouped_linear(xq, xqs, w.up_q, w.up_qs, a.recv_offsets, eu);
  const Tensor ea = rows_view(s.dact_W, rows, F);  // backward scratch, free in the forward
  ops.swiglu_fwd(eg, eu, ea, bf16 ? a.eg.slice(0, rows) : Tensor(), bf16 ? a.eu.slice(0, rows) : Tensor());
  const Tensor eq = a.ea_q.slice(0, rows), eqs = scale_rows(a.ea_qs, rows);
  quantize(ops, ea, rule, eq, eqs, st, ex.exchange ? a.recv_offsets : Tensor());
  const Tensor ys = bf16 || ex.exchange ? s.ys_f32_XD.slice(0, rows) : a.ys;
  ops.mx_grouped_linear(eq, eqs, w.down_q, w.down_qs, a.recv_offsets, ys);
  return ys;
}

void mx_experts_backward(const SublayerContext& ctx, const MxExpertWeights& w, LayerWeights& dW,
                         const Tensor& g, const Tensor& stats, FfnActs& a, const Tensor& dxs, const Tensor& dxs_up) {
  Backend& ops = ctx.ops;
  Scratch& s = ctx.scratch;
  const Dims& d = ctx.dims;
  const mx::ScaleRule rule = d.mx.rule;
  const int64_t rows = g.dim(0), F = a.eg.dim(1), D = g.dim(1);
  const Tensor st = bwd_stats(stats);
  const Tensor row_end = d.ep > 1 ? a.recv_offsets : Tensor();  // EP: only received rows are real
  const Tensor& off = a.recv_offsets;

  // Down: da = g * W_down (reducing over D: g and W_down^T quantized along D).
  const Tensor da = rows_view(s.dact_W, rows, F);
  const Tensor gq = s.mx_dy_q.slice(0, rows), gqs = scale_rows(s.mx_dy_qs, rows);
  quantize(ops, g, rule, gq, gqs, st, row_end);
  ops.mx_grouped_linear(gq, gqs, w.down_t, w.down_ts, off, da);
  const Tensor ea = rows_view(s.mx_deq_W, rows, F);
  dequantize(ops, a.ea_q.slice(0, rows), scale_rows(a.ea_qs, rows), ea, row_end);
  ops.grouped_linear_bwd_weight(g, ea, off, dW.exp_down, ctx.accumulate_grad(dW.exp_down));

  // SwiGLU; its gradients go straight into GEMM operands (bf16 over their own fp32 scratch).
  const Tensor dg = ctx.grad_operand_store(s.dgate_W, rows, F, rows_view(s.dgate_W, rows, F));
  const Tensor du = ctx.grad_operand_store(s.dup_W, rows, F, rows_view(s.dup_W, rows, F));
  ops.swiglu_bwd(da, a.eg.slice(0, rows), a.eu.slice(0, rows), dg, du);

  // Gate and up: dxs = dh * W (reducing over F), weight gradients on the dequantized inputs.
  const Tensor x = rows_view(s.mx_deq_W, rows, D);
  dequantize(ops, a.xr_q.slice(0, rows), scale_rows(a.xr_qs, rows), x, row_end);
  const Tensor hq = s.mx_dh_q.slice(0, rows), hqs = scale_rows(s.mx_dh_qs, rows);
  quantize(ops, dg, rule, hq, hqs, st, row_end);
  ops.mx_grouped_linear(hq, hqs, w.gate_t, w.gate_ts, off, dxs);
  ops.grouped_linear_bwd_weight(dg, x, off, dW.exp_gate, ctx.accumulate_grad(dW.exp_gate));
  if (d.ep == 1) {
    PhaseScope permute(Phase::kPermute);
    ops.moe_gather_bwd(dxs, a.slot_pos, s.dnormed_TD);
  }
  quantize(ops, du, rule, hq, hqs, st, row_end);
  ops.mx_grouped_linear(hq, hqs, w.up_t, w.up_ts, off, dxs_up);
  ops.grouped_linear_bwd_weight(du, x, off, dW.exp_up, ctx.accumulate_grad(dW.exp_up));
}

}  // namespace moe
