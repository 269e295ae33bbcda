#include "model/step_stats.h"

#include "kernels/step_control.h"

namespace moe {

StepStats make_step_stats(Backend& ops, int64_t M, int64_t E, int64_t P, int64_t ep, DType compute, bool quant) {
  StepStats s;
  s.num_moe_layers = M;
  const int64_t X = ep > 1 ? M * (4 + ep) : 0, Q = quant ? M * 8 : 0;
  // Widest elements first, so every section is aligned.
  const size_t values_bytes = static_cast<size_t>(2 + 2 * M + kCtlSize + P + Q) * sizeof(double);
  const size_t prob_bytes = static_cast<size_t>(M * E) * dtype_size(compute);
  const size_t count_bytes = static_cast<size_t>(M * E) * sizeof(int32_t);
  const size_t bytes = values_bytes + prob_bytes + count_bytes + static_cast<size_t>(X) * sizeof(int32_t);
  s.memory = Buffer(ops, bytes);
  char* base = static_cast<char*>(s.memory.data());
  const Device dev = s.memory.device();
  s.words = Tensor(base, DType::kI32, {static_cast<int64_t>(bytes / sizeof(int32_t))}, dev);
  s.values = Tensor(base, DType::kF64, {2 + 2 * M}, dev);
  s.control = Tensor(base + static_cast<size_t>(2 + 2 * M) * sizeof(double), DType::kF64, {kCtlSize}, dev);
  s.grad_sumsq = Tensor(base + static_cast<size_t>(2 + 2 * M + kCtlSize) * sizeof(double), DType::kF64, {P}, dev);
  if (Q > 0) s.quant = Tensor(base + static_cast<size_t>(2 + 2 * M + kCtlSize + P) * sizeof(double), DType::kF64, {M, 8}, dev);
  for (int64_t m = 0; m < M; ++m) {
    s.mean_prob.emplace_back(base + values_bytes + static_cast<size_t>(m * E) * dtype_size(compute), compute,
                             std::initializer_list<int64_t>{E}, dev);
    s.counts.emplace_back(base + values_bytes + prob_bytes + static_cast<size_t>(m * E) * sizeof(int32_t), DType::kI32,
                          std::initializer_list<int64_t>{E}, dev);
  }
  if (X > 0) s.exchange = Tensor(base + values_bytes + prob_bytes + count_bytes, DType::kI32, {M, 4 + ep}, dev);
  return s;
}

void zero_step_stats(Backend& ops, StepStats& s) {
  ops.fill(s.values, 0.0);
  for (const Tensor& c : s.counts) ops.fill(c, 0.0);
  for (const Tensor& p : s.mean_prob) ops.fill(p, 0.0);
}

}  // namespace moe
