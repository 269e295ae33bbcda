#include "parity_common.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/rng.h"
#include "kernels/ops.h"
#include "common/test_util.h"
#include "train/trainer.h"

namespace moe::test {

Config parity_config() {
  Config c;
  ModelConfig& m = c.model;
  m.vocab_size = 64;
  m.d_model = 32;
  m.n_layers = 4;
  m.n_dense_layers = 1;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.num_experts = 8;
  m.top_k = 2;
  m.expert_hidden = 24;
  m.shared_hidden = 0;
  m.tie_embeddings = false;
  m.router_bias_gamma = 1e-3;
  c.loss.lm_z_coef = 1e-3;
  c.loss.lbl_coef = 0.01;
  c.loss.router_z_coef = 1e-3;
  c.optim.lr = 3e-3;
  c.optim.warmup_steps = 2;
  c.optim.max_grad_norm = 0.5;  // the first steps' norms are above: clipping triggers
  c.train.seq_len = 16;
  c.train.batch_size = 8;
  c.train.micro_batch_size = 1;
  c.train.steps = 10;
  c.train.seed = 7;
  return c;
}

void parity_batch(const Config& c, int64_t step, std::vector<int32_t>& ids, std::vector<int32_t>& labels) {
  const int64_t B = c.train.batch_size, S = c.train.seq_len;
  ids.resize(static_cast<size_t>(B * S));
  labels.resize(ids.size());
  for (int64_t i = 0; i < B * S; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>(
        random_words(99, static_cast<uint64_t>(step), static_cast<uint64_t>(i))[0] % static_cast<uint64_t>(c.model.vocab_size));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      // Row b labels only its first S - 1 - (b % 5) positions: unequal loss tokens per micro-batch.
      const bool labeled = s < S - 1 - (b % 5);
      labels[static_cast<size_t>(b * S + s)] = labeled ? ids[static_cast<size_t>(b * S + (s + 1) % S)] : -1;
    }
}

StepResult parity_step(Trainer& trainer, const Config& c, int64_t step) {
  std::vector<int32_t> ids, labels;
  parity_batch(c, step, ids, labels);
  const int64_t B = c.train.batch_size, S = c.train.seq_len;
  return trainer.step(Tensor(ids.data(), DType::kI32, {B, S}), Tensor(labels.data(), DType::kI32, {B, S}));
}

namespace {
RunResult run(const Config& c, ProcessGroups* groups, DType compute) {
  std::unique_ptr<Backend> ops = make_backend(compute == DType::kF64 ? "ref" : "cpu");
  Trainer trainer(c, *ops, compute, groups);
  RunResult out;
  train_steps(trainer, 0, c.train.steps, out);
  collect_params(trainer, out);
  return out;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }
}  // namespace

void train_steps(Trainer& trainer, int64_t from, int64_t to, RunResult& out) {
  const Config& c = trainer.config();
  ProcessGroups* groups = trainer.groups();
  const int64_t local = trainer.local_batch(), S = c.train.seq_len;
  const int64_t row0 = groups ? groups->coords.dp * local : 0;
  std::vector<int32_t> ids, labels;
  for (int64_t step = from; step < to; ++step) {
    parity_batch(c, step, ids, labels);
    Tensor tid(ids.data() + row0 * S, DType::kI32, {local, S}), tlab(labels.data() + row0 * S, DType::kI32, {local, S});
    StepResult r = trainer.step(tid, tlab);
    out.total.push_back(r.total);
    out.grad_norm.push_back(r.grad_norm);
    out.clipped.push_back(r.clipped);
  }
}

void collect_params(Trainer& trainer, RunResult& out) {
  const Transformer& model = trainer.model();
  const Tensor& flat = const_cast<Transformer&>(model).params().flat;
  for (const ParamInfo& info : model.layout().entries()) {
    std::vector<double>& v = out.params[info.name];
    v.clear();
    for (int64_t i = 0; i < info.numel; ++i) v.push_back(get(flat, info.offset + i));
    out.global_begin[info.name] = info.global_begin;
  }
  uint64_t h = 1469598103934665603ull;
  const auto* bytes = static_cast<const unsigned char*>(flat.data);
  for (size_t i = 0; i < static_cast<size_t>(model.layout().dense_end()) * dtype_size(flat.dtype); ++i)
    h = (h ^ bytes[i]) * 1099511628211ull;
  out.dense_hash = h;
}

RunResult run_single(const Config& c, DType compute) {
  Config single = c;
  single.parallel = ParallelConfig{};
  return run(single, nullptr, compute);
}

RunResult run_distributed(const Config& c, ProcessGroups& groups, DType compute) { return run(c, &groups, compute); }

void expect_parity(const RunResult& dist, const RunResult& single, double rel_tol) {
  ASSERT_EQ(dist.total.size(), single.total.size());
  bool any_clipped = false;
  for (size_t s = 0; s < single.total.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1));
    any_clipped = any_clipped || single.clipped[s];
    EXPECT_EQ(dist.clipped[s], single.clipped[s]);
    if (rel_tol == 0) {
      EXPECT_EQ(dist.total[s], single.total[s]);
      EXPECT_EQ(dist.grad_norm[s], single.grad_norm[s]);
    } else {
      EXPECT_LE(rel(dist.total[s], single.total[s]), rel_tol) << dist.total[s] << " vs " << single.total[s];
      EXPECT_LE(rel(dist.grad_norm[s], single.grad_norm[s]), rel_tol)
          << dist.grad_norm[s] << " vs " << single.grad_norm[s];
    }
  }
  EXPECT_TRUE(any_clipped) << "the parity config must make clipping trigger";
  EXPECT_FALSE(dist.params.empty());
  for (const auto& [name, mine] : dist.params) {
    SCOPED_TRACE(name);
    const auto it = single.params.find(name);
    ASSERT_NE(it, single.params.end());
    const int64_t begin = dist.global_begin.at(name);
    ASSERT_LE(static_cast<size_t>(begin) + mine.size(), it->second.size());
    double max_diff = 0, max_ref = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      const double ref = it->second[static_cast<size_t>(begin) + i];
      max_diff = std::max(max_diff, std::abs(mine[i] - ref));
      max_ref = std::max(max_ref, std::abs(ref));
    }
    if (rel_tol == 0) EXPECT_EQ(max_diff, 0.0);
    else EXPECT_LE(max_diff / max_ref, rel_tol);
  }
}

}  // namespace moe::test
