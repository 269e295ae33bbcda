// Op tests through the Backend, over every backend under test (cpu, strict; later cuda), each
// against the ref backend as the oracle.
//
//   MOE_BACKEND_SUITE(Gemm);            // once per suite: instantiates it for every backend
//   TEST_P(Gemm, MatchesRef) {
//     test::fast().linear_fwd(x, w, y, false);   // host tensors in, host tensors out
//     ref::linear_fwd(x, w, yr, false);
//   }
//
// fast() is the backend under test seen from the host: every tensor argument is uploaded to the
// backend's own memory (aliasing arguments share one device copy), the op runs there, the
// host waits, and every argument is downloaded back. So one test body checks a backend whose
// memory the host cannot touch (strict, cuda) exactly like one it can.
// skip_unless(op, dtype) turns a case the backend lacks (Backend::supports) into a reported skip.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace moe::test {

// Names of the backends every op test runs on.
const std::vector<std::string>& backends_under_test();

// Wraps `device` so that its ops take host tensors (see above).
std::unique_ptr<Backend> host_facing(Backend& device);

// The backend under test of the running TEST_P, as host_facing; and the device backend itself.
Backend& fast();
Backend& fast_device();

class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override;
  void TearDown() override;
};

}  // namespace moe::test

#define MOE_BACKEND_SUITE(Suite)                                                                  \
  class Suite : public ::moe::test::BackendTest {};                                               \
  INSTANTIATE_TEST_SUITE_P(Backends, Suite, ::testing::ValuesIn(::moe::test::backends_under_test()), \
                           [](const ::testing::TestParamInfo<std::string>& i) { return i.param; })

// Skips the rest of the test, reported as skipped, when the backend under test lacks the case.
#define MOE_SKIP_UNLESS_SUPPORTED(op, dtype)                                                       \
  do {                                                                                            \
    if (!::moe::test::fast_device().supports(op, dtype))                                          \
      GTEST_SKIP() << ::moe::test::fast_device().name() << " does not support " << ::moe::op_name(op) \
                   << " in " << ::moe::dtype_name(dtype);                                         \
  } while (0)
