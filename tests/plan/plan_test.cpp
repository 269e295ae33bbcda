// The planner (src/plan/) against the trainer's own sizes and against independent counts: one
// process's memory is `moecore config`'s estimate and the Transformer's arena; uniform routing's
// closed-form counts and the exchange rows against a token-by-token walk; the random-routing drop
// expectation against a Monte Carlo; checkpoint shards adding up to the model; bad layouts named.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <cctype>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/check.h"
#include "kernels/ops.h"
#include "plan/memory.h"
#include "parallel/parallelize.h"
#include "model/transformer.h"
#include "model/exchange_bounds.h"
#include "plan/exchange_model.h"
#include "plan/plan.h"
#include "plan_test_util.h"
#include "common/cli_util.h"

namespace moe {
namespace {

Config small(const std::vector<std::string>& extra = {}) { return test::small_plan_config(2, extra); }

using test::error_of;

// One process: the plan's memory is the estimate, component by component, and its activations
// are the arena a Transformer of that config carves.
TEST(PlanMemory, OneProcessIsTheEstimateAndTheArena) {
  std::unique_ptr<Backend> ops = make_backend("cpu");
  for (const std::vector<std::string>& extra :
       std::vector<std::vector<std::string>>{{}, {"train.precision=bf16"}, {"train.recompute=true"}, {"model.shared_hidden=16"}}) {
    const Config c = small(extra);
    const Plan p = make_plan(c);
    ASSERT_EQ(p.stages.size(), 1u);
    const MemoryEstimate want = estimate_memory(c), got = p.stages[0].memory;
    EXPECT_EQ(got.params, want.params);
    EXPECT_EQ(got.operand_copies, want.operand_copies);
    EXPECT_EQ(got.optimizer, want.optimizer);
    EXPECT_EQ(got.activations, want.activations);
    EXPECT_EQ(got.kernel_scratch, want.kernel_scratch);
    EXPECT_EQ(got.step_stats, want.step_stats);
    EXPECT_EQ(got.total(), want.total());
    Transformer model(c.model, c.loss, model_options(c, DType::kF32, nullptr), *ops);
    EXPECT_EQ(got.activations, static_cast<double>(model.activation_arena_bytes()));
    EXPECT_EQ(got.params, 4.0 * static_cast<double>(model.layout().total()));
    // One process trains alone: nothing to send, the whole model to save.
    EXPECT_TRUE(p.ranks.at(0).comm.empty());
    EXPECT_GT(p.stages[0].expert_row_buffers, 0);
    EXPECT_LT(p.stages[0].expert_row_buffers, got.activations);
  }
}

// Pipeline stages: each stage's plan is estimate_stage_memory of that stage; stages after the
// first hold a gradient copy per slot; the first holds the most slots.
TEST(PlanMemory, StagesDifferAsThePipelineHoldsThem) {
  const Config c = small({"parallel.pp=2", "parallel.dp=1", "parallel.stage_layers=1,3"});
  const Plan p = make_plan(c);
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[0].layer_end, 1);
  EXPECT_EQ(p.stages[0].moe_layers, 0);
  EXPECT_EQ(p.stages[1].moe_layers, 3);
  EXPECT_EQ(p.stages[0].slots, 2);
  EXPECT_EQ(p.stages[1].slots, 1);
  for (int64_t s = 0; s < 2; ++s) EXPECT_EQ(p.stages[static_cast<size_t>(s)].memory.total(), estimate_stage_memory(c, s).total());
  EXPECT_EQ(p.stages[0].memory.comm_buffers, 0);
  EXPECT_EQ(p.stages[1].memory.comm_buffers, 1.0 * 2 * 16 * 32 * 4);  // one slot of (T, D) f32
  EXPECT_EQ(estimate_memory(c).total(), std::max(p.stages[0].memory.total(), p.stages[1].memory.total()));
}

// Every rank's checkpoint shard adds up to the whole model: parameters and both moments in fp32
// once each, plus the router biases, whatever the layout (ZeRO-1 shards the moments).
TEST(PlanMemory, CheckpointShardsAddUpToTheModel) {
  for (const std::vector<std::string>& layout : std::vector<std::vector<std::string>>{
           {}, {"parallel.dp=4", "parallel.ep=2"}, {"parallel.dp=4", "parallel.ep=2", "parallel.zero1=true"},
           {"parallel.dp=2", "parallel.pp=2", "parallel.zero1=true"}, {"parallel.dp=8", "parallel.ep=8", "parallel.pp=2", "train.micro_batch_size=1"}}) {
    const Config c = small(layout);
    const Plan p = make_plan(c);
    double sum = 0;
    for (const PlannedRank& r : p.ranks) sum += r.checkpoint_bytes;
    const double N = static_cast<double>(c.model.num_params());
    EXPECT_EQ(sum, 12 * N + 4.0 * static_cast<double>(c.model.num_experts * c.model.num_moe_layers()))
        << c.parallel.dp << " " << c.parallel.ep << " " << c.parallel.pp;
    // The variant that shards master weights too needs less on every stage once there are replicas.
    for (const PlannedStage& st : p.stages)
      if (c.parallel.dp > 1) {
        EXPECT_LT(st.total_sharded_master, st.memory.total());
      }
  }
}

// Uniform routing's counts in closed form against the router's rule walked token by token.
TEST(PlanExchange, UniformCountsEqualTheRoutersRule) {
  for (int64_t E : {1, 3, 8, 64})
    for (int64_t K : {1, 2, 3})
      for (int64_t T : {1, 5, 13, 64})
        for (int64_t base : {0, 1, 7, 1000003}) {
          if (K > E) continue;
          std::vector<int32_t> want(static_cast<size_t>(E), 0);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < K; ++j) ++want[static_cast<size_t>(((base + t) * K + j) % E)];
          EXPECT_EQ(uniform_expert_counts(base, T, K, E), want) << E << " " << K << " " << T << " " << base;
        }
}

// The exchange rows of every EP rank against an independent walk: each receiving rank takes its
// local experts in order, each source rank's rows in order, until the capacity is spent.
TEST(PlanExchange, RowsEqualACapacityWalk) {
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"parallel.dp=4", "parallel.ep=4", "train.seq_len=13", "model.top_k=3"},
           {"parallel.dp=4", "parallel.ep=2", "parallel.ep_capacity_factor=0.6"},
           {"parallel.dp=4", "parallel.ep=4", "train.seq_len=13", "model.top_k=3", "parallel.ep_capacity_factor=0.9"},
           {"parallel.dp=8", "parallel.ep=8", "parallel.ep_capacity_factor=0.3", "train.micro_batch_size=1"}}) {
    Config c = small(extra);
    c.model.routing = "uniform";
    const int64_t ep = c.parallel.ep, E = c.model.num_experts, K = c.model.top_k, El = E / ep;
    const int64_t T = c.train.micro_batch_size * c.train.seq_len, M = c.train.batch_size / (c.train.micro_batch_size * c.parallel.dp);
    const int64_t cap = expert_capacity(T, K, c.parallel.ep_capacity_factor);
    for (int64_t step : {1, 3})
      for (int64_t group = 0; group < c.parallel.dp; group += ep)
        for (int64_t m = 0; m < M; ++m) {
          // counts[s][e] walked token by token.
          std::vector<std::vector<int64_t>> n(static_cast<size_t>(ep), std::vector<int64_t>(static_cast<size_t>(E)));
          for (int64_t s = 0; s < ep; ++s) {
            const int64_t base = micro_batch_token_base(c, step, group + s, m);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t j = 0; j < K; ++j) ++n[static_cast<size_t>(s)][static_cast<size_t>(((base + t) * K + j) % E)];
          }
          std::vector<std::vector<int64_t>> kept = n;
          double routed = 0, dropped = 0;
          for (int64_t r = 0; r < ep; ++r) {
            int64_t left = cap < 0 ? INT64_MAX : cap;
            for (int64_t e = r * El; e < (r + 1) * El; ++e)
              for (int64_t s = 0; s < ep; ++s) {
                int64_t& k = kept[static_cast<size_t>(s)][static_cast<size_t>(e)];
                routed += static_cast<double>(k);
                k = std::min(k, left);
                left -= k;
                dropped += static_cast<double>(n[static_cast<size_t>(s)][static_cast<size_t>(e)] - k);
              }
          }
          const std::vector<ExchangeRows> rows = exchange_rows(c, step, group, m);
          for (int64_t me = 0; me < ep; ++me) {
            double out = 0, back = 0, got = 0;
            for (int64_t e = 0; e < E; ++e) {
              if (e / El != me) out += static_cast<double>(kept[static_cast<size_t>(me)][static_cast<size_t>(e)]);
              for (int64_t s = 0; s < ep; ++s)
                if (e / El == me) {
                  got += static_cast<double>(kept[static_cast<size_t>(s)][static_cast<size_t>(e)]);
                  if (s != me) back += static_cast<double>(kept[static_cast<size_t>(s)][static_cast<size_t>(e)]);
                }
            }
            const ExchangeRows& x = rows[static_cast<size_t>(me)];
            EXPECT_EQ(x.dispatched, out);
            EXPECT_EQ(x.returned, back);
            EXPECT_EQ(x.received, got);
            EXPECT_EQ(x.routed, routed);
            EXPECT_EQ(x.dropped, dropped);
          }
        }
  }
}

// The random-routing drop expectation (a normal approximation) against a Monte Carlo of the same
// routing: K distinct experts per token, uniformly. Tolerance: 10% of the simulated fraction or
// 1e-5 of the routes, whichever is larger: near the mean the approximation is within a few
// percent; in the far tail (cf 1.05: 1e-5 of the routes dropped) it overstates the drops by
// half, which costs nothing a user would notice.
TEST(PlanExchange, RandomRoutingDropsMatchASimulation) {
  for (double cf : {0.95, 1.0, 1.05}) {
    Config c = small({"parallel.dp=4", "parallel.ep=4", "model.num_experts=32", "model.top_k=4", "train.seq_len=256",
                      "train.micro_batch_size=2", "train.batch_size=8"});
    c.parallel.ep_capacity_factor = cf;
    c.model.routing = "random";
    const int64_t ep = 4, E = 32, K = 4, El = E / ep, T = 512;
    const int64_t cap = expert_capacity(T, K, cf);
    std::mt19937_64 rng(12345);
    double dropped = 0, routed = 0;
    std::vector<int> experts(static_cast<size_t>(E));
    for (int trial = 0; trial < 400; ++trial) {
      std::vector<int64_t> per_rank(static_cast<size_t>(ep), 0);
      for (int64_t t = 0; t < ep * T; ++t) {
        for (int64_t e = 0; e < E; ++e) experts[static_cast<size_t>(e)] = static_cast<int>(e);
        for (int64_t j = 0; j < K; ++j) {  // partial Fisher-Yates: K distinct experts
          std::uniform_int_distribution<int64_t> pick(j, E - 1);
          std::swap(experts[static_cast<size_t>(j)], experts[static_cast<size_t>(pick(rng))]);
          ++per_rank[static_cast<size_t>(experts[static_cast<size_t>(j)] / El)];
        }
      }
      for (int64_t r : per_rank) {
        routed += static_cast<double>(r);
        dropped += static_cast<double>(std::max<int64_t>(0, r - cap));
      }
    }
    const double simulated = dropped / routed, predicted = expected_drop_fraction_random(c);
    EXPECT_NEAR(predicted, simulated, std::max(0.1 * simulated, 1e-5)) << "cf " << cf;
    if (std::getenv("MOE_VERBOSE")) std::printf("cf %.2f: predicted %.6g simulated %.6g\n", cf, predicted, simulated);
    EXPECT_GT(simulated, 0);
  }
}

// Skewed routing's drops against a Monte Carlo of the same router: K distinct experts drawn one
// after another with weights (e + 1)^-skew among those left (a Plackett-Luce top-K). Tolerance:
// 15% of the simulated fraction, for the inclusion-probability approximation; skew 0 must give
// the random-routing figure exactly.
TEST(PlanExchange, SkewedRoutingDropsMatchASimulation) {
  Config c = small({"parallel.dp=4", "parallel.ep=4", "model.num_experts=32", "model.top_k=4", "train.seq_len=256",
                    "train.micro_batch_size=2", "train.batch_size=8", "parallel.ep_capacity_factor=1.25"});
  EXPECT_DOUBLE_EQ(expected_drop_fraction_skewed(c, 0), expected_drop_fraction_random(c));
  const int64_t ep = 4, E = 32, K = 4, El = E / ep, T = 512;
  const int64_t cap = expert_capacity(T, K, 1.25);
  for (double skew : {0.5, 1.0}) {
    std::mt19937_64 rng(99);
    std::uniform_real_distribution<double> u(0, 1);
    double dropped = 0, routed = 0;
    for (int trial = 0; trial < 100; ++trial) {
      std::vector<int64_t> per_rank(static_cast<size_t>(ep), 0);
      for (int64_t t = 0; t < ep * T; ++t) {
        std::vector<double> w(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) w[static_cast<size_t>(e)] = std::pow(static_cast<double>(e + 1), -skew);
        for (int64_t j = 0; j < K; ++j) {
          double total = 0;
          for (double x : w) total += x;
          double r = u(rng) * total;
          int64_t e = 0;
          while (e < E - 1 && (r -= w[static_cast<size_t>(e)]) > 0) ++e;
          if (w[static_cast<size_t>(e)] == 0) {  // rounding at the end: the last expert left
            e = E - 1;
            while (w[static_cast<size_t>(e)] == 0) --e;
          }
          w[static_cast<size_t>(e)] = 0;
          ++per_rank[static_cast<size_t>(e / El)];
        }
      }
      for (int64_t r : per_rank) {
        routed += static_cast<double>(r);
        dropped += static_cast<double>(std::max<int64_t>(0, r - cap));
      }
    }
    const double simulated = dropped / routed, predicted = expected_drop_fraction_skewed(c, skew);
    if (std::getenv("MOE_VERBOSE")) std::printf("skew %.1f: predicted %.6g simulated %.6g\n", skew, predicted, simulated);
    EXPECT_GT(simulated, 0.01) << "skew " << skew;
    EXPECT_NEAR(predicted, simulated, 0.15 * simulated) << "skew " << skew;
  }
}

TEST(PlanErrors, LayoutArgumentAndLayoutNameWhatIsWrong) {
  ParallelConfig pc;
  apply_layout_arg("pp=2,dp=4", pc);
  EXPECT_EQ(pc.dp, 4);
  EXPECT_EQ(pc.pp, 2);
  EXPECT_EQ(pc.ep, 1);
  EXPECT_NE(error_of([&] { apply_layout_arg("dp=4,tp=2", pc); }).find("unknown key 'tp'"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_layout_arg("dp=x", pc); }).find("dp=x is not a positive integer"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_layout_arg("dp=0", pc); }).find("not a positive integer"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_layout_arg("dp=2,dp=4", pc); }).find("dp given twice"), std::string::npos);
  EXPECT_NE(error_of([&] { apply_layout_arg("dp4", pc); }).find("not key=value"), std::string::npos);
  EXPECT_NE(error_of([&] { make_plan(small({"parallel.dp=4", "parallel.ep=3"})); }).find("ep=3"), std::string::npos);
  EXPECT_NE(error_of([&] { make_plan(small({"parallel.dp=3"})); }).find("train.batch_size"), std::string::npos);
  EXPECT_NE(error_of([&] { make_plan(small({"parallel.pp=5"})); }).find("pp=5"), std::string::npos);
}

// The JSON carries what the tables show, at full precision.
TEST(PlanOutput, JsonHoldsEveryRankAndStage) {
  const Config c = small({"parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "model.routing=uniform"});
  const Plan p = make_plan(c);
  const nlohmann::json j = nlohmann::json::parse(plan_to_json(c, p));
  EXPECT_EQ(j["layout"]["world"], 4);
  ASSERT_EQ(j["ranks"].size(), 4u);
  ASSERT_EQ(j["stages"].size(), 2u);
  EXPECT_EQ(j["stages"][1]["total_bytes"].get<double>(), p.stages[1].memory.total());
  EXPECT_EQ(j["ranks"][3]["bytes_sent"].get<double>(), p.ranks[3].bytes_sent());
  EXPECT_EQ(j["ranks"][3]["comm"].size(), p.ranks[3].comm.size());
  const std::string text = format_plan(c, p);
  EXPECT_NE(text.find("expert dispatch, forward"), std::string::npos);
  EXPECT_NE(text.find("stage 1 [2,4)"), std::string::npos);
}

// Link classes from the rank order: with 2 ranks per node, dp=4 spans two nodes, while each EP
// pair (contiguous ranks) stays inside one.
TEST(PlanOutput, LinksFollowTheRankOrder) {
  PlanOptions o;
  o.ranks_per_node = 2;
  const Plan p = make_plan(small({"parallel.dp=4", "parallel.ep=2", "model.routing=uniform"}), o);
  for (const PlannedCollective& c : p.ranks[0].comm) {
    EXPECT_EQ(c.link, c.group == "ep" ? "node" : "network") << c.group << " " << c.what;
  }
}

// What the tables print is rounded: random routing's expected drops of the 1.2T model at capacity
// 1.1875 are 2.4e-297 %, which printed as a figure ("2.35323e-297%"); the JSON keeps the value.
TEST(PlanCli, PrintsNoFloatingPointNoise) {
  const test::CliResult r = test::run_cli(
      "plan --config " + std::string(test::source_dir()) + "/configs/published/olmo3_v7_1t.toml --cluster b300x512 "
      "--layout dp=64,ep=8,pp=8 --set train.micro_batch_size=1 --set train.batch_size=8192 "
      "--set parallel.ep_capacity_factor=1.1875");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("routes dropped < 0.0001% ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("skew 0.0 < 0.0001%;"), std::string::npos) << r.output;
  // No exponent (a digit, e or E, an optional sign, a digit) and no 7 or more decimals. A plain
  // scan: std::regex here trips g++ 12's -Wmaybe-uninitialized in the sanitizer build.
  const std::string& o = r.output;
  const auto digit = [&](size_t i) { return i < o.size() && std::isdigit(static_cast<unsigned char>(o[i])) != 0; };
  for (size_t i = 0; i < o.size(); ++i) {
    if (digit(i) && (i + 1 < o.size() && (o[i + 1] == 'e' || o[i + 1] == 'E'))) {
      const size_t j = i + 2 + (i + 2 < o.size() && (o[i + 2] == '-' || o[i + 2] == '+') ? 1 : 0);
      EXPECT_FALSE(digit(j)) << "an exponent at " << o.substr(i, 12) << " in " << o;
    }
    if (o[i] == '.') {
      size_t n = 0;
      while (digit(i + 1 + n)) ++n;
      EXPECT_LT(n, 7u) << "decimals at " << o.substr(i, 12) << " in " << o;
    }
  }
}

TEST(PlanCli, PrintsTablesAndJsonAndNamesBadInput) {
  const test::CliResult ok = test::run_cli("plan --layout dp=2,ep=2 --set model.routing=uniform");
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_NE(ok.output.find("## memory per rank"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("expert combine, backward"), std::string::npos) << ok.output;
  const test::CliResult js = test::run_cli("plan --layout dp=2,pp=2 --json");
  EXPECT_EQ(js.status, 0) << js.output;
  EXPECT_EQ(nlohmann::json::parse(js.output)["layout"]["pp"], 2);
  const test::CliResult bad = test::run_cli("plan --layout dp=2,ep=4");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("ep=4"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace moe
