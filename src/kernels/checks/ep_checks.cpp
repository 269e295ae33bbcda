#include "kernels/checks/ep_checks.h"

#include "core/check.h"

namespace moe {

namespace {
// (ep, E) from the matrix m (named `name`), with rank inside the group.
EpGroup group_of(const Tensor& m, const char* name, int64_t rank, const char* op) {
  MOE_CHECK(m.ndim == 2, op, ": ", name, " must be (ep,E), got ", m.shape_str());
  const EpGroup g{m.dim(0), m.dim(1)};
  MOE_CHECK(g.ep >= 1 && g.E % g.ep == 0, op, ": ", g.E, " experts do not divide over ", g.ep, " ranks");
  MOE_CHECK(rank >= 0 && rank < g.ep, op, ": rank ", rank, " outside the group of ", g.ep);
  return g;
}
}  // namespace

EpGroup check_ep_plan_args(const Tensor& counts, int64_t rank, const Tensor& kept, const Tensor& local_begin,
                           const Tensor& recv_begin, const Tensor& recv_offsets, const Tensor& totals) {
  const EpGroup g = group_of(counts, "counts", rank, "ep_plan");
  const int64_t El = g.E / g.ep;
  for (const Tensor* t : {&counts, &kept, &local_begin, &recv_begin, &recv_offsets, &totals})
    check_dtype(*t, DType::kI32, "ep_plan");
  check_shape(kept, {g.ep, g.E}, "ep_plan kept");
  check_shape(local_begin, {g.E}, "ep_plan local_begin");
  check_shape(recv_begin, {El, g.ep}, "ep_plan recv_begin");
  check_shape(recv_offsets, {El + 1}, "ep_plan recv_offsets");
  check_shape(totals, {4 + g.ep}, "ep_plan totals");
  return g;
}

EpGroup check_ep_slab_copy_args(const Tensor& counts, const Tensor& kept, const Tensor& local_begin,
                                const Tensor& recv_begin, int64_t rank, const Tensor& rows, const Tensor& slabs) {
  const EpGroup g = group_of(kept, "kept", rank, "ep_slab_copy");
  const int64_t El = g.E / g.ep;
  for (const Tensor* t : {&counts, &kept, &local_begin, &recv_begin}) check_dtype(*t, DType::kI32, "ep_slab_copy");
  check_shape(counts, {g.ep, g.E}, "ep_slab_copy counts");
  check_shape(local_begin, {g.E}, "ep_slab_copy local_begin");
  check_shape(recv_begin, {El, g.ep}, "ep_slab_copy recv_begin");
  MOE_CHECK(rows.ndim == 2 && slabs.ndim == 3 && slabs.dim(0) == g.ep && slabs.dim(2) == rows.cols() &&
                rows.dtype == slabs.dtype,
            "ep_slab_copy: rows ", rows.shape_str(), " ", dtype_name(rows.dtype), " and slabs ", slabs.shape_str(), " ",
            dtype_name(slabs.dtype), " do not match (slabs (", g.ep, ", S, cols) of the rows' dtype)");
  return g;
}

}  // namespace moe
