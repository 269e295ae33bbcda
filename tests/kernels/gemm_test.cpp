// GEMM family: each backend under test against ref, ref against finite differences (the cpu
// kernels' tiles, threads and oneDNN primitives: gemm_tiles_test.cpp).
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
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend_errors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "gemm_test_util.h"
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
using namespace gemm_test;





MOE_BACKEND_SUITE(Gemm);


// ------------------------------------------------------------------ dense, backend vs ref


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
    {40, 5000, 260},                   // a wide weight (cpu: strided forward tiles, on AMX staged ones streamed out) and a long reduction
    {150, 4200, 40},                   // in the data gradient (cpu: 2,048-long chunks and a tail), row bands
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
  // On AMX, weight gradients' 512-row chunks and padded remainders (gemm_tiles.cpp, kAmxChunk):
  // two chunks exactly, two and a 76-row tail, a tail of a whole tile depth, one of 511 rows.
  check_grouped(DType::kBF16, {1024, 1100, 32, 0, 511}, 3, 48, 40);
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

// A step with the first of `loads` (rows per expert, 4 experts), then steps with the others
// (different tail lengths) create no oneDNN primitive: the first created every family.
void expect_loads_create_no_primitive(DType dt, int64_t k, const std::vector<std::vector<int32_t>>& loads) {
  const int64_t n = 48, r = 1400;
  auto x = random(dt, {r, k}, 1), w = random(dt, {4, n, k}, 2), dy = random(dt, {r, n}, 3);
  OwnedTensor y(DType::kF32, {r, n}), dx(DType::kF32, {r, k}), dw(DType::kF32, {4, n, k});
  size_t created = 0;
  for (size_t i = 0; i < loads.size(); ++i) {
    auto off = offsets_tensor(make_offsets(loads[i]));
    test::fast().grouped_linear_fwd(x, w, off, y);
    test::fast().grouped_linear_bwd_data(dy, w, off, dx);
    test::fast().grouped_linear_bwd_weight(dy, x, off, dw, true);
    if (i == 0) created = cpu::gemm::primitive_count();
  }
  EXPECT_EQ(cpu::gemm::primitive_count(), created) << dtype_name(dt);
}

TEST_P(Gemm, NewExpertLoadCreatesNoPrimitive) {
  MOE_SKIP_UNLESS_CPU_KERNELS();
  expect_loads_create_no_primitive(DType::kF32, 40, {{100, 100, 100, 100}, {7, 250, 0, 131}, {1, 2, 3, 383}});
}

// The same in bf16, whose weight gradients on AMX pad their remainders (gemm_tiles.cpp,
// kAmxChunk): every padded length is created with the first load.
TEST_P(Gemm, NewExpertLoadCreatesNoBf16Primitive) {
  MOE_SKIP_UNLESS_CPU_KERNELS();
  MOE_SKIP_UNLESS_SUPPORTED(OpId::grouped_linear_bwd_weight, DType::kBF16);
  expect_loads_create_no_primitive(DType::kBF16, 64,
                                   {{100, 100, 100, 100}, {7, 250, 0, 131}, {1, 2, 3, 1383}, {513, 511, 33, 31}});
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

}  // namespace
}  // namespace moe
