// ep_slab_copy (the padded expert transport's packing and placement) through every backend,
// with the ranks of an EP group simulated in one process: every rank packs its rows into
// per-peer slabs, the test swaps the slabs as the all-to-all would, every rank places what it
// received; then the way back. The expected rows come from walking the receive order (local
// expert, then source rank, then token order) one row at a time, not from the plan's offsets.
// Rows are random bytes (the op copies bytes, any dtype); rows past the plan are left as they were.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend_errors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "core/rng.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

MOE_BACKEND_SUITE(EpSlabCopy);

using Bytes = std::vector<unsigned char>;

struct RankPlan {
  std::vector<int32_t> kept, local_begin, recv_begin, recv_offsets, totals;
};

RankPlan plan_of(std::vector<int32_t>& counts, int64_t ep, int64_t E, int64_t rank, int64_t capacity) {
  const int64_t El = E / ep;
  RankPlan p;
  p.kept.resize(static_cast<size_t>(ep * E));
  p.local_begin.resize(static_cast<size_t>(E));
  p.recv_begin.resize(static_cast<size_t>(El * ep));
  p.recv_offsets.resize(static_cast<size_t>(El + 1));
  p.totals.resize(static_cast<size_t>(4 + ep));
  ref::ep_plan(Tensor(counts.data(), DType::kI32, {ep, E}), rank, capacity, Tensor(p.kept.data(), DType::kI32, {ep, E}),
               Tensor(p.local_begin.data(), DType::kI32, {E}), Tensor(p.recv_begin.data(), DType::kI32, {El, ep}),
               Tensor(p.recv_offsets.data(), DType::kI32, {El + 1}), Tensor(p.totals.data(), DType::kI32, {4 + ep}));
  return p;
}

Bytes random_bytes(size_t n, uint64_t& draw) {
  Bytes b(n);
  for (size_t i = 0; i < n; i += 4) {
    const uint32_t w = random_words(test::test_seed(), static_cast<uint64_t>(RngStream::kTest), draw++)[0];
    for (size_t j = 0; j < 4 && i + j < n; ++j) b[i + j] = static_cast<unsigned char>(w >> (8 * j));
  }
  return b;
}

struct Case {
  int64_t ep, El, capacity, D;
  DType dtype;
};

void run_case(const Case& k, uint64_t& draw) {
  const int64_t ep = k.ep, El = k.El, E = ep * El, D = k.D;
  const size_t row = static_cast<size_t>(D) * dtype_size(k.dtype);
  std::vector<int32_t> counts(static_cast<size_t>(ep * E));
  for (int32_t& c : counts) {
    const uint32_t u = random_words(test::test_seed(), static_cast<uint64_t>(RngStream::kTest), draw++)[0];
    c = u % 4 == 0 ? 0 : static_cast<int32_t>(u % 9);
  }
  std::vector<RankPlan> plans;
  for (int64_t r = 0; r < ep; ++r) plans.push_back(plan_of(counts, ep, E, r, k.capacity));
  const auto count = [&](int64_t s, int64_t g) { return static_cast<int64_t>(counts[static_cast<size_t>(s * E + g)]); };
  const auto kept = [&](int64_t s, int64_t g) { return static_cast<int64_t>(plans[0].kept[static_cast<size_t>(s * E + g)]); };
  // Slab rows: the most kept rows one rank sends one peer, plus one row that must stay untouched.
  int64_t S = 1;
  for (int64_t s = 0; s < ep; ++s)
    for (int64_t p = 0; p < ep; ++p) {
      int64_t n = 0;
      for (int64_t e = 0; e < El; ++e) n += kept(s, p * El + e);
      S = std::max(S, n + 1);
    }
  const auto rows_of = [&](int64_t s) {  // my rows (expert-major, all routed) + 2 spare
    int64_t n = 2;
    for (int64_t g = 0; g < E; ++g) n += count(s, g);
    return n;
  };
  const auto received_of = [&](int64_t r) { return plans[static_cast<size_t>(r)].totals[0] + int64_t{2}; };
  const size_t slab_bytes = static_cast<size_t>(ep * S) * row;
  const auto T = [&](Bytes& b, int64_t rows) { return Tensor(b.data(), k.dtype, {rows, D}); };
  const auto slabs_t = [&](Bytes& b) { return Tensor(b.data(), k.dtype, {ep, S, D}); };
  const auto run = [&](int64_t r, bool expert_side, bool to_slabs, Bytes& rows, int64_t n, Bytes& slabs) {
    RankPlan& p = plans[static_cast<size_t>(r)];
    test::fast().ep_slab_copy(Tensor(counts.data(), DType::kI32, {ep, E}), Tensor(p.kept.data(), DType::kI32, {ep, E}),
                              Tensor(p.local_begin.data(), DType::kI32, {E}),
                              Tensor(p.recv_begin.data(), DType::kI32, {El, ep}), r, expert_side, to_slabs, T(rows, n),
                              slabs_t(slabs));
  };

  // Toward the experts.
  std::vector<Bytes> local, send, recv, received;
  for (int64_t s = 0; s < ep; ++s) {
    local.push_back(random_bytes(static_cast<size_t>(rows_of(s)) * row, draw));
    send.push_back(random_bytes(slab_bytes, draw));
    run(s, false, true, local.back(), rows_of(s), send.back());
  }
  for (int64_t r = 0; r < ep; ++r) {  // the all-to-all: slab r of source q is slab q at r
    recv.emplace_back(slab_bytes);
    for (int64_t q = 0; q < ep; ++q)
      std::memcpy(recv[static_cast<size_t>(r)].data() + static_cast<size_t>(q * S) * row,
                  send[static_cast<size_t>(q)].data() + static_cast<size_t>(r * S) * row, static_cast<size_t>(S) * row);
  }
  std::vector<Bytes> received_before;
  for (int64_t r = 0; r < ep; ++r) {
    received.push_back(random_bytes(static_cast<size_t>(received_of(r)) * row, draw));
    received_before.push_back(received.back());
    run(r, true, false, received.back(), received_of(r), recv[static_cast<size_t>(r)]);
  }
  // Expected: receiving rank r walks (local expert, source, token); source rows walk expert-major.
  std::vector<Bytes> expected = received_before;
  for (int64_t r = 0; r < ep; ++r) {
    int64_t at = 0;
    for (int64_t e = 0; e < El; ++e)
      for (int64_t s = 0; s < ep; ++s) {
        const int64_t g = r * El + e;
        int64_t first = 0;  // s's first row for global expert g
        for (int64_t x = 0; x < g; ++x) first += count(s, x);
        for (int64_t i = 0; i < kept(s, g); ++i, ++at)
          std::memcpy(expected[static_cast<size_t>(r)].data() + static_cast<size_t>(at) * row,
                      local[static_cast<size_t>(s)].data() + static_cast<size_t>(first + i) * row, row);
      }
    ASSERT_EQ(at, plans[static_cast<size_t>(r)].totals[0]);
    EXPECT_TRUE(received[static_cast<size_t>(r)] == expected[static_cast<size_t>(r)]) << "received rows of rank " << r;
  }

  // Back to the tokens: expert outputs (fresh random rows), zeros for dropped routes.
  std::vector<Bytes> outputs, back, back_before;
  send.clear();
  for (int64_t r = 0; r < ep; ++r) {
    outputs.push_back(random_bytes(static_cast<size_t>(received_of(r)) * row, draw));
    send.push_back(random_bytes(slab_bytes, draw));
    run(r, true, true, outputs.back(), received_of(r), send.back());
  }
  for (int64_t s = 0; s < ep; ++s)
    for (int64_t q = 0; q < ep; ++q)
      std::memcpy(recv[static_cast<size_t>(s)].data() + static_cast<size_t>(q * S) * row,
                  send[static_cast<size_t>(q)].data() + static_cast<size_t>(s * S) * row, static_cast<size_t>(S) * row);
  for (int64_t s = 0; s < ep; ++s) {
    back.push_back(random_bytes(static_cast<size_t>(rows_of(s)) * row, draw));
    back_before.push_back(back.back());
    run(s, false, false, back.back(), rows_of(s), recv[static_cast<size_t>(s)]);
  }
  expected = back_before;
  for (int64_t r = 0; r < ep; ++r) {
    int64_t at = 0;
    for (int64_t e = 0; e < El; ++e)
      for (int64_t s = 0; s < ep; ++s) {
        const int64_t g = r * El + e;
        int64_t first = 0;
        for (int64_t x = 0; x < g; ++x) first += count(s, x);
        unsigned char* dst = expected[static_cast<size_t>(s)].data() + static_cast<size_t>(first) * row;
        for (int64_t i = 0; i < kept(s, g); ++i, ++at)
          std::memcpy(dst + static_cast<size_t>(i) * row,
                      outputs[static_cast<size_t>(r)].data() + static_cast<size_t>(at) * row, row);
        std::memset(dst + static_cast<size_t>(kept(s, g)) * row, 0, static_cast<size_t>(count(s, g) - kept(s, g)) * row);
      }
  }
  for (int64_t s = 0; s < ep; ++s)
    EXPECT_TRUE(back[static_cast<size_t>(s)] == expected[static_cast<size_t>(s)]) << "returned rows of rank " << s;
}

TEST_P(EpSlabCopy, SimulatedRanksExchangeLikeTheReceiveOrder) {
  uint64_t draw = 0;
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF64}) {
    MOE_SKIP_UNLESS_SUPPORTED(OpId::ep_slab_copy, dtype);
    for (int64_t ep : {1, 2, 3, 4})
      for (int64_t El : {1, 3})
        for (int64_t capacity : {-1, 0, 4, 11})
          for (int64_t D : {3, 8}) {
            SCOPED_TRACE(std::string(dtype_name(dtype)) + " ep " + std::to_string(ep) + " El " + std::to_string(El) +
                         " capacity " + std::to_string(capacity) + " D " + std::to_string(D));
            run_case(Case{ep, El, capacity, D, dtype}, draw);
          }
  }
}

TEST_P(EpSlabCopy, RefusesBlocksThatDoNotFit) {
  std::vector<int32_t> counts = {3, 1, 2, 2}, kept = counts, lb = {0, 3}, rb = {0, 3};  // ep 2, E 2, rank 0
  std::vector<float> rows(4 * 2), slabs(2 * 3 * 2);  // room for slabs of up to 3 rows
  const auto err = [&](int64_t n_rows, int64_t S) {
    return test::error_of([&] {
      test::fast().ep_slab_copy(Tensor(counts.data(), DType::kI32, {2, 2}), Tensor(kept.data(), DType::kI32, {2, 2}),
                                Tensor(lb.data(), DType::kI32, {2}), Tensor(rb.data(), DType::kI32, {1, 2}), 0, false,
                                true, Tensor(rows.data(), DType::kF32, {n_rows, 2}),
                                Tensor(slabs.data(), DType::kF32, {2, S, 2}));
    });
  };
  // Rank 0 sends 3 rows to itself: a slab of 2 rows cannot hold them.
  // cuda checks the blocks on the device: its error gives the block's rows at the block's index
  // (peer * El + local expert).
  EXPECT_TRUE(test::says(err(4, 2),
                         {"block (peer 0, local expert 0) of 3 rows at row 0 and slab row 0 does not fit 4 rows and "
                          "slabs of 2 rows"},
                         {"ep_slab_copy: invalid value 3 at index 0"}));
  EXPECT_EQ(err(4, 3), "(no error)");  // three slab rows hold them
  std::vector<float> slabs3(2 * 3 * 2);
  const std::string bad_dtype = test::error_of([&] {
    test::fast().ep_slab_copy(Tensor(counts.data(), DType::kI32, {2, 2}), Tensor(kept.data(), DType::kI32, {2, 2}),
                              Tensor(lb.data(), DType::kI32, {2}), Tensor(rb.data(), DType::kI32, {1, 2}), 0, false,
                              true, Tensor(rows.data(), DType::kF32, {4, 2}), Tensor(slabs3.data(), DType::kF64, {2, 1, 3}));
  });
  EXPECT_NE(bad_dtype.find("do not match"), std::string::npos) << bad_dtype;
}

}  // namespace
}  // namespace moe
