// Training-step properties: bitwise repeatability across runs and thread counts, loss
// normalization over micro-batches, the weight of auxiliary losses, block recompute, bf16.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>

#include "common/olmo_core3_options.h"
#include "common/small_config.h"
#include "common/test_util.h"
#include "core/rng.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/host_view.h"
#include "train/trainer.h"

namespace moe {
namespace {

// The shared small model, wider (d 48, 8 experts of 32, a shared expert of 16), with every
// auxiliary loss, over sequences longer than one 64-wide attention tile.
Config small_config() {
  Config c = test::small_config();
  ModelConfig& m = c.model;
  m.d_model = 48;
  m.num_experts = 8;
  m.expert_hidden = 32;
  m.shared_hidden = 16;
  c.loss.lbl_coef = 0.01;
  c.loss.router_z_coef = 1e-3;
  c.train.seq_len = 80;
  return c;
}

// Olmo-core 3's options on small_config (docs/MODEL.md): reordered norms, a scaled and normed
// embedding, a dense layer between MoE layers, sigmoid scores with their epsilon, L2-normed
// weights times K, scaled, attention biases, clip_qkv, partial RoPE, loss-free bias.
Config olmo_core3_config() {
  Config c = small_config();
  c.model.n_layers = 3;
  test::apply_olmo_core3_options(c.model, '1');
  c.model.router_bias_gamma = 1e-3;
  return c;
}

void synthetic_batch(int64_t B, int64_t S, int64_t V, uint64_t seed, int64_t step, OwnedTensor& ids, OwnedTensor& labels) {
  test::synthetic_batch(B, S, V, seed, step, ids, labels, static_cast<int64_t>(seed % 5));
}

struct Trace {
  std::vector<uint64_t> loss_bits, norm_bits;
  std::vector<double> losses;
};

uint64_t bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, 8);
  return u;
}

Trace train(const Config& c, int threads, int64_t steps) {
  const int saved = omp_get_max_threads();
  cpu::set_num_threads(threads);
  std::unique_ptr<Backend> ops = make_backend(c.train.backend);
  Trainer trainer(c, *ops, c.train.backend == "ref" ? DType::kF64 : DType::kF32);
  Trace t;
  for (int64_t s = 0; s < steps; ++s) {
    OwnedTensor ids, labels;
    synthetic_batch(c.train.batch_size, c.train.seq_len, c.model.vocab_size, c.train.seed, s, ids, labels);
    StepResult r = trainer.step(ids, labels);
    t.loss_bits.push_back(bits(r.total));
    t.norm_bits.push_back(bits(r.grad_norm));
    t.losses.push_back(r.total);
  }
  cpu::set_num_threads(saved);
  return t;
}

TEST(Step, RepeatsBitwiseWithOneAndTwoThreadsAndAcrossThreadCounts) {
  Config c = small_config();
  Trace a1 = train(c, 1, 4), b1 = train(c, 1, 4), a2 = train(c, 2, 4), b2 = train(c, 2, 4);
  EXPECT_EQ(a1.loss_bits, b1.loss_bits);
  EXPECT_EQ(a1.norm_bits, b1.norm_bits);
  EXPECT_EQ(a2.loss_bits, b2.loss_bits);
  EXPECT_EQ(a2.norm_bits, b2.norm_bits);
  // Stronger: no reduction depends on the thread count, so 1 and 2 threads agree too.
  EXPECT_EQ(a1.loss_bits, a2.loss_bits);
  EXPECT_EQ(a1.norm_bits, a2.norm_bits);
}

// The step a CUDA graph captures (tests/gpu/graph_test.cpp): enqueue_step_on_device leaves the update
// counter to the device, so two of them after two eager steps are steps 3 and 4, bitwise, on the
// strict backend (whose ops, like a replayed graph, only run in order on the device).
TEST(Step, DeviceOnlyStepsContinueAsTheNextSteps) {
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    Config c = small_config();
    c.train.precision = precision;
    c.train.backend = "strict";
    std::unique_ptr<Backend> ops_a = make_backend("strict"), ops_b = make_backend("strict");
    Trainer eager(c, *ops_a, DType::kF32), device_only(c, *ops_b, DType::kF32);
    OwnedTensor ids, labels;
    synthetic_batch(c.train.batch_size, c.train.seq_len, c.model.vocab_size, c.train.seed, 0, ids, labels);
    for (int s = 0; s < 4; ++s) eager.step(ids, labels);
    for (int s = 0; s < 2; ++s) device_only.step(ids, labels);
    for (int s = 0; s < 2; ++s) device_only.enqueue_step_on_device(ids, labels);
    ops_b->synchronize();
    const HostView a(*ops_a, eager.model().params().flat), b(*ops_b, device_only.model().params().flat);
    ASSERT_EQ(a.tensor().nbytes(), b.tensor().nbytes());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.tensor().nbytes()), 0);
  }
}

TEST(Step, RandomRoutingIsAlsoRepeatable) {
  Config c = small_config();
  c.model.routing = "random";
  EXPECT_EQ(train(c, 2, 3).loss_bits, train(c, 1, 3).loss_bits);
}

// Gradients and losses of one step with the given micro-batch size.
struct StepOutcome {
  StepResult r;
  OwnedTensor grads;
};

StepOutcome one_step(Config c, int64_t micro_batch, const OwnedTensor& ids, const OwnedTensor& labels) {
  c.train.micro_batch_size = micro_batch;
  std::unique_ptr<Backend> ops = make_backend(c.train.backend);
  Trainer trainer(c, *ops, c.train.backend == "ref" ? DType::kF64 : DType::kF32);
  StepOutcome o;
  o.r = trainer.compute_gradients(ids, labels);
  o.grads = test::clone(trainer.model().grads().flat);
  return o;
}

TEST(Step, LossIsNormalizedOverTheWholeStepNotPerMicroBatch) {
  // lbl_coef = 0: the Switch balancing loss is a product of per-micro-batch statistics, so only
  // the other terms are exactly independent of the split (its weight is tested below).
  for (const char* backend : {"ref", "cpu"}) {
    SCOPED_TRACE(backend);
    Config c = small_config();
    c.train.backend = backend;
    c.loss.lbl_coef = 0;
    OwnedTensor ids, labels;
    synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 1, 0, ids, labels);
    // Unequal loss tokens: the last two sequences keep only a few labels.
    for (int64_t i = 2 * c.train.seq_len; i < 4 * c.train.seq_len; ++i)
      if (i % 9 != 0) labels.as<int32_t>()[i] = -1;
    StepOutcome one = one_step(c, 4, ids, labels), two = one_step(c, 2, ids, labels), four = one_step(c, 1, ids, labels);
    // f64: the same math in another order, ~1e-15; f32: the 1e-6.
    const double tol = std::string(backend) == "ref" ? 1e-12 : 1e-6;
    EXPECT_NEAR(one.r.total, two.r.total, tol * one.r.total);
    EXPECT_NEAR(one.r.total, four.r.total, tol * one.r.total);
    EXPECT_NEAR(one.r.ce, two.r.ce, tol * one.r.ce);
    EXPECT_LT(test::rel_error(two.grads, one.grads), std::string(backend) == "ref" ? 1e-12 : 1e-5);
    EXPECT_LT(test::rel_error(four.grads, one.grads), std::string(backend) == "ref" ? 1e-12 : 1e-5);
  }
}

TEST(Step, AuxiliaryLossWeightDoesNotChangeWithTheNumberOfMicroBatches) {
  Config c = small_config();
  c.train.backend = "ref";
  c.loss.lbl_coef = 0.5;  // large, so a wrong weight would show
  OwnedTensor half_ids, half_labels;
  synthetic_batch(2, c.train.seq_len, c.model.vocab_size, 3, 0, half_ids, half_labels);
  // The batch is the same two sequences twice: every micro-batch split sees identical statistics.
  OwnedTensor ids(DType::kI32, {4, c.train.seq_len}), labels(DType::kI32, {4, c.train.seq_len});
  for (int k = 0; k < 2; ++k) {
    std::memcpy(ids.as<int32_t>() + k * half_ids.t.numel(), half_ids.t.data, half_ids.t.nbytes());
    std::memcpy(labels.as<int32_t>() + k * half_labels.t.numel(), half_labels.t.data, half_labels.t.nbytes());
  }
  StepOutcome one = one_step(c, 4, ids, labels), two = one_step(c, 2, ids, labels);
  for (size_t m = 0; m < one.r.lbl.size(); ++m) EXPECT_NEAR(one.r.lbl[m], two.r.lbl[m], 1e-12);
  EXPECT_NEAR(one.r.total, two.r.total, 1e-12 * one.r.total);
  EXPECT_LT(test::rel_error(two.grads, one.grads), 1e-12);
}

TEST(Step, BlockRecomputeGivesBitwiseEqualGradients) {
  for (int dense : {0, 1, 2}) {  // 2: Olmo-core 3's options, the dense layer in the middle
    Config c = dense == 2 ? olmo_core3_config() : small_config();
    c.model.n_layers = 3;
    if (dense < 2) c.model.n_dense_layers = dense;
    OwnedTensor ids, labels;
    synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 2, 0, ids, labels);
    StepOutcome plain = one_step(c, 2, ids, labels);
    c.train.recompute = true;
    StepOutcome again = one_step(c, 2, ids, labels);
    EXPECT_EQ(bits(plain.r.total), bits(again.r.total));
    EXPECT_TRUE(test::bitwise_equal(plain.grads, again.grads)) << "dense layers " << dense;
  }
}

TEST(Step, Bf16StepZeroLossIsWithinOneHundredthOfFp32) {
  for (bool oc3 : {false, true}) {
    SCOPED_TRACE(oc3 ? "olmo_core3 options" : "small config");
    Config c = oc3 ? olmo_core3_config() : small_config();
    OwnedTensor ids, labels;
    synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 4, 0, ids, labels);
    StepOutcome f32 = one_step(c, 2, ids, labels);
    c.train.precision = "bf16";
    StepOutcome b16 = one_step(c, 2, ids, labels);
    EXPECT_NEAR(b16.r.total, f32.r.total, 1e-2);
    EXPECT_NEAR(b16.r.ce, f32.r.ce, 1e-2);
  }
}

class Bf16Curve : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Step, Bf16Curve, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "olmo_core3" : "small"; });

TEST_P(Bf16Curve, LossCurveTracksFp32Within2Percent) {
  Config c = GetParam() ? olmo_core3_config() : small_config();
  c.train.steps = 300;
  c.optim.warmup_steps = 20;
  c.optim.lr = 3e-3;
  Trace f32 = train(c, 2, 300);
  c.train.precision = "bf16";
  Trace b16 = train(c, 2, 300);
  for (int64_t s = 0; s < 300; s += 25) {
    // Compare 25-step window means (single steps are noisy in both precisions alike).
    double a = 0, b = 0;
    for (int64_t i = s; i < s + 25; ++i) {
      a += f32.losses[static_cast<size_t>(i)];
      b += b16.losses[static_cast<size_t>(i)];
    }
    EXPECT_NEAR(b / a, 1.0, 0.02) << "steps " << s << "-" << s + 24 << ": fp32 " << a / 25 << ", bf16 " << b / 25;
  }
  EXPECT_LT(f32.losses.back(), 0.5 * f32.losses.front()) << "the synthetic task must be learned";
}

TEST(Step, NonFiniteLossIsCaughtAndNamesTheStep) {
  Config c = small_config();
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Trainer trainer(c, *ops, DType::kF32);
  trainer.model().params().embed.as<float>()[5 * c.model.d_model] = std::nanf("");  // row of token 5
  OwnedTensor ids, labels;
  synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 1, 0, ids, labels);
  for (int64_t i = 0; i < ids.t.numel(); ++i) ids.as<int32_t>()[i] = 5;
  try {
    trainer.step(ids, labels);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("non-finite values at step 1"), std::string::npos) << msg;
    const std::string name = trainer.first_nonfinite_grad();
    ASSERT_FALSE(name.empty());
    EXPECT_NE(msg.find("'" + name + "' (first offending tensor)"), std::string::npos) << msg;
  }
  EXPECT_EQ(trainer.steps_taken(), 0);
}

TEST(Step, FirstNonFiniteGradientIsNamedInLayoutOrder) {
  Config c = small_config();
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Trainer trainer(c, *ops, DType::kF32);
  OwnedTensor ids, labels;
  synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 1, 0, ids, labels);
  StepResult r = trainer.compute_gradients(ids, labels);
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(trainer.first_nonfinite_grad(), "");
  const auto& entries = trainer.model().layout().entries();
  ASSERT_GT(entries.size(), 6u);
  float* g = trainer.model().grads().flat.as<float>();
  g[entries[6].offset + entries[6].numel - 1] = INFINITY;  // last element of a later tensor
  g[entries[3].offset + 1] = std::nanf("");
  EXPECT_EQ(trainer.first_nonfinite_grad(), entries[3].name);
}

// A transient fault: the first parameter's gradient NaN after the reduction, once.
struct NanFirstGradient final : StepHooks {
  bool done = false;
  void after_gradients(Backend& ops, const ParamLayout& layout, const Tensor& grads, const StepStats&) override {
    if (!std::exchange(done, true)) ops.fill(param_view(layout.entries().front(), grads), std::nan(""));
  }
};

// A step names its first offending tensor from the per-parameter sums of squares that arrive
// with its one download: the same name the full scan gives, and no second read.
TEST(Step, NonFiniteStepNamesTheTensorFromItsOneDownload) {
  Config c = small_config();
  c.train.on_nonfinite = "skip";
  for (const char* backend : {"cpu", "strict"}) {
    SCOPED_TRACE(backend);
    std::unique_ptr<Backend> ops = make_backend(backend);
    Trainer trainer(c, *ops, DType::kF32);
    OwnedTensor ids, labels;
    synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 1, 0, ids, labels);
    NanFirstGradient nan_gradient;  // the first parameter's gradient, in this step
    trainer.set_step_hooks(&nan_gradient);
    const StepResult r = trainer.step(ids, labels);
    EXPECT_TRUE(r.skipped);
    EXPECT_EQ(r.nonfinite_tensor, trainer.model().layout().entries().front().name);
    EXPECT_EQ(r.transfers.to_host, 1u) << "the step's statistics only";
    EXPECT_EQ(trainer.first_nonfinite_grad(), r.nonfinite_tensor);
  }
}

TEST(Step, NonFiniteStepIsSkippedWhenConfigured) {
  Config c = small_config();
  c.train.on_nonfinite = "skip";
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Trainer trainer(c, *ops, DType::kF32);
  OwnedTensor ids, labels;
  synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 1, 0, ids, labels);
  float* w = trainer.model().params().embed.as<float>() + 5 * c.model.d_model;
  const float saved = *w;
  *w = std::nanf("");
  for (int64_t i = 0; i < ids.t.numel(); ++i) ids.as<int32_t>()[i] = 5;
  OwnedTensor before = test::clone(trainer.model().params().flat);
  StepResult r = trainer.step(ids, labels);
  EXPECT_FALSE(r.finite);
  EXPECT_TRUE(r.skipped);
  EXPECT_FALSE(r.nonfinite_tensor.empty());
  EXPECT_EQ(trainer.skipped_steps(), 1);
  EXPECT_EQ(trainer.steps_taken(), 0) << "no optimizer step on a skipped step";
  EXPECT_TRUE(test::bitwise_equal(trainer.model().params().flat, before.t)) << "parameters untouched";
  *w = saved;  // the next step is healthy again
  synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 1, 1, ids, labels);
  StepResult ok = trainer.step(ids, labels);
  EXPECT_TRUE(ok.finite);
  EXPECT_FALSE(ok.skipped);
  EXPECT_EQ(ok.step, 1);
  EXPECT_EQ(trainer.steps_taken(), 1);
  EXPECT_EQ(trainer.skipped_steps(), 1);
}

TEST(Step, MeanRouterProbabilitiesArePerLayerDistributions) {
  Config c = small_config();
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Trainer trainer(c, *ops, DType::kF32);
  OwnedTensor ids, labels;
  synthetic_batch(4, c.train.seq_len, c.model.vocab_size, 1, 0, ids, labels);
  StepResult r = trainer.step(ids, labels);
  ASSERT_EQ(r.mean_prob.size(), static_cast<size_t>(c.model.num_moe_layers()));
  for (const auto& p : r.mean_prob) {
    ASSERT_EQ(p.size(), static_cast<size_t>(c.model.num_experts));
    double sum = 0;
    for (double x : p) sum += x;
    EXPECT_NEAR(sum, 1.0, 1e-5) << "softmax router: the token-weighted mean over the step sums to 1";
  }
}

}  // namespace
}  // namespace moe
