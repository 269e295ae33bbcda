#include "model/activations.h"

#include <algorithm>

#include "core/buffer.h"

namespace moe {

Tensor ArenaPlan::operator()(DType dtype, std::initializer_list<int64_t> dims) {
  size_t need = Arena::footprint(dtype, dims);
  bytes += need;
  if (arena) return arena->alloc(dtype, dims);
  return Tensor(nullptr, dtype, dims);
}

void plan_layer(ArenaPlan& A, const ModelConfig& c, const Dims& d, int64_t layer, LayerActs& a) {
  const int64_t T = d.T, D = c.d_model, H = c.n_heads, G = c.n_kv_heads, hd = c.hd();
  const bool peri = c.norm_placement == "peri";
  const bool bf16 = d.adt != d.cdt;
  AttnActs& at = a.attn;
  at.rstd_in = A(d.cdt, {T});
  at.h_act = A(d.adt, {T, D});
  if (c.qk_norm != "none") {
    at.q_lin = A(d.cdt, {T, H * hd});
    at.k_lin = A(d.cdt, {T, G * hd});
    const int64_t qr = c.qk_norm == "per_head" ? T * H : T, kr = c.qk_norm == "per_head" ? T * G : T;
    at.rstd_q = A(d.cdt, {qr});
    at.rstd_k = A(d.cdt, {kr});
  }
  at.q = A(d.cdt, {d.B, d.S, H, hd});
  at.k = A(d.cdt, {d.B, d.S, G, hd});
  at.v = A(d.cdt, {d.B, d.S, G, hd});
  at.o = A(d.cdt, {d.B, d.S, H, hd});
  if (bf16) at.o_act = A(d.adt, {T, H * hd});
  at.lse = A(d.cdt, {d.B, H, d.S});
  if (peri) {
    at.out = A(d.cdt, {T, D});
    at.rstd_out = A(d.cdt, {T});
  }
  a.x_mid = A(d.cdt, {T, D});

  FfnActs& f = a.ffn;
  f.rstd_in = A(d.cdt, {T});
  const bool moe = c.is_moe_layer(layer);
  // The router reads the compute-dtype normed input; dense layers need it only as an operand.
  if (moe || !bf16) f.h = A(d.cdt, {T, D});
  f.h_act = bf16 ? A(d.adt, {T, D}) : f.h;
  const int64_t Fw = moe ? c.shared_hidden : c.dense_width();
  // SwiGLU inputs and expert outputs are saved in the operand dtype (bf16 mode: bf16); the
  // forward computes them in the compute dtype in scratch first.
  if (Fw > 0) {
    f.g = A(d.adt, {T, Fw});
    f.u = A(d.adt, {T, Fw});
    f.a_act = A(d.adt, {T, Fw});
  }
  if (moe) {
    const int64_t E = c.num_experts, K = c.top_k, R = d.R, F = c.expert_hidden;
    f.logits = A(d.cdt, {T, E});
    f.scores = A(d.cdt, {T, E});
    f.expert_idx = A(DType::kI32, {T, K});
    f.weights = A(d.cdt, {T, K});
    f.counts = A(DType::kI32, {E});
    f.offsets = A(DType::kI32, {E + 1});
    f.sorted_slot = A(DType::kI32, {R});
    f.slot_pos = A(DType::kI32, {R});
    f.xs_act = A(d.adt, {R, D});
    f.xr_act = f.xs_act;
    f.recv_offsets = f.offsets;  // with EP: the exchange plan's (set per forward)
    if (d.ep > 1) f.xr_act = A(d.adt, {d.Rx, D});
    f.eg = A(d.adt, {d.Rx, F});
    f.eu = A(d.adt, {d.Rx, F});
    f.ea_act = A(d.adt, {d.Rx, F});
    f.ys = A(d.adt, {R, D});
  }
  if (peri) {
    f.out = A(d.cdt, {T, D});
    f.rstd_out = A(d.cdt, {T});
  }
}

int64_t lm_head_chunk_rows(int64_t vocab_size, int64_t tokens) {
  constexpr int64_t kLogitsPerChunk = int64_t{1} << 26;
  return std::clamp<int64_t>(kLogitsPerChunk / std::max<int64_t>(vocab_size, 1), 1, std::max<int64_t>(tokens, 1));
}

void plan_scratch(ArenaPlan& A, const ModelConfig& c, const Dims& d, int64_t head_chunk, Scratch& s) {
  const int64_t T = d.T, D = c.d_model, H = c.n_heads, G = c.n_kv_heads, hd = c.hd();
  const int64_t E = c.num_experts, K = c.top_k, R = d.R;
  const bool any_moe = c.num_moe_layers() > 0;
  const bool any_dense = c.n_dense_layers > 0;
  s.dx = A(d.cdt, {T, D});
  s.dtmp = A(d.cdt, {T, D});
  s.dtmp2 = A(d.cdt, {T, D});
  s.dtmp3 = A(d.cdt, {T, D});
  s.dh = A(d.cdt, {T, D});
  s.fwd_dtmp = A(d.cdt, {T, D});
  s.dq = A(d.cdt, {d.B, d.S, H, hd});
  s.dk = A(d.cdt, {d.B, d.S, G, hd});
  s.dv = A(d.cdt, {d.B, d.S, G, hd});
  s.dO = A(d.cdt, {d.B, d.S, H, hd});
  s.dq_lin = A(d.cdt, {T, H * hd});
  s.dk_lin = A(d.cdt, {T, G * hd});
  // Rows x width of the largest SwiGLU activation: routed (Rx,F), dense (T,Fd), shared (T,Fs).
  const int64_t Rx = d.Rx;
  const bool ep = d.ep > 1;
  int64_t swiglu = 0;
  if (any_moe) swiglu = std::max({swiglu, Rx * c.expert_hidden, T * c.shared_hidden});
  if (any_dense) swiglu = std::max(swiglu, T * c.dense_width());
  swiglu = std::max<int64_t>(swiglu, 1);
  s.dg = A(d.cdt, {swiglu});
  s.du = A(d.cdt, {swiglu});
  s.da = A(d.cdt, {swiglu});
  if (d.adt != d.cdt) {
    s.fg = A(d.cdt, {swiglu});
    s.fu = A(d.cdt, {swiglu});
  }
  if (any_moe && (d.adt != d.cdt || ep)) s.fys = A(d.cdt, {Rx, D});
  if (any_moe) {
    s.dys = A(d.cdt, {R, D});
    s.dxs = A(d.cdt, {Rx, D});
    if (ep) {
      s.dyr = A(d.adt, {Rx, D});
      s.dxs2 = A(d.cdt, {Rx, D});
    }
    s.dweights = A(d.cdt, {T, K});
    s.dscores = A(d.cdt, {T, E});
    s.dlogits = A(d.cdt, {T, E});
    s.mean_prob = A(d.cdt, {E});
  }
  // Operand-dtype copy of any upstream gradient that feeds a GEMM.
  int64_t dy = std::max({T * D, T * H * hd, head_chunk * c.vocab_size, swiglu});
  if (any_moe) dy = std::max(dy, std::max(R, Rx) * D);
  s.dy_act = A(d.adt, {dy});
  s.logits = A(d.cdt, {head_chunk, c.vocab_size});
  s.row_ce = A(d.cdt, {head_chunk});
  s.row_z = A(d.cdt, {head_chunk});
}

}  // namespace moe
