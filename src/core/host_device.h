// MOE_HD: a function compiled for the host and, under nvcc, for the device too, so the CPU and the
// CUDA kernels share one text where their results must be identical (core/philox.h,
// kernels/math/ep_plan_math.h).
#pragma once

#ifdef __CUDACC__
#define MOE_HD __host__ __device__
#else
#define MOE_HD
#endif
