// Pipeline parallelism (src/parallel/pipeline.h): the 1F1B order and its activation slots, the
// stage layout (configured boundaries, memory per stage), and parity with one process on the same
// global batches. PP alone reorders no floating-point sum (every stage accumulates its gradients
// in micro-batch order; loss and grad-norm partials of the other stages are exact zeros), so it
// must be bitwise equal; PP x DP inherits DP's all-reduce reordering (f64, 1e-9, see
// parity_test.cpp). Tests needing a world size skip on the others. Interleaved 1F1B:
// interleaved_pipeline_test.cpp; the bubble of both: PipelineBubble below.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "data/token_file.h"
#include "kernels/ops.h"
#include "plan/memory.h"
#include "plan/pipeline_sim.h"
#include "parallel/process_groups.h"
#include "parity_common.h"
#include "train/metrics.h"
#include "parallel/pipeline.h"
#include "train/trainer.h"
#include "world.h"

namespace moe::test {
namespace {

// Canonical 1F1B of stage s of P over M micro-batches, written out independently of
// one_f_one_b: P - s - 1 warm-up forwards (at most M), steady pairs "F(w+i) B(i)", then drain.
std::string action(char kind, int64_t micro) {
  std::string s(1, kind);
  s += std::to_string(micro);
  return s;
}

std::vector<std::string> canonical_1f1b(int64_t P, int64_t s, int64_t M) {
  std::vector<std::string> order;
  const int64_t warmup = P - s - 1 < M ? P - s - 1 : M;
  for (int64_t i = 0; i < warmup; ++i) order.push_back(action('F', i));
  for (int64_t i = 0; i + warmup < M; ++i) {
    order.push_back(action('F', i + warmup));
    order.push_back(action('B', i));
  }
  for (int64_t i = M - warmup; i < M; ++i) order.push_back(action('B', i));
  return order;
}

// Most micro-batches whose activations a stage held at once (forwarded, not yet backwarded).
int64_t max_in_flight(const std::vector<std::string>& log) {
  int64_t now = 0, most = 0;
  for (const std::string& a : log) {
    now += a[0] == 'F' ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

std::vector<std::string> names(const std::vector<PipelineAction>& actions) {
  std::vector<std::string> out;
  for (const auto& a : actions) out.push_back(a.name());
  return out;
}

TEST(PipelineSchedule, OneFOneBIsCanonicalAndBounded) {
  // A hand-written case (pp=4, M=5).
  EXPECT_EQ(names(one_f_one_b(4, 0, 5)),
            (std::vector<std::string>{"F0", "F1", "F2", "F3", "B0", "F4", "B1", "B2", "B3", "B4"}));
  EXPECT_EQ(names(one_f_one_b(4, 3, 2)), (std::vector<std::string>{"F0", "B0", "F1", "B1"}));
  EXPECT_EQ(names(one_f_one_b(4, 1, 1)), (std::vector<std::string>{"F0", "B0"}));
  for (int64_t P = 1; P <= 5; ++P)
    for (int64_t M = 1; M <= 11; ++M)
      for (int64_t s = 0; s < P; ++s) {
        SCOPED_TRACE("pp=" + std::to_string(P) + " stage " + std::to_string(s) + " M=" + std::to_string(M));
        const std::vector<std::string> order = names(one_f_one_b(P, s, M));
        EXPECT_EQ(order, canonical_1f1b(P, s, M));
        EXPECT_EQ(max_in_flight(order), pipeline_slots(P, s, M));
        EXPECT_LE(max_in_flight(order), P - s);
      }
}

// Every stage's order, executed with blocking receives (a forward needs the previous stage's
// forward of that micro-batch, a backward the next stage's backward), completes: no deadlock.
TEST(PipelineSchedule, NoDeadlockWithBlockingReceives) {
  for (int64_t P = 1; P <= 6; ++P)
    for (int64_t M = 1; M <= 13; ++M) {
      std::vector<std::vector<PipelineAction>> orders;
      for (int64_t s = 0; s < P; ++s) orders.push_back(one_f_one_b(P, s, M));
      std::vector<size_t> next(static_cast<size_t>(P), 0);
      std::vector<std::vector<bool>> fdone(static_cast<size_t>(P), std::vector<bool>(static_cast<size_t>(M))),
          bdone = fdone;
      for (bool progress = true; progress;) {
        progress = false;
        for (int64_t s = 0; s < P; ++s) {
          const auto si = static_cast<size_t>(s);
          if (next[si] == orders[si].size()) continue;
          const PipelineAction& a = orders[si][next[si]];
          const auto m = static_cast<size_t>(a.micro);
          const bool ready = a.forward ? (s == 0 || fdone[si - 1][m]) : (s == P - 1 || bdone[si + 1][m]);
          if (!ready) continue;
          (a.forward ? fdone : bdone)[si][m] = true;
          ++next[si];
          progress = true;
        }
      }
      for (int64_t s = 0; s < P; ++s)
        EXPECT_EQ(next[static_cast<size_t>(s)], orders[static_cast<size_t>(s)].size())
            << "deadlock at pp=" << P << " M=" << M << " stage " << s;
    }
}

TEST(PipelineConfig, StageLayersValidationNamesTheProblem) {
  const std::vector<std::string> base = {"model.n_layers=4", "parallel.pp=2", "optim.warmup_steps=0"};
  auto parse = [&](const std::string& spec) {
    std::vector<std::string> o = base;
    o.push_back("parallel.stage_layers=" + spec);
    return parse_config("", o);
  };
  auto expect_error = [&](const std::string& spec, const std::string& what) {
    try {
      parse(spec);
      ADD_FAILURE() << "'" << spec << "' accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error("\"1,2\"", "sums to 3 layers, but model.n_layers = 4");
  expect_error("\"4\"", "has 1 stages, but parallel.pp = 2");
  expect_error("\"1,1,2\"", "has 3 stages");
  expect_error("\"0,4\"", "'0' is not a positive layer count");
  expect_error("\"2,x\"", "'x' is not a positive layer count");
  const auto layers = [](const ParallelConfig& p, int64_t stage) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const LayerRange& r : configured_stage_chunks(p, 4, stage)) out.emplace_back(r.begin, r.end);
    return out;
  };
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  const Config c = parse("\"1,3\"");
  EXPECT_EQ(layers(c.parallel, 0), (Ranges{{0, 1}}));
  EXPECT_EQ(layers(c.parallel, 1), (Ranges{{1, 4}}));
  const Config balanced = parse("\"\"");
  EXPECT_EQ(layers(balanced.parallel, 1), (Ranges{{2, 4}}));
}

// A stage's estimate (estimate_stage_memory, from the layer range and slots) equals the arena a
// stage built from ModelOptions really allocates, byte for byte; pp=1 unchanged by the slots.
TEST(PipelineMemory, StageEstimateEqualsTheArena) {
  std::unique_ptr<Backend> ops = make_backend("cpu");
  Config c = parity_config();
  for (const bool recompute : {false, true})
    for (const bool bf16 : {false, true})
      for (const auto& [begin, end, slots] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {0, 4, 1}, {0, 2, 2}, {1, 3, 3}, {2, 4, 1}, {0, 1, 4}}) {
        SCOPED_TRACE("layers [" + std::to_string(begin) + "," + std::to_string(end) + ") slots " +
                     std::to_string(slots) + (recompute ? " recompute" : "") + (bf16 ? " bf16" : ""));
        ModelOptions o;
        o.bf16_operands = bf16;
        o.recompute = recompute;
        o.batch = 2;
        o.seq_len = c.train.seq_len;
        o.shard.layer_begin = begin;
        o.shard.layer_end = end;
        o.pipeline_slots = slots;
        Transformer model(c.model, c.loss, o, *ops);
        const MemoryEstimate m =
            estimate_stage_memory(c.model, o.batch, o.seq_len, bf16, recompute, begin, end, slots);
        const double arena = static_cast<double>(model.activation_arena_bytes());
        EXPECT_EQ(arena, m.activations);
        EXPECT_EQ(m.params, 4.0 * static_cast<double>(model.layout().total()));
      }
}

// `moecore config` with pp > 1 reports the stage that needs the most: with 8 micro-batches and
// pp = 4 over 4 equal MoE layers, stage 0 (embedding + 4 activation slots) beats the last
// (final norm, LM head, 1 slot).
TEST(PipelineMemory, ConfigEstimateIsTheLargestStage) {
  Config c = parity_config();
  c.model.n_dense_layers = 0;
  c.parallel.pp = 4;
  const MemoryEstimate m = estimate_memory(c);
  const int64_t T = c.train.seq_len;
  const MemoryEstimate first = estimate_stage_memory(c.model, 1, T, false, false, 0, 1, 4);
  const MemoryEstimate last = estimate_stage_memory(c.model, 1, T, false, false, 3, 4, 1);
  EXPECT_EQ(m.total(), std::max(first.total(), last.total()));
  EXPECT_GT(first.activations, last.activations);
  EXPECT_LT(m.total(), estimate_memory(c.model, 1, T, false, false).total());
}

// The order each stage really executed, and stage 0's activations in flight, for M = 1, pp and
// 2 pp + 1 micro-batches.
TEST(PipelineSchedule, ExecutedOrderIsCanonical1F1B) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "needs two or more ranks";
  for (const int64_t M : {int64_t{1}, int64_t{n}, int64_t{2 * n + 1}}) {
    SCOPED_TRACE("pp=" + std::to_string(n) + " M=" + std::to_string(M));
    Config c = parity_config();
    c.parallel.pp = n;
    c.train.batch_size = M;
    c.train.micro_batch_size = 1;
    c.train.steps = 1;
    c.optim.warmup_steps = 0;
    ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
    std::unique_ptr<Backend> ops = make_backend("cpu");
    Trainer trainer(c, *ops, DType::kF32, &g);
    const StepResult r = parity_step(trainer, c, 0);
    const int64_t stage = g.coords.pp;
    const std::vector<std::string>& log = trainer.pipeline_schedule();
    EXPECT_EQ(log, canonical_1f1b(n, stage, M)) << "stage " << stage;
    EXPECT_EQ(trainer.model().pipeline_slots(), std::min<int64_t>(n - stage, M));
    if (stage == 0) {
      EXPECT_LE(max_in_flight(log), n);
      EXPECT_EQ(max_in_flight(log), std::min<int64_t>(n, M));
    }
    EXPECT_GE(r.pp_bubble_s, 0.0);
    EXPECT_EQ(step_record(r, 0.0, 1.0, MfuPeak{1.0, "config", ""}, false)["pp_bubble_s"].get<double>(), r.pp_bubble_s);
    EXPECT_TRUE(std::isfinite(r.total));
  }
}

TEST(PipelineParity, Pp2BitwiseF64AndF32) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  Config c = parity_config();
  c.parallel.pp = 2;
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  for (const DType dt : {DType::kF64, DType::kF32}) {
    SCOPED_TRACE(dt == DType::kF64 ? "f64" : "f32");
    expect_parity(run_distributed(c, g, dt), run_single(c, dt), 0);
  }
}

// Block recompute and bf16 GEMM operands, and stage boundaries given by parallel.stage_layers.
TEST(PipelineParity, Pp2RecomputeBf16AndConfiguredStagesBitwise) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  Config c = parity_config();
  c.parallel.pp = 2;
  c.train.batch_size = 5;  // 5 micro-batches: more than pp, not a multiple
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  {
    SCOPED_TRACE("recompute + bf16");
    Config k = c;
    k.train.recompute = true;
    k.train.precision = "bf16";
    expect_parity(run_distributed(k, g, DType::kF32), run_single(k, DType::kF32), 0);
  }
  {
    SCOPED_TRACE("stage_layers 1,3 (stage 0: the dense layer only)");
    Config k = c;
    k.parallel.stage_layers = "1,3";
    expect_parity(run_distributed(k, g, DType::kF64), run_single(k, DType::kF64), 0);
  }
}

// pp = 4 (one layer per stage), and pp = 3 under mpirun -np 3 (uneven stages 2,1,1).
TEST(PipelineParity, Pp4Bitwise) {
  const int n = world().size();
  if (n != 4 && n != 3) GTEST_SKIP() << "needs 4 (or 3) ranks";
  Config c = parity_config();
  c.parallel.pp = n;
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  expect_parity(run_distributed(c, g, DType::kF64), run_single(c, DType::kF64), 0);
  expect_parity(run_distributed(c, g, DType::kF32), run_single(c, DType::kF32), 0);
}

TEST(PipelineParity, Pp2Dp2) {
  if (world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  Config c = parity_config();
  c.parallel.pp = 2;
  c.parallel.dp = 2;
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  expect_parity(run_distributed(c, g, DType::kF64), run_single(c, DType::kF64), 1e-9);
  SCOPED_TRACE("interleaved (2 chunks per stage) with EP = 2 and ZeRO-1");
  c.parallel.pp_interleave = 2;
  c.parallel.ep = 2;
  c.parallel.zero1 = true;
  ProcessGroups h = make_process_groups(world(), layout_from_config(c.parallel));
  expect_parity(run_distributed(c, h, DType::kF64), run_single(c, DType::kF64), 1e-9);
}

// A micro-batch's forward and backward are far apart under 1F1B: each action must see its own
// micro-batch's document mask and routing draws (random routing, recomputed in backward).
TEST(PipelineParity, Pp2DocumentMaskAndRandomRoutingBitwise) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  Config c = parity_config();
  c.parallel.pp = 2;
  c.train.batch_size = 4;
  c.train.steps = 3;
  c.train.recompute = true;
  c.model.routing = "random";
  c.model.router_bias_gamma = 0;
  c.data.eos_id = 5;
  c.data.intra_doc_mask = true;
  ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
  std::unique_ptr<Backend> ops = make_backend("ref");
  Trainer staged(c, *ops, DType::kF64, &g);
  Config single_config = c;
  single_config.parallel = ParallelConfig{};
  Trainer single(single_config, *ops, DType::kF64);
  const int64_t B = c.train.batch_size, S = c.train.seq_len;
  std::vector<int32_t> ids, labels, doc(static_cast<size_t>(B * S));
  int64_t documents = 0;
  for (int64_t step = 0; step < c.train.steps; ++step) {
    parity_batch(c, step, ids, labels);
    for (int64_t b = 0; b < B; ++b) {
      ids[static_cast<size_t>(b * S + 3 + b)] = 5;  // a document boundary at a different place per row
      document_starts(ids.data() + b * S, S, 5, doc.data() + b * S);
    }
    for (int32_t d : doc) documents += d > 0;
    const Tensor tid(ids.data(), DType::kI32, {B, S}), tlab(labels.data(), DType::kI32, {B, S}),
        tdoc(doc.data(), DType::kI32, {B, S});
    const StepResult a = staged.step(tid, tlab, tdoc), b = single.step(tid, tlab, tdoc);
    EXPECT_EQ(a.total, b.total) << "step " << step + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step + 1;
  }
  EXPECT_GT(documents, 0);
}

// Validation across stages: the last stage's loss sum reaches every stage, equal to one process.
TEST(PipelineParity, ForwardLossAcrossStages) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "needs two or more ranks";
  for (const int64_t v : {int64_t{1}, int64_t{2}}) {
    SCOPED_TRACE("pp_interleave " + std::to_string(v));
    Config c = parity_config();
    c.model.n_layers = std::max<int64_t>(4, n * v);
    c.parallel.pp = n;
    c.parallel.pp_interleave = v;
    c.train.batch_size = 2 * n;
    c.train.micro_batch_size = 2;
    ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
    std::unique_ptr<Backend> ops = make_backend("ref");
    Trainer staged(c, *ops, DType::kF64, &g);
    Config single_config = c;
    single_config.parallel = ParallelConfig{};
    Trainer single(single_config, *ops, DType::kF64);
    std::vector<int32_t> ids, labels;
    parity_batch(c, 3, ids, labels);
    const Tensor tid(ids.data(), DType::kI32, {2, c.train.seq_len}), tlab(labels.data(), DType::kI32, {2, c.train.seq_len});
    OwnedTensor a(DType::kF64, {1}), b(DType::kF64, {1});
    ops->fill(a.t, 0.0);
    ops->fill(b.t, 0.0);
    for (int rep = 0; rep < 2; ++rep) {  // sums accumulate over calls, as validation does
      staged.forward_loss(tid, tlab, a);
      single.forward_loss(tid, tlab, b);
    }
    EXPECT_GT(b.as<double>()[0], 0.0);
    EXPECT_EQ(a.as<double>()[0], b.as<double>()[0]) << "stage " << g.coords.pp;
  }
}

// The bubble: time blocked in receives per step, against the step time (printed by rank 0;
// each rank's value is gathered), for plain 1F1B and, at pp = 2, interleaved 1F1B with v = 2 and
// 3 (12 layers: even chunks for each v). The prediction is the planner's simulation of the same
// schedule (plan/pipeline_sim.h) with each stage's measured forward and backward compute per
// micro-batch (the pipeline's own clocks) and no transfer time, as a fraction of the simulated
// span; ideal 1F1B's fraction is
// (pp - 1) / (M + pp - 1), interleaved (pp - 1) / (v M + pp - 1). The measured one adds stage
// imbalance (the LM head on the last stage) and CPU sharing.
// MOE_BUBBLE_SET="model.n_layers=8;parallel.stage_layers=5,3" overrides the model or layout.
TEST(PipelineBubble, MeasuredPerStep) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "needs two or more ranks";
  for (const int64_t v : {int64_t{1}, int64_t{2}, int64_t{3}})
    for (const int64_t M : {int64_t{n}, int64_t{4 * n}}) {
      if (v > 1 && n != 2) continue;
      const int64_t layers = n == 2 ? 12 : 4;
      std::vector<std::string> o = {"model.vocab_size=512", "model.d_model=128", "model.n_layers=" + std::to_string(layers),
                                    "model.n_dense_layers=0", "model.n_heads=4", "model.n_kv_heads=2",
                                    "model.num_experts=8", "model.top_k=2", "model.expert_hidden=128",
                                    "model.tie_embeddings=false", "train.seq_len=64", "train.micro_batch_size=1",
                                    "train.steps=4", "optim.warmup_steps=0", "parallel.pp=" + std::to_string(n),
                                    "parallel.pp_interleave=" + std::to_string(v),
                                    "train.batch_size=" + std::to_string(M)};
      if (const char* extra = std::getenv("MOE_BUBBLE_SET")) {
        std::stringstream in(extra);
        for (std::string item; std::getline(in, item, ';');) o.push_back(item);
      }
      const Config c = parse_config("", o);
      ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
      std::unique_ptr<Backend> ops = make_backend("cpu");
      Trainer trainer(c, *ops, DType::kF32, &g);
      std::vector<int32_t> ids, labels;
      double bubble = 0, step_s = 0, fwd_s = 0, bwd_s = 0;
      for (int64_t s = 0; s < c.train.steps; ++s) {
        parity_batch(c, s, ids, labels);
        world().barrier();
        const auto t0 = std::chrono::steady_clock::now();
        const StepResult r = trainer.step(Tensor(ids.data(), DType::kI32, {c.train.batch_size, c.train.seq_len}),
                                          Tensor(labels.data(), DType::kI32, {c.train.batch_size, c.train.seq_len}));
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (s == 0) continue;  // warm-up (first-touch of buffers)
        bubble += r.pp_bubble_s;
        step_s += dt;
        fwd_s += trainer.pipeline().forward_compute_s();
        bwd_s += trainer.pipeline().backward_compute_s();
        EXPECT_GE(r.pp_bubble_s, 0.0);
        EXPECT_LE(r.pp_bubble_s, dt);
      }
      const double steps = static_cast<double>(c.train.steps - 1);
      const double per_micro = steps * static_cast<double>(M);
      std::vector<double> mine = {bubble / steps, step_s / steps, fwd_s / per_micro, bwd_s / per_micro},
                          all(static_cast<size_t>(4 * n));
      world().all_gather(mine.data(), all.data(), 4, DType::kF64);
      std::vector<double> fwd, bwd;  // each stage's compute per micro-batch
      for (int s = 0; s < n; ++s) {
        fwd.push_back(all[static_cast<size_t>(4 * s + 2)]);
        bwd.push_back(all[static_cast<size_t>(4 * s + 3)]);
      }
      const std::vector<TimelineEntry> tl = simulate_interleaved(fwd, bwd, 0.0, M, v);
      double makespan = 0;
      for (const TimelineEntry& e : tl) makespan = std::max(makespan, e.end_s);
      if (world().rank() == 0)
        for (int s = 0; s < n; ++s) {
          const double busy = static_cast<double>(M) * (fwd[static_cast<size_t>(s)] + bwd[static_cast<size_t>(s)]);
          const double blocked = all[static_cast<size_t>(4 * s)], step = all[static_cast<size_t>(4 * s + 1)];
          std::printf("[bubble] pp=%d v=%lld M=%lld stage %d: %.4f s blocked in receive, predicted %.4f s "
                      "(simulated schedule); %.1f%% of the %.4f s step; ideal fraction %.1f%%\n",
                      n, static_cast<long long>(v), static_cast<long long>(M), s, blocked, makespan - busy,
                      100.0 * blocked / step, step, 100.0 * (n - 1) / static_cast<double>(v * M + n - 1));
        }
    }
}

}  // namespace
}  // namespace moe::test
