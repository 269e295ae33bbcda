// moecore bench on a tiny config: the phase rows sum to the step time and every MoE phase runs.
#include <gtest/gtest.h>

#include "config/config.h"
#include "train/bench.h"

namespace moe {
namespace {

TEST(Bench, PhasesSumToStepTimeAndMoePhasesAreNonZero) {
  const Config c = parse_config(R"(
[model]
vocab_size = 64
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
num_experts = 4
top_k = 2
expert_hidden = 32
[optim]
warmup_steps = 2
[train]
seq_len = 32
batch_size = 4
micro_batch_size = 2
steps = 10
)", {}, "bench test config");
  BenchOptions o;
  o.warmup = 1;
  o.steps = 3;
  const BenchResult r = run_bench(c, o);
  ASSERT_EQ(r.step_s.size(), 3u);
  EXPECT_GT(r.tokens_per_s, 0);
  EXPECT_LE(r.phase_error, 0.03) << "phases " << r.phase_sum_s << " s vs step " << r.mean_step_s << " s";
  for (Phase p : {Phase::kAttention, Phase::kRouter, Phase::kPermute, Phase::kExpertGemm, Phase::kCombine,
                  Phase::kLmHeadLoss, Phase::kOptimizer})
    EXPECT_GT(r.phase_s[static_cast<size_t>(p)], 0.0) << phase_name(p);
  EXPECT_EQ(r.alloc_steps, 0);  // no counter installed in the test binary
  EXPECT_FALSE(PhaseTimer::enabled());  // bench leaves the profiler off
}

}  // namespace
}  // namespace moe
