// Helpers shared by the GEMM tests (gemm_test.cpp: against the reference; gemm_tiles_test.cpp:
// the cpu kernels' tiles, threads and oneDNN primitives).
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/backends.h"
#include "common/test_util.h"
#include "kernels/cpu/cpu_ops.h"

namespace moe::gemm_test {

inline double f32_tol(int64_t reduction, double sides = 1) {
  return sides * 8.0 * std::sqrt(static_cast<double>(std::max<int64_t>(reduction, 1))) *
         std::ldexp(1.0, -24);
}

inline void report(const char* what, double err, double tol) {
  if (std::getenv("MOE_GEMM_VERBOSE")) std::printf("  %-48s err %.3g  tol %.3g\n", what, err, tol);
}

// Restores the thread count at the end of a test.
class Threads {
 public:
  explicit Threads(int n) : saved_(omp_get_max_threads()) { cpu::set_num_threads(n); }
  ~Threads() { cpu::set_num_threads(saved_); }
  void set(int n) { cpu::set_num_threads(n); }

 private:
  int saved_;
};

inline OwnedTensor random(DType t, std::initializer_list<int64_t> dims, uint64_t salt) {
  OwnedTensor o(t, dims);
  test::fill_uniform(o, test::test_seed(), salt);
  return o;
}

struct LinearCase {
  int64_t m, n, k;
};

// Rows per expert, including an empty expert and chunks that are not multiples of 64.
inline std::vector<int32_t> make_offsets(const std::vector<int32_t>& rows) {
  std::vector<int32_t> off{0};
  for (int32_t r : rows) off.push_back(off.back() + r);
  return off;
}

inline OwnedTensor offsets_tensor(const std::vector<int32_t>& off) {
  OwnedTensor t(DType::kI32, {static_cast<int64_t>(off.size())});
  for (size_t i = 0; i < off.size(); ++i) t.as<int32_t>()[i] = off[i];
  return t;
}

// Experts with 70, 0, 3, 300, 1, 64, 128 and 583 rows (every chunk kind: 256, multiples of 64,
// tails), 5 rows beyond offsets[E].
inline const std::vector<int32_t> kUneven = {70, 0, 3, 300, 1, 64, 128, 583};

}  // namespace moe::gemm_test

// The tests of the cpu kernels' internals (oneDNN's primitive cache, its kernels and threads) run
// where those kernels run: the cpu backend, and strict (the cpu kernels on its own thread, in this
// process). Elsewhere they would pass or fail whatever the backend's own kernels do.
#define MOE_SKIP_UNLESS_CPU_KERNELS()                                                               \
  do {                                                                                              \
    const std::string backend = test::fast_device().name();                                         \
    if (backend != "cpu" && backend != "strict")                                                    \
      GTEST_SKIP() << "tests the cpu kernels' oneDNN internals, which the " << backend              \
                   << " backend does not run";                                                      \
  } while (0)
