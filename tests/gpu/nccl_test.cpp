// The NCCL communicator at world size 1 (one GPU: NCCL refuses two ranks of one communicator on
// one device): every collective over device buffers of the cuda backend, ordered against the
// backend's stream, with the results read back and the byte counters of communicator.h. Label gpu;
// Skipped without a GPU. Cross-rank NCCL (and NCCL expert parallelism) is untested until a
// machine with several GPUs runs it.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/buffer.h"
#include "kernels/cuda/cuda_backend.h"
#include "parallel/communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/staged_comm.h"

namespace moe {
namespace {

TEST(Nccl, EveryCollectiveAtWorldSizeOne) {
  std::string why;
  if (cuda_device_count(&why) == 0) GTEST_SKIP() << "no GPU: " << why;
  std::unique_ptr<Backend> ops = make_backend("cuda");
  SelfCommunicator self;
  std::unique_ptr<Communicator> world = make_nccl_world(self, *ops);
  ASSERT_EQ(world->size(), 1);
  EXPECT_EQ(world->backend(), "nccl");
  EXPECT_EQ(world->buffer_device(), Device::kCuda);
  const int64_t n = 1000;
  std::vector<float> h(n);
  std::iota(h.begin(), h.end(), 1.0f);
  Buffer a(*ops, n * 4), b(*ops, n * 4);
  const Tensor ta = a.view(DType::kF32, {n}), tb = b.view(DType::kF32, {n});
  StagedComm comm(*ops);
  ASSERT_TRUE(comm.direct(*world)) << "device buffers go to NCCL as they are";

  ops->upload(h.data(), ta);
  comm.all_reduce_sum(*world, ta);  // size 1: the sum of one rank is itself
  comm.reduce_scatter_sum(*world, ta, tb);
  comm.broadcast(*world, tb, 0);
  comm.all_gather(*world, tb, ta);
  std::vector<float> back(n, -1.0f);
  ops->download(ta, back.data());
  ops->synchronize();
  EXPECT_EQ(back, h);

  // Grouped send and receive to itself, as the expert exchange posts them.
  ops->upload(h.data(), ta);
  world->group_start();
  Request r = world->irecv(tb.data, n, DType::kF32, 0);
  Request s = world->isend(ta.data, n, DType::kF32, 0);
  world->group_end();
  r.wait();
  s.wait();
  std::vector<float> got(n, -1.0f);
  ops->download(tb, got.data());
  ops->synchronize();
  EXPECT_EQ(got, h);
  world->barrier();

  const CommStats st = world->stats();
  EXPECT_EQ(st.sent(CommOp::kAllReduce), 0u) << "size 1 sends nothing (communicator.h)";
  EXPECT_EQ(st.sent(CommOp::kSend), static_cast<uint64_t>(n * 4));
  EXPECT_EQ(st.count(CommOp::kAllGather), 1u);
  std::unique_ptr<Communicator> sub = world->split(0, 0);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_FALSE(nccl_version().empty());
}

}  // namespace
}  // namespace moe
