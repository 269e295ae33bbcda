// GoogleTest under mpirun: every rank runs every test; only rank 0 prints (other ranks print
// only their failures), and a failure on any rank makes every rank exit non-zero.
#include <gtest/gtest.h>

#include <cstdio>

#include "world.h"

namespace moe::test {
namespace {
std::unique_ptr<Communicator> g_world;

// Non-zero ranks: print failed assertions (prefixed with the rank), nothing else.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                   r.summary());
  }

 private:
  int rank_;
};
}  // namespace

Communicator& world() { return *g_world; }
}  // namespace moe::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  moe::test::g_world = moe::mpi_world();
  const int rank = moe::test::g_world->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new moe::test::FailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  moe::test::g_world->all_reduce_sum(&failed, 1, moe::DType::kI32);
  if (rank == 0 && failed) std::fprintf(stderr, "%d rank(s) failed\n", failed);
  moe::test::g_world.reset();
  return failed ? 1 : 0;
}
