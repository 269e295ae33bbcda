// The arithmetic of the ep_plan op (kernels/op_list.inc) over raw i32 arrays, compiled from this
// one text by the reference backend (kernels/ref/expert_parallel.cpp) and the CUDA kernel
// (kernels/cuda/expert_parallel.cuh): the plan must be the same integers everywhere. Counts are
// checked non-negative by the caller first.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moe {

// c (ep,E) counts -> k (ep,E) kept, lb (E) local_begin, rb (El,ep) recv_begin, off (El+1)
// recv_offsets, tot (4+ep) totals; capacity < 0: dropless.
MOE_HD inline void ep_plan_arrays(const int32_t* c, int64_t ep, int64_t E, int64_t rank, int64_t capacity, int32_t* k,
                                  int32_t* lb, int32_t* rb, int32_t* off, int32_t* tot) {
  const int64_t El = E / ep;
  // Each receiving rank r keeps rows in its receive order: local expert major, then source rank.
  int64_t routed = 0, dropped = 0;
  for (int64_t r = 0; r < ep; ++r) {
    int64_t taken = 0;
    for (int64_t e = r * El; e < (r + 1) * El; ++e)
      for (int64_t s = 0; s < ep; ++s) {
        const int64_t n = c[s * E + e];
        int64_t keep = n;
        if (capacity >= 0) {
          keep = capacity - taken;
          keep = keep < 0 ? 0 : (keep > n ? n : keep);
        }
        k[s * E + e] = static_cast<int32_t>(keep);
        taken += keep;
        routed += n;
        dropped += n - keep;
      }
    tot[4 + r] = static_cast<int32_t>(taken);
  }
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    lb[e] = static_cast<int32_t>(row);
    row += c[rank * E + e];
  }
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

// One (peer q, local expert e) block of the ep_slab_copy op on `rank`'s side: rows
// [row, row + rows) <-> slab q rows [slab_row, slab_row + rows); then `dropped` rows from
// row + rows (tokens side only) that the op zeroes when copying out of the slabs.
struct EpSlabBlock {
  int64_t row = 0, slab_row = 0, rows = 0, dropped = 0;
};
MOE_HD inline EpSlabBlock ep_slab_block(const int32_t* c, const int32_t* k, const int32_t* lb, const int32_t* rb,
                                        int64_t ep, int64_t E, int64_t rank, bool expert_side, int64_t q, int64_t e) {
  const int64_t El = E / ep;
  // The block's source rank and first global expert of the destination rank.
  const int64_t source = expert_side ? q : rank, first = expert_side ? rank * El : q * El;
  EpSlabBlock b;
  for (int64_t x = 0; x < e; ++x) b.slab_row += k[source * E + first + x];
  const int64_t g = first + e;
  b.rows = k[source * E + g];
  if (expert_side) {
    b.row = rb[e * ep + q];
  } else {
    b.row = lb[g];
    b.dropped = c[source * E + g] - b.rows;
  }
  return b;
}

}  // namespace moe
