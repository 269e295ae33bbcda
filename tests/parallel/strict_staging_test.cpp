// Communication staging on the strict backend: every buffer the communicator moves goes through
// a counted host copy, and those bytes are exactly the communicator's byte counters
// (communicator.h) of the staged operations -- all-reduce (gradients, step statistics, the norm's
// sums), send/recv (pipeline), reduce-scatter and all-gather (ZeRO-1) -- less the few host values
// that never were on the device (the loss-token count, the pipeline's end-of-step token) -- and,
// with the padded expert transport (all-gather of counts, all-to-all of slabs), the step reads
// nothing else of the device.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/process_groups.h"
#include "parallel/parity_common.h"
#include "parallel/world.h"
#include "train/trainer.h"

namespace moe::test {
namespace {

CommStats operator-(const CommStats& a, const CommStats& b) {
  CommStats d;
  for (int i = 0; i < kNumCommOps; ++i) {
    d.bytes_sent[i] = a.bytes_sent[i] - b.bytes_sent[i];
    d.bytes_received[i] = a.bytes_received[i] - b.bytes_received[i];
    d.calls[i] = a.calls[i] - b.calls[i];
  }
  return d;
}

CommStats total(const ProcessGroups& g) {
  CommStats t;
  for (const Communicator* c : {g.world, g.dp.get(), g.ep.get(), g.edp.get(), g.pp.get()}) {
    const CommStats s = c->stats();
    for (int i = 0; i < kNumCommOps; ++i) {
      t.bytes_sent[i] += s.bytes_sent[i];
      t.bytes_received[i] += s.bytes_received[i];
    }
  }
  return t;
}

struct Layouts {
  const char* name;
  int64_t dp, pp;
  bool zero1;
  int64_t ep = 1;  // with the padded expert transport
};

TEST(StrictStaging, StagedBytesAreTheCommunicatorsPayload) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  for (const Layouts& l : {Layouts{"dp2", 2, 1, false}, Layouts{"dp2_zero1", 2, 1, true}, Layouts{"pp2", 1, 2, false},
                         Layouts{"dp2_ep2_padded", 2, 1, false, 2}}) {
    SCOPED_TRACE(l.name);
    Config c = parity_config();
    c.parallel.dp = l.dp;
    c.parallel.pp = l.pp;
    c.parallel.zero1 = l.zero1;
    c.parallel.ep = l.ep;
    c.parallel.ep_transport = "padded";
    ProcessGroups g = make_process_groups(world(), layout_from_config(c.parallel));
    std::unique_ptr<Backend> ops = make_backend("strict");
    Trainer trainer(c, *ops, DType::kF32, &g);
    const int64_t local = trainer.local_batch(), S = c.train.seq_len, row0 = g.coords.dp * local;
    std::vector<int32_t> ids, labels;
    const Tensor no_doc_start;
    for (int64_t step = 0; step < 3; ++step) {
      parity_batch(c, step, ids, labels);
      const Tensor tid(ids.data() + row0 * S, DType::kI32, {local, S}), tlab(labels.data() + row0 * S, DType::kI32, {local, S});
      const CommStats before = total(g);
      const StepResult& r = trainer.step(tid, tlab, no_doc_start);
      const CommStats d = total(g) - before;
      ASSERT_TRUE(r.finite);
      // Host values: the loss-token count (one f64 all-reduce over dp), the end-of-step token
      // (one i32 from stage 0 to each later stage).
      const uint64_t host_all_reduce = l.dp > 1 ? 8 : 0;
      const uint64_t token_sent = l.pp > 1 && g.coords.pp == 0 ? 4 : 0;
      const uint64_t token_received = l.pp > 1 && g.coords.pp > 0 ? 4 : 0;
      const uint64_t all_reduce = d.sent(CommOp::kAllReduce) - host_all_reduce;
      // ZeRO-1 over 2 ranks: a reduce-scatter stages the whole region down and one chunk up and
      // counts one chunk; an all-gather stages one chunk down and the region up and counts one.
      const uint64_t scatter = d.sent(CommOp::kReduceScatter), gather = d.sent(CommOp::kAllGather);
      // The padded expert exchange over 2 ranks: each all-to-all stages both slabs down and up
      // and counts the one that leaves; the count all-gathers add one chunk down, two up.
      const uint64_t slabs = d.sent(CommOp::kAllToAllV);
      EXPECT_EQ(l.ep > 1, slabs > 0 && gather > 0);
      EXPECT_GT(all_reduce, 0u);
      EXPECT_EQ(l.zero1, scatter > 0);
      EXPECT_EQ(r.staged.to_host_bytes, all_reduce + 2 * scatter + gather + 2 * slabs + d.sent(CommOp::kSend) - token_sent)
          << "step " << step;
      EXPECT_EQ(r.staged.to_device_bytes,
                all_reduce + scatter + 2 * gather + 2 * slabs + d.received(CommOp::kRecv) - token_received)
          << "step " << step;
      // The step's own read, its statistics, and nothing else: with the padded transport no
      // routing count reaches the host.
      EXPECT_EQ(r.transfers.to_host, 1u) << "step " << step;
    }
  }
}

}  // namespace
}  // namespace moe::test
