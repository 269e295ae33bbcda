// One CUTLASS configuration per translation unit (kernels/cuda/grouped_cutlass.cuh): dgrad, sm90.
#include "kernels/cuda/grouped_cutlass.cuh"

namespace moe::cuda::grouped {

bool dgrad_sm90(const Args& a) { return run<Sm90Config, Kind::kDgrad>(a); }

}  // namespace moe::cuda::grouped
