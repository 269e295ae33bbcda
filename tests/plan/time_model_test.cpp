// The step-time model: the 1F1B simulation against the closed forms, the cluster files' rules
// (every number cited, unknown keys refused), and the model's response to what it reads.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <functional>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/check.h"
#include "plan/hardware.h"
#include "plan/plan.h"
#include "common/paths.h"
#include "plan_test_util.h"
#include "plan/time_model.h"
#include "parallel/pipeline_schedule.h"

namespace moe {
namespace {

using test::error_of;

Config small(const std::vector<std::string>& extra = {}) { return test::small_plan_config(1, extra); }

// Equal stages, no transfer: the pipeline takes (M + P - 1)(f + b), stage 0 idles (P - 1)(f + b)
// of it, the textbook bubble (P - 1) / (M + P - 1). With transfers between stages, and unequal
// stages, the end is the longest path through the schedule's dependency graph, computed here by
// recursion over it (not by the simulation's event loop).
double longest_path(const std::vector<double>& f, const std::vector<double>& b, double x, int64_t M) {
  const auto P = static_cast<int64_t>(f.size());
  std::vector<std::vector<PipelineAction>> order;
  std::map<std::tuple<int64_t, bool, int64_t>, size_t> index;
  for (int64_t s = 0; s < P; ++s) {
    order.push_back(one_f_one_b(P, s, M));
    for (size_t i = 0; i < order.back().size(); ++i) index[{s, order.back()[i].forward, order.back()[i].micro}] = i;
  }
  std::map<std::pair<int64_t, size_t>, double> memo;
  std::function<double(int64_t, size_t)> end = [&](int64_t s, size_t i) -> double {
    if (auto it = memo.find({s, i}); it != memo.end()) return it->second;
    const PipelineAction& a = order[static_cast<size_t>(s)][i];
    double start = i > 0 ? end(s, i - 1) : 0;
    if (a.forward && s > 0) start = std::max(start, end(s - 1, index.at({s - 1, true, a.micro})) + x);
    if (!a.forward && s < P - 1) start = std::max(start, end(s + 1, index.at({s + 1, false, a.micro})) + x);
    return memo[{s, i}] = start + (a.forward ? f : b)[static_cast<size_t>(s)];
  };
  double out = 0;
  for (int64_t s = 0; s < P; ++s) out = std::max(out, end(s, order[static_cast<size_t>(s)].size() - 1));
  return out;
}

TEST(Simulate1F1B, MatchesTheClosedFormAndTheLongestPath) {
  for (int64_t P : {1, 2, 3, 4, 8})
    for (int64_t M : {1, 2, 3, 8, 17})
      for (double x : {0.0, 0.25}) {
        const std::vector<double> f(static_cast<size_t>(P), 1.0), b(static_cast<size_t>(P), 2.0);
        const std::vector<TimelineEntry> tl = simulate_1f1b(f, b, x, M);
        double end = 0, busy0 = 0;
        for (const TimelineEntry& e : tl) {
          end = std::max(end, e.end_s);
          if (e.stage == 0) busy0 += e.end_s - e.start_s;
        }
        const double Md = static_cast<double>(M), Pd = static_cast<double>(P);
        EXPECT_DOUBLE_EQ(end, longest_path(f, b, x, M)) << P << " " << M << " " << x;
        if (x == 0) {
          EXPECT_DOUBLE_EQ(end, (Md + Pd - 1) * 3);
          EXPECT_DOUBLE_EQ((end - busy0) / end, (Pd - 1) / (Md + Pd - 1));
        }
      }
  const std::vector<double> f = {1.0, 3.0, 0.5, 2.0}, b = {2.0, 1.0, 4.0, 0.25};
  for (int64_t M : {1, 4, 9}) {
    double e = 0;
    for (const TimelineEntry& t : simulate_1f1b(f, b, 0.3, M)) e = std::max(e, t.end_s);
    EXPECT_DOUBLE_EQ(e, longest_path(f, b, 0.3, M)) << M;
  }
}

// The simulated order on every stage is the trainer's 1F1B order; a stage runs one action at a
// time; a forward starts after the previous stage's forward of that micro-batch, a backward
// after the next stage's backward (and the last stage's after its own forward).
TEST(Simulate1F1B, KeepsTheTrainersOrderAndDependencies) {
  const std::vector<double> f = {1.0, 3.0, 0.5}, b = {2.0, 1.0, 4.0};
  const int64_t M = 5, P = 3;
  const std::vector<TimelineEntry> tl = simulate_1f1b(f, b, 0.1, M);
  std::map<std::tuple<int64_t, bool, int64_t>, TimelineEntry> at;
  for (int64_t s = 0; s < P; ++s) {
    std::vector<TimelineEntry> mine;
    for (const TimelineEntry& e : tl)
      if (e.stage == s) mine.push_back(e);
    const std::vector<PipelineAction> order = one_f_one_b(P, s, M);
    ASSERT_EQ(mine.size(), order.size());
    for (size_t i = 0; i < order.size(); ++i) {
      EXPECT_EQ(mine[i].forward, order[i].forward);
      EXPECT_EQ(mine[i].micro, order[i].micro);
      if (i > 0) {
        EXPECT_GE(mine[i].start_s, mine[i - 1].end_s);
      }
      at[{s, mine[i].forward, mine[i].micro}] = mine[i];
    }
  }
  const auto get = [&](int64_t s, bool fwd, int64_t m) { return at.at(std::make_tuple(s, fwd, m)); };
  for (int64_t s = 0; s < P; ++s)
    for (int64_t m = 0; m < M; ++m) {
      if (s > 0) {
        EXPECT_GE(get(s, true, m).start_s, get(s - 1, true, m).end_s + 0.1 - 1e-12);
      }
      if (s < P - 1) {
        EXPECT_GE(get(s, false, m).start_s, get(s + 1, false, m).end_s + 0.1 - 1e-12);
      }
      EXPECT_GE(get(s, false, m).start_s, get(s, true, m).end_s);
    }
}

TEST(Cluster, PresetsParseAndSizesScale) {
  for (const std::string& name : cluster_presets()) {
    SCOPED_TRACE(name);
    const Cluster c = load_cluster(name);
    EXPECT_GT(c.device.bf16_flops, 0);
    EXPECT_GT(c.device.memory_bytes, c.device.reserved_bytes);
    EXPECT_FALSE(c.sources.empty());
  }
  EXPECT_EQ(cluster_presets().size(), 7u);
  const Cluster big = load_cluster("h200x64");
  EXPECT_EQ(big.nodes, 8);
  EXPECT_EQ(big.ranks(), 64);
  EXPECT_EQ(load_cluster("h200x2").ranks(), 2);
  EXPECT_NE(error_of([] { load_cluster("h200x12"); }).find("not whole nodes"), std::string::npos);
  EXPECT_NE(error_of([] { load_cluster("tpu"); }).find("not a preset"), std::string::npos);
}

TEST(Cluster, EveryNumberNeedsASourceAndUnknownKeysAreRefused) {
  const std::string ok = R"(name = "t"
nodes = 1
ranks_per_node = 2
[device]
backend = "cpu"
kind = "test"
memory_gib = 1
reserved_gib = 0
process_mib = 10
bf16_tflops = 1
fp32_tflops = 0.5
memory_gbps = 10
memory_efficiency = 1
storage_gbps = 1
timing_spread = 0.05
power_capped_gemm = 1
attention_efficiency = 0.5
attention_efficiency_fp32 = 0.5
gemm_efficiency = [[1e6, 0.5], [1e9, 1.0]]
grouped_efficiency = [[1, 1.0]]
[network]
intra_gbps = 1
intra_latency_us = 1
intra_efficiency = [[1, 1.0]]
inter_gbps = 1
inter_latency_us = 1
inter_efficiency = [[1, 1.0]]
[sources]
)";
  std::string cited;
  for (const char* k : {"nodes", "ranks_per_node", "device.memory_gib", "device.reserved_gib", "device.process_mib", "device.bf16_tflops",
                        "device.fp32_tflops", "device.memory_gbps", "device.memory_efficiency", "device.storage_gbps", "device.timing_spread", "device.power_capped_gemm",
                        "device.attention_efficiency", "device.attention_efficiency_fp32", "device.gemm_efficiency",
                        "device.grouped_efficiency", "network.intra_gbps", "network.intra_latency_us",
                        "network.intra_efficiency", "network.inter_gbps", "network.inter_latency_us",
                        "network.inter_efficiency"})
    cited += std::string("\"") + k + "\" = \"test\"\n";
  const Cluster c = parse_cluster(ok + cited, "t.toml");
  EXPECT_EQ(c.ranks(), 2);
  // Curves: the points themselves, log-linear between them, flat outside.
  EXPECT_DOUBLE_EQ(c.device.gemm_efficiency.at(1e6), 0.5);
  EXPECT_NEAR(c.device.gemm_efficiency.at(std::sqrt(1e6 * 1e9)), 0.75, 1e-12);
  EXPECT_DOUBLE_EQ(c.device.gemm_efficiency.at(1), 0.5);
  EXPECT_DOUBLE_EQ(c.device.gemm_efficiency.at(1e12), 1.0);
  std::string uncited = cited;
  uncited.erase(uncited.find("\"device.memory_gbps\""), std::string("\"device.memory_gbps\" = \"test\"\n").size());
  EXPECT_NE(error_of([&] { parse_cluster(ok + uncited, "t.toml"); }).find("t.toml: device.memory_gbps has no source"),
            std::string::npos);
  std::string extra = ok;
  extra.insert(extra.find("[network]"), "sm_count = 132\n");
  EXPECT_NE(error_of([&] { parse_cluster(extra + cited, "t.toml"); }).find("unknown key 'device.sm_count'"), std::string::npos);
  std::string bad = ok;
  bad.replace(bad.find("memory_efficiency = 1"), 21, "memory_efficiency = 3");
  EXPECT_NE(error_of([&] { parse_cluster(bad + cited, "t.toml"); }).find("device.memory_efficiency = 3 is outside"),
            std::string::npos);
}

// The model responds to what it reads: a faster device is faster, recompute adds a forward to
// every backward, expert parallelism adds exchange time, MFU's two conventions differ by the
// peak only.
TEST(StepTime, FollowsTheDeviceAndTheLayout) {
  const Cluster cpu = load_cluster("cpu-corex2");
  Cluster fast = cpu;
  fast.device.fp32_flops *= 2;
  fast.device.bf16_flops *= 2;
  const Config c = small({"parallel.dp=2"});
  const Plan p = make_plan(c);
  const StepTime base = estimate_step_time(c, p, cpu), quick = estimate_step_time(c, p, fast);
  EXPECT_LT(quick.stages[0].forward_compute_s, base.stages[0].forward_compute_s);
  EXPECT_NEAR(base.mfu_bf16 * cpu.device.bf16_flops, base.mfu * cpu.device.fp32_flops, 1e-9 * cpu.device.bf16_flops);
  EXPECT_EQ(base.stages[0].forward_exchange_s, 0);
  const Config r = small({"parallel.dp=2", "train.recompute=true"});
  const StepTime rec = estimate_step_time(r, make_plan(r), cpu);
  EXPECT_NEAR(rec.stages[0].backward_compute_s - base.stages[0].backward_compute_s, base.stages[0].forward_compute_s,
              1e-12 + 1e-9 * base.stages[0].forward_compute_s);
  const Config e = small({"parallel.dp=2", "parallel.ep=2", "model.routing=uniform"});
  const StepTime ep = estimate_step_time(e, make_plan(e), cpu);
  EXPECT_GT(ep.stages[0].forward_exchange_s, 0);
  EXPECT_GT(ep.stages[0].backward_exchange_s, 0);
  EXPECT_GT(base.stages[0].sync_s, 0);
  // Per-device throughput and the step: tokens per step over the step, over the ranks.
  EXPECT_DOUBLE_EQ(base.tokens_per_s_per_device * 2 * base.step_s, 8.0 * 16);
}

// The sweep: every layout of the world the trainer accepts, best first; what does not fit names
// its stage and its largest part; what the trainer refuses carries the config's error.
// A sliding window shortens exactly the attention terms: the forward loses 4 T H hd (full - windowed
// pairs) / S over (peak x attention efficiency) per windowed layer; the backward 2.5x that.
// One stage never waits: its bubble is zero, not the rounding between two sums of its work (the
// page showed "bubble 0.0000000000000178%"); two stages do wait.
TEST(StepTime, OneStageHasNoBubble) {
  const Cluster cpu = load_cluster("cpu-corex2");
  for (const char* micro : {"train.batch_size=6", "train.batch_size=14"}) {
    const Config one = small({"parallel.dp=2", micro});
    const StepTime t = estimate_step_time(one, make_plan(one), cpu);
    EXPECT_EQ(t.bubble_fraction, 0.0) << micro;
    EXPECT_EQ(t.stages[0].bubble_s, 0.0) << micro;
  }
  // The page's case: V7 on one B300 node with pp = 1 (rounding left 3.8e-15 of the span).
  const Config v7 = load_config(std::string(test::source_dir()) + "/configs/published/olmo3_v7_1t.toml",
                          {"parallel.dp=8", "parallel.ep=8", "parallel.pp=1", "parallel.pp_interleave=1"});
  EXPECT_EQ(estimate_step_time(v7, make_plan(v7), load_cluster("b300x8")).bubble_fraction, 0.0);
  const Config two = small({"parallel.pp=2"});
  EXPECT_GT(estimate_step_time(two, make_plan(two), cpu).bubble_fraction, 0.0);
}

TEST(StepTime, SlidingWindowsCutOnlyTheAttentionTime) {
  const Cluster cpu = load_cluster("cpu-corex2");
  const Config full = small(), win = small({"model.sliding_window=4", "model.sliding_window_full_first=false",
                                            "model.sliding_window_full_last=false"});
  const Plan p = make_plan(full);
  const StepTime a = estimate_step_time(full, p, cpu), b = estimate_step_time(win, make_plan(win), cpu);
  const ModelConfig& m = full.model;
  const double S = static_cast<double>(full.train.seq_len), T = static_cast<double>(p.tokens_per_micro);
  ASSERT_LT(4, S);
  const double pairs_cut = m.attention_pairs(0, full.train.seq_len) - win.model.attention_pairs(0, full.train.seq_len);
  const double peak = full.train.precision == "fp32" ? cpu.device.fp32_flops : cpu.device.bf16_flops;
  const double eff = full.train.precision == "fp32" ? cpu.device.attention_efficiency_fp32 : cpu.device.attention_efficiency;
  const double per_layer = 4 * T * static_cast<double>(m.n_heads * m.hd()) * pairs_cut / S / (peak * eff);
  const double L = static_cast<double>(m.n_layers);
  EXPECT_NEAR(a.stages[0].forward_compute_s - b.stages[0].forward_compute_s, L * per_layer, 1e-9 * a.stages[0].forward_compute_s);
  EXPECT_NEAR(a.stages[0].backward_compute_s - b.stages[0].backward_compute_s, 2.5 * L * per_layer,
              1e-9 * a.stages[0].backward_compute_s);
}

TEST(Sweep, RanksFittingLayoutsAndSaysWhyOthersFail) {
  Cluster tiny = load_cluster("cpu-core");
  tiny.nodes = 2;  // 4 ranks
  // Batches of 4 sequences in micro-batches of 2: dp = 4 cannot split them (refused), dp 1 and 2 can.
  const Config c = small({"train.batch_size=4", "train.micro_batch_size=2"});
  // A memory line between the smallest and the largest layout's peak.
  std::vector<SweepRow> rows = sweep_layouts(c, tiny, 4);
  double lo = 1e300, hi = 0;
  for (const SweepRow& r : rows)
    if (r.reason.empty()) {
      lo = std::min(lo, r.peak_bytes);
      hi = std::max(hi, r.peak_bytes);
    }
  ASSERT_LT(lo, hi);
  tiny.device.reserved_bytes = 0;
  tiny.device.process_bytes = 0;
  tiny.device.memory_bytes = (lo + hi) / 2;
  rows = sweep_layouts(c, tiny, 4);
  // pp * dp = 4, ep dividing dp and the 8 experts: dp 4 (ep 1, 2, 4), dp 2 (ep 1, 2), dp 1.
  EXPECT_EQ(rows.size(), 3u + 2u + 1u);
  bool seen_reject = false;
  for (size_t i = 0; i < rows.size(); ++i) {
    const SweepRow& r = rows[i];
    if (r.fits) {
      EXPECT_FALSE(seen_reject) << "a fitting layout after a rejected one";
      if (i > 0 && rows[i - 1].fits) {
        EXPECT_GE(rows[i - 1].time.tokens_per_s, r.time.tokens_per_s);
      }
    } else {
      seen_reject = true;
      EXPECT_FALSE(r.reason.empty());
    }
  }
  EXPECT_TRUE(seen_reject);
  bool named = false, refused = false;
  for (const SweepRow& r : rows) {
    named = named || (r.reason.find("needs") != std::string::npos && r.reason.find("largest:") != std::string::npos);
    refused = refused || r.reason.find("train.batch_size") != std::string::npos;
  }
  EXPECT_TRUE(named);
  EXPECT_TRUE(refused);
}

TEST(StepTime, JsonCarriesTimeAndSweep) {
  const Cluster cl = load_cluster("cpu-corex2");
  const Config c = small({"parallel.dp=2", "parallel.ep=2"});
  const Plan p = make_plan(c);
  const StepTime t = estimate_step_time(c, p, cl);
  const std::vector<SweepRow> sw = sweep_layouts(c, cl, 2);
  const nlohmann::json j = nlohmann::json::parse(plan_report_json(c, p, &cl, &t, &sw));
  EXPECT_EQ(j["time"]["step_s"].get<double>(), t.step_s);
  EXPECT_EQ(j["time"]["timeline"].size(), t.timeline.size());
  EXPECT_EQ(j["sweep"].size(), sw.size());
  EXPECT_EQ(j["cluster"]["ranks_per_node"], 2);
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// Interleaved 1F1B (not in the trainer): equal stages and no transfer give the textbook
// M (f + b) + (P - 1)(f + b) / v and stage 0's bubble (P - 1) / (v M + P - 1); every virtual
// stage's dependencies hold; v = 1 is the trainer's 1F1B.
TEST(SimulateInterleaved, ClosedFormAndDependencies) {
  for (int64_t P : {2, 4})
    for (int64_t v : {1, 2, 3})
      for (int64_t M : {P, 2 * P, 4 * P}) {
        const std::vector<double> f(static_cast<size_t>(P), 1.0), b(static_cast<size_t>(P), 2.0);
        const std::vector<TimelineEntry> tl = simulate_interleaved(f, b, 0.0, M, v);
        double end = 0, busy0 = 0;
        std::map<std::tuple<int64_t, bool, int64_t>, TimelineEntry> at;  // (virtual stage, fwd, micro)
        for (const TimelineEntry& e : tl) {
          end = std::max(end, e.end_s);
          if (e.stage == 0) busy0 += e.end_s - e.start_s;
          at[{e.chunk * P + e.stage, e.forward, e.micro}] = e;
        }
        const double Pd = static_cast<double>(P), Md = static_cast<double>(M), vd = static_cast<double>(v);
        EXPECT_NEAR(end, Md * 3 + (Pd - 1) * 3 / vd, 1e-9) << P << " " << v << " " << M;
        EXPECT_NEAR((end - busy0) / end, (Pd - 1) / (vd * Md + Pd - 1), 1e-12);
        EXPECT_EQ(tl.size(), static_cast<size_t>(2 * P * M * v));
        for (int64_t vs = 0; vs < P * v; ++vs)
          for (int64_t m = 0; m < M; ++m) {
            if (vs > 0) {
              EXPECT_GE(at.at(std::make_tuple(vs, true, m)).start_s, at.at(std::make_tuple(vs - 1, true, m)).end_s - 1e-12);
            }
            if (vs < P * v - 1) {
              EXPECT_GE(at.at(std::make_tuple(vs, false, m)).start_s, at.at(std::make_tuple(vs + 1, false, m)).end_s - 1e-12);
            }
          }
        if (v == 1) {
          const std::vector<TimelineEntry> plain = simulate_1f1b(f, b, 0.0, M);
          EXPECT_EQ(plain.size(), tl.size());
        }
      }
  EXPECT_THROW(simulate_interleaved({1, 1}, {1, 1}, 0, 3, 2), Error);  // M not a multiple of P
}

}  // namespace
}  // namespace moe
