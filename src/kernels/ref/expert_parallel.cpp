// ep_plan: the expert-parallel exchange plan, from the all-gathered count matrix; ep_slab_copy:
// the padded transport's copies between rows and per-peer slabs.
#include <cstring>

#include "kernels/checks/ep_checks.h"
#include "kernels/math/ep_plan_math.h"
#include "kernels/ref/ref_ops.h"

namespace moe::ref {

void ep_plan(const Tensor& counts, int64_t rank, int64_t capacity, const Tensor& kept, const Tensor& local_begin,
             const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals) {
  const EpGroup g = check_ep_plan_args(counts, rank, kept, local_begin, recv_begin, recv_offsets, totals);
  const int64_t ep = g.ep, E = g.E;
  const int32_t* c = counts.as<int32_t>();
  int32_t* k = kept.as<int32_t>();
  int32_t* tot = totals.as<int32_t>();
  for (int64_t i = 0; i < ep * E; ++i)
    MOE_CHECK(c[i] >= 0, "ep_plan: negative count ", c[i], " (source ", i / E, ", expert ", i % E, ")");
  ep_plan_arrays(c, ep, E, rank, capacity, k, local_begin.as<int32_t>(), recv_begin.as<int32_t>(),
                 recv_offsets.as<int32_t>(), tot);
}

void ep_slab_copy(const Tensor& counts, const Tensor& kept, const Tensor& local_begin, const Tensor& recv_begin,
                  int64_t rank, bool expert_side, bool to_slabs, const Tensor& rows, const Tensor& slabs) {
  const EpGroup g = check_ep_slab_copy_args(counts, kept, local_begin, recv_begin, rank, rows, slabs);
  const int64_t ep = g.ep, E = g.E, El = E / ep;
  const int64_t S = slabs.dim(1), N = rows.rows();
  const size_t row_bytes = static_cast<size_t>(rows.cols()) * dtype_size(rows.dtype);
  char* r = static_cast<char*>(rows.data);
  char* sl = static_cast<char*>(slabs.data);
  const int32_t *c = counts.as<int32_t>(), *k = kept.as<int32_t>();
  for (int64_t q = 0; q < ep; ++q)
    for (int64_t e = 0; e < El; ++e) {
      const EpSlabBlock b = ep_slab_block(c, k, local_begin.as<int32_t>(), recv_begin.as<int32_t>(), ep, E, rank,
                                          expert_side, q, e);
      MOE_CHECK(b.rows >= 0 && b.dropped >= 0 && b.row >= 0 && b.slab_row + b.rows <= S && b.row + b.rows + b.dropped <= N,
                "ep_slab_copy: block (peer ", q, ", local expert ", e, ") of ", b.rows, " rows at row ", b.row,
                " and slab row ", b.slab_row, " does not fit ", N, " rows and slabs of ", S, " rows");
      char* row = r + static_cast<size_t>(b.row) * row_bytes;
      char* slab = sl + static_cast<size_t>(q * S + b.slab_row) * row_bytes;
      const size_t n = static_cast<size_t>(b.rows) * row_bytes;
      if (n > 0) std::memcpy(to_slabs ? slab : row, to_slabs ? row : slab, n);
      if (!to_slabs && b.dropped > 0) std::memset(row + n, 0, static_cast<size_t>(b.dropped) * row_bytes);
    }
}

}  // namespace moe::ref
