// One CUTLASS configuration per translation unit (kernels/cuda/grouped_cutlass.cuh): wgrad, sm90.
#include "kernels/cuda/grouped_cutlass.cuh"

namespace moe::cuda::grouped {

bool wgrad_sm90(const Args& a) { return run<Sm90Config, Kind::kWgrad>(a); }

}  // namespace moe::cuda::grouped
