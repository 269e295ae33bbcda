// Grouped (expert) GEMMs whose group sizes stay on the device. bf16 operands on Hopper and
// Blackwell go to the CUTLASS tensor-core kernels (grouped_cutlass.cuh); everything else -- fp32
// operands (the parity path), other GPUs, unaligned shapes -- to the SIMT kernel here, where each
// block finds its expert and row tile from the offsets itself (no count reaches the host): 64x64 tiles,
// 4x4 outputs per thread, every output summed over the reduction index in order (deterministic).
// Contracts: kernels/op_list.inc; reference: kernels/ref/gemm.cpp.
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/grouped_cutlass.h"
#include "kernels/cuda/grouped_offsets.cuh"
#include "kernels/checks/gemm_checks.h"

namespace moe::cuda {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = 16, kThreads = 256;

int error_code(OpId op) { return static_cast<int>(op) + 1; }  // DeviceError's codes

// Row tile `tile` of the concatenated per-expert tilings: its expert, and the tile's first row.
// Tiles past the last expert's return false. E is small (<= 1024): a scan per block is cheap.
__device__ bool find_tile(const int32_t* offsets, int64_t E, int64_t R, int64_t tile, int64_t& expert, int64_t& row0,
                          int64_t& row1) {
  int64_t seen = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t r0, r1;
    expert_rows(offsets, e, R, r0, r1);
    const int64_t tiles = (r1 - r0 + kBM - 1) / kBM;
    if (tile < seen + tiles) {
      expert = e;
      row0 = r0 + (tile - seen) * kBM;
      row1 = r1;
      return true;
    }
    seen += tiles;
  }
  return false;
}

using TileA = float[kBK][kBM + 4];
using TileB = float[kBK][kBN + 4];

// acc (this thread's 4x4 outputs) += the staged tiles' product, over the tile's reduction index in order.
__device__ __forceinline__ void accumulate_tile(const TileA& As, const TileB& Bs, float (&acc)[4][4], int tx, int ty) {
#pragma unroll
  for (int l = 0; l < kBK; ++l) {
    float av[4], bv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      av[u] = As[l][ty * 4 + u];
      bv[u] = Bs[l][tx * 4 + u];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[u][v] = __fmaf_rn(av[u], bv[v], acc[u][v]);
  }
}

// C(i, j) = sum_l A(i, l) B(l, j) over one expert's rows:
//   A(i, l) = a[(row0 + i) * red + l]            (rows of x or dy)
//   B(l, j) = b[expert * b_expert + l * b_l + j * b_j]
//   C(i, j) = c[(row0 + i) * cols + j]
template <class S>
__global__ void __launch_bounds__(kThreads) grouped_rows_kernel(const S* a, const S* b, float* c, const int32_t* offsets,
                                                                int64_t E, int64_t R, int64_t red, int64_t cols,
                                                                int64_t b_expert, int64_t b_l, int64_t b_j,
                                                                DeviceError* err, int code) {
  // Blocks (e, 0), e < E, exist (row_tiles counts a tile per expert beyond the rows): they check.
  if (blockIdx.y == 0 && blockIdx.x < E && threadIdx.x == 0) check_expert_offsets(offsets, blockIdx.x, E, R, err, code);
  int64_t expert, row0, row1;
  if (!find_tile(offsets, E, R, blockIdx.x, expert, row0, row1)) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kBN;
  __shared__ TileA As;
  __shared__ TileB Bs;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  const S* bexp = b + expert * b_expert;
  for (int64_t l0 = 0; l0 < red; l0 += kBK) {
    for (int q = threadIdx.x; q < kBM * kBK; q += kThreads) {
      const int i = q / kBK, l = q % kBK;
      const int64_t row = row0 + i, ll = l0 + l;
      As[l][i] = row < row1 && ll < red ? load(a + row * red + ll) : 0.0f;
    }
    for (int q = threadIdx.x; q < kBK * kBN; q += kThreads) {
      const int l = q / kBN, j = q % kBN;
      const int64_t ll = l0 + l, col = col0 + j;
      Bs[l][j] = ll < red && col < cols ? load(bexp + ll * b_l + col * b_j) : 0.0f;
    }
    __syncthreads();
    accumulate_tile(As, Bs, acc, tx, ty);
    __syncthreads();
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int64_t row = row0 + ty * 4 + u;
    if (row >= row1) continue;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int64_t col = col0 + tx * 4 + v;
      if (col < cols) c[row * cols + col] = acc[u][v];
    }
  }
}

// dw[e](n, k) += sum over the expert's rows r of dy[r, n] x[r, k]; an expert without rows is left
// untouched. grid (k tiles, n tiles, E).
template <class S>
__global__ void __launch_bounds__(kThreads) grouped_wgrad_kernel(const S* dy, const S* x, float* dw, const int32_t* offsets,
                                                                 int64_t R, int64_t N, int64_t K, DeviceError* err,
                                                                 int code) {
  const int64_t e = blockIdx.z;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) check_expert_offsets(offsets, e, gridDim.z, R, err, code);
  int64_t r0, r1;
  expert_rows(offsets, e, R, r0, r1);
  if (r1 <= r0) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBM, k0 = static_cast<int64_t>(blockIdx.x) * kBN;
  __shared__ TileA As;
  __shared__ TileB Bs;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t rr = r0; rr < r1; rr += kBK) {
    for (int q = threadIdx.x; q < kBK * kBM; q += kThreads) {
      const int l = q / kBM, i = q % kBM;
      const int64_t r = rr + l, n = n0 + i;
      As[l][i] = r < r1 && n < N ? load(dy + r * N + n) : 0.0f;
    }
    for (int q = threadIdx.x; q < kBK * kBN; q += kThreads) {
      const int l = q / kBN, j = q % kBN;
      const int64_t r = rr + l, k = k0 + j;
      Bs[l][j] = r < r1 && k < K ? load(x + r * K + k) : 0.0f;
    }
    __syncthreads();
    accumulate_tile(As, Bs, acc, tx, ty);
    __syncthreads();
  }
  float* out = dw + e * N * K;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int64_t n = n0 + ty * 4 + u;
    if (n >= N) continue;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int64_t k = k0 + tx * 4 + v;
      if (k < K) out[n * K + k] = __fadd_rn(out[n * K + k], acc[u][v]);
    }
  }
}

void check_operands(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& out, const char* op) {
  check_device({&a, &b, &offsets, &out}, op);
  MOE_CHECK(a.dtype == DType::kF32 || a.dtype == DType::kBF16, op, ": operands must be f32 or bf16 on cuda, got ",
            dtype_name(a.dtype));
  check_gemm_dtypes(a, b, out, op);
  check_dtype(offsets, DType::kI32, op);
}

// The tensor-core kernels, when the operands are bf16, the GPU is Hopper or Blackwell, and every
// contiguous dimension is a multiple of 8 elements (16-byte TMA alignment; arena bases are 64-byte
// aligned). True when one was enqueued; otherwise the SIMT kernel runs.
bool tensor_core(Context& ctx, grouped::Kind kind, const Tensor& a, const Tensor& b, const Tensor& out,
                 const Tensor& offsets, const GroupedDims& d) {
  if (!ctx.tensor_core_grouped || a.dtype != DType::kBF16 || d.n % 8 != 0 || d.k % 8 != 0) return false;
  if (ctx.cc_major != 9 && ctx.cc_major != 10) return false;
  grouped::Args args;
  args.a = a.data;
  args.b = b.data;
  args.out = static_cast<float*>(out.data);
  args.offsets = static_cast<const int32_t*>(offsets.data);
  args.experts = d.experts;
  args.rows = d.rows;
  args.error = ctx.error;
  args.error_code = error_code(kind == grouped::Kind::kFwd     ? OpId::grouped_linear_fwd
                               : kind == grouped::Kind::kDgrad ? OpId::grouped_linear_bwd_data
                                                               : OpId::grouped_linear_bwd_weight);
  args.n = d.n;
  args.k = d.k;
  args.scratch = ctx.scratch;
  args.scratch_bytes = ctx.scratch_bytes;
  args.device = ctx.device;
  args.sm_count = ctx.sm_count;
  args.stream = ctx.stream;
  const bool hopper = ctx.cc_major == 9;
  bool ran = false;
  switch (kind) {
    case grouped::Kind::kFwd: ran = hopper ? grouped::fwd_sm90(args) : grouped::fwd_sm100(args); break;
    case grouped::Kind::kDgrad: ran = hopper ? grouped::dgrad_sm90(args) : grouped::dgrad_sm100(args); break;
    case grouped::Kind::kWgrad: ran = hopper ? grouped::wgrad_sm90(args) : grouped::wgrad_sm100(args); break;
  }
  ctx.paths.grouped_cutlass += ran ? 1 : 0;
  return ran;
}

unsigned row_tiles(int64_t rows, int64_t experts) { return static_cast<unsigned>((rows + kBM - 1) / kBM + experts); }
unsigned col_tiles(int64_t cols) { return static_cast<unsigned>((cols + kBN - 1) / kBN); }

}  // namespace

void grouped_linear_fwd(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& y) {
  check_operands(x, w, offsets, y, "grouped_linear_fwd");
  const GroupedDims d = grouped_fwd_dims(x, w, y);
  check_shape(offsets, {d.experts + 1}, "grouped_linear_fwd offsets");
  if (d.rows == 0 || d.n == 0) return;
  if (tensor_core(ctx, grouped::Kind::kFwd, x, w, y, offsets, d)) return check_launch("grouped_linear_fwd");
  ++ctx.paths.grouped_simt;
  dispatch_storage(x.dtype, "grouped_linear_fwd", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    grouped_rows_kernel<S><<<dim3(row_tiles(d.rows, d.experts), col_tiles(d.n)), kThreads, 0, ctx.stream>>>(
        ptr<const S>(x), ptr<const S>(w), ptr<float>(y), ptr<const int32_t>(offsets), d.experts, d.rows, d.k, d.n, d.n * d.k,
        1, d.k, ctx.error, error_code(OpId::grouped_linear_fwd));
  });
  check_launch("grouped_linear_fwd");
}

void grouped_linear_bwd_data(Context& ctx, const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx) {
  check_operands(dy, w, offsets, dx, "grouped_linear_bwd_data");
  const GroupedDims d = grouped_bwd_data_dims(dy, w, dx);
  check_shape(offsets, {d.experts + 1}, "grouped_linear_bwd_data offsets");
  if (d.rows == 0 || d.k == 0) return;
  if (tensor_core(ctx, grouped::Kind::kDgrad, dy, w, dx, offsets, d)) return check_launch("grouped_linear_bwd_data");
  ++ctx.paths.grouped_simt;
  dispatch_storage(dy.dtype, "grouped_linear_bwd_data", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    grouped_rows_kernel<S><<<dim3(row_tiles(d.rows, d.experts), col_tiles(d.k)), kThreads, 0, ctx.stream>>>(
        ptr<const S>(dy), ptr<const S>(w), ptr<float>(dx), ptr<const int32_t>(offsets), d.experts, d.rows, d.n, d.k, d.n * d.k,
        d.k, 1, ctx.error, error_code(OpId::grouped_linear_bwd_data));
  });
  check_launch("grouped_linear_bwd_data");
}

void grouped_linear_bwd_weight(Context& ctx, const Tensor& dy, const Tensor& x, const Tensor& offsets, const Tensor& dw,
                               bool accumulate) {
  check_operands(dy, x, offsets, dw, "grouped_linear_bwd_weight");
  const GroupedDims d = grouped_bwd_weight_dims(dy, x, dw);
  check_shape(offsets, {d.experts + 1}, "grouped_linear_bwd_weight offsets");
  // Without accumulate: zeros, then the kernels add. The expert row counts are on the device, so
  // the host cannot skip zero-row experts' zeroing; every expert's dw is zeroed first.
  if (!accumulate && dw.numel() > 0)
    MOE_CUDA_CHECK(cudaMemsetAsync(dw.data, 0, static_cast<size_t>(dw.numel()) * sizeof(float), ctx.stream));
  // No rows at all: dw += 0 (and CUTLASS would see only empty problems).
  if (d.experts == 0 || d.n == 0 || d.k == 0 || d.rows == 0) return;
  MOE_CHECK(d.experts <= 65535, "grouped_linear_bwd_weight: ", d.experts, " experts exceed the grid");
  if (tensor_core(ctx, grouped::Kind::kWgrad, dy, x, dw, offsets, d)) return check_launch("grouped_linear_bwd_weight");
  ++ctx.paths.grouped_simt;
  dispatch_storage(dy.dtype, "grouped_linear_bwd_weight", [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    grouped_wgrad_kernel<S><<<dim3(col_tiles(d.k), static_cast<unsigned>((d.n + kBM - 1) / kBM), static_cast<unsigned>(d.experts)),
                              kThreads, 0, ctx.stream>>>(ptr<const S>(dy), ptr<const S>(x), ptr<float>(dw),
                                                         ptr<const int32_t>(offsets), d.rows, d.n, d.k, ctx.error,
                                                         error_code(OpId::grouped_linear_bwd_weight));
  });
  check_launch("grouped_linear_bwd_weight");
}

}  // namespace moe::cuda
