// GEMM tiles of the cpu kernels (kernels/cpu/gemm_tiles.h): bitwise independence of the thread
// count, and the oneDNN primitives behind the tiles (which the strict backend runs too).
#include <dirent.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/backends.h"
#include "common/test_util.h"
#include "gemm_test_util.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_dnnl.h"
#include "kernels/cpu/gemm_long.h"
#include "kernels/cpu/gemm_wgrad.h"

namespace moe {
namespace {

using test::poison;
using namespace gemm_test;

MOE_BACKEND_SUITE(GemmTiles);

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

TEST_P(GemmTiles, BitwiseIdenticalWithOneTwoAndThreeThreads) {
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

// The LM head's shapes in small (cpu: a wide weight's forward in strided tiles, a long reduction in
// chunks): their tiles are a function of the shapes too.
TEST_P(GemmTiles, LongReductionAndWideWeightIgnoreTheThreadCount) {
  Threads threads(1);
  struct Shape {
    int64_t m, n, k;
  };
  for (DType dt : {DType::kF32, DType::kBF16})
    for (const Shape& sh : {Shape{40, 5000, 260}, Shape{150, 4200, 40}}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " m=" << sh.m << " n=" << sh.n << " k=" << sh.k);
      auto x = random(dt, {sh.m, sh.k}, 41), w = random(dt, {sh.n, sh.k}, 42), dy = random(dt, {sh.m, sh.n}, 43);
      std::vector<OwnedTensor> first;
      for (int t : {1, 2, 3}) {
        threads.set(t);
        std::vector<OwnedTensor> out;
        out.emplace_back(random(DType::kF32, {sh.m, sh.n}, 44));
        test::fast().linear_fwd(x, w, out.back(), true);
        out.emplace_back(DType::kF32, std::initializer_list<int64_t>{sh.m, sh.k});
        poison(out.back());
        test::fast().linear_bwd_data(dy, w, out.back(), false);
        out.emplace_back(random(DType::kF32, {sh.m, sh.k}, 45));
        test::fast().linear_bwd_data(dy, w, out.back(), true);
        if (first.empty()) {
          first = std::move(out);
          continue;
        }
        for (size_t i = 0; i < out.size(); ++i)
          EXPECT_TRUE(test::bitwise_equal(first[i], out[i])) << "output " << i << ", " << t << " threads";
      }
    }
}

// Dense weight gradients cut dw into one band per thread (cpu gemm_tiles.cpp: weight_band), so the
// bands' rows change with the thread count: every element's bits must not (here 1..8 threads give
// bands of 16 to 256 rows, with tails, reduction chunks with tails, fp32 and bf16, overwrite and
// accumulate).
TEST_P(GemmTiles, WeightBandsOfAnySizeGiveTheSameBits) {
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

TEST_P(GemmTiles, OneDnnRunsSequentiallyInsideOurRegion) {
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
  // The first tile of each op at the benchmark shapes runs a brgemm kernel, weight gradients our
  // own (gemm_wgrad.h, with AVX-512), and so does an LM head's bf16 data gradient (gemm_long.h). The documented exceptions, served by oneDNN 2.6's JIT GEMM: the data gradient of a small-M GEMM, cut into
  // column tiles whose B (a column block of w) is strided; an LM head's forward (a wide weight:
  // tiles written in place, C strided) and its data gradient (a long reduction in chunks, A
  // strided).
  using cpu::GemmOp;
  const bool bf16_cpu = __builtin_cpu_supports("avx512bf16");
  // Without AVX-512 (oneDNN 2.6's brgemm and bf16 matmul need avx512_core) every shape gets the
  // AVX2 JIT GEMM, and bf16 runs it on operands widened to fp32 (gemm_dnnl.cpp).
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  struct Shape {
    int64_t m, n, k;
  };
  // With AMX (gemm::amx_bf16) every bf16 tile is oneDNN's, on dense tiles (the LM head's forward
  // in dense row bands), except the LM head's data gradient, whose chunks oneDNN runs in its JIT
  // GEMM there.
  const bool amx = cpu::gemm::amx_bf16();
  for (const Shape& s : {Shape{4096, 1536, 512}, Shape{64, 1536, 512}, Shape{64, 512, 1536}, Shape{1024, 50304, 256}})
    for (GemmOp op : {GemmOp::kForward, GemmOp::kBackwardData, GemmOp::kBackwardWeight}) {
      SCOPED_TRACE(testing::Message() << "op " << static_cast<int>(op) << " m=" << s.m << " n=" << s.n);
      const bool lm_head = s.n == 50304;
      const bool jit = (op == GemmOp::kBackwardData && s.m == 64) || (lm_head && op != GemmOp::kBackwardWeight);
      const std::string f32 = cpu::gemm_impl_info(op, DType::kF32, s.m, s.n, s.k);
      const std::string bf = cpu::gemm_impl_info(op, DType::kBF16, s.m, s.n, s.k);
      if (amx) {
        const bool bf_jit = op == GemmOp::kBackwardData && (s.m == 64 || lm_head);
        EXPECT_EQ(bf, bf_jit ? "gemm:jit" : "brg:avx512_core_amx_bf16");
      }
      if (lm_head && op == GemmOp::kBackwardData && cpu::longred::available(DType::kBF16)) {  // ours (gemm_long.h)
        if (!amx) {
          EXPECT_EQ(bf, "moecore:avx512_bf16");
        }
        EXPECT_EQ(f32, "gemm:jit");
        continue;
      }
      if (op == GemmOp::kBackwardWeight && cpu::wgrad::available(DType::kF32)) {  // ours (gemm_wgrad.h)
        EXPECT_EQ(f32, "moecore:avx512");
        if (cpu::wgrad::available(DType::kBF16) && !amx) {
          EXPECT_EQ(bf, "moecore:avx512_bf16");
        }
        continue;
      }
      if (amx && lm_head && op == GemmOp::kForward) {  // dense row bands, not the wide weight's strided tiles
        EXPECT_EQ(f32, "gemm:jit");
        continue;
      }
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

TEST_P(GemmTiles, DenseTilesAlwaysGetBrgemm) {
  MOE_SKIP_UNLESS_CPU_KERNELS();
  // Run every op on odd shapes, then inspect every primitive created so far: each one whose
  // operands are dense (all but small-M data-gradient column tiles) must be a brgemm kernel.
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (const auto& c : {LinearCase{7, 100, 257}, LinearCase{130, 33, 70},
                          LinearCase{64, 1100, 48}, LinearCase{300, 600, 200}, LinearCase{40, 5000, 260}}) {
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
      // Only the data gradient's column tiles (strided B), a long reduction's chunks (strided A,
      // B not transposed) and a wide weight's forward tiles (strided C, B transposed) may be.
      const bool column_tiles = a_dense && d.ldc != d.n && d.tb == Trans::kN && d.ldb > d.n;
      const bool chunks = d.ta == Trans::kN && d.lda > d.k && d.tb == Trans::kN;
      const bool wide = a_dense && b_dense && d.tb == Trans::kT && d.ldc > d.n;
      EXPECT_TRUE(column_tiles || chunks || wide) << impl;
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
