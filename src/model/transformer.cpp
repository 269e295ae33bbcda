#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/fnv1a.h"
#include "core/phase_timer.h"
#include "core/rng.h"
#include "kernels/host_view.h"
#include "kernels/step_control.h"
#include "moe/p2p_transport.h"

namespace moe {

Transformer::Transformer(const ModelConfig& config, const LossConfig& loss, const ModelOptions& o,
                         Backend& ops)
    : cfg_(config), loss_(loss), ops_(ops), layout_(config, o.shard, o.dense_chunks, o.expert_chunks), recompute_(o.recompute), seed_(o.seed) {
  cfg_.validate();
  const ModelShard& shard = layout_.shard();
  const int64_t ep = o.ep ? o.ep->size() : 1;
  MOE_CHECK(shard.num_local_experts * ep == cfg_.num_experts && (ep == 1 || shard.expert_begin == o.ep->rank() * shard.num_local_experts),
            "expert shard [", shard.expert_begin, ", ", shard.expert_begin + shard.num_local_experts,
            ") does not match EP rank ", o.ep ? o.ep->rank() : 0, " of ", ep, " over ", cfg_.num_experts, " experts");
  MOE_CHECK(o.pipeline_slots >= 1, "pipeline_slots = ", o.pipeline_slots, " must be at least 1");
  layer_begin_ = shard.layer_begin;
  layer_end_ = shard.layer_end;
  MOE_CHECK(o.compute == DType::kF32 || o.compute == DType::kF64, "compute dtype must be f32 or f64");
  MOE_CHECK(!(o.bf16_operands && o.compute != DType::kF32), "bf16 operands need f32 compute");
  dims_.B = o.batch;
  dims_.S = o.seq_len;
  dims_.T = o.batch * o.seq_len;
  dims_.R = dims_.T * cfg_.top_k;
  dims_.ep = ep;
  dims_.El = shard.num_local_experts;
  dims_.Rx = ep > 1 ? expert_rows_bound(dims_.T, cfg_.top_k, cfg_.num_experts, ep, o.ep_capacity_factor) : dims_.R;
  if (ep > 1) {
    const int64_t M = cfg_.num_moe_layers(), words = ExchangePlan::words(ep, cfg_.num_experts);
    transport_ = std::make_unique<P2pExpertTransport>(*o.ep, ops, cfg_.num_experts);
    exchange_ = std::make_unique<ExpertExchange>(*transport_, ops, cfg_.num_experts,
                                                 expert_capacity(dims_.T, cfg_.top_k, o.ep_capacity_factor));
    // One plan per (activation slot, MoE layer): 1F1B keeps several micro-batches in flight.
    plan_mem_ = Buffer(ops, static_cast<size_t>(o.pipeline_slots * M * words) * sizeof(int32_t));
    const Tensor all = plan_mem_.view(DType::kI32, {o.pipeline_slots * M * words});
    plans_.resize(static_cast<size_t>(o.pipeline_slots));
    for (int64_t s = 0; s < o.pipeline_slots; ++s)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t at = (s * M + m) * words;
        plans_[static_cast<size_t>(s)].push_back(ExchangePlan::over(all.slice(at, at + words), ep, cfg_.num_experts));
      }
    exchange_counts_ = OwnedTensor(ops, DType::kI32, {M, 4 + ep});
    reset_exchange_counts();
  }
  dims_.cdt = o.compute;
  dims_.adt = o.bf16_operands ? DType::kBF16 : o.compute;
  moe_index_base_ = cfg_.n_dense_layers;

  const size_t esize = dtype_size(dims_.cdt);
  // Model state lives in the backend's memory (zero-filled on the host backends; others leave
  // it undefined, so everything below is written before it is read).
  const int64_t N = layout_.total();
  param_mem_ = Buffer(ops, static_cast<size_t>(N) * esize);
  grad_mem_ = Buffer(ops, static_cast<size_t>(N) * esize);
  params_ = bind_weights(layout_, cfg_, param_mem_.view(dims_.cdt, {N}));
  grads_ = bind_weights(layout_, cfg_, grad_mem_.view(dims_.cdt, {N}));
  if (o.bf16_operands) {
    operand_mem_ = Buffer(ops, static_cast<size_t>(N) * dtype_size(DType::kBF16));
    operands_ = bind_weights(layout_, cfg_, operand_mem_.view(DType::kBF16, {N}));
  } else {
    operands_ = params_;
  }
  for (int64_t m = 0; m < cfg_.num_moe_layers(); ++m) router_bias_.emplace_back(ops, dims_.cdt, std::initializer_list<int64_t>{cfg_.num_experts});

  head_chunk_ = lm_head_chunk_rows(cfg_.vocab_size, dims_.T);

  // Plan all activations twice: measure, then carve them out of one arena.
  const int64_t n_local = layer_end_ - layer_begin_;
  const bool stage_moe = cfg_.is_moe_layer(layer_end_ - 1), stage_dense = !cfg_.is_moe_layer(layer_begin_);
  const auto slots = static_cast<size_t>(o.pipeline_slots);
  for (int pass = 0; pass < 2; ++pass) {
    ArenaPlan alloc{pass == 0 ? nullptr : &arena_};
    resid_.assign(slots, std::vector<Tensor>(static_cast<size_t>(n_local + 1)));
    for (auto& slot : resid_)
      for (auto& r : slot) r = alloc(dims_.cdt, {dims_.T, cfg_.d_model});
    if (recompute_) {
      // The single shared LayerActs must fit the stage's largest layer kind.
      acts_.assign(1, std::vector<LayerActs>(1));
      plan_layer(alloc, cfg_, dims_, stage_moe ? layer_end_ - 1 : layer_begin_, acts_[0][0]);
      // Dense layers reuse the MoE-shaped activations; their (T, dense_width) buffers come extra.
      recompute_dense_ = LayerActs();
      if (stage_moe && stage_dense) plan_layer(alloc, cfg_, dims_, layer_begin_, recompute_dense_);
    } else {
      acts_.assign(slots, std::vector<LayerActs>(static_cast<size_t>(n_local)));
      for (auto& slot : acts_)
        for (int64_t l = layer_begin_; l < layer_end_; ++l)
          plan_layer(alloc, cfg_, dims_, l, slot[static_cast<size_t>(l - layer_begin_)]);
    }
    plan_scratch(alloc, cfg_, dims_, head_chunk_, scratch_);
    if (last_stage()) {
      rstd_final_ = alloc(dims_.cdt, {dims_.T});
      xf_act_ = alloc(dims_.adt, {dims_.T, cfg_.d_model});
    }
    if (pass == 0) arena_ = Arena(ops, alloc.bytes);
  }
}

double Transformer::activation_bytes_per_token() const {
  // Everything in the arena except the shared backward scratch is kept for backward.
  size_t bytes = 0;
  auto add = [&](const Tensor& t) { bytes += t.data ? t.nbytes() : 0; };
  std::vector<const LayerActs*> planned;
  for (const auto& slot : resid_)
    for (const auto& r : slot) add(r);
  for (const auto& slot : acts_)
    for (const auto& a : slot) planned.push_back(&a);
  if (recompute_dense_.x_mid.data) planned.push_back(&recompute_dense_);
  for (const LayerActs* ap : planned) {
    const LayerActs& a = *ap;
    for (const Tensor* t : {&a.attn.rstd_in, &a.attn.h_act, &a.attn.q_lin, &a.attn.k_lin, &a.attn.rstd_q,
                            &a.attn.rstd_k, &a.attn.q, &a.attn.k, &a.attn.v, &a.attn.o, &a.attn.o_act,
                            &a.attn.lse, &a.attn.out, &a.attn.rstd_out, &a.x_mid, &a.ffn.rstd_in,
                            &a.ffn.g, &a.ffn.u, &a.ffn.a_act, &a.ffn.logits, &a.ffn.scores,
                            &a.ffn.expert_idx, &a.ffn.weights, &a.ffn.sorted_slot, &a.ffn.slot_pos,
                            &a.ffn.xs_act, &a.ffn.eg, &a.ffn.eu, &a.ffn.ea_act, &a.ffn.ys, &a.ffn.out,
                            &a.ffn.rstd_out})
      add(*t);
    add(a.ffn.h);
    if (a.ffn.h_act.data != a.ffn.h.data) add(a.ffn.h_act);
    if (a.ffn.xr_act.data != a.ffn.xs_act.data) add(a.ffn.xr_act);
  }
  return static_cast<double>(bytes) / static_cast<double>(dims_.T);
}

void Transformer::reset_exchange_counts() {
  if (!exchange_counts_.t.empty()) ops_.fill(exchange_counts_.t, 0.0);
}

void Transformer::init_params(uint64_t seed) {
  // Host loop over the flat buffer (written in place on the host backends, else uploaded).
  HostView host(ops_, params_.flat, HostView::kWrite);
  for (const ParamInfo& info : layout_.entries()) {
    Tensor t = param_view(info, host.tensor());
    uint64_t stream = fnv1a(info.name);  // the name's hash: layout-independent streams
    stream = (stream << 8) | static_cast<uint64_t>(RngStream::kInit);
    for (int64_t i = 0; i < info.numel; ++i) {
      // Indexed by the element of the whole parameter: an expert shard draws its own slice.
      const auto index = static_cast<uint64_t>(info.global_begin + i);
      double v = info.is_norm ? 1.0 : cfg_.init_std * random_trunc_normal(seed, stream, index, 3.0);
      if (dims_.cdt == DType::kF64) t.as<double>()[i] = v;
      else t.as<float>()[i] = static_cast<float>(v);
    }
  }
  host.commit();
  // The padding row starts at zero, as transformers' init does for padding_idx.
  if (cfg_.pad_id >= 0 && layout_.shard().first_stage()) {
    const ParamInfo& e = layout_.find("embed");
    Tensor t = param_view(e, params_.flat);
    ops_.fill(t.slice(cfg_.pad_id, cfg_.pad_id + 1), 0.0);
  }
  for (auto& b : router_bias_) ops_.fill(b.t, 0.0);
  refresh_operand_weights();
}

void Transformer::refresh_operand_weights() {
  if (operands_.flat.data != params_.flat.data) ops_.convert(params_.flat, operands_.flat);
}

void Transformer::zero_grads() { ops_.fill(grads_.flat, 0.0); }

StepStats Transformer::make_stats() const {
  StepStats s;
  const int64_t M = cfg_.num_moe_layers(), E = cfg_.num_experts;
  s.num_moe_layers = M;
  const int64_t P = layout_.num_global_params(), X = dims_.ep > 1 ? M * (4 + dims_.ep) : 0;
  // Widest elements first, so every section is aligned.
  const size_t values_bytes = static_cast<size_t>(2 + 2 * M + kCtlSize + P) * sizeof(double);
  const size_t prob_bytes = static_cast<size_t>(M * E) * dtype_size(dims_.cdt);
  const size_t count_bytes = static_cast<size_t>(M * E) * sizeof(int32_t);
  const size_t bytes = values_bytes + prob_bytes + count_bytes + static_cast<size_t>(X) * sizeof(int32_t);
  s.memory = Buffer(ops_, bytes);
  char* base = static_cast<char*>(s.memory.data());
  const Device dev = s.memory.device();
  s.words = Tensor(base, DType::kI32, {static_cast<int64_t>(bytes / sizeof(int32_t))}, dev);
  s.values = Tensor(base, DType::kF64, {2 + 2 * M}, dev);
  s.control = Tensor(base + static_cast<size_t>(2 + 2 * M) * sizeof(double), DType::kF64, {kCtlSize}, dev);
  s.grad_sumsq = Tensor(base + static_cast<size_t>(2 + 2 * M + kCtlSize) * sizeof(double), DType::kF64, {P}, dev);
  for (int64_t m = 0; m < M; ++m) {
    s.mean_prob.emplace_back(base + values_bytes + static_cast<size_t>(m * E) * dtype_size(dims_.cdt), dims_.cdt,
                             std::initializer_list<int64_t>{E}, dev);
    s.counts.emplace_back(base + values_bytes + prob_bytes + static_cast<size_t>(m * E) * sizeof(int32_t), DType::kI32,
                          std::initializer_list<int64_t>{E}, dev);
  }
  if (X > 0) s.exchange = Tensor(base + values_bytes + prob_bytes + count_bytes, DType::kI32, {M, 4 + dims_.ep}, dev);
  return s;
}

void Transformer::zero_stats(StepStats& s) const {
  ops_.fill(s.values, 0.0);
  for (const Tensor& c : s.counts) ops_.fill(c, 0.0);
  for (const Tensor& p : s.mean_prob) ops_.fill(p, 0.0);
}

Tensor Transformer::operand(const Tensor& x, const Tensor& store) {
  if (dims_.adt == x.dtype) return x;
  Tensor out = store;
  out.ndim = x.ndim;
  out.shape = x.shape;
  MOE_CHECK(out.numel() <= store.numel(), "operand store too small");
  ops_.convert(x, out);
  return out;
}

Tensor Transformer::operand_grad(const Tensor& dy) {
  if (dims_.adt == dy.dtype) return dy;
  return operand(dy, scratch_.dy_act);
}

Tensor Transformer::grad_operand_store(const Tensor& store, int64_t rows, int64_t cols, const Tensor& fp32) const {
  if (dims_.adt == dims_.cdt) return fp32;
  MOE_CHECK(rows * cols * static_cast<int64_t>(dtype_size(dims_.adt)) <= static_cast<int64_t>(store.nbytes()),
            "operand gradient store too small");
  return Tensor(store.data, dims_.adt, {rows, cols}, store.device);
}

Tensor Transformer::norm_input(const Tensor& x_in, const Tensor& w, const Tensor& rstd, const Tensor& h,
                               const Tensor& h_act) {
  // Without a separate compute-dtype store, the norm writes straight into the saved operand
  // (rounded to bf16 as it is stored in bf16 mode).
  if (h.empty()) {
    ops_.rmsnorm_fwd(x_in, w, cfg_.norm_eps, h_act, rstd);
    return h_act;
  }
  ops_.rmsnorm_fwd(x_in, w, cfg_.norm_eps, h, rstd);
  return operand(h, h_act);
}

void Transformer::finish_sublayer(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out,
                                  const Tensor& x_in, const Tensor& x_out) {
  if (cfg_.norm_placement == "peri") ops_.rmsnorm_fwd(y, out_norm, cfg_.norm_eps, x_out, rstd_out);
  ops_.axpy(1.0, x_in, x_out);
}

Tensor Transformer::sublayer_output_grad(const Tensor& y, const Tensor& out_norm, const Tensor& rstd_out,
                                         const Tensor& dout_norm_w) {
  if (cfg_.norm_placement != "peri") return scratch_.dx;
  ops_.rmsnorm_bwd(scratch_.dx, y, out_norm, rstd_out, scratch_.dtmp, dout_norm_w, false);
  return scratch_.dtmp;
}

void Transformer::norm_input_backward(const Tensor& dh, const Tensor& x_in, const Tensor& w,
                                      const Tensor& rstd, const Tensor& dw) {
  ops_.rmsnorm_bwd(dh, x_in, w, rstd, scratch_.dx, dw, /*accumulate=*/true);  // residual + norm path
}

void Transformer::layer_forward(int64_t slot, int64_t l, int64_t token_base) {
  LayerActs& a = acts(slot, l);
  const std::vector<Tensor>& resid = resid_[static_cast<size_t>(slot)];
  const Tensor& x_in = resid[static_cast<size_t>(l - layer_begin_)];
  const Tensor& x_out = resid[static_cast<size_t>(l - layer_begin_ + 1)];
  attention_forward(l, x_in, a.attn, a.x_mid);
  if (cfg_.is_moe_layer(l)) moe_forward(slot, l, a.x_mid, a.ffn, x_out, token_base);
  else dense_forward(l, a.x_mid, dense_ffn_acts(slot, l), x_out);
}

void Transformer::layer_backward(int64_t slot, int64_t l, const MicroBatchScales& s, StepStats& stats) {
  LayerActs& a = acts(slot, l);
  if (cfg_.is_moe_layer(l)) moe_backward(slot, l, a.x_mid, a.ffn, s, stats);
  else dense_backward(l, a.x_mid, dense_ffn_acts(slot, l));
  attention_backward(l, resid_[static_cast<size_t>(slot)][static_cast<size_t>(l - layer_begin_)], a.attn);
}

void Transformer::stage_forward(int64_t slot, const Tensor& ids, int64_t token_base) {
  MOE_CHECK(slot >= 0 && slot < pipeline_slots(), "activation slot ", slot, " of ", pipeline_slots());
  if (first_stage()) {
    check_shape(ids, {dims_.B, dims_.S}, "ids");
    ops_.embedding_fwd(ids.view({dims_.T}), params_.embed, stage_input(slot));
  }
  for (int64_t l = layer_begin_; l < layer_end_; ++l) layer_forward(slot, l, token_base);
}

void Transformer::final_norm(int64_t slot) {
  ops_.rmsnorm_fwd(stage_output(slot), params_.final_norm, cfg_.norm_eps, xf_act_, rstd_final_);
}

void Transformer::stage_backward(int64_t slot, const Tensor& ids, const Tensor& labels, const MicroBatchScales& sc,
                                 StepStats& stats) {
  Scratch& s = scratch_;
  const int64_t T = dims_.T;
  if (last_stage()) {
    // The final norm runs here, not in stage_forward: one set of its buffers serves every slot.
    check_shape(labels, {dims_.B, dims_.S}, "labels");
    final_norm(slot);
    const Tensor& xf_act = xf_act_;
    Tensor lab = labels.view({T});
    std::optional<PhaseScope> phase(std::in_place, Phase::kLmHeadLoss);
    // LM head + cross-entropy, forward and backward per row chunk: full logits never exist.
    for (int64_t r0 = 0; r0 < T; r0 += head_chunk_) {
      const int64_t r1 = std::min(T, r0 + head_chunk_), n = r1 - r0;
      Tensor logits = s.logits.slice(0, n);
      Tensor x_rows = xf_act.slice(r0, r1);
      ops_.linear_fwd(x_rows, operands_.lm_head, logits, false);
      Tensor row_ce = s.row_ce.slice(0, n), row_z = s.row_z.slice(0, n);
      // The logits' gradient is written in place, or rounded straight into the bf16 operand.
      const Tensor g = grad_operand_store(s.dy_act, n, cfg_.vocab_size, logits);
      ops_.cross_entropy(logits, lab.slice(r0, r1), sc.ce_scale, loss_.lm_z_coef, g, row_ce, row_z);
      ops_.sum_to(row_ce, sc.ce_scale, stats.ce());
      ops_.sum_to(row_z, sc.ce_scale, stats.lm_z());
      ops_.linear_bwd_data(g, operands_.lm_head, s.dtmp.slice(r0, r1), false);
      ops_.linear_bwd_weight(g, x_rows, grads_.lm_head);
    }
    phase.reset();
    ops_.rmsnorm_bwd(s.dtmp, stage_output(slot), params_.final_norm, rstd_final_, s.dx, grads_.final_norm, false);
  }
  // Otherwise s.dx already holds the gradient of the stage output (received).
  for (int64_t l = layer_end_ - 1; l >= layer_begin_; --l) {
    if (recompute_) {
      recomputing_ = true;  // the expert exchange counts each forward once
      layer_forward(slot, l, sc.token_base);
      recomputing_ = false;
    }
    layer_backward(slot, l, sc, stats);
    if (layer_grads_hook_) layer_grads_hook_(l);
  }
  if (first_stage()) ops_.embedding_bwd(ids.view({T}), s.dx, grads_.embed, cfg_.pad_id);
}

void Transformer::forward_backward(const Tensor& ids, const Tensor& labels, const MicroBatchScales& sc,
                                   StepStats& stats) {
  MOE_CHECK(first_stage() && last_stage(), "forward_backward runs the whole model (a stage: stage_forward/backward)");
  stage_forward(0, ids, sc.token_base);
  stage_backward(0, ids, labels, sc, stats);
}

void Transformer::forward_logits(const Tensor& ids, const Tensor& logits) {
  MOE_CHECK(first_stage() && last_stage(), "forward_logits runs the whole model only");
  check_shape(logits, {dims_.T, cfg_.vocab_size}, "logits");
  stage_forward(0, ids, 0);
  final_norm(0);
  ops_.linear_fwd(xf_act_, operands_.lm_head, logits, false);
}

void Transformer::stage_loss(int64_t slot, const Tensor& labels, const Tensor& out) {
  MOE_CHECK(last_stage(), "stage_loss needs the last pipeline stage (final norm and LM head)");
  final_norm(slot);
  Scratch& s = scratch_;
  const int64_t T = dims_.T;
  const Tensor& xf_act = xf_act_;
  Tensor lab = labels.view({T});
  for (int64_t r0 = 0; r0 < T; r0 += head_chunk_) {
    const int64_t r1 = std::min(T, r0 + head_chunk_), n = r1 - r0;
    Tensor logits = s.logits.slice(0, n);
    ops_.linear_fwd(xf_act.slice(r0, r1), operands_.lm_head, logits, false);
    ops_.cross_entropy(logits, lab.slice(r0, r1), 1.0, 0.0, logits, s.row_ce.slice(0, n), s.row_z.slice(0, n));
    ops_.sum_to(s.row_ce.slice(0, n), 1.0, out);
  }
}

void Transformer::forward_loss(const Tensor& ids, const Tensor& labels, const Tensor& out) {
  MOE_CHECK(first_stage() && last_stage(), "forward_loss runs the whole model (pipeline: Trainer::forward_loss)");
  stage_forward(0, ids, 0);
  stage_loss(0, labels, out);
}

}  // namespace moe
