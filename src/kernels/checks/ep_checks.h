// Argument contracts of the expert-parallel ops (op_list.inc: ep_plan, ep_slab_copy), checked
// once for every backend. Shapes and dtypes only: device rules are each backend's, and the
// reference also checks the counts' values, which only it can read on the host.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moe {

struct EpGroup {
  int64_t ep = 1, E = 0;  // ranks, global experts
};

// counts (ep,E), kept (ep,E), local_begin (E), recv_begin (El,ep), recv_offsets (El+1), totals (4+ep).
EpGroup check_ep_plan_args(const Tensor& counts, int64_t rank, const Tensor& kept, const Tensor& local_begin,
                           const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals);
// The plan views as above, rows (N, D) and slabs (ep, S, D) of one dtype.
EpGroup check_ep_slab_copy_args(const Tensor& counts, const Tensor& kept, const Tensor& local_begin,
                                const Tensor& recv_begin, int64_t rank, const Tensor& rows, const Tensor& slabs);

}  // namespace moe
