// ep_plan: the expert-parallel exchange plan, from the all-gathered count matrix.
#include <algorithm>

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
  // Each receiving rank r keeps rows in its receive order: local expert major, then source rank.
  int64_t routed = 0, dropped = 0;
  for (int64_t r = 0; r < ep; ++r) {
    int64_t taken = 0;
    for (int64_t e = r * El; e < (r + 1) * El; ++e)
      for (int64_t s = 0; s < ep; ++s) {
        const int64_t n = c[s * E + e];
        const int64_t keep = capacity < 0 ? n : std::clamp<int64_t>(capacity - taken, 0, n);
        k[s * E + e] = static_cast<int32_t>(keep);
        taken += keep;
        routed += n;
        dropped += n - keep;
      }
    tot[4 + r] = static_cast<int32_t>(taken);
  }
  int32_t* lb = local_begin.as<int32_t>();
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    lb[e] = static_cast<int32_t>(row);
    row += c[rank * E + e];
  }
  int32_t* rb = recv_begin.as<int32_t>();
  int32_t* off = recv_offsets.as<int32_t>();
  row = 0;
  off[0] = 0;
  for (int64_t e = 0; e < El; ++e) {
    for (int64_t s = 0; s < ep; ++s) {
      rb[e * ep + s] = static_cast<int32_t>(row);
      row += k[s * E + rank * El + e];
    }
    off[e + 1] = static_cast<int32_t>(row);
  }
  int64_t off_rank = 0;
  for (int64_t e = 0; e < E; ++e)
    if (e / El != rank) off_rank += k[rank * E + e];
  tot[0] = static_cast<int32_t>(row);
  tot[1] = static_cast<int32_t>(off_rank);
  tot[2] = static_cast<int32_t>(routed);
  tot[3] = static_cast<int32_t>(dropped);
}

}  // namespace moe::ref
