// ep_plan: the expert-parallel exchange plan, from the all-gathered count matrix.
#include "kernels/ep_plan_math.h"
#include "kernels/ref/ref_ops.h"

namespace moe::ref {

void ep_plan(const Tensor& counts, int64_t rank, int64_t capacity, const Tensor& kept, const Tensor& local_begin,
             const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals) {
  MOE_CHECK(counts.ndim == 2, "ep_plan: counts must be (ep,E), got ", counts.shape_str());
  const int64_t ep = counts.dim(0), E = counts.dim(1);
  MOE_CHECK(ep >= 1 && E % ep == 0, "ep_plan: ", E, " experts do not divide over ", ep, " ranks");
  MOE_CHECK(rank >= 0 && rank < ep, "ep_plan: rank ", rank, " outside the group of ", ep);
  const int64_t El = E / ep;
  for (const Tensor* t : {&counts, &kept, &local_begin, &recv_begin, &recv_offsets, &totals})
    check_dtype(*t, DType::kI32, "ep_plan");
  check_shape(kept, {ep, E}, "ep_plan kept");
  check_shape(local_begin, {E}, "ep_plan local_begin");
  check_shape(recv_begin, {El, ep}, "ep_plan recv_begin");
  check_shape(recv_offsets, {El + 1}, "ep_plan recv_offsets");
  check_shape(totals, {4 + ep}, "ep_plan totals");
  const int32_t* c = counts.as<int32_t>();
  int32_t* k = kept.as<int32_t>();
  int32_t* tot = totals.as<int32_t>();
  for (int64_t i = 0; i < ep * E; ++i)
    MOE_CHECK(c[i] >= 0, "ep_plan: negative count ", c[i], " (source ", i / E, ", expert ", i % E, ")");
  ep_plan_arrays(c, ep, E, rank, capacity, k, local_begin.as<int32_t>(), recv_begin.as<int32_t>(),
                 recv_offsets.as<int32_t>(), tot);
}

}  // namespace moe::ref
