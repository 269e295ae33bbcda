#include "train/bench_alone.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <initializer_list>

#include "core/buffer.h"
#include "kernels/random_tensor.h"

namespace moe {
namespace {

// Seconds per call of f: after one call to warm up (primitives, packing buffers), kRounds rounds
// of enough calls to last kRoundSeconds, the median round: what the phases are compared with are
// means over the timed steps, and on a shared VM the fastest round of a few-ms kernel is one its
// vCPUs happened to have to themselves (such a VM's speed moves by a third within minutes).
constexpr int kRounds = 5;
constexpr double kRoundSeconds = 0.03;
template <class F> double seconds_per_call(Backend& ops, F&& f) {
  const auto timed = [&](int64_t calls) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < calls; ++i) f();
    ops.synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const double first = timed(1);
  const int64_t calls = std::max<int64_t>(1, static_cast<int64_t>(kRoundSeconds / std::max(first, 1e-6)));
  std::array<double, kRounds> round{};
  for (double& r : round) r = timed(calls) / static_cast<double>(calls);
  std::nth_element(round.begin(), round.begin() + kRounds / 2, round.end());
  return round[kRounds / 2];
}

// Random operands of one measurement, freed with it.
struct Operands {
  Backend& ops;
  std::vector<Buffer> keep;
  uint64_t seed = 1;
  Tensor operator()(DType t, std::initializer_list<int64_t> dims) { return random_tensor(ops, keep, t, dims, seed++); }
};

// y(M,N) = x(M,K) w(N,K)^T with operands of adt: forward, data and weight gradient.
double linear_alone(Backend& ops, DType adt, int64_t M, int64_t N, int64_t K) {
  Operands o{ops, {}};
  const Tensor x = o(adt, {M, K}), w = o(adt, {N, K}), dy = o(adt, {M, N});
  const Tensor y = o(DType::kF32, {M, N}), dx = o(DType::kF32, {M, K}), dw = o(DType::kF32, {N, K});
  return seconds_per_call(ops, [&] {
    ops.linear_fwd(x, w, y, false);
    ops.linear_bwd_data(dy, w, dx, false);
    ops.linear_bwd_weight(dy, x, dw, false);
  });
}

// The same for E experts of w (N,K) on rows[e] rows each.
double grouped_alone(Backend& ops, DType adt, const std::vector<int32_t>& rows, int64_t N, int64_t K) {
  const int64_t E = static_cast<int64_t>(rows.size());
  std::vector<int32_t> off(rows.size() + 1, 0);
  for (size_t e = 0; e < rows.size(); ++e) off[e + 1] = off[e] + rows[e];
  const int64_t R = std::max<int64_t>(off.back(), 1);
  Operands o{ops, {}};
  const Tensor x = o(adt, {R, K}), w = o(adt, {E, N, K}), dy = o(adt, {R, N});
  const Tensor y = o(DType::kF32, {R, N}), dx = o(DType::kF32, {R, K}), dw = o(DType::kF32, {E, N, K});
  o.keep.emplace_back(ops, off.size() * sizeof(int32_t));
  const Tensor offsets = o.keep.back().view(DType::kI32, {E + 1});
  ops.upload(off.data(), offsets);
  return seconds_per_call(ops, [&] {
    ops.grouped_linear_fwd(x, w, offsets, y);
    ops.grouped_linear_bwd_data(dy, w, offsets, dx);
    ops.grouped_linear_bwd_weight(dy, x, offsets, dw, false);
  });
}

// Causal attention over one micro-batch, forward and backward, as the step calls it.
double attention_alone(Backend& ops, DType adt, bool bf16, int64_t B, int64_t S, int64_t H, int64_t G, int64_t hd) {
  Operands o{ops, {}};
  const Tensor q = o(adt, {B, S, H, hd}), k = o(adt, {B, S, G, hd}), v = o(adt, {B, S, G, hd});
  const Tensor out = o(adt, {B, S, H, hd}), dout = o(DType::kF32, {B, S, H, hd}), lse = o(DType::kF32, {B, H, S});
  const Tensor dq = o(DType::kF32, {B, S, H, hd}), dk = o(DType::kF32, {B, S, G, hd}), dv = o(DType::kF32, {B, S, G, hd});
  return seconds_per_call(ops, [&] {
    ops.attention_fwd(q, k, v, out, lse, Tensor(), bf16);
    ops.attention_bwd(dout, q, k, v, out, lse, dq, dk, dv, Tensor(), bf16);
  });
}

// What the measurement does not model, or "" (see KernelsAlone).
std::string unmodelled(const Config& c) {
  const ModelConfig& m = c.model;
  if (c.train.backend != "cpu") return "the cpu backend only";
  if (c.train.precision != "fp32" && c.train.precision != "bf16") return "fp32 and bf16 steps only";
  if (m.num_experts == 0 || m.num_dense_layers() > 0) return "models whose every layer is MoE only";
  if (m.shared_width() > 0) return "models without shared experts only";
  if (c.data.intra_doc_mask) return "attention without document masks only";
  for (int64_t l = 0; l < m.n_layers; ++l)
    if (m.attention_window(l) > 0) return "attention without sliding windows only";
  return "";
}

}  // namespace

KernelsAlone time_kernels_alone(const Config& c, Backend& ops, const std::vector<std::vector<int32_t>>& counts) {
  KernelsAlone k;
  k.not_measured = unmodelled(c);
  if (k.not_measured.empty() && counts.size() != static_cast<size_t>(c.model.num_moe_layers()))
    k.not_measured = "no expert counts for every MoE layer";
  if (!k.not_measured.empty()) return k;
  const ModelConfig& m = c.model;
  const bool bf16 = c.train.precision == "bf16";
  const DType adt = bf16 ? DType::kBF16 : DType::kF32;
  const int64_t micro = c.train.micro_batch_size, S = c.train.seq_len, T = micro * S;
  const double batches = static_cast<double>(c.train.batch_size / micro);
  const int64_t D = m.d_model, H = m.n_heads, G = m.n_kv_heads, hd = m.hd(), E = m.num_experts, F = m.expert_hidden;
  auto& s = k.seconds;
  const auto at = [&](Phase p) -> double& { return s[static_cast<size_t>(p)]; };
  // Attention: q (D -> H x hd), o (H x hd -> D), k and v (D -> G x hd); the same in every layer.
  const double projections = linear_alone(ops, adt, T, H * hd, D) + linear_alone(ops, adt, T, D, H * hd) +
                             2 * linear_alone(ops, adt, T, G * hd, D);
  at(Phase::kAttention) = static_cast<double>(m.n_layers) * batches *
                          (projections + attention_alone(ops, adt, bf16, micro, S, H, G, hd));
  // The router reads its input widened to fp32 (model/moe_ffn.cpp), in every precision.
  at(Phase::kRouter) = static_cast<double>(m.num_moe_layers()) * batches * linear_alone(ops, DType::kF32, T, E, D);
  // Each MoE layer's experts on a micro-batch's share of the step's load: gate and up (F x D),
  // then down (D x F).
  for (const std::vector<int32_t>& layer : counts) {
    std::vector<int32_t> rows(layer.size());
    for (size_t e = 0; e < layer.size(); ++e) rows[e] = static_cast<int32_t>(static_cast<double>(layer[e]) / batches + 0.5);
    at(Phase::kExpertGemm) += batches * (2 * grouped_alone(ops, adt, rows, F, D) + grouped_alone(ops, adt, rows, D, F));
  }
  at(Phase::kLmHeadLoss) = batches * linear_alone(ops, adt, T, m.vocab_size, D);
  return k;
}

}  // namespace moe
