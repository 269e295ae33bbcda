// ep_plan and ep_slab_copy: the reference's loops are the fast path here.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe::cpu {

// A few thousand integer operations per MoE layer.
void ep_plan(const Tensor& counts, int64_t rank, int64_t capacity, const Tensor& kept, const Tensor& local_begin,
             const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals) {
  ref::ep_plan(counts, rank, capacity, kept, local_begin, recv_begin, recv_offsets, totals);
}

// Whole-row memcpy per block: the reference is already the memory-bound copy.
void ep_slab_copy(const Tensor& counts, const Tensor& kept, const Tensor& local_begin, const Tensor& recv_begin,
                  int64_t rank, bool expert_side, bool to_slabs, const Tensor& rows, const Tensor& slabs) {
  ref::ep_slab_copy(counts, kept, local_begin, recv_begin, rank, expert_side, to_slabs, rows, slabs);
}

}  // namespace moe::cpu
