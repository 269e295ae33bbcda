// Layouts against one process on the same global batches (parity_common.h). Every rank runs the
// single-process reference locally, so no files or rank 0 broadcast are needed.
//
// Why f64 (ref backend) and 1e-9: a data-parallel all-reduce sums the replicas' gradients in
// another order than one process accumulates micro-batches. In fp32 that moves losses and grad
// norms by ~1e-7 relative (checked below too), but AdamW divides each element's moment by its own
// RMS, so an element whose gradient nearly cancels turns a rounding difference into a visible
// update difference (fp32: up to 2.5e-6 of max|param| after 10 steps, DP=2). In f64 the same
// reordering is ~1e-16, so any real mistake (a missing or doubled contribution, a wrong scale)
// stands out by many orders of magnitude under a 1e-9 bound. Pipeline parallelism alone reorders
// nothing and must be bitwise equal (pipeline_test.cpp).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "common/olmo_core3_options.h"
#include "parity_common.h"
#include "train/trainer.h"
#include "world.h"

namespace moe::test {
namespace {

// Dense replicas must hold the same bits after the run: all-gather the hashes over dp.
void expect_dense_replicas_equal(const RunResult& r, ProcessGroups& g) {
  std::vector<uint64_t> all(static_cast<size_t>(g.dp->size()));
  g.dp->all_gather(&r.dense_hash, all.data(), 2, DType::kI32);  // 64 bits as two i32
  for (size_t i = 1; i < all.size(); ++i) EXPECT_EQ(all[i], all[0]) << "dp replica " << i << " differs";
}

struct Compared {
  RunResult dist, single;
};

// The layout in c.parallel (over the whole world) against one process.
Compared compare(const Config& c, DType compute) {
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  Compared out{run_distributed(c, g, compute), run_single(c, compute)};
  expect_dense_replicas_equal(out.dist, g);
  return out;
}

void expect_f64_parity(const Config& c) {
  const Compared r = compare(c, DType::kF64);
  expect_parity(r.dist, r.single, 1e-9);
}

Config dp_config(int n) {
  Config c = parity_config();
  c.parallel.dp = n;
  return c;
}

TEST(Parity, DataParallel) {
  if (world().size() == 1) GTEST_SKIP() << "needs two or more ranks";
  expect_f64_parity(dp_config(world().size()));
}

// ZeRO-1: reduce-scatter, update the owned chunk, all-gather (yet another summation order).
TEST(Parity, Zero1) {
  if (world().size() == 1) GTEST_SKIP() << "needs two or more ranks";
  Config c = dp_config(world().size());
  c.parallel.zero1 = true;
  expect_f64_parity(c);
}

// DDP with per-layer all-reduces started during the backward: the same sums as after it.
TEST(Parity, OverlappedGradientReduction) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "needs two or more ranks";
  Config c = dp_config(n);
  c.parallel.ep = 2;  // experts reduced over edp (size 1 at n=2)
  c.parallel.overlap_grad_reduce = true;
  if (n == 4) {  // and a pipeline: each stage reduces its own layers
    c.parallel.pp = 2;
    c.parallel.dp = 2;
  }
  expect_f64_parity(c);
}

// Every dimension at once (np=4: pp=2 x dp=2, ep=2, ZeRO-1), and at np=8 pp=2 x dp=4, ep=2.
TEST(Parity, PipelineDataExpertZero1) {
  const int n = world().size();
  if (n != 4 && n != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  Config c = parity_config();
  c.parallel.pp = 2;
  c.parallel.dp = n / 2;
  c.parallel.ep = 2;
  c.parallel.zero1 = true;
  expect_f64_parity(c);
}

// Olmo-core 3's options together (docs/MODEL.md): reordered norms, scaled and normed embedding,
// a dense layer inside the stack, per-head QK-norm, sigmoid scores with their epsilon, L2-normed
// weights times K, a scale and sqrt(original_top_k / K), two gated shared experts, the routers'
// logit biases, attention biases, clip_qkv, partial RoPE, loss-free bias.
Config olmo_core3_options_config() {
  Config c = parity_config();
  apply_olmo_core3_options(c.model, '2');
  c.model.shared_hidden = 16;
  c.loss.lbl_granularity = "instance";  // per sequence: every layout splits the same sequences
  c.train.micro_batch_size = 2;         // two sequences per micro-batch (one would be local_batch)
  return c;
}

// Olmo-core 3's global load balancing at dp = n, one micro-batch per rank, equals one process
// whose single micro-batch holds the same sequences with local-batch balancing: E/K times the
// group's summed counts over n, dotted with each rank's mean probabilities and summed over the
// ranks, is the whole batch's counts dotted with its mean probabilities. With EP (the counts are
// the tokens' ranks') and with a pipeline (the dp group of each stage).
TEST(Parity, GlobalLoadBalancingEqualsOneProcessOverTheWholeBatch) {
  const int n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  // {dp, ep, pp}
  std::vector<std::array<int64_t, 3>> cases = {{n, 1, 1}, {n, 2, 1}};
  if (n == 4) cases.push_back({2, 2, 2});
  for (const auto& k : cases) {
    SCOPED_TRACE(testing::Message() << "dp " << k[0] << " ep " << k[1] << " pp " << k[2]);
    Config c = parity_config();
    c.parallel.dp = k[0];
    c.parallel.ep = k[1];
    c.parallel.pp = k[2];
    c.train.micro_batch_size = c.train.batch_size / k[0];
    c.loss.lbl_granularity = "global";
    ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
    const RunResult dist = run_distributed(c, g, DType::kF64);
    Config one = c;
    one.parallel = ParallelConfig{};
    one.train.micro_batch_size = c.train.batch_size;
    one.loss.lbl_granularity = "local_batch";
    expect_parity(dist, run_single(one, DType::kF64), 1e-9);
    // ... which the local loss of the same layout is not.
    Config local = c;
    local.loss.lbl_granularity = "local_batch";
    const RunResult loc = run_distributed(local, g, DType::kF64);
    EXPECT_GT(std::abs(loc.total[0] - dist.total[0]), 1e-6 * std::abs(dist.total[0]));
  }
}

// ... in every layout of the matrix: DP + ZeRO-1, DP x EP over each expert transport, the
// pipeline (a stage that starts with the dense layer), interleaved (one layer per chunk), and at
// 4 ranks all of them with recompute.
TEST(Parity, OlmoCore3OptionsInEveryLayout) {
  const int n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  // {dp, ep, pp, zero1, padded transport, recompute, pp_interleave}
  std::vector<std::array<int64_t, 7>> cases = {{n, 1, 1, 1, 0, 0, 1},     {n, n, 1, 0, 0, 0, 1},
                                               {n, 2, 1, 0, 1, 0, 1},     {n / 2, 1, 2, 0, 0, 0, 1},
                                               {n / 2, 1, 2, 0, 0, 0, 2}};
  if (n == 4) cases.push_back({2, 2, 2, 1, 1, 1, 2});
  for (const auto& k : cases) {
    SCOPED_TRACE(testing::Message() << "dp " << k[0] << " ep " << k[1] << " pp " << k[2] << " zero1 " << k[3]
                                    << " padded " << k[4] << " recompute " << k[5] << " interleave " << k[6]);
    Config c = olmo_core3_options_config();
    c.parallel.dp = k[0];
    c.parallel.ep = k[1];
    c.parallel.pp = k[2];
    c.parallel.zero1 = k[3] != 0;
    if (k[4] != 0) c.parallel.ep_transport = "padded";
    c.train.recompute = k[5] != 0;
    c.parallel.pp_interleave = k[6];
    expect_f64_parity(c);
  }
}

// The fast fp32 path: per-step loss and grad norm within 1e-6 (parameters: see the top).
TEST(Parity, DataParallelFp32LossAndNorm) {
  if (world().size() == 1) GTEST_SKIP() << "needs two or more ranks";
  const Compared r = compare(dp_config(world().size()), DType::kF32);
  for (size_t s = 0; s < r.single.total.size(); ++s) {
    EXPECT_NEAR(r.dist.total[s], r.single.total[s], 1e-6 * std::abs(r.single.total[s])) << "step " << s + 1;
    EXPECT_NEAR(r.dist.grad_norm[s], r.single.grad_norm[s], 1e-6 * r.single.grad_norm[s]) << "step " << s + 1;
  }
}

// bf16 GEMM operands with block recompute under DP + ZeRO-1: the first step (same weights
// everywhere) matches one process to 1e-6; later steps differ by bf16 rounding of weights that
// moved by reduction-order amounts, so they are only required to stay close (1e-3), and the
// dense replicas must still be bitwise equal.
TEST(Parity, DataParallelBf16Recompute) {
  if (world().size() == 1) GTEST_SKIP() << "needs two or more ranks";
  Config c = dp_config(world().size());
  c.train.precision = "bf16";
  c.train.recompute = true;
  c.parallel.zero1 = true;
  const Compared r = compare(c, DType::kF32);
  EXPECT_NEAR(r.dist.total[0], r.single.total[0], 1e-6 * std::abs(r.single.total[0]));
  EXPECT_NEAR(r.dist.grad_norm[0], r.single.grad_norm[0], 1e-6 * r.single.grad_norm[0]);
  for (size_t s = 1; s < r.single.total.size(); ++s)
    EXPECT_NEAR(r.dist.total[s], r.single.total[s], 1e-3 * std::abs(r.single.total[s])) << "step " << s + 1;
}

// Optimizer-state memory per rank against dp, on the default model (printed for the notes):
// ZeRO-1 holds 1/dp of the moments (plus at most 16 x dp padding elements per region).
TEST(Zero1, OptimizerStatePerRankShrinksWithDp) {
  const int n = world().size();
  Config c = parse_config("", {"train.micro_batch_size=1"});
  c.parallel.dp = n;
  std::unique_ptr<Backend> ops = make_backend("cpu");
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  Trainer plain(c, *ops, DType::kF32, n > 1 ? &g : nullptr);
  c.parallel.zero1 = true;
  Trainer sharded(c, *ops, DType::kF32, n > 1 ? &g : nullptr);
  const double full = static_cast<double>(plain.optimizer().state_bytes());
  const double mine = static_cast<double>(sharded.optimizer().state_bytes());
  if (world().rank() == 0)
    std::printf("[ zero1    ] dp=%d: Adam state per rank %.2f MB (ZeRO-1) vs %.2f MB (replicated), ratio %.3f\n", n,
                mine / 1e6, full / 1e6, mine / full);
  const double padding = 2.0 * 2 * 16 * n * sizeof(float);  // two moments, two regions
  EXPECT_LE(mine, full / n + padding);
  EXPECT_GE(mine, full / n - padding);
}

}  // namespace
}  // namespace moe::test
