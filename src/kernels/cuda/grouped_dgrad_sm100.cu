// One CUTLASS configuration per translation unit (kernels/cuda/grouped_cutlass.cuh): dgrad, sm100.
#include "kernels/cuda/grouped_cutlass.cuh"

namespace moe::cuda::grouped {

bool dgrad_sm100(const Args& a) { return run<Sm100Config, Kind::kDgrad>(a); }

}  // namespace moe::cuda::grouped
