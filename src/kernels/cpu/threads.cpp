// Thread control for the CPU kernels. Results never depend on the count (see op_list.inc).
#include <omp.h>

#include <atomic>

#include "kernels/cpu/cpu_ops.h"

namespace moe::cpu {
namespace {
std::atomic<int> g_requested{0};  // 0: never set
}  // namespace

void set_num_threads(int n) {
  MOE_CHECK(n >= 1, "thread count must be >= 1, got ", n);
  g_requested.store(n, std::memory_order_relaxed);
  omp_set_num_threads(n);
}

int num_threads() {
  const int n = g_requested.load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_max_threads();
}

void adopt_thread_setting() {
  const int n = g_requested.load(std::memory_order_relaxed);
  if (n > 0 && n != omp_get_max_threads()) omp_set_num_threads(n);
}

}  // namespace moe::cpu
