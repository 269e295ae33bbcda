// Device discipline of a plain training step on the GPU, counted by CUPTI at the driver API (so
// cuBLASLt, CUTLASS and NCCL calls count too): during steps after the warm-up, no allocation and
// no free anywhere in the process, exactly one host synchronization per step (the wait for its
// record), one device-to-host copy (the step's statistics: the strict backend's budget) and two
// host-to-device copies (ids and labels) through the backend's pinned staging ring. cuDNN's
// frontend adds its own: each SDPA execute copies its workspace constants from pageable host
// vectors (graph_interface.h, run_auxiliary_kernels). The first GPU run counted them (bf16: 8 per
// step of 2 layers x 2 micro-batches x forward and backward); they are told apart by their
// pageable source and held to at most one per cuDNN call, none in fp32 (no cuDNN). Label gpu;
// Skipped without a GPU or without CUPTI.
#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpu/small_config.h"
#include "kernels/cuda/cuda_backend.h"
#include "train/trainer.h"

#ifdef MOE_HAVE_CUPTI
#include <cuda_runtime.h>
#include <cupti.h>
#endif

namespace moe {
namespace {

#ifdef MOE_HAVE_CUPTI
struct ApiCounts {
  int64_t alloc = 0, free = 0, sync = 0, d2h = 0, h2d = 0, d2d = 0;
  std::vector<std::pair<uintptr_t, size_t>> h2d_sources;  // (host source, bytes), classified afterwards
  std::vector<std::pair<uintptr_t, uintptr_t>> untyped;  // cuMemcpy(Async): (dst, src), classified afterwards
  std::vector<std::string> names;                        // every counted call, for the failure message
};
ApiCounts g_counts;
bool g_counting = false;

void CUPTIAPI on_driver_call(void*, CUpti_CallbackDomain, CUpti_CallbackId cbid, const void* data) {
  const auto* d = static_cast<const CUpti_CallbackData*>(data);
  if (!g_counting || d->callbackSite != CUPTI_API_ENTER) return;
  const std::string_view n(d->functionName);
  auto has = [&](const char* s) { return n.find(s) != std::string_view::npos; };
  bool counted = true;
  if (has("Memcpy")) {
    if (has("DtoH")) ++g_counts.d2h;
    else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2) {
      const auto* p = static_cast<const cuMemcpyHtoDAsync_v2_params*>(d->functionParams);
      g_counts.h2d_sources.emplace_back(reinterpret_cast<uintptr_t>(p->srcHost), p->ByteCount);
    } else if (has("HtoD")) ++g_counts.h2d;
    else if (has("DtoD")) ++g_counts.d2d;
    else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync) {
      const auto* p = static_cast<const cuMemcpyAsync_params*>(d->functionParams);
      g_counts.untyped.emplace_back(static_cast<uintptr_t>(p->dst), static_cast<uintptr_t>(p->src));
    } else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemcpy) {
      const auto* p = static_cast<const cuMemcpy_params*>(d->functionParams);
      g_counts.untyped.emplace_back(static_cast<uintptr_t>(p->dst), static_cast<uintptr_t>(p->src));
    }
  } else if (has("MemAlloc") || has("MemHostAlloc") || has("MemCreate") || has("MemAllocAsync")) {
    ++g_counts.alloc;
  } else if (has("MemFree") || has("MemRelease")) {
    ++g_counts.free;
  } else if (has("Synchronize")) {
    ++g_counts.sync;
  } else {
    counted = false;
  }
  if (counted) g_counts.names.emplace_back(n);
}

// The memory a pointer names (cudaMemoryTypeUnregistered: pageable host memory, or unknown).
cudaMemoryType memory_type(uintptr_t p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(p)) != cudaSuccess) {
    cudaGetLastError();
    return cudaMemoryTypeUnregistered;
  }
  return a.type;
}
bool on_device(uintptr_t p) {
  const cudaMemoryType t = memory_type(p);
  return t == cudaMemoryTypeDevice || t == cudaMemoryTypeManaged;
}
bool pinned_host(uintptr_t p) { return memory_type(p) == cudaMemoryTypeHost; }
#endif

TEST(Cupti, PlainStepsAllocateNothingAndSyncOnce) {
  std::string why;
  if (cuda_device_count(&why) == 0) GTEST_SKIP() << "no GPU: " << why;
#ifndef MOE_HAVE_CUPTI
  GTEST_SKIP() << "built without CUPTI (MOE_CUPTI_LIBRARY not found)";
#else
  // Eager steps (Trainer::step) and lagged ones (submit, as `moecore train` runs them by default):
  // the same budget per step.
  for (const std::string precision : {"fp32", "bf16"})
    for (const bool lagged : {false, true}) {
    SCOPED_TRACE(precision + (lagged ? " lagged" : " eager"));
    const Config c = test::small_cuda_config(precision);
    std::unique_ptr<Backend> ops = make_backend("cuda");
    Trainer trainer(c, *ops, DType::kF32);
    OwnedTensor ids(DType::kI32, {4, 64}), labels(DType::kI32, {4, 64});
    for (int64_t i = 0; i < 4 * 64; ++i) {
      ids.as<int32_t>()[i] = static_cast<int32_t>((i * 7) % 64);
      labels.as<int32_t>()[i] = static_cast<int32_t>((i * 7 + 3) % 64);
    }
    const auto one_step = [&] {
      if (lagged) trainer.submit(ids, labels);
      else trainer.step(ids, labels);
    };
    for (int s = 0; s < 2; ++s) one_step();  // warm-up: GEMM plans, heuristics (lagged: one in flight)
    CUpti_SubscriberHandle sub = nullptr;
    ASSERT_EQ(cuptiSubscribe(&sub, on_driver_call, nullptr), CUPTI_SUCCESS);
    ASSERT_EQ(cuptiEnableDomain(1, sub, CUPTI_CB_DOMAIN_DRIVER_API), CUPTI_SUCCESS);
    g_counts = ApiCounts{};
    const int steps = 3;
    const CudaPaths before = cuda_paths(*ops);
    g_counting = true;
    for (int s = 0; s < steps; ++s) one_step();
    g_counting = false;
    cuptiUnsubscribe(sub);
    trainer.collect();
    const int64_t cudnn_calls = static_cast<int64_t>((cuda_paths(*ops) - before).attention_cudnn);
    int64_t pageable = 0;
    for (const auto& [src, bytes] : g_counts.h2d_sources) {
      if (pinned_host(src)) {
        ++g_counts.h2d;
      } else {
        ++pageable;
        EXPECT_LE(bytes, 4096u) << "a pageable host-to-device copy of " << bytes << " bytes: not a cuDNN constant";
      }
    }
    for (const auto& [dst, src] : g_counts.untyped) {
      const bool d = on_device(dst), s = on_device(src);
      if (d && s) ++g_counts.d2d;
      else if (d) ++g_counts.h2d;
      else if (s) ++g_counts.d2h;
    }
    std::string calls;
    for (const std::string& n : g_counts.names) calls += n + " ";
    EXPECT_EQ(g_counts.alloc, 0) << calls;
    EXPECT_EQ(g_counts.free, 0) << calls;
    EXPECT_EQ(g_counts.sync, steps) << "one wait per step: " << calls;
    EXPECT_EQ(g_counts.d2h, steps) << "one download per step (the strict backend's budget): " << calls;
    EXPECT_EQ(g_counts.h2d, 2 * steps) << "ids and labels, through the pinned ring: " << calls;
    EXPECT_LE(pageable, cudnn_calls) << "copies from pageable memory: at most one per cuDNN SDPA call (" << cudnn_calls
                                     << "): " << calls;
    if (precision == "fp32") {
      EXPECT_EQ(pageable, 0) << calls;
    }
  }
#endif
}

}  // namespace
}  // namespace moe
