// One CUTLASS configuration per translation unit (kernels/cuda/grouped_cutlass.cuh): fwd, sm90.
#include "kernels/cuda/grouped_cutlass.cuh"

namespace moe::cuda::grouped {

bool fwd_sm90(const Args& a) { return run<Sm90Config, Kind::kFwd>(a); }

}  // namespace moe::cuda::grouped
