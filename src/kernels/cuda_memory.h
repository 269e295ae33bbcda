// Device memory the cuda backend holds beside the model's own buffers, stated once so that the
// memory estimate (plan/memory.cpp, moecore config) counts what the backend allocates
// (kernels/cuda/cuda_backend.cpp, kernels/cuda/sdpa_cudnn.cpp). No CUDA headers: the estimate is
// made in every build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/check.h"

namespace moe {

// name (MiB, a positive integer) from the environment, or fallback bytes.
inline uint64_t env_mib(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const unsigned long long mb = std::strtoull(v, &end, 10);
  MOE_CHECK(end && *end == '\0' && mb > 0, name, " = \"", v, "\" is not a positive number of MiB");
  return static_cast<uint64_t>(mb) << 20;
}

// The kernels' shared scratch (MOE_CUDA_SCRATCH_MB, default 64 MiB) and cuBLASLt's workspace.
inline uint64_t cuda_scratch_bytes() { return env_mib("MOE_CUDA_SCRATCH_MB", uint64_t{64} << 20); }
constexpr uint64_t kCublasLtWorkspaceBytes = uint64_t{32} << 20;  // cuBLASLt's recommendation for Hopper and Blackwell

// cuDNN SDPA's one buffer: bf16 copies of the fp32 tensors among q, k, v, o (forward; nq =
// B*S*H*hd, nk = B*S*G*hd) or q, o, dO, dQ, k, v, dK, dV (backward), each from a 256-byte
// boundary, then the graph's workspace. stored_bf16: q, k, v and o are bf16 already (bf16
// mode's saved activations), so only dO, dQ, dK, dV are copied.
inline uint64_t cudnn_sdpa_buffer_bytes(bool backward, bool stored_bf16, int64_t nq, int64_t nk, int64_t workspace) {
  // 64-bit whatever size_t is: the memory estimate also runs as 32-bit WebAssembly (the planner).
  const auto padded = [](int64_t n) { return static_cast<uint64_t>((n * 2 + 255) / 256 * 256); };
  const uint64_t copies = (stored_bf16 ? 0 : 2) + (backward ? 2 : 0);
  return copies * (padded(nq) + padded(nk)) + static_cast<uint64_t>(workspace);
}

// The backward's workspace, the estimate's bound for cuDNN's own figure (known only once the graph
// is built on the device). Deterministic, on Hopper: a dP buffer of b * h * ceil64(s_q) *
// ceil64(s_kv) * 2 bytes (shared/reference/gpu-backend.md). Otherwise: an fp32 dQ accumulator and
// two fp32 row statistics, b * h * ceil64(s) * (hd + 2) * 4 bytes (FlashAttention-2's layout; to
// be checked against cuDNN's figure on a GPU).
inline int64_t cudnn_sdpa_backward_workspace_bound(int64_t B, int64_t H, int64_t S, int64_t hd, bool deterministic) {
  const int64_t s64 = (S + 63) / 64 * 64;
  return deterministic ? B * H * s64 * s64 * 2 : B * H * s64 * (hd + 2) * 4;
}

}  // namespace moe
