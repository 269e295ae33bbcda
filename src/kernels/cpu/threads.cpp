// Thread control for the CPU kernels. Results never depend on the count (see op_list.inc).
#include <omp.h>

#include "kernels/cpu/cpu_ops.h"

namespace moe::cpu {

void set_num_threads(int n) {
  MOE_CHECK(n >= 1, "thread count must be >= 1, got ", n);
  omp_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace moe::cpu
