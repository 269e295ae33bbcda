#include "model/memory.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "model/activations.h"
#include "model/params.h"
#include "moe/expert_exchange.h"
#include "parallel/layout.h"

namespace moe {

// The closed form. N = num_params(), T = B*S tokens per micro-batch, R = T*K expert rows,
// c = 4 (fp32 compute), a = operand bytes (2 in bf16 mode, else 4), bf = 1 in bf16 mode.
//   weights: params 4N, operand copies 2N*bf, grads 4N, AdamW 8N, router biases 4E*L_moe.
//   saved, per layer (Ha = H*hd, Ga = G*hd; q = T*H for per-head QK-norm else T, k likewise):
//     attention  c*T*(1 + 2Ha + 2Ga + H) + a*T*D  [+ c*(T*(Ha+Ga) + q + k) with QK-norm]
//                [+ a*T*Ha in bf16] [+ c*T*(D+1) peri]
//     x_mid      c*T*D
//     FFN        c*T + 3a*T*Fw  [+ c*T*D if MoE or fp32] [+ a*T*D in bf16] [+ c*T*(D+1) peri]
//                Fw = shared_hidden (MoE layer) or dense_width (dense layer)
//     MoE only   2c*T*E + 4*T*K + c*T*K + 4E + 4(E+1) + 8R + 2a*R*D + 3a*Rx*F
//                [+ a*Rx*D with EP: received rows; their group offsets are in the exchange plan,
//                model state of (2ep*E + E + El*ep + El + 5 + ep) i32 per slot and MoE layer, not here]
//   Rx = R, or with EP (ep > 1) expert_rows_bound: min(ep*T*min(K, E/ep), ceil(cf*K*T) if cf > 0),
//     the rows one rank's experts may receive (dropless worst case: the whole group routes to it).
//   kept per model: residual stream c*T*D*(L+1); final norm c*T + c*T*D [+ a*T*D in bf16].
//   layers planned: all L, or with recompute one (MoE-shaped if any MoE layer) plus one dense
//     layer when the model has both kinds.
//   A pipeline stage of L_s layers with P slots: residual stream c*T*D*(L_s+1)*P, its layers
//     P times (recompute: once, by the stage's kinds), final norm only on the last stage.
//   scratch (shared): c*T*D*6 + c*T*(2Ha + 2Ga) + c*T*(Ha+Ga) + c*W*(4 [+ 2 in bf16])
//     + [MoE: c*R*D + c*Rx*D [+ c*Rx*D in bf16 or EP] [+ (a+c)*Rx*D with EP] + c*T*K + 2c*T*E + c*E]
//     + a*max(T*D, T*Ha, Tc*V, W [, max(R,Rx)*D]) + c*T*D + c*Tc*(V + 2),
//     W = max(Rx*F, T*Fs [MoE], T*Fd [dense], 1), Tc = clamp(2^21/V, 1, T)
// Every tensor is padded to 64 bytes in the arena, so the real arena exceeds this by less than
// 64 bytes per tensor (tests/model/memory_test.cpp checks the bound).
namespace {

double layer_bytes(const ModelConfig& c, double T, double a, bool bf16, bool moe, double ep, double Rx) {
  const double D = static_cast<double>(c.d_model), H = static_cast<double>(c.n_heads),
               G = static_cast<double>(c.n_kv_heads), hd = static_cast<double>(c.hd());
  const double Ha = H * hd, Ga = G * hd, cb = 4;
  const bool peri = c.norm_placement == "peri";
  double b = cb * T * (1 + 2 * Ha + 2 * Ga + H) + a * T * D;
  if (c.qk_norm != "none") {
    const double q = c.qk_norm == "per_head" ? T * H : T, k = c.qk_norm == "per_head" ? T * G : T;
    b += cb * (T * (Ha + Ga) + q + k);
  }
  if (bf16) b += a * T * Ha;
  if (peri) b += cb * T * (D + 1);
  b += cb * T * D;  // x_mid
  const double Fw = static_cast<double>(moe ? c.shared_hidden : c.dense_width());
  b += cb * T + 3 * a * T * Fw;
  if (moe || !bf16) b += cb * T * D;
  if (bf16) b += a * T * D;
  if (peri) b += cb * T * (D + 1);
  if (moe) {
    const double E = static_cast<double>(c.num_experts), K = static_cast<double>(c.top_k), R = T * K,
                 F = static_cast<double>(c.expert_hidden);
    b += 2 * cb * T * E + 4 * T * K + cb * T * K + 4 * E + 4 * (E + 1) + 8 * R + 2 * a * R * D + 3 * a * Rx * F;
    if (ep > 1) b += a * Rx * D;
  }
  return b;
}

}  // namespace

MemoryEstimate estimate_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                               bool recompute, int64_t ep, double capacity_factor) {
  return estimate_stage_memory(c, micro_batch, seq_len, bf16, recompute, 0, c.n_layers, 1, ep, capacity_factor);
}

MemoryEstimate estimate_stage_memory(const ModelConfig& c, int64_t micro_batch, int64_t seq_len, bool bf16,
                                     bool recompute, int64_t layer_begin, int64_t layer_end, int64_t slots,
                                     int64_t ep, double capacity_factor, int64_t zero1_dp) {
  MemoryEstimate m;
  ModelShard shard;
  shard.layer_begin = layer_begin;
  shard.layer_end = layer_end;
  shard.num_local_experts = c.num_experts / ep;
  const bool whole = layer_begin == 0 && layer_end == c.n_layers && ep == 1;
  // A shard's parameters: its layers, its 1/ep of the experts (padding included).
  const ParamLayout held(c, shard, zero1_dp, std::max<int64_t>(zero1_dp / ep, 1));
  const double N = static_cast<double>(whole && zero1_dp == 1 ? c.num_params() : held.total());
  m.params = 4 * N;
  m.operand_copies = bf16 ? 2 * N : 0;
  m.grads = 4 * N;
  // ZeRO-1: the moments of one dense chunk (1/dp) and one expert chunk (1/edp).
  m.optimizer = zero1_dp > 1 ? 8.0 * (static_cast<double>(held.dense_end()) / static_cast<double>(zero1_dp) +
                                      static_cast<double>(held.total() - held.dense_end()) /
                                          static_cast<double>(std::max<int64_t>(zero1_dp / ep, 1)))
                             : 8 * N;
  m.router_bias = 4.0 * static_cast<double>(c.num_experts * c.num_moe_layers());

  const int64_t Ti = micro_batch * seq_len;
  const double T = static_cast<double>(Ti), a = bf16 ? 2 : 4, cb = 4, P = static_cast<double>(slots);
  const double D = static_cast<double>(c.d_model), H = static_cast<double>(c.n_heads),
               G = static_cast<double>(c.n_kv_heads), hd = static_cast<double>(c.hd());
  const double Ha = H * hd, Ga = G * hd, V = static_cast<double>(c.vocab_size);
  const double E = static_cast<double>(c.num_experts), K = static_cast<double>(c.top_k), R = T * K;
  const bool any_moe = c.num_moe_layers() > 0, any_dense = c.n_dense_layers > 0;
  const double epd = static_cast<double>(ep);
  const double Rx = ep > 1 ? static_cast<double>(expert_rows_bound(Ti, c.top_k, c.num_experts, ep, capacity_factor)) : R;
  const bool stage_moe = c.is_moe_layer(layer_end - 1), stage_dense = !c.is_moe_layer(layer_begin);

  double layers = 0;
  if (recompute) {
    layers = layer_bytes(c, T, a, bf16, stage_moe, epd, Rx);
    if (stage_moe && stage_dense) layers += layer_bytes(c, T, a, bf16, false, epd, Rx);
  } else {
    for (int64_t l = layer_begin; l < layer_end; ++l) layers += P * layer_bytes(c, T, a, bf16, c.is_moe_layer(l), epd, Rx);
  }
  double kept = cb * T * D * static_cast<double>(layer_end - layer_begin + 1) * P;
  if (layer_end == c.n_layers) kept += cb * T + a * T * D;  // final norm: rstd, output (operand dtype)

  const double Tc = static_cast<double>(lm_head_chunk_rows(c.vocab_size, Ti));
  double W = 0;
  if (any_moe) W = std::max({W, Rx * static_cast<double>(c.expert_hidden), T * static_cast<double>(c.shared_hidden)});
  if (any_dense) W = std::max(W, T * static_cast<double>(c.dense_width()));
  W = std::max(W, 1.0);
  double scratch = cb * T * D * 6 + cb * T * (2 * Ha + 2 * Ga) + cb * T * (Ha + Ga) + cb * W * (bf16 ? 5 : 3);
  if (any_moe) {
    scratch += cb * R * D + cb * Rx * D + cb * T * K + 2 * cb * T * E + cb * E;  // dys, dxs, ...
    if (bf16 || ep > 1) scratch += cb * Rx * D;                                // fys
    if (ep > 1) scratch += a * Rx * D + cb * Rx * D;                           // dyr, dxs2
  }
  double dy = std::max({T * D, T * Ha, Tc * V, W});
  if (any_moe) dy = std::max(dy, std::max(R, Rx) * D);
  scratch += a * dy + cb * Tc * (V + 2);

  m.activations = layers + kept + scratch;
  // bf16 mode: the attention kernel packs q, k, v and dO once per op (kernels/cpu/attention_bf16.h:
  // a bf16 copy, 64 bytes of alignment, and pair rows of ceil(S/2) positions; grow-only per slot,
  // so two slots of q's size and two of k's).
  if (bf16 && c.hd() % 2 == 0 && layer_end > layer_begin) {
    const double Bm = static_cast<double>(micro_batch), Sp = static_cast<double>((seq_len + 1) / 2);
    auto pack = [&](double row) { return 2 * T * row + 64 + 4 * Bm * Sp * row; };
    m.kernel_scratch = 2 * pack(Ha) + 2 * pack(Ga);
  }
  m.act_per_layer_token = layer_bytes(c, T, a, bf16, any_moe, epd, Rx) / T;
  m.act_shared = kept + scratch;
  return m;
}

MemoryEstimate estimate_memory(const Config& config) {
  const ParallelConfig& pc = config.parallel;
  const int64_t pp = pc.pp, zero1_dp = pc.zero1 ? pc.dp : 1;
  // Pipeline: the stage that needs the most (1F1B activation slots: min(pp - stage, micro-batches)).
  const int64_t micro = config.train.batch_size / (config.train.micro_batch_size * pc.dp);
  MemoryEstimate most;
  for (int64_t s = 0; s < pp; ++s) {
    const auto [begin, end] = configured_stage_layers(pc, config.model.n_layers, s);
    const MemoryEstimate m = estimate_stage_memory(config.model, config.train.micro_batch_size, config.train.seq_len,
                                                   config.train.precision == "bf16", config.train.recompute, begin,
                                                   end, pp == 1 ? 1 : std::min(pp - s, micro), pc.ep,
                                                   pc.ep_capacity_factor, zero1_dp);
    if (m.total() > most.total()) most = m;
  }
  return most;
}

std::string format_memory(const MemoryEstimate& m) {
  std::ostringstream o;
  auto line = [&](const char* name, double bytes) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "# memory %-34s %16.0f bytes %10.3f GiB\n", name, bytes, bytes / (1024.0 * 1024.0 * 1024.0));
    o << buf;
  };
  line("parameters (fp32 master)", m.params);
  if (m.operand_copies > 0) line("bf16 operand copies", m.operand_copies);
  line("gradients (fp32)", m.grads);
  line("AdamW state (2 x fp32)", m.optimizer);
  if (m.router_bias > 0) line("router biases", m.router_bias);
  line("activations (arena, one micro-batch)", m.activations);
  line("  of which per layer per token (MoE layer)", m.act_per_layer_token);
  line("  of which shared scratch + residual", m.act_shared);
  if (m.kernel_scratch > 0) line("kernel scratch (bf16 attention operands)", m.kernel_scratch);
  line("total", m.total());
  return o.str();
}

}  // namespace moe
