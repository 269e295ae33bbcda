#include "model/activations.h"

#include <algorithm>

#include "core/mxfp8.h"
#include "model/exchange_bounds.h"

namespace moe {

Tensor ArenaPlan::operator()(DType dtype, std::initializer_list<int64_t> dims) {
  const uint64_t at = bytes;
  bytes += Arena::footprint(dtype, dims);
  uint64_t n = dtype_size(dtype);
  for (int64_t d : dims) n *= static_cast<uint64_t>(d);
  tensor_bytes += n;
  if (arena) return arena->alloc(dtype, dims);
  if (!region.empty()) {
    MOE_CHECK(bytes <= region.nbytes(), "activation plan: a region of ", region.nbytes(), " bytes cannot hold ", bytes);
    return Tensor(static_cast<char*>(region.data) + at, dtype, dims, region.device);
  }
  return Tensor(nullptr, dtype, dims);
}

ArenaPlan ArenaPlan::within(const Tensor& storage) {
  ArenaPlan p;
  p.region = storage;
  return p;
}

MxMode mx_mode(const Config& config) {
  MxMode m;
  if (config.train.precision != "mxfp8") return m;
  m.experts = config.mxfp8.experts;
  m.dispatch = config.mxfp8.experts && config.mxfp8.dispatch;
  m.attention = config.mxfp8.attention;
  m.rule = config.mxfp8.scale_rule == "floor" ? mx::ScaleRule::kFloor : mx::ScaleRule::kRceil;
  m.grad_elem = config.mxfp8.grad_format == "e5m2" ? DType::kE5M2 : DType::kE4M3;
  return m;
}

Dims model_dims(const ModelConfig& c, int64_t batch, int64_t seq_len, DType compute, bool bf16_operands,
                int64_t ep, double capacity_factor, bool padded_exchange, const MxMode& mx) {
  Dims d;
  d.mx = mx;
  d.B = batch;
  d.S = seq_len;
  d.T = batch * seq_len;
  d.R = d.T * c.top_k;
  d.ep = ep;
  d.El = c.num_experts / ep;
  d.Rx = ep > 1 ? expert_rows_bound(d.T, c.top_k, c.num_experts, ep, capacity_factor) : d.R;
  d.slab_rows = ep > 1 && padded_exchange ? exchange_slab_rows(d.T, c.top_k, c.num_experts, ep, capacity_factor) : 0;
  d.cdt = compute;
  d.adt = bf16_operands ? DType::kBF16 : compute;
  return d;
}

namespace {

// One layer's attention activations (and x_mid, the residual stream after it).
void plan_attention(ArenaPlan& A, const ModelConfig& c, const ModelChoices& choice, const Dims& d, LayerActs& a) {
  const int64_t T = d.T, D = c.d_model, H = c.n_heads, G = c.n_kv_heads, hd = c.hd();
  const bool peri = choice.output_norm();
  const bool in_norm = choice.input_norm();  // reordered: sublayers read the residual stream itself
  const bool bf16 = d.adt != d.cdt;
  AttnActs& at = a.attn;
  if (in_norm) at.rstd_in = A(d.cdt, {T});
  const bool mx_attn = d.mx.attention;
  if (mx_attn) {  // saved quantized for the weight gradients (the bf16 normed input is scratch)
    at.h_q = A(DType::kE4M3, {T, D});
    at.h_qs = A(DType::kE8M0, {T, D / mx::kBlock});
  } else if (in_norm || bf16) {
    at.h_act = A(d.adt, {T, D});
  }
  if (choice.qk_norm != QkNorm::kNone) {  // the norms' inputs, for their backward (autocast: bf16)
    at.q_lin = A(d.adt, {T, H * hd});
    at.k_lin = A(d.adt, {T, G * hd});
    const bool per_head = choice.qk_norm == QkNorm::kPerHead;
    const int64_t qr = per_head ? T * H : T, kr = per_head ? T * G : T;
    at.rstd_q = A(d.cdt, {qr});
    at.rstd_k = A(d.cdt, {kr});
  }
  if (c.clip_qkv > 0) {
    at.q_pre = A(d.cdt, {T, H * hd});
    at.k_pre = A(d.cdt, {T, G * hd});
    at.v_pre = A(d.cdt, {T, G * hd});
  }
  // The attention products' operands and output, in the operand dtype (bf16 mode: as autocast's
  // scaled_dot_product_attention saves them; o is wo's operand too).
  at.q = A(d.adt, {d.B, d.S, H, hd});
  at.k = A(d.adt, {d.B, d.S, G, hd});
  at.v = A(d.adt, {d.B, d.S, G, hd});
  at.o = A(d.adt, {d.B, d.S, H, hd});
  if (mx_attn) {
    at.o_q = A(DType::kE4M3, {T, H * hd});
    at.o_qs = A(DType::kE8M0, {T, H * hd / mx::kBlock});
  }
  at.lse = A(d.cdt, {d.B, H, d.S});
  if (peri) {
    at.out = A(d.cdt, {T, D});
    at.rstd_out = A(d.cdt, {T});
  }
  a.x_mid = A(d.cdt, {T, D});
}

// An MoE layer's router, permutation and routed-expert activations.
void plan_routed_experts(ArenaPlan& A, const ModelConfig& c, const Dims& d, FfnActs& f) {
  const int64_t T = d.T, D = c.d_model;
  const int64_t E = c.num_experts, K = c.top_k, R = d.R, F = c.expert_hidden;
  f.logits = A(d.cdt, {T, E});
  f.scores = A(d.cdt, {T, E});
  f.expert_idx = A(DType::kI32, {T, K});
  f.weights = A(d.cdt, {T, K});
  f.counts = A(DType::kI32, {E});
  if (c.shared_router) {
    const int64_t Es = c.shared_experts;
    f.shared_logits = A(d.cdt, {T, Es});
    f.shared_scores = A(d.cdt, {T, Es});
    f.shared_w = A(d.cdt, {T, Es});
    f.shared_idx = A(DType::kI32, {T, Es});
    f.shared_pos = A(DType::kI32, {T * Es});
  }
  f.offsets = A(DType::kI32, {E + 1});
  f.sorted_slot = A(DType::kI32, {R});
  f.slot_pos = A(DType::kI32, {R});
  f.recv_offsets = f.offsets;  // with EP: the exchange plan's (set per forward)
  if (d.mx.experts) {  // the GEMMs' inputs saved quantized (the gathered rows are scratch)
    f.xr_q = A(DType::kE4M3, {d.Rx, D});
    f.xr_qs = A(DType::kE8M0, {d.Rx, D / mx::kBlock});
    f.ea_q = A(DType::kE4M3, {d.Rx, F});
    f.ea_qs = A(DType::kE8M0, {d.Rx, F / mx::kBlock});
  } else {
    // With EP the permuted rows are only sent (from scratch.xs_RD): the received ones are kept.
    f.xr_act = A(d.adt, {d.ep > 1 ? d.Rx : R, D});
    if (d.ep == 1) f.xs_act = f.xr_act;
    f.ea_act = A(d.adt, {d.Rx, F});
  }
  f.eg = A(d.adt, {d.Rx, F});
  f.eu = A(d.adt, {d.Rx, F});
  f.ys = A(d.adt, {R, D});
}

// One layer's FFN activations (dense SwiGLU, or the MoE layer's router, shared and routed experts).
void plan_ffn(ArenaPlan& A, const ModelConfig& c, const ModelChoices& choice, const Dims& d, int64_t layer,
              FfnActs& f) {
  const int64_t T = d.T, D = c.d_model;
  const bool peri = choice.output_norm();
  const bool in_norm = choice.input_norm();  // reordered: sublayers read the residual stream itself
  const bool bf16 = d.adt != d.cdt;
  if (in_norm) f.rstd_in = A(d.cdt, {T});
  const bool moe = c.is_moe_layer(layer);
  // fp32: the normed input is h, and h_act = h. bf16 mode keeps only the operand copy h_act: the
  // router reads it widened (as Olmo-core's bf16 model feeds its fp32 router), except with the
  // gated shared experts, whose router and the routed one read h. Reordered norms: both read
  // x_mid (the forward points h and, in fp32, h_act at it).
  if (in_norm && (!bf16 || (moe && c.shared_router))) f.h = A(d.cdt, {T, D});
  f.h_act = bf16 ? A(d.adt, {T, D}) : f.h;
  const int64_t Fw = moe ? c.shared_width() : c.dense_width();
  // SwiGLU inputs and expert outputs are saved in the operand dtype (bf16 mode: bf16); the
  // forward computes them in the compute dtype in scratch first.
  if (Fw > 0) {
    f.g = A(d.adt, {T, Fw});
    f.u = A(d.adt, {T, Fw});
    f.a_act = A(d.adt, {T, Fw});
  }
  if (moe) plan_routed_experts(A, c, d, f);
  if (peri) {
    f.out = A(d.cdt, {T, D});
    f.rstd_out = A(d.cdt, {T});
  }
}

// One layer's saved activations, carved in the order the arena lays them out.
void plan_layer(ArenaPlan& A, const ModelConfig& c, const ModelChoices& choice, const Dims& d, int64_t layer,
                LayerActs& a) {
  plan_attention(A, c, choice, d, a);
  plan_ffn(A, c, choice, d, layer, a.ffn);
}

void plan_scratch(ArenaPlan& A, const ModelConfig& c, const Dims& d, int64_t head_chunk, Scratch& s);

}  // namespace

int64_t lm_head_chunk_rows(int64_t vocab_size, int64_t tokens) {
  constexpr int64_t kLogitsPerChunk = int64_t{1} << 26;
  return std::clamp<int64_t>(kLogitsPerChunk / std::max<int64_t>(vocab_size, 1), 1, std::max<int64_t>(tokens, 1));
}

namespace {
// A tensor over the bytes of `storage` from byte `offset`: two scratch roles whose lifetimes never
// meet share the storage (measure mode: no data, only the check that the role fits).
Tensor alias(const Tensor& storage, uint64_t offset, DType dtype, std::initializer_list<int64_t> dims) {
  Tensor t(nullptr, dtype, dims, storage.device);
  MOE_CHECK(offset + t.nbytes() <= storage.nbytes(), "activation plan: a scratch role of ", t.nbytes(),
            " bytes at ", offset, " does not fit its storage of ", storage.nbytes());
  if (!storage.empty()) t.data = static_cast<char*>(storage.data) + offset;
  return t;
}

// The SwiGLU scratch, sized by the largest SwiGLU activation W: routed (Rx,F), dense (T,Fd),
// shared (T,Fs). The forward's roles (bf16 mode: the GEMMs' fp32 gate and up outputs;
// the gated shared and MXFP8 experts' fp32 product in dact_W) are dead before any backward of the
// stage starts (recompute re-runs a layer's forward before its backward), so they share storage
// with the backward's: dact_W (fp32), dgate_W and dup_W (GEMM operands only: the operand dtype,
// both in one fp32-sized buffer in bf16 mode; fp32 where the gated shared experts scale them
// first or the operands are fp32). With EP, dxs_up_XD and returned_RD are dact_W's storage too:
// the up part of the experts' input gradient is written after the SwiGLU backward has read dact,
// and rows come back after the experts' SwiGLU (forward) or after dxs_up is summed (backward).
void plan_swiglu_scratch(ArenaPlan& A, const ModelConfig& c, const Dims& d, Scratch& s) {
  const int64_t T = d.T, D = c.d_model, Rx = d.Rx;
  const bool any_moe = c.num_moe_layers() > 0;
  const bool any_dense = c.num_dense_layers() > 0;
  const bool bf16 = d.adt != d.cdt;
  const bool ep = any_moe && d.ep > 1;
  int64_t swiglu = 0;
  if (any_moe) swiglu = std::max({swiglu, Rx * c.expert_hidden, T * c.shared_width()});
  if (any_dense) swiglu = std::max(swiglu, T * c.dense_width());
  swiglu = std::max<int64_t>(swiglu, 1);
  const Tensor x = A(d.cdt, {std::max(swiglu, ep ? std::max(Rx, d.R) * D : 0)});
  s.dact_W = alias(x, 0, d.cdt, {swiglu});
  if (ep) {
    s.dxs_up_XD = alias(x, 0, d.cdt, {Rx, D});
    s.returned_RD = alias(x, 0, d.cdt, {d.R, D});
  }
  // The gated shared experts' and the MXFP8 experts' forward hold dact_W beside gate and up.
  const bool three = !bf16 || (any_moe && (c.shared_router || d.mx.experts));
  if (three) {
    s.dgate_W = A(d.cdt, {swiglu});
    s.dup_W = A(d.cdt, {swiglu});
    if (bf16) {
      s.gate_f32_W = s.dgate_W;
      s.up_f32_W = s.dup_W;
    }
  } else {
    const Tensor y = A(d.cdt, {swiglu});
    const uint64_t half = static_cast<uint64_t>(swiglu) * dtype_size(d.adt);
    s.dgate_W = alias(y, 0, d.adt, {swiglu});
    s.dup_W = alias(y, half, d.adt, {swiglu});
    s.gate_f32_W = s.dact_W;
    s.up_f32_W = y;
  }
}

// The MoE layers' scratch: expert rows' gradients, router gradients, load balancing, the
// exchange's slabs, MXFP8 codes. The experts' fp32 outputs (forward only) share dxs_XD (backward
// only).
void plan_moe_scratch(ArenaPlan& A, const ModelConfig& c, const Dims& d, Scratch& s) {
  const int64_t T = d.T, D = c.d_model, E = c.num_experts, K = c.top_k, R = d.R, Rx = d.Rx;
  const bool ep = d.ep > 1;
  s.dys_RD = A(d.adt, {R, D});  // only the experts' GEMMs read it: moe_combine_bwd rounds it
  // The permuted rows before they leave (EP's send buffer; MXFP8's rows before quantization):
  // the forward has sent (quantized) them before moe_combine_bwd writes dys_RD.
  if (ep || d.mx.experts) s.xs_RD = alias(s.dys_RD, 0, d.adt, {R, D});
  s.dxs_XD = A(d.cdt, {Rx, D});
  if (d.adt != d.cdt || ep) s.ys_f32_XD = s.dxs_XD;
  if (ep) s.dyr_XD = A(d.adt, {Rx, D});
  s.dweights_TK = A(d.cdt, {T, K});
  s.dscores_TE = A(d.cdt, {T, E});
  s.dlogits_TE = A(d.cdt, {T, E});
  if (c.shared_router) {
    const int64_t Es = c.shared_experts;
    s.dshared_w_TS = A(d.cdt, {T * Es});
    s.dshared_scores_TS = A(d.cdt, {T * Es});
    s.dshared_logits_TS = A(d.cdt, {T * Es});
    s.shared_zero_N = A(DType::kI32, {T * Es});
    s.shared_sorted_N = A(DType::kI32, {T * Es});
    s.shared_plan_3 = A(DType::kI32, {3});
  }
  s.mean_prob_E = A(d.cdt, {E});
  s.lbl_counts_E = A(DType::kI32, {E});
  if (d.slab_rows > 0) s.ep_slabs = A(d.cdt, {2 * d.ep * d.slab_rows * D});
  if (d.mx.experts) {
    const int64_t F = c.expert_hidden, b = mx::kBlock;
    if (ep && d.mx.dispatch) {
      s.mx_xs_q = A(DType::kE4M3, {R, D});
      s.mx_xs_qs = A(DType::kE8M0, {R, D / b});
    } else if (ep) {
      s.mx_xr_XD = A(d.adt, {Rx, D});
    }
    s.mx_dy_q = A(d.mx.grad_elem, {Rx, D});
    s.mx_dy_qs = A(DType::kE8M0, {Rx, D / b});
    s.mx_dh_q = A(d.mx.grad_elem, {Rx, F});
    s.mx_dh_qs = A(DType::kE8M0, {Rx, F / b});
    s.mx_deq_W = A(d.adt, {Rx * std::max(D, F)});
  }
}

void plan_scratch(ArenaPlan& A, const ModelConfig& c, const Dims& d, int64_t head_chunk, Scratch& s) {
  const int64_t T = d.T, D = c.d_model, H = c.n_heads, G = c.n_kv_heads, hd = c.hd();
  const bool any_moe = c.num_moe_layers() > 0;
  s.dresid_TD = A(d.cdt, {T, D});
  s.dy_TD = A(d.cdt, {T, D});
  s.dnormed_TD = A(d.cdt, {T, D});
  // v1's merge of shared and routed outputs (no gate): its forward sum (forward only) and the two
  // shares of the output gradient (backward only).
  const ModelChoices choice = model_choices(c);
  if (any_moe && c.shared_hidden > 0 && !c.shared_router && choice.shared_merge == SharedMerge::kV1) {
    s.droute_TD = A(d.cdt, {T, D});
    s.dshared_TD = A(d.cdt, {T, D});
    s.shared_out_TD = s.dshared_TD;
  }
  s.dq_BSHd = A(d.cdt, {d.B, d.S, H, hd});
  s.dk_BSGd = A(d.cdt, {d.B, d.S, G, hd});
  s.dv_BSGd = A(d.cdt, {d.B, d.S, G, hd});
  s.do_BSHd = A(d.cdt, {d.B, d.S, H, hd});
  if (choice.qk_norm != QkNorm::kNone) {  // dq_lin is written after attention_bwd has read do
    s.dq_lin_THd = alias(s.do_BSHd, 0, d.cdt, {T, H * hd});
    s.dk_lin_TGd = A(d.cdt, {T, G * hd});
  }
  if (c.attention_bias || c.router_logit_bias || c.shared_router_bias) s.ones_T1 = A(d.cdt, {T, 1});
  plan_swiglu_scratch(A, c, d, s);
  if (any_moe) plan_moe_scratch(A, c, d, s);
  if (d.mx.attention) {
    const int64_t W = std::max(D, H * hd);
    s.mx_attn_x_N = A(d.adt, {T * W});
    s.mx_attn_g_q = A(d.mx.grad_elem, {T * W});
    s.mx_attn_g_qs = A(DType::kE8M0, {T * W / mx::kBlock});
  }
  // Operand-dtype copy of any upstream gradient that feeds a GEMM.
  const int64_t dy = std::max({T * D, T * H * hd, head_chunk * c.vocab_size});
  s.dy_operand_N = A(d.adt, {dy});
  s.logits_CV = A(d.cdt, {head_chunk, c.vocab_size});
  s.row_ce_C = A(d.cdt, {head_chunk});
  s.row_z_C = A(d.cdt, {head_chunk});
}

}  // namespace

ActivationPlan::ActivationPlan(const ModelConfig& c, const Dims& d, const StagePlan& stage, Allocator* memory)
    : recompute_(stage.recompute), head_chunk_(lm_head_chunk_rows(c.vocab_size, d.T)) {
  chunks_ = stage.chunks;
  const std::vector<int64_t>& chunk_slots = stage.chunk_slots;
  MOE_CHECK(!chunks_.empty() && chunk_slots.size() == chunks_.size(), "activation plan: ", chunk_slots.size(),
            " slot counts for ", chunks_.size(), " chunks");
  for (const int64_t n : chunk_slots) MOE_CHECK(n >= 1, "activation slots = ", n, " must be at least 1");
  const ModelChoices choice = model_choices(c);
  // The stage's layer kinds, and one layer of each (dense layers may sit anywhere).
  int64_t a_moe = -1, a_dense = -1;
  for (const LayerRange& r : chunks_)
    for (int64_t l = r.begin; l < r.end; ++l) (c.is_moe_layer(l) ? a_moe : a_dense) = l;
  const bool stage_moe = a_moe >= 0, stage_dense = a_dense >= 0;
  const size_t n_chunks = chunks_.size();
  // Plan twice with memory: measure, then carve the same tensors, in the same order, out of
  // one arena. Measure mode stops after the first pass.
  for (int pass = 0; pass < (memory ? 2 : 1); ++pass) {
    ArenaPlan alloc;
    alloc.arena = pass == 0 ? nullptr : &arena_;
    resid_.assign(n_chunks, {});
    for (size_t k = 0; k < n_chunks; ++k) {
      const auto n_local = static_cast<size_t>(chunks_[k].end - chunks_[k].begin);
      resid_[k].assign(static_cast<size_t>(chunk_slots[k]), std::vector<Tensor>(n_local + 1));
      for (auto& slot : resid_[k])
        for (auto& r : slot) r = alloc(d.cdt, {d.T, c.d_model});
    }
    const size_t resid_bytes = alloc.bytes;
    if (stage.recompute) {
      // One layer's set, shared by every layer (each is recomputed just before its backward).
      acts_.assign(1, std::vector<std::vector<LayerActs>>(1, std::vector<LayerActs>(1)));
      LayerActs& one = acts_[0][0][0];
      recompute_dense_ = stage_moe && stage_dense;
      recompute_dense_ffn_ = FfnActs();
      if (!recompute_dense_) {
        plan_layer(alloc, c, choice, d, stage_moe ? a_moe : a_dense, one);
      } else {  // the MoE and the dense FFN sets over the same bytes, as large as the larger
        plan_attention(alloc, c, choice, d, one);
        ArenaPlan moe_size, dense_size;
        FfnActs unused;
        plan_ffn(moe_size, c, choice, d, a_moe, unused);
        plan_ffn(dense_size, c, choice, d, a_dense, unused);
        const Tensor ffn = alloc(DType::kF32, {static_cast<int64_t>(std::max(moe_size.bytes, dense_size.bytes) / 4)});
        ArenaPlan moe_ffn = ArenaPlan::within(ffn), dense_ffn = ArenaPlan::within(ffn);
        plan_ffn(moe_ffn, c, choice, d, a_moe, one.ffn);
        plan_ffn(dense_ffn, c, choice, d, a_dense, recompute_dense_ffn_);
      }
    } else {
      acts_.assign(n_chunks, {});
      for (size_t k = 0; k < n_chunks; ++k) {
        const LayerRange r = chunks_[k];
        acts_[k].assign(static_cast<size_t>(chunk_slots[k]), std::vector<LayerActs>(static_cast<size_t>(r.end - r.begin)));
        for (auto& slot : acts_[k])
          for (int64_t l = r.begin; l < r.end; ++l) plan_layer(alloc, c, choice, d, l, slot[static_cast<size_t>(l - r.begin)]);
      }
    }
    layer_bytes_ = alloc.bytes - resid_bytes;
    saved_bytes_ = alloc.tensor_bytes;
    plan_scratch(alloc, c, d, head_chunk_, scratch_);
    embed_.assign(chunks_.front().begin == 0 && c.embedding_norm ? static_cast<size_t>(chunk_slots.front()) : 0,
                  EmbedActs());
    for (EmbedActs& e : embed_) {
      e.x0 = alloc(d.cdt, {d.T, c.d_model});
      e.rstd = alloc(d.cdt, {d.T});
    }
    if (chunks_.back().end == c.n_layers) {
      final_norm_.rstd = alloc(d.cdt, {d.T});
      final_norm_.out_act = alloc(d.adt, {d.T, c.d_model});
    }
    if (pass == 0) {
      bytes_ = alloc.bytes;
      if (memory) {
        const AllocationScope scope("the activation arena (saved activations and scratch)");
        arena_ = Arena(*memory, alloc.bytes);
      }
    }
  }
}

}  // namespace moe
