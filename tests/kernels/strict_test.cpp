// The backend memory and stream calls (every backend), and what the strict backend enforces:
// host reads of its memory fault, results appear only after a wait, fresh memory is NaN bytes,
// errors surface at the next wait, host tensors are refused, transfers are counted.
#include <gtest/gtest.h>

#include <csignal>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/backends.h"
#include "common/test_util.h"
#include "core/buffer.h"
#include "kernels/ops.h"

namespace moe {
namespace {

using test::error_of;

class Memory : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Backends, Memory, ::testing::Values("ref", "cpu", "strict"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST_P(Memory, UploadCopyDownloadRoundTripAndAreCounted) {
  std::unique_ptr<Backend> b = make_backend(GetParam());
  std::vector<float> in(1000), out(1000, -7.0f);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) * 0.25f - 3.0f;
  OwnedTensor x(*b, DType::kF32, {10, 100}), y(*b, DType::kF32, {10, 100});
  EXPECT_EQ(x.t.device, b->device());
  const TransferStats before = b->transfers();
  b->upload(in.data(), x.t);
  b->copy(x.t, y.t);
  b->scale(y.t, 2.0);
  b->download(y.t, out.data());
  b->synchronize();
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], 2.0f * in[i]) << i;
  const TransferStats d = b->transfers() - before;
  EXPECT_EQ(d.to_device, 1u);
  EXPECT_EQ(d.to_device_bytes, 4000u);
  EXPECT_EQ(d.to_host, 1u);
  EXPECT_EQ(d.to_host_bytes, 4000u);
  // Sub-views keep the device and address the right bytes.
  Tensor row = y.t.slice(3, 4);
  EXPECT_EQ(row.device, b->device());
  std::vector<float> r(100);
  b->download(row, r.data());
  b->synchronize();
  EXPECT_EQ(r[0], 2.0f * in[300]);
  EXPECT_EQ(error_of([&] { b->copy(x.t, OwnedTensor(*b, DType::kF32, {3}).t); }).find("copy: source (10,100) f32"),
            0u);
}

TEST_P(Memory, EventsMeasureTheStreamInOrder) {
  std::unique_ptr<Backend> b = make_backend(GetParam());
  OwnedTensor x(*b, DType::kF32, {1 << 16});
  const Event e0 = b->record();
  for (int i = 0; i < 20; ++i) b->fill(x.t, i);
  const Event e1 = b->record();
  EXPECT_GT(e1.seq, e0.seq);
  b->wait(e1);
  EXPECT_GE(b->elapsed_seconds(e0, e1), 0.0);
  float v = 0;
  b->download(x.t.slice(5, 6), &v);
  b->wait(b->record());
  EXPECT_EQ(v, 19.0f);
}

// ---------------------------------------------------------------- strict only

TEST(Strict, FreshMemoryIsNanBytes) {
  std::unique_ptr<Backend> b = make_backend("strict");
  OwnedTensor x(*b, DType::kF32, {333});
  std::vector<uint32_t> bits(333, 0);
  b->download(x.t, bits.data());
  b->synchronize();
  for (uint32_t v : bits) ASSERT_EQ(v, 0xFFFFFFFFu);
  float f = 0;
  std::memcpy(&f, bits.data(), 4);
  EXPECT_TRUE(std::isnan(f));
}

TEST(Strict, HostAccessToStrictMemoryIsRefused) {
  std::unique_ptr<Backend> b = make_backend("strict");
  OwnedTensor x(*b, DType::kF32, {16});
  EXPECT_EQ(x.t.device, Device::kStrict);
  EXPECT_NE(error_of([&] { (void)x.t.as<float>(); }).find("host access to a strict tensor (16)"), std::string::npos);
}

#if defined(__SANITIZE_ADDRESS__)
#define MOE_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOE_UNDER_ASAN 1
#endif
#endif

TEST(StrictDeathTest, HostDereferenceOfStrictMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto dereference = [] {
    std::unique_ptr<Backend> b = make_backend("strict");
    OwnedTensor x(*b, DType::kF32, {16});
    b->fill(x.t, 1.0);
    b->synchronize();
    volatile float v = *static_cast<volatile float*>(x.t.data);  // the bug under test
    (void)v;
    std::exit(0);  // not reached: the read faults
  };
#ifdef MOE_UNDER_ASAN
  // AddressSanitizer catches the fault itself, reports it and exits with an error.
  EXPECT_DEATH(dereference(), "SEGV");
#else
  EXPECT_EXIT(dereference(), ::testing::KilledBySignal(SIGSEGV), "");
#endif
}

// A download read without waiting is stale, every time: a missing wait cannot pass by luck.
TEST(Strict, ResultsAppearOnlyAfterAWait) {
  std::unique_ptr<Backend> b = make_backend("strict");
  OwnedTensor x(*b, DType::kF32, {64});
  b->fill(x.t, 5.0);
  std::vector<float> host(64, -1.0f);
  b->download(x.t, host.data());
  const Event done = b->record();
  for (float v : host) ASSERT_EQ(v, -1.0f);  // dropped wait: the host still sees its old bytes
  b->wait(done);
  for (float v : host) ASSERT_EQ(v, 5.0f);
}

TEST(Strict, OpErrorsSurfaceAtTheNextWaitAndLaterCallsAreSkipped) {
  std::unique_ptr<Backend> b = make_backend("strict");
  OwnedTensor x(*b, DType::kF32, {8}), y(*b, DType::kF32, {9});
  b->fill(y.t, 1.0);
  b->convert(x.t, y.t);  // shape mismatch: raised on the worker, not here
  b->fill(y.t, 2.0);     // skipped: the stream is in error
  const std::string err = error_of([&] { b->synchronize(); });
  EXPECT_NE(err.find("convert"), std::string::npos) << err;
  float v = 0;
  b->download(y.t.slice(0, 1), &v);
  b->synchronize();  // the error was reported once; the backend works again
  EXPECT_EQ(v, 1.0f);
}

TEST(Strict, HostTensorsAreRefusedNamingTheOp) {
  std::unique_ptr<Backend> b = make_backend("strict");
  OwnedTensor host(DType::kF32, {4});
  const std::string err = error_of([&] { b->fill(host.t, 1.0); });
  EXPECT_NE(err.find("strict backend: fill was given a cpu tensor (4)"), std::string::npos) << err;
  OwnedTensor x(*b, DType::kF32, {4});
  Tensor past = x.t;
  past.shape[0] = 100000;  // runs past the allocation (pages are 4 KiB)
  EXPECT_NE(error_of([&] { b->fill(past, 1.0); }).find("runs past the end of its allocation"), std::string::npos);
}

TEST(Strict, AFullQueueRunsAndFreeingWaitsForPendingWork) {
  std::unique_ptr<Backend> b = make_backend("strict");
  OwnedTensor x(*b, DType::kF64, {4});
  b->fill(x.t, 0.0);
  for (int i = 0; i < 3000; ++i) b->fill(x.t, i);  // more calls than the queue holds
  {
    OwnedTensor tmp(*b, DType::kF64, {1 << 20});
    b->fill(tmp.t, 1.0);
  }  // freed with its fill pending: deallocate drains first
  double v = 0;
  b->download(x.t.slice(2, 3), &v);
  b->synchronize();
  EXPECT_EQ(v, 2999.0);
}

}  // namespace
}  // namespace moe
