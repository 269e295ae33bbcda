// `moecore bench --kernels` on the cuda backend: the ops that dominate a step, timed with device
// events on problems large enough to pass launch overheads, each against its ceiling:
//   dense bf16 GEMM through our linear_fwd against the fastest of cuBLASLt's heuristic choices;
//   grouped bf16 GEMMs (forward, data and weight gradient) at 128, 512 and 2,048 rows per expert
//   against the dense rate; attention forward and backward (bf16 products, causal).
// One row per measurement, printed as it is measured (kernels/cuda/bench_rows.h): "kernel | shape |
// TFLOP/s | note", each labelled by the implementation that ran (the backend's CudaPaths).
#include <cuda_runtime.h>

#include <iomanip>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "kernels/cuda/bench_rows.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/gemm_lt.h"
#include "kernels/ops.h"
#include "kernels/random_tensor.h"

namespace moe {
namespace {

template <class F> double seconds_per_run(Backend& ops, F&& f, int reps) {
  f();  // warm-up: plans, heuristics
  ops.synchronize();
  const Event a = ops.record();
  for (int r = 0; r < reps; ++r) f();
  const Event b = ops.record();
  ops.wait(b);
  return ops.elapsed_seconds(a, b) / reps;
}

// The implementation the calls since `before` took: "CUTLASS", "SIMT", "cuDNN", "ours", or a mix.
std::string grouped_path(const CudaPaths& d) {
  return d.grouped_simt == 0 ? "CUTLASS" : d.grouped_cutlass == 0 ? "SIMT" : "CUTLASS+SIMT";
}
std::string attention_path(const CudaPaths& d) {
  return d.attention_ours == 0 ? "cuDNN" : d.attention_cudnn == 0 ? "ours" : "cuDNN+ours";
}

}  // namespace

void cuda_kernel_bench(std::ostream& os) {
  std::unique_ptr<Backend> ops = make_backend("cuda");
  std::vector<Buffer> keep;
  kernel_bench_row(os, "kernel", "shape", "TFLOP/s", "note");

  // Dense bf16 GEMM, 8192^3: ours (linear_fwd) and cuBLASLt's best heuristic algorithm.
  const int64_t M = 8192, N = 8192, K = 8192;
  const Tensor x = random_tensor(*ops, keep, DType::kBF16, {M, K}, 1), w = random_tensor(*ops, keep, DType::kBF16, {N, K}, 2);
  keep.emplace_back(*ops, static_cast<size_t>(M * N) * 4);
  const Tensor y = keep.back().view(DType::kF32, {M, N});
  const double flops = 2.0 * M * N * K;
  const double ours = seconds_per_run(*ops, [&] { ops->linear_fwd(x, w, y, false); }, 10);
  keep.emplace_back(*ops, size_t{32} << 20);  // the same workspace size as the backend's own
  cuda::GemmLt lt(keep.back().data(), size_t{32} << 20);
  const double best = lt.best_algorithm_seconds(static_cast<cudaStream_t>(cuda_stream(*ops)), true, true, false, N, M, K,
                                                w.data, K, x.data, K, static_cast<float*>(y.data), N, 16, 10);
  const double dense = flops / ours * 1e-12;
  kernel_bench_row(os, "dense bf16 GEMM (linear_fwd)", "8192 x 8192 x 8192, fp32 out", dense, "cuBLASLt, no split-K");
  kernel_bench_row(os, "dense bf16 GEMM (cuBLAS best)", "8192 x 8192 x 8192, fp32 out", best > 0 ? flops / best * 1e-12 : 0,
                   "fastest of 16 heuristic algorithms");

  // Grouped bf16 GEMMs: n = 2 x 1024 (an OLMoE expert's gate+up), k = 2048.
  for (const int64_t rows : {128, 512, 2048}) {
    const int64_t E = rows >= 2048 ? 8 : 32, R = E * rows, n = 2048, k = 2048;
    std::vector<int32_t> off(static_cast<size_t>(E + 1));
    for (int64_t e = 0; e <= E; ++e) off[static_cast<size_t>(e)] = static_cast<int32_t>(e * rows);
    keep.emplace_back(*ops, off.size() * 4);
    const Tensor offsets = keep.back().view(DType::kI32, {E + 1});
    ops->upload(off.data(), offsets);
    const Tensor gx = random_tensor(*ops, keep, DType::kBF16, {R, k}, 3), gw = random_tensor(*ops, keep, DType::kBF16, {E, n, k}, 4);
    const Tensor gdy = random_tensor(*ops, keep, DType::kBF16, {R, n}, 5);
    keep.emplace_back(*ops, static_cast<size_t>(R * n) * 4);
    const Tensor gy = keep.back().view(DType::kF32, {R, n});
    keep.emplace_back(*ops, static_cast<size_t>(R * k) * 4);
    const Tensor gdx = keep.back().view(DType::kF32, {R, k});
    keep.emplace_back(*ops, static_cast<size_t>(E * n * k) * 4);
    const Tensor gdw = keep.back().view(DType::kF32, {E, n, k});
    ops->fill(gdw, 0.0);
    const double gflops = 2.0 * R * n * k;
    const std::string shape = std::to_string(E) + " x " + std::to_string(rows) + " rows, " + std::to_string(n) + " x " +
                              std::to_string(k);
    auto pct = [&](double v) { return std::to_string(static_cast<int>(100 * v / dense + 0.5)) + "% of dense (linear_fwd)"; };
    const auto measure = [&](const char* what, auto&& call) {
      const CudaPaths before = cuda_paths(*ops);
      const double rate = gflops / seconds_per_run(*ops, call, 10) * 1e-12;
      kernel_bench_row(os, std::string("grouped bf16 ") + what + " (" + grouped_path(cuda_paths(*ops) - before) + ")", shape,
                       rate, pct(rate));
    };
    measure("fwd", [&] { ops->grouped_linear_fwd(gx, gw, offsets, gy); });
    measure("dgrad", [&] { ops->grouped_linear_bwd_data(gdy, gw, offsets, gdx); });
    measure("wgrad", [&] { ops->grouped_linear_bwd_weight(gdy, gx, offsets, gdw, true); });
  }

  // Attention: B 2, S 4096, 16 heads of 128, causal, bf16 products (cuDNN's SDPA where it loads, else ours).
  const int64_t B = 2, S = 4096, H = 16, hd = 128;
  const Tensor q = random_tensor(*ops, keep, DType::kF32, {B, S, H, hd}, 6), k = random_tensor(*ops, keep, DType::kF32, {B, S, H, hd}, 7);
  const Tensor v = random_tensor(*ops, keep, DType::kF32, {B, S, H, hd}, 8), dout = random_tensor(*ops, keep, DType::kF32, {B, S, H, hd}, 9);
  std::vector<Tensor> outs;
  for (int i = 0; i < 4; ++i) {
    keep.emplace_back(*ops, static_cast<size_t>(B * S * H * hd) * 4);
    outs.push_back(keep.back().view(DType::kF32, {B, S, H, hd}));
  }
  keep.emplace_back(*ops, static_cast<size_t>(B * H * S) * 4);
  const Tensor lse = keep.back().view(DType::kF32, {B, H, S});
  const double attn_fwd_flops = 2.0 * B * H * S * S * hd;  // 4 B H S^2 hd, halved by the causal mask
  const std::string ashape = "B2 S4096 H16 hd128 causal";
  CudaPaths before = cuda_paths(*ops);
  const double fa = attn_fwd_flops / seconds_per_run(*ops, [&] { ops->attention_fwd(q, k, v, outs[0], lse, Tensor(), true); }, 3) * 1e-12;
  kernel_bench_row(os, "attention fwd (" + attention_path(cuda_paths(*ops) - before) + ")", ashape, fa, "bf16 products, fp32 storage");
  before = cuda_paths(*ops);
  const double ba = 2.5 * attn_fwd_flops /
                    seconds_per_run(*ops, [&] { ops->attention_bwd(dout, q, k, v, outs[0], lse, outs[1], outs[2], outs[3], Tensor(), true); }, 2) *
                    1e-12;
  kernel_bench_row(os, "attention bwd (" + attention_path(cuda_paths(*ops) - before) + ")", ashape, ba, "2.5x the forward's FLOPs");
}

}  // namespace moe
