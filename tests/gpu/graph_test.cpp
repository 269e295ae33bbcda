// A whole training step (one GPU, no EP) captured in a CUDA graph (cudaStreamCaptureModeGlobal, so
// any synchronizing or allocating call during the capture fails it) and replayed twice: the
// parameters after the two replays equal, bit for bit, those of a second trainer that ran the same
// two steps eagerly. Label gpu; Skipped without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "gpu/small_config.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/host_view.h"
#include "train/trainer.h"

namespace moe {
namespace {

void check(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

TEST(CudaGraph, OneCapturedStepReplaysAsTheNextStepsBitwise) {
  std::string why;
  if (cuda_device_count(&why) == 0) GTEST_SKIP() << "no GPU: " << why;
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const Config c = test::small_cuda_config(precision);
    std::unique_ptr<Backend> ops_a = make_backend("cuda"), ops_b = make_backend("cuda");
    Trainer eager(c, *ops_a, DType::kF32), graphed(c, *ops_b, DType::kF32);
    OwnedTensor ids(DType::kI32, {4, 64}), labels(DType::kI32, {4, 64});
    for (int64_t i = 0; i < 4 * 64; ++i) {
      ids.as<int32_t>()[i] = static_cast<int32_t>((i * 5 + 1) % 64);
      labels.as<int32_t>()[i] = static_cast<int32_t>((i * 5 + 6) % 64);
    }
    for (int s = 0; s < 4; ++s) eager.step(ids, labels);
    for (int s = 0; s < 2; ++s) graphed.step(ids, labels);  // warm-up: plans, heuristics, first-use state

    auto stream = static_cast<cudaStream_t>(cuda_stream(*ops_b));
    cudaGraph_t graph = nullptr;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    graphed.enqueue_step_on_device(ids, labels);
    check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture (a call in the step is not capturable)");
    cudaGraphExec_t exec = nullptr;
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");  // step 3
    check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");  // step 4
    ops_b->synchronize();

    const HostView a(*ops_a, eager.model().params().flat), b(*ops_b, graphed.model().params().flat);
    ASSERT_EQ(a.tensor().nbytes(), b.tensor().nbytes());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.tensor().nbytes()), 0)
        << "parameters after two replays differ from two eager steps";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

}  // namespace
}  // namespace moe
