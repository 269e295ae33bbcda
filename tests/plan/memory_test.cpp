// The memory estimate of `moecore config` (plan/memory.cpp: from a Config) against the
// activation arena a model built from ModelOptions really allocates, for pre/peri norms, dense
// layers, shared experts, QK-norm variants, bf16 operands and block recompute: equal, since both
// run the same planning code; and the plan's sizes against shapes worked out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "config/config.h"
#include "kernels/ops.h"
#include "model/activations.h"
#include "plan/memory.h"
#include "parallel/parallelize.h"
#include "model/transformer.h"

namespace moe {
namespace {

struct Case {
  const char* name;
  std::vector<std::string> overrides;
};

TEST(MemoryEstimate, EqualsTheArena) {
  const std::vector<Case> cases = {
      {"pre fp32", {}},
      {"peri fp32", {"model.norm_placement=peri"}},
      {"dense + shared", {"model.n_dense_layers=1", "model.shared_hidden=48"}},
      {"bf16", {"train.precision=bf16"}},
      {"bf16 dense + shared peri", {"train.precision=bf16", "model.n_dense_layers=2", "model.shared_hidden=32",
                                    "model.norm_placement=peri"}},
      {"bf16 gated shared experts, logit biases", {"train.precision=bf16", "model.shared_hidden=16",
                                                   "model.shared_experts=3", "model.shared_router=true",
                                                   "model.shared_router_bias=true", "model.router_logit_bias=true"}},
      {"recompute", {"train.recompute=true"}},
      {"recompute bf16 dense", {"train.recompute=true", "train.precision=bf16", "model.n_dense_layers=1",
                                "model.qk_norm=per_head"}},
      {"all dense", {"model.n_dense_layers=3", "model.qk_norm=none", "model.dense_hidden=80"}},
      {"big vocab chunked head", {"model.vocab_size=70000", "model.tie_embeddings=true"}},
  };
  std::unique_ptr<Backend> ops = make_backend("cpu");
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    std::vector<std::string> o = {"model.vocab_size=96", "model.d_model=32", "model.n_layers=3", "model.n_heads=4",
                                  "model.n_kv_heads=2", "model.num_experts=4", "model.top_k=2",
                                  "model.expert_hidden=24", "train.seq_len=16", "train.micro_batch_size=3",
                                  "train.batch_size=3", "optim.warmup_steps=0"};
    o.insert(o.end(), k.overrides.begin(), k.overrides.end());
    Config c = parse_config("", o);
    const ModelOptions mo = model_options(c, DType::kF32, nullptr);
    Transformer model(c.model, c.loss, mo, *ops);
    const MemoryEstimate m = estimate_memory(c);
    const double arena = static_cast<double>(model.activation_arena_bytes());
    EXPECT_EQ(arena, m.activations);
    if (std::getenv("MOE_VERBOSE")) std::printf("%-26s arena %.0f\n", k.name, arena);
    const double N = static_cast<double>(c.model.num_params());
    EXPECT_EQ(m.params, 4 * N);
    EXPECT_EQ(m.grads, 4 * N);
    EXPECT_EQ(m.optimizer, 8 * N);
    EXPECT_EQ(m.operand_copies, mo.bf16_operands ? 2 * N : 0.0);
  }
}

// The plan's saved tensors of one dense, pre-norm, fp32 layer without QK-norm, counted by hand
// from docs/MODEL.md's data flow (fp32: the normed FFN input is its own GEMM operand).
TEST(MemoryEstimate, PlanHoldsTheHandCountedTensorsOfADenseLayer) {
  Config c = parse_config("", {"model.vocab_size=96", "model.d_model=32", "model.n_layers=1", "model.n_heads=4",
                               "model.n_kv_heads=2", "model.n_dense_layers=1", "model.qk_norm=none",
                               "model.dense_hidden=80"});
  const int64_t B = 3, S = 16, T = B * S, D = 32, H = 4, G = 2, hd = 8, F = 80;
  const Dims d = model_dims(c.model, B, S, DType::kF32, false);
  const ActivationPlan plan(c.model, d, StagePlan{0, 1, 1, false}, nullptr);
  const int64_t resid = 2 * T * D;                                      // into and after the layer
  const int64_t attn = T + T * D + T * (H + G + G + H) * hd + B * H * S;  // rstd, h, q k v o, lse
  const int64_t x_mid = T * D;
  const int64_t ffn = T + T * D + 3 * T * F;                            // rstd, h, gate up act
  EXPECT_EQ(plan.saved_tensor_bytes(), static_cast<size_t>(4 * (resid + attn + x_mid + ffn)));
  EXPECT_GT(plan.bytes(), plan.saved_tensor_bytes());  // + the shared scratch and the final norm
}

// train.backend = "cuda": the cpu attention's packing is not counted; the backend's kernel scratch
// and cuBLASLt workspace are, and with bf16 products and no document masking cuDNN attention's
// buffer at the backward's size: 4 bf16 copies (dO, dQ of B*S*H*hd, dK, dV of B*S*G*hd, each
// from a 256-byte boundary: q, k, v and o are saved in bf16) and the deterministic backward's
// dP workspace bound, B*H*ceil64(S)^2*2 bytes.
TEST(MemoryEstimate, CudaCountsTheBackendsBuffersAndCudnnAttention) {
  ::unsetenv("MOE_CUDA_SCRATCH_MB");
  Config c = parse_config("", {"train.precision=bf16", "train.micro_batch_size=2", "train.batch_size=4", "train.seq_len=100"});
  const MemoryEstimate cpu = estimate_memory(c);
  EXPECT_GT(cpu.kernel_scratch, 0);
  EXPECT_EQ(cpu.backend_buffers, 0);
  c.train.backend = "cuda";
  const MemoryEstimate bf16 = estimate_memory(c);
  const int64_t B = 2, S = 100, H = c.model.n_heads, G = c.model.n_kv_heads, hd = c.model.hd();
  const auto copy = [](int64_t n) { return static_cast<double>((2 * n + 255) / 256 * 256); };
  const double fixed = (64 + 32) * 1048576.0;
  const double cudnn = 2 * copy(B * S * H * hd) + 2 * copy(B * S * G * hd) + static_cast<double>(B * H * 128 * 128 * 2);
  EXPECT_EQ(bf16.kernel_scratch, 0);
  EXPECT_EQ(bf16.backend_buffers, fixed + cudnn);
  EXPECT_EQ(bf16.total(), cpu.total() - cpu.kernel_scratch + fixed + cudnn);
  c.data.intra_doc_mask = true;  // masked attention runs our kernel: no cuDNN buffer
  EXPECT_EQ(estimate_memory(c).backend_buffers, fixed);
  c.data.intra_doc_mask = false;
  c.train.precision = "fp32";
  EXPECT_EQ(estimate_memory(c).backend_buffers, fixed);
  ::setenv("MOE_CUDA_SCRATCH_MB", "16", 1);
  EXPECT_EQ(estimate_memory(c).backend_buffers, (16 + 32) * 1048576.0);
  ::unsetenv("MOE_CUDA_SCRATCH_MB");
  EXPECT_NE(format_memory(bf16).find("cuda: scratch, cuBLASLt, cuDNN attention"), std::string::npos);
}

// The cpu attention backward's buffers: its store of score-gradient tiles (rounds of (batch, kv
// head) pairs, as few as 16 MiB allows, evenly filled; a pair is H/G heads x the causal tile pairs
// // x 64 x 64 floats) and D = rowsum(dO * O), B*H*S floats; with the store off, D alone.
TEST(MemoryEstimate, CpuCountsTheAttentionBackwardsStore) {
  ::unsetenv("MOE_CPU_ATTENTION_STORE_MB");
  Config c = parse_config("", {"train.micro_batch_size=2", "train.batch_size=4", "train.seq_len=100"});
  const int64_t B = 2, S = 100, H = c.model.n_heads, G = c.model.n_kv_heads;
  const double pair = static_cast<double>(H / G) * 3 /* tile pairs of 2 tiles */ * 64 * 64 * 4;
  const double fit = std::min(static_cast<double>(B * G), std::floor(16 * 1048576.0 / pair));
  const double pairs = std::ceil(static_cast<double>(B * G) / std::ceil(static_cast<double>(B * G) / fit));
  const double D = 4.0 * static_cast<double>(B * H * S);
  EXPECT_EQ(estimate_memory(c).kernel_scratch, pairs * pair + D);
  // The default model: 8 heads, 4 kv heads: 8 pairs of 2 x 3 tiles (96 KiB). 0.52 MiB fits 5:
  // 2 rounds of 4.
  ASSERT_EQ(B * G, 8);
  ASSERT_EQ(pair, 98304.0);
  ::setenv("MOE_CPU_ATTENTION_STORE_MB", "0.52", 1);
  EXPECT_EQ(estimate_memory(c).kernel_scratch, 4 * pair + D);
  ::setenv("MOE_CPU_ATTENTION_STORE_MB", "0", 1);
  EXPECT_EQ(estimate_memory(c).kernel_scratch, D);
  ::unsetenv("MOE_CPU_ATTENTION_STORE_MB");
}

TEST(MemoryEstimate, FormatsBytesAndGiB) {
  Config c = parse_config("", {});
  const std::string s = format_memory(estimate_memory(c));
  for (const char* w : {"parameters", "gradients", "AdamW", "activations", "per layer per token", "GiB", "total"})
    EXPECT_NE(s.find(w), std::string::npos) << w << " missing in:\n" << s;
}

}  // namespace
}  // namespace moe
