// The closed-form memory estimate of `moecore config` (model/memory.cpp) against the activation
// arena the model really allocates, for pre/peri norms, dense layers, shared experts, QK-norm
// variants, bf16 operands and block recompute.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "config/config.h"
#include "kernels/ops.h"
#include "model/memory.h"
#include "model/transformer.h"

namespace moe {
namespace {

struct Case {
  const char* name;
  std::vector<std::string> overrides;
};

TEST(MemoryEstimate, ClosedFormEqualsTheArenaUpToAlignmentPadding) {
  const std::vector<Case> cases = {
      {"pre fp32", {}},
      {"peri fp32", {"model.norm_placement=peri"}},
      {"dense + shared", {"model.n_dense_layers=1", "model.shared_hidden=48"}},
      {"bf16", {"train.precision=bf16"}},
      {"bf16 dense + shared peri", {"train.precision=bf16", "model.n_dense_layers=2", "model.shared_hidden=32",
                                    "model.norm_placement=peri"}},
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
    ModelOptions mo;
    mo.bf16_operands = c.train.precision == "bf16";
    mo.recompute = c.train.recompute;
    mo.batch = c.train.micro_batch_size;
    mo.seq_len = c.train.seq_len;
    Transformer model(c.model, c.loss, mo, *ops);
    const MemoryEstimate m = estimate_memory(c);
    const double arena = static_cast<double>(model.activation_arena_bytes());
    // Each arena tensor is padded to 64 bytes: the arena exceeds the closed form by less than 64
    // bytes per tensor (at most ~60 tensors per planned layer, ~45 shared).
    const double layers = c.train.recompute ? 2 : static_cast<double>(c.model.n_layers);
    const double tolerance = 64.0 * (60.0 * layers + 45.0);
    EXPECT_GE(arena, m.activations);
    EXPECT_LT(arena - m.activations, tolerance) << "arena " << arena << " closed form " << m.activations;
    if (std::getenv("MOE_VERBOSE")) std::printf("%-26s arena %.0f closed form %.0f padding %.0f\n", k.name, arena, m.activations, arena - m.activations);
    const double N = static_cast<double>(c.model.num_params());
    EXPECT_EQ(m.params, 4 * N);
    EXPECT_EQ(m.grads, 4 * N);
    EXPECT_EQ(m.optimizer, 8 * N);
    EXPECT_EQ(m.operand_copies, mo.bf16_operands ? 2 * N : 0.0);
  }
}

TEST(MemoryEstimate, FormatsBytesAndGiB) {
  Config c = parse_config("", {});
  const std::string s = format_memory(estimate_memory(c));
  for (const char* w : {"parameters", "gradients", "AdamW", "activations", "per layer per token", "GiB", "total"})
    EXPECT_NE(s.find(w), std::string::npos) << w << " missing in:\n" << s;
}

}  // namespace
}  // namespace moe
