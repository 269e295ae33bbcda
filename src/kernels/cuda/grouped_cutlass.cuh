// The tensor-core grouped GEMMs (bf16 operands, fp32 accumulation and output) on CUTLASS 3.x
// ptr-array kernels, with the group sizes kept on the device: a prep kernel, one thread per expert,
// turns the offsets into each group's problem shape, pointers and strides; CUTLASS gets a null host
// problem-shape array, so the host never sees a count. One configuration per translation unit
// (grouped_{fwd,dgrad,wgrad}_{sm90,sm100}.cu) so builds parallelize.
//
// Our row-major operands in CUTLASS's terms (A is M x K, B is N x K, D is M x N):
//   fwd    y_e(M_e,N)  = x_e(M_e,K) w_e(N,K)^T   A row-major x_e, B column-major w_e (K contiguous)
//   dgrad  dx_e(M_e,K) = dy_e(M_e,N) w_e(N,K)    A row-major dy_e, B row-major w_e (problem N = K, K = N)
//   wgrad  dw_e(N,K)  += dy_e^T x_e              A column-major dy_e, B row-major x_e, ragged K = M_e,
//                                                C = D = dw_e with beta = 1
// An expert without rows is an empty problem (M = 0) in every kind, so the tile scheduler gives it
// no tile: for wgrad that matters, since with K = 0 CUTLASS's mainloop never clears its
// accumulators and the epilogue would store stale registers + C (reported upstream for SM100).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "kernels/cuda/grouped_cutlass.h"
#include "kernels/cuda/grouped_offsets.cuh"

namespace moe::cuda::grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

template <Kind kKind> struct Layouts;
template <> struct Layouts<Kind::kFwd> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
  using C = void;  // no source: y is overwritten
};
template <> struct Layouts<Kind::kDgrad> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
  using C = void;
};
template <> struct Layouts<Kind::kWgrad> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
  using C = float;  // dw += : the source is dw itself
};

// Sm90: cooperative TMA warp-specialized, 128x128x64 tiles. Sm100: one-SM tcgen05, 128x128x64.
struct Sm90Config {
  using Arch = cutlass::arch::Sm90;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Sm100Config {
  using Arch = cutlass::arch::Sm100;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
};

template <class Config, Kind kKind> struct Kernel {
  using ElementAB = cutlass::bfloat16_t;
  using ElementC = typename Layouts<kKind>::C;
  using ElementD = float;
  using LayoutA = typename Layouts<kKind>::A;
  using LayoutB = typename Layouts<kKind>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 8, kAlignD = 4;
  static constexpr int kAlignC = cute::is_void_v<ElementC> ? kAlignD : 4;
  using LayoutC = LayoutD;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      typename Config::Arch, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutC*, kAlignC, ElementD, LayoutD*, kAlignD,
      typename Config::Epilogue>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      typename Config::Arch, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB, LayoutB*, kAlignAB,
      float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Mainloop>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// Per-group arrays the kernel reads, carved from the scratch in this order.
template <class K> struct GroupArrays {
  typename K::Shape3* shapes;
  const typename K::ElementAB** a;
  const typename K::ElementAB** b;
  const float** c;
  float** d;
  typename K::StrideA* sa;
  typename K::StrideB* sb;
  typename K::StrideC* sc;
  typename K::StrideD* sd;
};

template <class K, Kind kKind>
__global__ void prepare_groups_kernel(GroupArrays<K> g, const int32_t* offsets, int64_t experts, int64_t R,
                                      const void* a_base, const void* b_base, float* out, int64_t n, int64_t k,
                                      DeviceError* err, int code) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= experts) return;
  check_expert_offsets(offsets, e, experts, R, err, code);
  int64_t r0, r1;
  expert_rows(offsets, e, R, r0, r1);
  const int64_t rows = r1 - r0;
  const auto* A = static_cast<const typename K::ElementAB*>(a_base);
  const auto* B = static_cast<const typename K::ElementAB*>(b_base);
  int M = 0, N = 0, Kd = 0;
  if constexpr (kKind == Kind::kFwd) {  // a = x (R,k), b = w (E,n,k), out = y (R,n)
    M = static_cast<int>(rows), N = static_cast<int>(n), Kd = static_cast<int>(k);
    g.a[e] = A + r0 * k;
    g.b[e] = B + e * n * k;
    g.d[e] = out + r0 * n;
  } else if constexpr (kKind == Kind::kDgrad) {  // a = dy (R,n), b = w (E,n,k), out = dx (R,k)
    M = static_cast<int>(rows), N = static_cast<int>(k), Kd = static_cast<int>(n);
    g.a[e] = A + r0 * n;
    g.b[e] = B + e * n * k;
    g.d[e] = out + r0 * k;
  } else {  // a = dy (R,n), b = x (R,k), out = dw (E,n,k); no rows: M = 0 (no tile, dw_e untouched)
    M = rows > 0 ? static_cast<int>(n) : 0, N = static_cast<int>(k), Kd = static_cast<int>(rows);
    g.a[e] = A + r0 * n;
    g.b[e] = B + r0 * k;
    g.c[e] = out + e * n * k;
    g.d[e] = out + e * n * k;
  }
  g.shapes[e] = typename K::Shape3{M, N, Kd};
  g.sa[e] = cutlass::make_cute_packed_stride(typename K::StrideA{}, cute::make_shape(M, Kd, 1));
  g.sb[e] = cutlass::make_cute_packed_stride(typename K::StrideB{}, cute::make_shape(N, Kd, 1));
  g.sc[e] = cutlass::make_cute_packed_stride(typename K::StrideC{}, cute::make_shape(M, N, 1));
  g.sd[e] = cutlass::make_cute_packed_stride(typename K::StrideD{}, cute::make_shape(M, N, 1));
}

inline size_t align_up(size_t v) { return (v + 255) / 256 * 256; }

// Enqueues one grouped GEMM; false when this configuration cannot run it (the caller falls back).
template <class Config, Kind kKind> bool run(const Args& args) {
  using K = Kernel<Config, kKind>;
  const size_t E = static_cast<size_t>(args.experts);
  char* p = static_cast<char*>(args.scratch);
  size_t used = 0;
  auto take = [&](size_t bytes) {
    char* at = p + used;
    used += align_up(bytes);
    return at;
  };
  GroupArrays<K> g;
  g.shapes = reinterpret_cast<typename K::Shape3*>(take(E * sizeof(typename K::Shape3)));
  g.a = reinterpret_cast<const typename K::ElementAB**>(take(E * sizeof(void*)));
  g.b = reinterpret_cast<const typename K::ElementAB**>(take(E * sizeof(void*)));
  g.c = reinterpret_cast<const float**>(take(E * sizeof(void*)));
  g.d = reinterpret_cast<float**>(take(E * sizeof(void*)));
  g.sa = reinterpret_cast<typename K::StrideA*>(take(E * sizeof(typename K::StrideA)));
  g.sb = reinterpret_cast<typename K::StrideB*>(take(E * sizeof(typename K::StrideB)));
  g.sc = reinterpret_cast<typename K::StrideC*>(take(E * sizeof(typename K::StrideC)));
  g.sd = reinterpret_cast<typename K::StrideD*>(take(E * sizeof(typename K::StrideD)));
  if (used > args.scratch_bytes) return false;

  cutlass::KernelHardwareInfo hw;
  hw.device_id = args.device;
  hw.sm_count = args.sm_count;
  typename K::Gemm::Arguments arguments;
  decltype(arguments.epilogue.thread) fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = kKind == Kind::kWgrad ? 1.0f : 0.0f;
  auto c_array = [&] {
    if constexpr (kKind == Kind::kWgrad) return g.c;
    else return nullptr;
  }();
  arguments = typename K::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                          {static_cast<int>(E), g.shapes, nullptr},
                                          {g.a, g.sa, g.b, g.sb},
                                          {fusion, c_array, g.sc, g.d, g.sd},
                                          hw};
  const size_t workspace = K::Gemm::get_workspace_size(arguments);
  void* ws = take(workspace);
  if (used > args.scratch_bytes) return false;
  typename K::Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return false;
  prepare_groups_kernel<K, kKind><<<static_cast<unsigned>((E + 127) / 128), 128, 0, args.stream>>>(
      g, args.offsets, args.experts, args.rows, args.a, args.b, args.out, args.n, args.k, args.error, args.error_code);
  if (gemm.initialize(arguments, ws, args.stream) != cutlass::Status::kSuccess) return false;
  return gemm.run(args.stream) == cutlass::Status::kSuccess;
}

}  // namespace moe::cuda::grouped
