// The grouped GEMMs' expert offsets, read only on the device: checked and clamped by the kernels
// that already read them (grouped_gemm.cu's SIMT kernels, grouped_cutlass.cuh's prep kernel), so
// the check adds no launch to a step.
#pragma once

#include <cstdint>

#include "kernels/cuda/device.cuh"

namespace moe::cuda {

// Expert e's part of the check 0 = offsets[0] <= ... <= offsets[E] <= R (one thread per expert):
// a violation goes to the device error word, naming the op (raised at the next wait). Not inlined:
// the GEMM kernels it runs in keep their registers for the tiles.
static __device__ __noinline__ void check_expert_offsets(const int32_t* offsets, int64_t e, int64_t E, int64_t R,
                                                     DeviceError* err, int code) {
  const int64_t a = offsets[e], b = offsets[e + 1];
  if (e == 0 && a != 0) report_error(err, code, static_cast<int>(a), 0);
  else if (b < a) report_error(err, code, static_cast<int>(b), e + 1);
  else if (e == E - 1 && b > R) report_error(err, code, static_cast<int>(b), E);
}

// Expert e's rows [r0, r1), clamped to [0, R): a bad table reads and writes nothing outside.
__device__ __forceinline__ void expert_rows(const int32_t* offsets, int64_t e, int64_t R, int64_t& r0, int64_t& r1) {
  r0 = min(max(static_cast<int64_t>(offsets[e]), int64_t{0}), R);
  r1 = min(max(static_cast<int64_t>(offsets[e + 1]), r0), R);
}

}  // namespace moe::cuda
