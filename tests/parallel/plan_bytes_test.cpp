// The planner's communication per step (src/plan/) against the byte counters of real steps:
// every rank, every group, every kind of operation, bytes and calls equal, for uniform routing
// (whose counts the plan derives in closed form) over the layouts this world size allows.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/ops.h"
#include "parallel/process_groups.h"
#include "parity_common.h"
#include "plan/plan.h"
#include "train/trainer.h"
#include "world.h"

namespace moe {
namespace {

using test::parity_batch;
using test::parity_config;
using test::world;

using Key = std::pair<std::string, std::string>;  // (group, op)
struct Traffic {
  double bytes = 0, received = 0, calls = 0;
};

std::map<Key, Traffic> snapshot(const ProcessGroups& g) {
  std::map<Key, Traffic> out;
  const std::pair<const char*, const Communicator*> comms[] = {
      {"world", g.world}, {"dp", g.dp.get()}, {"ep", g.ep.get()}, {"edp", g.edp.get()}, {"pp", g.pp.get()}};
  for (const auto& [name, c] : comms) {
    const CommStats s = c->stats();
    for (int op = 0; op < kNumCommOps; ++op) {
      const Key key{name, comm_op_name(static_cast<CommOp>(op))};
      Traffic& t = out[key];
      t.bytes = static_cast<double>(s.bytes_sent[static_cast<size_t>(op)]);
      t.received = static_cast<double>(s.bytes_received[static_cast<size_t>(op)]);
      t.calls = static_cast<double>(s.calls[static_cast<size_t>(op)]);
    }
  }
  return out;
}

struct Case {
  std::string name;
  int world;
  std::vector<std::string> overrides;
};

TEST(PlanBytes, PredictedTrafficEqualsTheByteCounters) {
  const int n = world().size();
  // "uneven": seq_len 13 x top_k 3 = 39 routes per micro-batch over 8 experts, so the counts
  // differ by expert and shift with every micro-batch's first token (the closed form is tested,
  // not only T K / E).
  const std::vector<Case> cases = {
      {"dp2", 2, {"parallel.dp=2"}},
      {"dp2 overlap", 2, {"parallel.dp=2", "parallel.overlap_grad_reduce=true"}},
      {"dp2 ep2", 2, {"parallel.dp=2", "parallel.ep=2"}},
      {"dp2 ep2 uneven", 2, {"parallel.dp=2", "parallel.ep=2", "train.seq_len=13", "model.top_k=3"}},
      {"dp2 ep2 uneven capacity recompute bf16", 2,
       {"parallel.dp=2", "parallel.ep=2", "train.seq_len=13", "model.top_k=3", "parallel.ep_capacity_factor=0.6",
        "train.recompute=true", "train.precision=bf16"}},
      {"dp2 ep2 padded capacity", 2,
       {"parallel.dp=2", "parallel.ep=2", "parallel.ep_transport=padded", "parallel.ep_capacity_factor=0.5"}},
      {"dp2 ep2 zero1", 2, {"parallel.dp=2", "parallel.ep=2", "parallel.zero1=true"}},
      {"dp2 zero1", 2, {"parallel.dp=2", "parallel.zero1=true"}},
      // Global load balancing: E counts per MoE layer and micro-batch, all-reduced over dp.
      {"dp2 ep2 global load balancing overlap", 2,
       {"parallel.dp=2", "parallel.ep=2", "loss.lbl_granularity=global", "parallel.overlap_grad_reduce=true"}},
      // MXFP8: the forward dispatch as codes then scales (33/32 bytes per value).
      {"dp2 ep2 mxfp8 uneven recompute", 2,
       {"parallel.dp=2", "parallel.ep=2", "train.precision=mxfp8", "model.expert_hidden=32", "train.seq_len=13",
        "model.top_k=3", "train.recompute=true"}},
      {"dp2 ep2 padded mxfp8", 2,
       {"parallel.dp=2", "parallel.ep=2", "parallel.ep_transport=padded", "train.precision=mxfp8", "model.expert_hidden=32"}},
      {"dp2 ep2 mxfp8 bf16 dispatch", 2,
       {"parallel.dp=2", "parallel.ep=2", "train.precision=mxfp8", "model.expert_hidden=32", "mxfp8.dispatch=false"}},
      {"pp2", 2, {"parallel.pp=2"}},
      {"pp2 uneven stages", 2, {"parallel.pp=2", "parallel.stage_layers=1,3", "train.recompute=true"}},
      {"dp2 ep2 pp2", 4, {"parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "train.seq_len=13", "model.top_k=3"}},
      {"dp4 ep2 zero1", 4, {"parallel.dp=4", "parallel.ep=2", "parallel.zero1=true", "parallel.ep_capacity_factor=0.8"}},
      {"dp4 ep4", 4, {"parallel.dp=4", "parallel.ep=4", "train.seq_len=13", "model.top_k=3"}},
      {"dp2 pp2 zero1", 4, {"parallel.dp=2", "parallel.pp=2", "parallel.zero1=true"}},
      {"dp2 pp2 global load balancing", 4, {"parallel.dp=2", "parallel.pp=2", "loss.lbl_granularity=global"}},
  };
  int ran = 0;
  for (const Case& k : cases) {
    if (k.world != n) continue;
    SCOPED_TRACE(k.name);
    ++ran;
    std::vector<std::string> o = {"model.routing=uniform", "model.router_bias_gamma=0"};
    o.insert(o.end(), k.overrides.begin(), k.overrides.end());
    const Config c = parse_config(config_to_toml(parity_config()), o);
    ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
    std::unique_ptr<Backend> ops = make_backend("cpu");
    Trainer trainer(c, *ops, DType::kF32, &g);
    const int64_t local = trainer.local_batch(), S = c.train.seq_len, row0 = g.coords.dp * local;
    std::vector<int32_t> ids, labels;
    for (int64_t step = 1; step <= 2; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      PlanOptions po;
      po.step = step;
      const Plan plan = make_plan(c, po);
      std::map<Key, Traffic> predicted;
      for (const PlannedCollective& pc : plan.ranks[static_cast<size_t>(world().rank())].comm) {
        Traffic& t = predicted[{pc.group, pc.op}];
        t.bytes += pc.bytes;
        t.received += pc.received;
        t.calls += pc.calls;
        EXPECT_TRUE(pc.exact) << pc.what;
      }
      parity_batch(c, step - 1, ids, labels);
      Tensor tid(ids.data() + row0 * S, DType::kI32, {local, S}), tlab(labels.data() + row0 * S, DType::kI32, {local, S});
      const std::map<Key, Traffic> before = snapshot(g);
      const StepResult r = trainer.step(tid, tlab);
      ASSERT_EQ(r.step, step);
      const std::map<Key, Traffic> after = snapshot(g);
      for (const auto& [key, a] : after) {
        const Traffic& b = before.at(key);
        const Traffic p = predicted.count(key) ? predicted.at(key) : Traffic{};
        SCOPED_TRACE(key.first + " " + key.second);
        EXPECT_EQ(a.bytes - b.bytes, p.bytes);
        EXPECT_EQ(a.received - b.received, p.received);
        // Groups of one rank count calls that send nothing; the plan lists none.
        if (group_size(plan.layout, key.first) > 1) {
          EXPECT_EQ(a.calls - b.calls, p.calls);
        }
        predicted.erase(key);
      }
      EXPECT_TRUE(predicted.empty()) << predicted.size() << " predicted (group, op) pairs the counters lack";
      // The plan's drop fraction is the step's measured one in every MoE layer this stage holds
      // (uniform routing does not depend on the layer).
      if (c.parallel.ep > 1) {
        const PlannedStage& st = plan.stages[static_cast<size_t>(g.coords.pp)];
        for (int64_t l = st.layer_begin; l < st.layer_end; ++l)
          if (c.model.is_moe_layer(l)) {
            EXPECT_DOUBLE_EQ(r.ep_drop_fraction.at(static_cast<size_t>(c.model.moe_index(l))), plan.drop_fraction);
          }
        if (c.parallel.ep_capacity_factor > 0 && c.parallel.ep_capacity_factor < 0.7) {
          EXPECT_GT(plan.drop_fraction, 0);
        }
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no layout of " << n << " ranks in the table";
}

}  // namespace
}  // namespace moe
