// GEMM family: each backend under test against ref, ref against finite differences, bitwise
// independence of the thread count, and the oneDNN primitives behind the cpu kernels (which the
// strict backend runs too).
//
// Tolerances. An f32 dot product of length K, summed in any blocked order, has a rounding
// error of about sqrt(K) * 2^-24 * |typical term| (random-walk growth of the per-addition
// errors), while max|y| over a tensor is several typical |y| ~ sqrt(K) * |term|. The measure
// rel_error = max|a-b| / max|b| is therefore well below sqrt(K) * 2^-24; we allow
// 8 * sqrt(K) * 2^-24 for one f32 computation against exact (f64) arithmetic, and twice that when
// both sides round in f32. Measured errors stay ~9x below these bounds (largest err/tol 0.11 over
// ten seeds; printed with MOE_GEMM_VERBOSE=1). bf16 operands are compared with the ref run on the SAME bf16 operands:
// bf16 x bf16 products are exact in f32, so only the summation order differs. Backward ops are
// checked in f64 against central differences of loss = sum(y * r); the loss is bilinear, so the
// difference quotient is exact up to f64 rounding (~1e-13 relative) and 1e-8 is a safe bound.
#include <dirent.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "backend_errors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_dnnl.h"
#include "kernels/ref/ref_ops.h"
#ifdef MOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_backend.h"  // cuda_paths: which grouped GEMM kernel ran
#endif

namespace moe {
namespace {

using test::clone;
using test::fill_uniform;
using test::poison;
using test::rel_error;

double f32_tol(int64_t reduction, double sides = 1) {
  return sides * 8.0 * std::sqrt(static_cast<double>(std::max<int64_t>(reduction, 1))) *
         std::ldexp(1.0, -24);
}

void report(const char* what, double err, double tol) {
  if (std::getenv("MOE_GEMM_VERBOSE")) std::printf("  %-48s err %.3g  tol %.3g\n", what, err, tol);
}

// Restores the thread count at the end of a test.
class Threads {
 public:
  explicit Threads(int n) : saved_(omp_get_max_threads()) { cpu::set_num_threads(n); }
  ~Threads() { cpu::set_num_threads(saved_); }
  void set(int n) { cpu::set_num_threads(n); }

 private:
  int saved_;
};

OwnedTensor random(DType t, std::initializer_list<int64_t> dims, uint64_t salt) {
  OwnedTensor o(t, dims);
  fill_uniform(o, test::test_seed(), salt);
  return o;
}

MOE_BACKEND_SUITE(Gemm);

// The tests of the cpu kernels' internals (oneDNN's primitive cache, its kernels and threads) run
// where those kernels run: the cpu backend, and strict (the cpu kernels on its own thread, in this
// process). Elsewhere they would pass or fail whatever the backend's own kernels do.
#define MOE_SKIP_UNLESS_CPU_KERNELS()                                                               \
  do {                                                                                              \
    const std::string backend = test::fast_device().name();                                         \
    if (backend != "cpu" && backend != "strict")                                                    \
      GTEST_SKIP() << "tests the cpu kernels' oneDNN internals, which the " << backend              \
                   << " backend does not run";                                                      \
  } while (0)

// ------------------------------------------------------------------ dense, backend vs ref

struct LinearCase {
  int64_t m, n, k;
};

// Backend output vs ref: f32 operands against the ref in f64 on the same values; bf16 operands
// against the ref on the same bf16 operands (float accumulation on both sides).
void check_linear(DType dt, const LinearCase& c, bool acc) {
  SCOPED_TRACE(testing::Message() << dtype_name(dt) << " m=" << c.m << " n=" << c.n << " k=" << c.k
                                  << " acc=" << acc << " seed=" << test::test_seed());
  const DType rt = dt == DType::kF32 ? DType::kF64 : DType::kBF16;  // ref operand dtype
  const DType ro = dt == DType::kF32 ? DType::kF64 : DType::kF32;   // ref output dtype
  const double sides = dt == DType::kF32 ? 1 : 2;
  auto x = random(dt, {c.m, c.k}, 1), w = random(dt, {c.n, c.k}, 2), dy = random(dt, {c.m, c.n}, 3);
  auto xr = clone(x, rt), wr = clone(w, rt), dyr = clone(dy, rt);

  {  // forward
    auto y = random(DType::kF32, {c.m, c.n}, 4);
    if (!acc) poison(y);
    auto yr = clone(y, ro);
    test::fast().linear_fwd(x, w, y, acc);
    ref::linear_fwd(xr, wr, yr, acc);
    const double err = rel_error(y, yr), tol = f32_tol(c.k, sides);
    report("linear_fwd", err, tol);
    EXPECT_LE(err, tol) << "linear_fwd";
  }
  {  // data gradient
    auto dx = random(DType::kF32, {c.m, c.k}, 5);
    if (!acc) poison(dx);
    auto dxr = clone(dx, ro);
    test::fast().linear_bwd_data(dy, w, dx, acc);
    ref::linear_bwd_data(dyr, wr, dxr, acc);
    const double err = rel_error(dx, dxr), tol = f32_tol(c.n, sides);
    report("linear_bwd_data", err, tol);
    EXPECT_LE(err, tol) << "linear_bwd_data";
  }
  {  // weight gradient
    auto dw = random(DType::kF32, {c.n, c.k}, 6);
    if (!acc) poison(dw);
    auto dwr = clone(dw, ro);
    test::fast().linear_bwd_weight(dy, x, dw, acc);
    ref::linear_bwd_weight(dyr, xr, dwr, acc);
    const double err = rel_error(dw, dwr), tol = f32_tol(c.m, sides);
    report("linear_bwd_weight", err, tol);
    EXPECT_LE(err, tol) << "linear_bwd_weight";
  }
}

const LinearCase kLinearCases[] = {
    {1, 33, 70},     {7, 100, 257},   {130, 33, 70},
    {130, 100, 257}, {300, 600, 200},  // several row and column tiles
    {64, 1100, 48},                    // small M, column tiles with a remainder
    {3, 2048, 2100},                   // weight-gradient bands past kStagedSumBytes (cpu): unstaged sums
};

TEST_P(Gemm, LinearF32MatchesRef) {
  for (const auto& c : kLinearCases)
    for (bool acc : {false, true}) check_linear(DType::kF32, c, acc);
}

TEST_P(Gemm, LinearBf16MatchesRefOnSameOperands) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::linear_fwd, DType::kBF16);
  MOE_SKIP_UNLESS_SUPPORTED(OpId::linear_bwd_data, DType::kBF16);
  MOE_SKIP_UNLESS_SUPPORTED(OpId::linear_bwd_weight, DType::kBF16);
  for (const auto& c : kLinearCases)
    for (bool acc : {false, true}) check_linear(DType::kBF16, c, acc);
}

TEST(GemmRef, Bf16AndF32MatchF64) {
  // The ref's own float paths against its f64 path on the same (rounded) values; sequential
  // float summation is the worst order, still within the sqrt(K) model for random signs.
  const int64_t m = 9, n = 31, k = 300;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto x = random(dt, {m, k}, 1), w = random(dt, {n, k}, 2);
    auto x64 = clone(x, DType::kF64), w64 = clone(w, DType::kF64);
    OwnedTensor y(DType::kF32, {m, n}), y64(DType::kF64, {m, n});
    poison(y);
    ref::linear_fwd(x, w, y, false);
    ref::linear_fwd(x64, w64, y64, false);
    EXPECT_LE(rel_error(y, y64), f32_tol(k)) << dtype_name(dt);
  }
}

TEST_P(Gemm, RejectsF64AndMismatchedOperands) {
  OwnedTensor x(DType::kF64, {4, 3}), w(DType::kF64, {5, 3}), y(DType::kF64, {4, 5});
  try {
    test::fast().linear_fwd(x, w, y, false);
    FAIL() << "f64 accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(test::says(e.what(), {"does not support f64"},
                           {"linear_fwd: operands must be f32 or bf16 on cuda, got f64"}));
  }
  OwnedTensor xf(DType::kF32, {4, 3}), wb(DType::kBF16, {5, 3}), yf(DType::kF32, {4, 5});
  EXPECT_THROW(test::fast().linear_fwd(xf, wb, yf, false), Error);
  OwnedTensor wf(DType::kF32, {5, 4});
  EXPECT_THROW(test::fast().linear_fwd(xf, wf, yf, false), Error);
}

TEST_P(Gemm, ZeroReductionOverwritesWithZeros) {
  OwnedTensor x(DType::kF32, {3, 0}), w(DType::kF32, {4, 0}), y(DType::kF32, {3, 4});
  poison(y);
  test::fast().linear_fwd(x, w, y, false);
  for (int64_t i = 0; i < y.t.numel(); ++i) EXPECT_EQ(test::get(y, i), 0.0);
}

// ------------------------------------------------------------------ grouped, backend vs ref

// Rows per expert, including an empty expert and chunks that are not multiples of 64.
std::vector<int32_t> make_offsets(const std::vector<int32_t>& rows) {
  std::vector<int32_t> off{0};
  for (int32_t r : rows) off.push_back(off.back() + r);
  return off;
}

OwnedTensor offsets_tensor(const std::vector<int32_t>& off) {
  OwnedTensor t(DType::kI32, {static_cast<int64_t>(off.size())});
  for (size_t i = 0; i < off.size(); ++i) t.as<int32_t>()[i] = off[i];
  return t;
}

// Rows [used, R) of an (R, C) tensor are all NaN.
void expect_rows_poisoned(const Tensor& t, int64_t used, const char* what) {
  const int64_t cols = t.cols();
  int64_t bad = 0;
  for (int64_t i = used * cols; i < t.numel(); ++i) bad += !std::isnan(test::get(t, i));
  EXPECT_EQ(bad, 0) << what << ": rows beyond offsets[E] were written";
}

void check_grouped(DType dt, const std::vector<int32_t>& rows, int64_t extra_rows, int64_t n,
                   int64_t k) {
  SCOPED_TRACE(testing::Message() << dtype_name(dt) << " n=" << n << " k=" << k
                                  << " seed=" << test::test_seed());
  const DType rt = dt == DType::kF32 ? DType::kF64 : DType::kBF16;
  const DType ro = dt == DType::kF32 ? DType::kF64 : DType::kF32;
  const double sides = dt == DType::kF32 ? 1 : 2;
  const auto off_v = make_offsets(rows);
  const int64_t e_count = static_cast<int64_t>(rows.size()), used = off_v.back();
  const int64_t r = used + extra_rows;
  int32_t max_rows = 0;
  for (int32_t v : rows) max_rows = std::max(max_rows, v);
  auto off = offsets_tensor(off_v);
  auto x = random(dt, {r, k}, 11), w = random(dt, {e_count, n, k}, 12), dy = random(dt, {r, n}, 13);
  // Rows beyond offsets[E] must not be read: NaN there would reach the outputs.
  poison(x.t.slice(used, r));
  poison(dy.t.slice(used, r));
  auto xr = clone(x, rt), wr = clone(w, rt), dyr = clone(dy, rt);

  {
    OwnedTensor y(DType::kF32, {r, n});
    poison(y);
    auto yr = clone(y, ro);
    test::fast().grouped_linear_fwd(x, w, off, y);
    ref::grouped_linear_fwd(xr, wr, off, yr);
    const double err = rel_error(y.t.slice(0, used), yr.t.slice(0, used)), tol = f32_tol(k, sides);
    report("grouped_linear_fwd", err, tol);
    EXPECT_LE(err, tol) << "grouped_linear_fwd";
    expect_rows_poisoned(y, used, "grouped_linear_fwd");
  }
  {
    OwnedTensor dx(DType::kF32, {r, k});
    poison(dx);
    auto dxr = clone(dx, ro);
    test::fast().grouped_linear_bwd_data(dy, w, off, dx);
    ref::grouped_linear_bwd_data(dyr, wr, off, dxr);
    const double err = rel_error(dx.t.slice(0, used), dxr.t.slice(0, used)),
                 tol = f32_tol(n, sides);
    report("grouped_linear_bwd_data", err, tol);
    EXPECT_LE(err, tol) << "grouped_linear_bwd_data";
    expect_rows_poisoned(dx, used, "grouped_linear_bwd_data");
  }
  for (const bool acc : {true, false}) {
    SCOPED_TRACE(testing::Message() << "weight gradient, accumulate=" << acc);
    auto dw = random(DType::kF32, {e_count, n, k}, 14);
    if (!acc) poison(dw);  // every value must be written, zero-row experts' with zeros
    for (int64_t e = 0; e < e_count; ++e)
      if (acc && rows[static_cast<size_t>(e)] == 0) poison(dw.t.slice(e, e + 1));  // must stay untouched
    auto dwr = clone(dw, ro);
    test::fast().grouped_linear_bwd_weight(dy, x, off, dw, acc);
    ref::grouped_linear_bwd_weight(dyr, xr, off, dwr, acc);
    for (int64_t e = 0; e < e_count; ++e) {
      const Tensor a = dw.t.slice(e, e + 1), b = dwr.t.slice(e, e + 1);
      if (rows[static_cast<size_t>(e)] == 0 && acc) {
        expect_rows_poisoned(a, 0, "grouped_linear_bwd_weight (zero-row expert)");
        continue;
      }
      if (rows[static_cast<size_t>(e)] == 0) {
        int64_t nonzero = 0;
        for (int64_t i = 0; i < a.numel(); ++i) nonzero += test::get(a, i) != 0.0;
        EXPECT_EQ(nonzero, 0) << "grouped_linear_bwd_weight without accumulate: zero-row expert " << e;
        continue;
      }
      const double err = rel_error(a, b), tol = f32_tol(rows[static_cast<size_t>(e)], sides);
      report("grouped_linear_bwd_weight (one expert)", err, tol);
      EXPECT_LE(err, tol) << "grouped_linear_bwd_weight expert " << e;
    }
  }
}

// Experts with 70, 0, 3, 300, 1, 64, 128 and 583 rows (every chunk kind: 256, multiples of 64,
// tails), 5 rows beyond offsets[E].
const std::vector<int32_t> kUneven = {70, 0, 3, 300, 1, 64, 128, 583};

TEST_P(Gemm, GroupedF32MatchesRef) {
  check_grouped(DType::kF32, kUneven, 5, 33, 70);
  check_grouped(DType::kF32, kUneven, 5, 100, 257);
  check_grouped(DType::kF32, {0, 2, 0}, 3, 1100, 20);  // column tiles with a remainder
}

TEST_P(Gemm, GroupedBf16MatchesRefOnSameOperands) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::grouped_linear_fwd, DType::kBF16);
  MOE_SKIP_UNLESS_SUPPORTED(OpId::grouped_linear_bwd_data, DType::kBF16);
  MOE_SKIP_UNLESS_SUPPORTED(OpId::grouped_linear_bwd_weight, DType::kBF16);
  check_grouped(DType::kBF16, kUneven, 5, 33, 70);
  check_grouped(DType::kBF16, kUneven, 5, 100, 257);
}

#ifdef MOE_WITH_CUDA
// grouped_gemm.cu's rule for bf16 operands whose n and k are multiples of 8: CUTLASS's tensor-core
// kernels on Hopper and Blackwell (compute capability 9, 10) unless MOE_CUDA_GROUPED=simt.
bool grouped_tensor_cores_here() {
  int device = -1, major = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);  // the backend's, set when it was made
  EXPECT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  const char* forced = std::getenv("MOE_CUDA_GROUPED");
  return (major == 9 || major == 10) && !(forced && std::string(forced) == "simt");
}
#endif

// Shapes for the cuda backend's tensor-core grouped GEMMs, which the ones above never reach (their
// n or k is not a multiple of 8): n and k multiples of 8 but not of the 128x128x64 tiles, uneven
// experts with empty ones (inside, first and last; a zero-row expert's dw stays untouched), rows
// beyond offsets[E]. On cuda the path counters must show all six calls (fwd, dgrad, wgrad each)
// on CUTLASS and none on the SIMT kernel (all on SIMT where the rule above rules tensor cores out).
TEST_P(Gemm, GroupedBf16TensorCoreShapesMatchRef) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::grouped_linear_fwd, DType::kBF16);
  MOE_SKIP_UNLESS_SUPPORTED(OpId::grouped_linear_bwd_data, DType::kBF16);
  MOE_SKIP_UNLESS_SUPPORTED(OpId::grouped_linear_bwd_weight, DType::kBF16);
#ifdef MOE_WITH_CUDA
  const bool cuda = std::string(test::fast_device().name()) == "cuda";
  const CudaPaths before = cuda ? cuda_paths(test::fast_device()) : CudaPaths{};
#endif
  check_grouped(DType::kBF16, kUneven, 5, 136, 264);
  check_grouped(DType::kBF16, {0, 129, 7, 0, 200, 0}, 3, 264, 136);
#ifdef MOE_WITH_CUDA
  if (cuda) {
    const CudaPaths ran = cuda_paths(test::fast_device()) - before;
    const uint64_t calls = 2 * 3;
    const bool tensor_cores = grouped_tensor_cores_here();
    EXPECT_EQ(ran.grouped_cutlass, tensor_cores ? calls : uint64_t{0}) << cuda_paths_text(ran);
    EXPECT_EQ(ran.grouped_simt, tensor_cores ? uint64_t{0} : calls) << cuda_paths_text(ran);
  }
#endif
}

TEST_P(Gemm, GroupedRejectsBadOffsets) {
  auto x = random(DType::kF32, {6, 4}, 1), w = random(DType::kF32, {2, 3, 4}, 2);
  OwnedTensor y(DType::kF32, {6, 3});
  for (const auto& bad : std::vector<std::vector<int32_t>>{{1, 2, 3}, {0, 4, 2}, {0, 3, 7}}) {
    auto off = offsets_tensor(bad);
    EXPECT_THROW(test::fast().grouped_linear_fwd(x, w, off, y), Error);
    EXPECT_THROW(ref::grouped_linear_fwd(x, w, off, y), Error);
  }
}

TEST_P(Gemm, NewExpertLoadCreatesNoPrimitive) {
  MOE_SKIP_UNLESS_CPU_KERNELS();
  // A second step with a different load (different tail lengths) reuses the families created
  // by the first.
  const int64_t n = 48, k = 40;
  auto x = random(DType::kF32, {400, k}, 1), w = random(DType::kF32, {4, n, k}, 2);
  auto dy = random(DType::kF32, {400, n}, 3);
  OwnedTensor y(DType::kF32, {400, n}), dx(DType::kF32, {400, k}), dw(DType::kF32, {4, n, k});
  auto step = [&](const std::vector<int32_t>& rows) {
    auto off = offsets_tensor(make_offsets(rows));
    test::fast().grouped_linear_fwd(x, w, off, y);
    test::fast().grouped_linear_bwd_data(dy, w, off, dx);
    test::fast().grouped_linear_bwd_weight(dy, x, off, dw, true);
  };
  step({100, 100, 100, 100});
  const size_t created = cpu::gemm::primitive_count();
  step({7, 250, 0, 131});
  step({1, 2, 3, 383});
  EXPECT_EQ(cpu::gemm::primitive_count(), created);
}

// ------------------------------------------------------------------ finite differences (f64 ref)

// loss = sum(y * r); returns dloss/dp by central differences, for every element of p.
template <class F>
std::vector<double> numeric_grad(const Tensor& p, F&& loss) {
  const double h = 1e-3;  // the loss is linear in p: any h works, this one keeps rounding small
  std::vector<double> g(static_cast<size_t>(p.numel()));
  for (int64_t i = 0; i < p.numel(); ++i) {
    const double v = test::get(p, i);
    test::set(p, i, v + h);
    const double lp = loss();
    test::set(p, i, v - h);
    const double lm = loss();
    test::set(p, i, v);
    g[static_cast<size_t>(i)] = (lp - lm) / (2 * h);
  }
  return g;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += test::get(a, i) * test::get(b, i);
  return s;
}

double rel_error_vec(const Tensor& a, const std::vector<double>& b) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::fabs(test::get(a, i) - b[static_cast<size_t>(i)]));
    ref = std::max(ref, std::fabs(b[static_cast<size_t>(i)]));
  }
  return ref > 0 ? diff / ref : diff;
}

TEST(GemmRef, LinearBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(testing::Message() << "seed=" << test::test_seed());
  const int64_t m = 5, n = 4, k = 6;
  auto x = random(DType::kF64, {m, k}, 1), w = random(DType::kF64, {n, k}, 2);
  auto rr = random(DType::kF64, {m, n}, 3);
  OwnedTensor y(DType::kF64, {m, n});
  auto loss = [&] {
    ref::linear_fwd(x, w, y, false);
    return dot(y, rr);
  };
  OwnedTensor dx(DType::kF64, {m, k}), dw(DType::kF64, {n, k});
  poison(dx);
  ref::linear_bwd_data(rr, w, dx, false);
  poison(dw);  // overwritten
  ref::linear_bwd_weight(rr, x, dw, false);
  const double ex = rel_error_vec(dx, numeric_grad(x, loss)),
               ew = rel_error_vec(dw, numeric_grad(w, loss));
  report("linear_bwd_data vs finite differences", ex, 1e-8);
  report("linear_bwd_weight vs finite differences", ew, 1e-8);
  EXPECT_LE(ex, 1e-8);
  EXPECT_LE(ew, 1e-8);
}

TEST(GemmRef, GroupedBackwardMatchesFiniteDifferences) {
  SCOPED_TRACE(testing::Message() << "seed=" << test::test_seed());
  const int64_t n = 3, k = 4;
  const std::vector<int32_t> rows = {2, 0, 3};
  auto off = offsets_tensor(make_offsets(rows));
  const int64_t r = 6;  // one row beyond offsets[E]
  auto x = random(DType::kF64, {r, k}, 1), w = random(DType::kF64, {3, n, k}, 2);
  auto rr = random(DType::kF64, {r, n}, 3);
  for (int64_t j = 0; j < n; ++j) test::set(rr, 5 * n + j, 0.0);  // the unused row has no loss
  OwnedTensor y(DType::kF64, {r, n});
  auto loss = [&] {
    for (int64_t i = 0; i < y.t.numel(); ++i) test::set(y, i, 0.0);
    ref::grouped_linear_fwd(x, w, off, y);
    return dot(y, rr);
  };
  OwnedTensor dx(DType::kF64, {r, k}), dw(DType::kF64, {3, n, k});
  for (int64_t i = 0; i < dx.t.numel(); ++i) test::set(dx, i, 0.0);
  poison(dw);  // overwritten (the zero-row expert's with zeros)
  ref::grouped_linear_bwd_data(rr, w, off, dx);
  ref::grouped_linear_bwd_weight(rr, x, off, dw, false);
  const double ex = rel_error_vec(dx, numeric_grad(x, loss)),
               ew = rel_error_vec(dw, numeric_grad(w, loss));
  report("grouped_linear_bwd_data vs finite differences", ex, 1e-8);
  report("grouped_linear_bwd_weight vs finite differences", ew, 1e-8);
  EXPECT_LE(ex, 1e-8);
  EXPECT_LE(ew, 1e-8);
}

// ------------------------------------------------------------------ determinism and threading

// Runs every op and returns the outputs, to compare across thread counts.
std::vector<OwnedTensor> run_all(DType dt, const std::vector<int32_t>& rows, int64_t m, int64_t n,
                                 int64_t k) {
  std::vector<OwnedTensor> out;
  auto x = random(dt, {m, k}, 21), w = random(dt, {n, k}, 22), dy = random(dt, {m, n}, 23);
  out.emplace_back(random(DType::kF32, {m, n}, 24));
  test::fast().linear_fwd(x, w, out.back(), true);
  out.emplace_back(DType::kF32, std::initializer_list<int64_t>{m, k});
  test::fast().linear_bwd_data(dy, w, out.back(), false);
  out.emplace_back(random(DType::kF32, {n, k}, 25));
  test::fast().linear_bwd_weight(dy, x, out.back(), true);
  out.emplace_back(DType::kF32, std::initializer_list<int64_t>{n, k});
  test::fast().linear_bwd_weight(dy, x, out.back(), false);

  const auto off_v = make_offsets(rows);
  auto off = offsets_tensor(off_v);
  const int64_t e_count = static_cast<int64_t>(rows.size()), r = off_v.back();
  auto gx = random(dt, {r, k}, 26), gw = random(dt, {e_count, n, k}, 27);
  auto gdy = random(dt, {r, n}, 28);
  out.emplace_back(DType::kF32, std::initializer_list<int64_t>{r, n});
  test::fast().grouped_linear_fwd(gx, gw, off, out.back());
  out.emplace_back(DType::kF32, std::initializer_list<int64_t>{r, k});
  test::fast().grouped_linear_bwd_data(gdy, gw, off, out.back());
  out.emplace_back(random(DType::kF32, {e_count, n, k}, 29));
  test::fast().grouped_linear_bwd_weight(gdy, gx, off, out.back(), true);
  out.emplace_back(DType::kF32, std::initializer_list<int64_t>{e_count, n, k});
  test::fast().grouped_linear_bwd_weight(gdy, gx, off, out.back(), false);
  return out;
}

TEST_P(Gemm, BitwiseIdenticalWithOneTwoAndThreeThreads) {
  // Skewed load: max/mean about 4, tails of every kind, an empty expert.
  const std::vector<int32_t> skewed = {260, 5, 64, 0, 129, 1, 40, 77, 13, 30, 11, 2};
  Threads threads(1);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    threads.set(1);
    auto one = run_all(dt, skewed, 300, 600, 200);
    for (int t : {2, 3}) {
      threads.set(t);
      auto many = run_all(dt, skewed, 300, 600, 200);
      for (size_t i = 0; i < one.size(); ++i)
        EXPECT_TRUE(test::bitwise_equal(one[i], many[i]))
            << "output " << i << ", " << t << " threads";
    }
  }
}

// Dense weight gradients cut dw into one band per thread (cpu gemm.cpp: weight_band), so the
// bands' rows change with the thread count: every element's bits must not (here 1..8 threads give
// bands of 16 to 256 rows, with tails, reduction chunks with tails, fp32 and bf16, overwrite and
// accumulate).
TEST_P(Gemm, WeightBandsOfAnySizeGiveTheSameBits) {
  Threads threads(1);
  struct Shape {
    int64_t m, n, k;
  };
  for (DType dt : {DType::kF32, DType::kBF16})
    for (const Shape& sh : {Shape{70, 48, 40}, Shape{600, 130, 257}, Shape{1100, 512, 512}, Shape{300, 1100, 64}}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " m=" << sh.m << " n=" << sh.n << " k=" << sh.k);
      auto x = random(dt, {sh.m, sh.k}, 31), dy = random(dt, {sh.m, sh.n}, 32);
      std::vector<OwnedTensor> first;
      for (int t : {1, 2, 3, 5, 8}) {
        threads.set(t);
        OwnedTensor written(DType::kF32, {sh.n, sh.k});
        poison(written);
        test::fast().linear_bwd_weight(dy, x, written, false);
        auto added = random(DType::kF32, {sh.n, sh.k}, 33);
        test::fast().linear_bwd_weight(dy, x, added, true);
        if (first.empty()) {
          first.push_back(std::move(written));
          first.push_back(std::move(added));
          continue;
        }
        EXPECT_TRUE(test::bitwise_equal(first[0], written)) << t << " threads, overwrite";
        EXPECT_TRUE(test::bitwise_equal(first[1], added)) << t << " threads, accumulate";
      }
    }
}

int os_threads() {
  int count = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) count += e->d_name[0] != '.';
    closedir(d);
  }
  return count;
}

TEST_P(Gemm, OneDnnRunsSequentiallyInsideOurRegion) {
  MOE_SKIP_UNLESS_CPU_KERNELS();
  // oneDNN must never open an OpenMP region of its own from inside ours: it would oversubscribe
  // the cores and overrun the one-thread scratchpads. Any such region starts new OS threads
  // (libgomp gives a nested team fresh threads, even under an inactive one-thread region), so
  // a sampler counts this process's threads while the ops run with nesting allowed: a
  // single-tile GEMM (our region inactive, as oneDNN then sees omp_in_parallel() false) and a
  // many-tile one (our region active). The caller's thread count must also survive the ops.
  // libgomp keeps max-active-levels per thread: under strict the ops run on the backend's own
  // thread, which omp_set_max_active_levels here does not reach (nesting stays off there), so
  // only the cpu instance runs them with nesting allowed.
  Threads threads(2);
  const int levels = omp_get_max_active_levels();
  auto x = random(DType::kF32, {256, 64}, 1), w = random(DType::kF32, {512, 64}, 2);
  auto dy = random(DType::kF32, {256, 512}, 3);
  OwnedTensor y(DType::kF32, {256, 512}), dx(DType::kF32, {256, 64}), dw(DType::kF32, {512, 64});
  const Tensor x1 = x.t.slice(0, 64), y1 = y.t.slice(0, 64);  // 64x512x64: one tile
  auto run = [&] {
    test::fast().linear_fwd(x1, w, y1, false);
    test::fast().linear_fwd(x, w, y, false);
    test::fast().linear_bwd_data(dy, w, dx, false);
    test::fast().linear_bwd_weight(dy, x, dw, true);
  };
  run();  // warm: primitives exist, the outer pool is started
  // Threads of OpenMP pools just shut down (a larger team of the test before, or the worker of
  // its strict backend) leave asynchronously: count once the number is steady, and before the
  // sampler starts, so that none still leaving is counted by the sampler but not in the base.
  int settled = os_threads();
  for (int steady = 0, polls = 0; steady < 3 && polls < 200; ++polls) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int now = os_threads();
    steady = now == settled ? steady + 1 : 0;
    settled = now;
  }
  const int base = settled + 1;  // main, the OpenMP worker(s), and the sampler started below
  std::atomic<bool> stop{false};
  std::atomic<int> peak{0};
  std::thread sampler([&] {
    while (!stop.load()) peak.store(std::max(peak.load(), os_threads()));
  });
  omp_set_max_active_levels(4);
  for (int i = 0; i < 20; ++i) run();
  omp_set_max_active_levels(levels);
  stop.store(true);
  sampler.join();
  EXPECT_LE(peak.load(), base);
  EXPECT_EQ(omp_get_max_threads(), 2);
}

bool is_bf16_kernel(const std::string& impl) {
  // AMX machines get an even better kernel (avx512_core_bf16_amx_bf16 / avx512_core_amx).
  return impl.find("avx512_core_bf16") != std::string::npos ||
         impl.find("amx") != std::string::npos;
}

TEST(GemmCpu, OneDnnPicksAvx512Kernels) {
  // The first tile of each op at the benchmark shapes runs a brgemm kernel. The one documented
  // exception: the data gradient of a small-M GEMM is cut into column tiles whose B (a column
  // block of w) is strided, which oneDNN 2.6 serves with its JIT GEMM.
  using cpu::GemmOp;
  const bool bf16_cpu = __builtin_cpu_supports("avx512bf16");
  // Without AVX-512 (oneDNN 2.6's brgemm and bf16 matmul need avx512_core) every shape gets the
  // AVX2 JIT GEMM, and bf16 runs it on operands widened to fp32 (gemm_dnnl.cpp).
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape& s : {Shape{4096, 1536, 512}, Shape{64, 1536, 512}, Shape{64, 512, 1536}})
    for (GemmOp op : {GemmOp::kForward, GemmOp::kBackwardData, GemmOp::kBackwardWeight}) {
      SCOPED_TRACE(testing::Message() << "op " << static_cast<int>(op) << " m=" << s.m);
      const bool jit = op == GemmOp::kBackwardData && s.m == 64;
      const std::string f32 = cpu::gemm_impl_info(op, DType::kF32, s.m, s.n, s.k);
      const std::string bf = cpu::gemm_impl_info(op, DType::kBF16, s.m, s.n, s.k);
      if (!avx512) {
        EXPECT_EQ(f32, "gemm:jit");
        EXPECT_EQ(bf, "widened to f32: gemm:jit");
        continue;
      }
      if (jit) {
        EXPECT_EQ(f32, "gemm:jit");
        EXPECT_EQ(bf, "gemm:jit");
        continue;
      }
      EXPECT_NE(f32.find("brg:avx512"), std::string::npos) << f32;
      if (bf16_cpu) {
        EXPECT_TRUE(is_bf16_kernel(bf)) << bf;
      }
    }
  if (!avx512) GTEST_SKIP() << "CPU lacks AVX-512: checked the AVX2 fallback (JIT GEMM, bf16 widened) instead";
  if (!bf16_cpu) GTEST_SKIP() << "CPU lacks avx512_bf16: the bf16 kernel was not checked";
}

TEST_P(Gemm, DenseTilesAlwaysGetBrgemm) {
  MOE_SKIP_UNLESS_CPU_KERNELS();
  // Run every op on odd shapes, then inspect every primitive created so far: each one whose
  // operands are dense (all but small-M data-gradient column tiles) must be a brgemm kernel.
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (const auto& c : {LinearCase{7, 100, 257}, LinearCase{130, 33, 70},
                          LinearCase{64, 1100, 48}, LinearCase{300, 600, 200}}) {
      auto x = random(dt, {c.m, c.k}, 1), w = random(dt, {c.n, c.k}, 2),
           dy = random(dt, {c.m, c.n}, 3);
      OwnedTensor y(DType::kF32, {c.m, c.n}), dx(DType::kF32, {c.m, c.k}),
          dw(DType::kF32, {c.n, c.k});
      test::fast().linear_fwd(x, w, y, true);
      test::fast().linear_bwd_data(dy, w, dx, false);
      test::fast().linear_bwd_weight(dy, x, dw, true);
    }
    const auto off_v = make_offsets(kUneven);
    auto off = offsets_tensor(off_v);
    const int64_t r = off_v.back(), e = static_cast<int64_t>(kUneven.size()), n = 33, k = 70;
    auto x = random(dt, {r, k}, 1), w = random(dt, {e, n, k}, 2), dy = random(dt, {r, n}, 3);
    OwnedTensor y(DType::kF32, {r, n}), dx(DType::kF32, {r, k}), dw(DType::kF32, {e, n, k});
    test::fast().grouped_linear_fwd(x, w, off, y);
    test::fast().grouped_linear_bwd_data(dy, w, off, dx);
    test::fast().grouped_linear_bwd_weight(dy, x, off, dw, true);
  }
  const bool bf16_cpu = __builtin_cpu_supports("avx512bf16");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  int dense = 0;
  for (const auto& [d, impl] : cpu::gemm::cached_primitives()) {
    using cpu::gemm::Trans;
    const bool a_dense = d.ta == Trans::kN ? d.lda == d.k : d.lda == d.m;
    const bool b_dense = d.tb == Trans::kN ? d.ldb == d.n : d.ldb == d.k;
    if (!(a_dense && b_dense && d.ldc == d.n)) {
      // Only the data gradient's column tiles (strided B) may be strided.
      EXPECT_TRUE(a_dense && d.ldc != d.n && d.tb == Trans::kN && d.ldb > d.n) << impl;
      continue;
    }
    ++dense;
    SCOPED_TRACE(testing::Message() << dtype_name(d.dtype) << " " << d.m << "x" << d.n << "x" << d.k
                                    << " ld " << d.lda << "," << d.ldb << "," << d.ldc);
    if (!avx512) {  // the AVX2 JIT GEMM, bf16 on widened operands (OneDnnPicksAvx512Kernels)
      EXPECT_EQ(impl, d.dtype == DType::kBF16 ? "widened to f32: gemm:jit" : "gemm:jit");
      continue;
    }
    EXPECT_NE(impl.find("brg:avx512"), std::string::npos) << impl;
    if (d.dtype == DType::kBF16 && bf16_cpu) {
      EXPECT_TRUE(is_bf16_kernel(impl)) << impl;
    }
  }
  EXPECT_GT(dense, 100);
}

}  // namespace
}  // namespace moe
