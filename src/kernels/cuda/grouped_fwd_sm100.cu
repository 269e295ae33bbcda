// One CUTLASS configuration per translation unit (kernels/cuda/grouped_cutlass.cuh): fwd, sm100.
#include "kernels/cuda/grouped_cutlass.cuh"

namespace moe::cuda::grouped {

bool fwd_sm100(const Args& a) { return run<Sm100Config, Kind::kFwd>(a); }

}  // namespace moe::cuda::grouped
