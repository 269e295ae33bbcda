// One CUTLASS configuration per translation unit (kernels/cuda/grouped_cutlass.cuh): wgrad, sm100.
#include "kernels/cuda/grouped_cutlass.cuh"

namespace moe::cuda::grouped {

bool wgrad_sm100(const Args& a) { return run<Sm100Config, Kind::kWgrad>(a); }

}  // namespace moe::cuda::grouped
