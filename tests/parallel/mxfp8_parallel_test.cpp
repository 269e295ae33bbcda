// MXFP8 experts under expert parallelism (model/mx_experts.h): the f64 reference path at EP = 2
// equals one process at the parity tolerance (1e-9, parity_test.cpp) with the quantized dispatch,
// without it, with recompute, with the attention projections in MXFP8 too and over the padded
// transport; and the dispatch's bytes on the wire
// are 33/32 per value (an e4m3 code plus an e8m0 scale per 32), from the byte counters.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "parallel/process_groups.h"
#include "parity_common.h"
#include "train/trainer.h"
#include "world.h"

namespace moe::test {
namespace {

Config mx_config(int64_t dp, int64_t ep) {
  Config c = parity_config();
  c.model.expert_hidden = 32;  // blocks of 32 along the expert width
  c.train.precision = "mxfp8";
  c.parallel.dp = dp;
  c.parallel.ep = ep;
  c.train.steps = 5;  // past warm-up and the first clipped steps; the ref f64 path is slow
  return c;
}

void expect_mx_parity(Config c) {
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  const RunResult dist = run_distributed(c, g, DType::kF64);
  const RunResult single = run_single(c, DType::kF64);
  expect_parity(dist, single, 1e-9);
}

TEST(Mxfp8Parallel, Ep2EqualsOneProcess) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  expect_mx_parity(mx_config(world().size(), 2));
}

TEST(Mxfp8Parallel, Ep2Variants) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  {
    SCOPED_TRACE("bf16 dispatch");
    Config c = mx_config(2, 2);
    c.mxfp8.dispatch = false;  // unquantized rows cross (f64 here), the experts' rank quantizes
    expect_mx_parity(c);
  }
  {
    SCOPED_TRACE("recompute, floor, e5m2 gradients");
    Config c = mx_config(2, 2);
    c.train.recompute = true;
    c.mxfp8.scale_rule = "floor";
    c.mxfp8.grad_format = "e5m2";
    expect_mx_parity(c);
  }
  {
    SCOPED_TRACE("attention projections too");  // MHA: the key/value width is a block
    Config c = mx_config(2, 2);
    c.model.n_kv_heads = 4;
    c.mxfp8.attention = true;
    expect_mx_parity(c);
  }
  {
    SCOPED_TRACE("padded transport");  // dropless: one process drops nothing either
    Config c = mx_config(2, 2);
    c.parallel.ep_transport = "padded";
    expect_mx_parity(c);
  }
}

uint64_t ep_bytes_of_one_step(const Config& c) {
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Trainer trainer(c, *ops, DType::kF32, &g);
  std::vector<int32_t> ids, labels;
  parity_batch(c, 0, ids, labels);
  const int64_t local = trainer.local_batch(), S = c.train.seq_len, row0 = g.coords.dp * local;
  const Tensor tid(ids.data() + row0 * S, DType::kI32, {local, S}), tlab(labels.data() + row0 * S, DType::kI32, {local, S});
  const uint64_t before = g.ep->stats().sent(CommOp::kSend);
  trainer.step(tid, tlab);
  return g.ep->stats().sent(CommOp::kSend) - before;
}

// Uniform routing at dp = ep = 2: each rank sends as many rows to the other as it gets back, X
// values each way. bf16 sends 2X (inputs) + 4X (outputs back, fp32) + 2X (output gradients) + 4X
// (input gradients back) = 12X; MXFP8 replaces the forward inputs by codes and scales, 33X/32.
TEST(Mxfp8Parallel, DispatchSends33Over32BytesPerValue) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  Config c = mx_config(2, 2);
  c.model.routing = "uniform";
  c.model.router_bias_gamma = 0;
  c.train.precision = "bf16";
  const uint64_t bf16 = ep_bytes_of_one_step(c);
  c.train.precision = "mxfp8";
  const uint64_t mx = ep_bytes_of_one_step(c);
  ASSERT_EQ(bf16 % (12 * 32), 0u);
  const uint64_t X = bf16 / 12;
  EXPECT_EQ(mx, X * 33 / 32 + 10 * X) << "bf16 " << bf16 << " bytes, mxfp8 " << mx;
  c.mxfp8.dispatch = false;
  EXPECT_EQ(ep_bytes_of_one_step(c), bf16) << "without the quantized dispatch the wire carries bf16";
}

}  // namespace
}  // namespace moe::test
