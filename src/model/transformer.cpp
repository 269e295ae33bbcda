#include "model/transformer.h"

#include <algorithm>

#include "model/attention_block.h"
#include "model/attention_masks.h"
#include "model/dense_ffn.h"

namespace moe {

namespace {
Dims checked_dims(const ModelConfig& c, const ModelOptions& o) {
  c.validate();
  MOE_CHECK(o.compute == DType::kF32 || o.compute == DType::kF64, "compute dtype must be f32 or f64");
  MOE_CHECK(!(o.bf16_operands && o.compute != DType::kF32), "bf16 operands need f32 compute");
  MOE_CHECK(o.pipeline_slots >= 1, "pipeline_slots = ", o.pipeline_slots, " must be at least 1");
  MOE_CHECK(o.chunk_slots.empty() || o.chunk_slots.size() == o.shard.chunks.size(), "interleaved pipelining: ",
            o.chunk_slots.size(), " slot counts for ", o.shard.chunks.size(), " layer chunks");
  MOE_CHECK(!(o.mx.experts || o.mx.attention) || o.bf16_operands || o.compute == DType::kF64,
            "MXFP8 GEMMs run with bf16 operands elsewhere (f32 compute) or on the f64 reference path");
  return model_dims(c, o.batch, o.seq_len, o.compute, o.bf16_operands, o.ep, o.ep_capacity_factor,
                    o.ep_transport == ExchangeTransportKind::kPadded, o.mx);
}
}  // namespace

Transformer::Transformer(const ModelConfig& config, const LossConfig& loss, const ModelOptions& o, Backend& ops)
    : cfg_(config),
      choice_(model_choices(config)),
      loss_(loss),
      ops_(ops),
      dims_(checked_dims(config, o)),
      recompute_(o.recompute),
      seed_(o.seed),
      state_(config, o.shard, o.dense_chunks, o.expert_chunks, o.compute, o.bf16_operands, ops,
             o.mx.experts || o.mx.attention ? std::optional(o.mx.rule) : std::nullopt, o.mx.experts, o.mx.attention) {
  const ModelShard& shard = layout().shard();
  const int64_t ep = dims_.ep;
  MOE_CHECK(ep >= 1 && shard.num_local_experts * ep == cfg_.num_experts && shard.expert_begin % shard.num_local_experts == 0,
            "expert shard [", shard.expert_begin, ", ", shard.expert_begin + shard.num_local_experts,
            ") is not one of ", ep, " equal shares of ", cfg_.num_experts, " experts");
  chunks_ = shard.chunks;
  const std::vector<int64_t> chunk_slots = o.chunk_slots.empty() ? std::vector<int64_t>{o.pipeline_slots} : o.chunk_slots;
  lbl_granularity_ = loss.lbl_granularity == "instance" ? LblGranularity::kInstance
                     : loss.lbl_granularity == "global" ? LblGranularity::kGlobal
                                                         : LblGranularity::kLocalBatch;
  const std::vector<int64_t> windows = cfg_.attention_windows();
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    const auto at = std::find(windows.begin(), windows.end(), cfg_.attention_window(l));
    window_slot_.push_back(at == windows.end() ? -1 : static_cast<int>(at - windows.begin()));
    rope_layer_.push_back(cfg_.rope_on(l) ? 1 : 0);
  }
  if (o.mx.experts && cfg_.num_moe_layers() > 0) {
    quant_stats_ = OwnedTensor(ops, DType::kF64, {cfg_.num_moe_layers(), 8});
    reset_quant_stats();
  }
  plan_ = ActivationPlan(cfg_, dims_, StagePlan(chunks_, chunk_slots, recompute_), &ops);
}

void Transformer::set_expert_dispatch(ExpertDispatch* dispatch) {
  MOE_CHECK(dims_.ep > 1 && dispatch != nullptr && dispatch->size() == dims_.ep, "expert dispatch over ",
            dispatch ? dispatch->size() : 0, " ranks for a model built for ep = ", dims_.ep);
  dispatch_ = dispatch;
}

void Transformer::reset_quant_stats() {
  if (!quant_stats_.t.empty()) ops_.fill(quant_stats_.t, 0.0);
}

StepStats Transformer::make_stats() const {
  return make_step_stats(ops_, cfg_.num_moe_layers(), cfg_.num_experts, state_.layout().num_global_params(), dims_.ep,
                         dims_.cdt, !quant_stats_.t.empty());
}

void Transformer::zero_stats(StepStats& s) const { zero_step_stats(ops_, s); }

MoeExchangeStep Transformer::exchange_step(int64_t slot, int64_t m, bool recomputing) {
  MoeExchangeStep ex;
  if (dims_.ep == 1) return ex;
  MOE_CHECK(dispatch_ != nullptr, "expert parallelism (ep = ", dims_.ep, ") without an expert dispatch: ",
            "parallelize (parallel/parallelize.h) installs it");
  ex.exchange = dispatch_;
  ex.slot = slot;
  ex.moe_layer = m;
  ex.new_plan = !recomputing;  // recompute reuses the plan (and counts each forward once)
  return ex;
}

void Transformer::layer_forward(const SublayerContext& ctx, int64_t slot, int64_t l, const MicroBatch& mb,
                                bool recomputing) {
  LayerActs& a = plan_.layer(slot, l);
  const Tensor& x_in = plan_.resid(slot, l);
  const Tensor& x_out = plan_.resid(slot, l + 1);
  const LayerParams p = state_.layer(l);
  attention_forward(ctx, p, x_in, a.attn, a.x_mid);
  if (!cfg_.is_moe_layer(l)) {
    dense_ffn_forward(ctx, p, a.x_mid, plan_.dense_ffn(slot, l), x_out);
    return;
  }
  const int64_t m = cfg_.moe_index(l);
  MoeRouting routing;
  routing.layer = l;
  if (cfg_.router_bias_selects()) routing.router_bias = router_bias()[static_cast<size_t>(m)].t;
  routing.seed = seed_;
  routing.token_base = mb.scales.token_base;
  if (!quant_stats_.t.empty() && !recomputing) routing.quant_stats = quant_stats_.t.slice(m, m + 1).view({8});
  moe_ffn_forward(ctx, p, routing, exchange_step(slot, m, recomputing), a.x_mid, a.ffn, x_out);
}

void Transformer::layer_backward(const SublayerContext& ctx, int64_t slot, int64_t l, const MicroBatch& mb,
                                 StepStats& stats) {
  LayerActs& a = plan_.layer(slot, l);
  const LayerParams p = state_.layer(l);
  if (cfg_.is_moe_layer(l)) {
    const int64_t m = cfg_.moe_index(l);
    MoeLossOutputs out;
    out.aux_weight = mb.scales.aux_weight;
    out.stat_weight = mb.scales.stat_weight;
    out.lbl_coef = loss_.lbl_coef;
    out.router_z_coef = loss_.router_z_coef;
    out.granularity = lbl_granularity_;
    out.count_sum = count_sum_.sum ? &count_sum_ : nullptr;
    out.sequences = dims_.B;
    out.lbl = stats.lbl(m);
    out.router_z = stats.router_z(m);
    out.mean_prob = stats.mean_prob[static_cast<size_t>(m)];
    out.counts = stats.counts[static_cast<size_t>(m)];
    if (!quant_stats_.t.empty()) out.quant_stats = quant_stats_.t.slice(m, m + 1).view({8});
    moe_ffn_backward(ctx, p, exchange_step(slot, m, true), out, a.x_mid, a.ffn);
  } else {
    dense_ffn_backward(ctx, p, a.x_mid, plan_.dense_ffn(slot, l));
  }
  attention_backward(ctx, p, plan_.resid(slot, l), a.attn);
}

void Transformer::stage_forward(int64_t chunk, int64_t slot, const MicroBatch& mb) {
  MOE_CHECK(chunk >= 0 && chunk < pipeline_chunks() && slot >= 0 && slot < pipeline_slots(chunk), "activation slot ",
            slot, " of chunk ", chunk, " (", pipeline_chunks(), " chunks)");
  if (chunk == 0 && first_stage()) {
    check_shape(mb.ids, {dims_.B, dims_.S}, "ids");
    embed_forward(slot, mb.ids.view({dims_.T}));
  }
  const LayerRange r = chunks_[static_cast<size_t>(chunk)];
  for (int64_t l = r.begin; l < r.end; ++l) layer_forward(sublayer_context(mb, l), slot, l, mb, false);
}

void Transformer::head_step(int64_t slot, const MicroBatch& mb, StepStats& stats) {
  MOE_CHECK(last_stage(), "head_step needs the last pipeline stage (final norm and LM head)");
  check_shape(mb.labels, {dims_.B, dims_.S}, "labels");
  lm_head_loss_step(head_context(), head_weights(), stage_output(pipeline_chunks() - 1, slot), mb.labels.view({dims_.T}), mb.scales.ce_scale,
                    loss_.lm_z_coef, stats.ce(), stats.lm_z(), grads().final_norm, grads().lm_head, grad_writes());
}

void Transformer::stage_backward(int64_t chunk, int64_t slot, const MicroBatch& mb, StepStats& stats) {
  const LayerRange r = chunks_[static_cast<size_t>(chunk)];
  for (int64_t l = r.end - 1; l >= r.begin; --l) {
    const SublayerContext ctx = sublayer_context(mb, l);
    if (recompute_) layer_forward(ctx, slot, l, mb, /*recomputing=*/true);
    layer_backward(ctx, slot, l, mb, stats);
    grad_writes().zero_unwritten(l);  // before the hook may start reducing the layer's gradients
    if (layer_grads_hook_) layer_grads_hook_(l);
  }
  if (chunk == 0 && first_stage()) embed_backward(slot, mb.ids.view({dims_.T}));
}

void Transformer::embed_forward(int64_t slot, const Tensor& ids) {
  const Tensor& x = stage_input(0, slot);
  if (!cfg_.embedding_norm) {
    ops_.embedding_fwd(ids, params().embed, x);
    if (cfg_.embed_scale != 1.0) ops_.scale(x, cfg_.embed_scale);
    return;
  }
  const EmbedActs& e = plan_.embed(slot);  // x = RMSNorm(embed(ids) * scale), Olmo-core 3's order
  ops_.embedding_fwd(ids, params().embed, e.x0);
  if (cfg_.embed_scale != 1.0) ops_.scale(e.x0, cfg_.embed_scale);
  ops_.rmsnorm_fwd(e.x0, params().embed_norm, cfg_.norm_eps, x, e.rstd);
}

void Transformer::embed_backward(int64_t slot, const Tensor& ids) {
  Tensor dx0 = stage_grad();  // d(stage input): its last use, so scaled in place
  if (cfg_.embedding_norm) {
    const EmbedActs& e = plan_.embed(slot);
    dx0 = plan_.scratch().dy_TD;
    grad_writes().prepare(grads().embed_norm);
    ops_.rmsnorm_bwd(stage_grad(), e.x0, params().embed_norm, e.rstd, dx0, grads().embed_norm, false);
  }
  if (cfg_.embed_scale != 1.0) ops_.scale(dx0, cfg_.embed_scale);
  grad_writes().prepare(grads().embed);
  ops_.embedding_bwd(ids, dx0, grads().embed, cfg_.pad_id);
}

void Transformer::forward_backward(const MicroBatch& mb, StepStats& stats) {
  MOE_CHECK(first_stage() && last_stage(), "forward_backward runs the whole model (a stage: stage_forward/backward)");
  stage_forward(0, 0, mb);
  head_step(0, mb, stats);
  stage_backward(0, 0, mb, stats);
}

SublayerContext Transformer::sublayer_context(const MicroBatch& mb, int64_t l) {
  const int w = window_slot_[static_cast<size_t>(l)];
  MOE_CHECK(w < 0 || static_cast<size_t>(w) < mb.window_start.size(), "layer ", l,
            " has a sliding window but the micro-batch carries ", mb.window_start.size(),
            " window tables (build them with AttentionMasks)");
  SublayerContext ctx{ops_, cfg_, choice_, dims_, plan_.scratch(), w < 0 ? mb.doc_start : mb.window_start[static_cast<size_t>(w)]};
  ctx.rope = rope_layer_[static_cast<size_t>(l)] != 0;
  ctx.grad_writes = &grad_writes();
  return ctx;
}

void Transformer::forward_logits(const Tensor& ids, const Tensor& logits, const Tensor& host_doc_start) {
  MOE_CHECK(first_stage() && last_stage(), "forward_logits runs the whole model only");
  check_shape(logits, {dims_.T, cfg_.vocab_size}, "logits");
  AttentionMasks masks;
  masks.build(ops_, cfg_.attention_windows(), host_doc_start, dims_.B, dims_.S);
  MicroBatch mb;
  mb.ids = ids;
  masks.fill(mb, 0, dims_.B);
  stage_forward(0, 0, mb);
  lm_head_logits(head_context(), head_weights(), stage_output(0, 0), logits);
}

void Transformer::stage_loss(int64_t slot, const Tensor& labels, const Tensor& out) {
  MOE_CHECK(last_stage(), "stage_loss needs the last pipeline stage (final norm and LM head)");
  lm_head_eval_loss(head_context(), head_weights(), stage_output(pipeline_chunks() - 1, slot), labels.view({dims_.T}), out);
}

void Transformer::forward_loss(const MicroBatch& mb, const Tensor& out) {
  MOE_CHECK(first_stage() && last_stage(), "forward_loss runs the whole model (pipeline: Trainer::forward_loss)");
  stage_forward(0, 0, mb);
  stage_loss(0, mb.labels, out);
}

}  // namespace moe
