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
// MOE_SKIP_UNLESS_SUPPORTED(op, dtype) turns a case the backend lacks (Backend::supports) into a
// reported skip. A suite with a parameter of its own (a shape) uses MOE_BACKEND_SUITE_WITH and
// reads it with param():
//
//   MOE_BACKEND_SUITE_WITH(AttentionShapes, Shape, ::testing::ValuesIn(kShapes), shape_name);
//   TEST_P(AttentionShapes, MatchesRef) { const Shape s = param(); ... }
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/ops.h"

namespace moe::test {

// Names of the backends every op test runs on: cpu, strict, and cuda in a CUDA build (its cases
// are reported as skipped, never passed, on a machine without a GPU).
const std::vector<std::string>& backends_under_test();
// False (with the reason) when the backend cannot run here (cuda without a GPU).
bool backend_available(const std::string& name, std::string* why = nullptr);
// Backend::supports, answered without making the backend (so without a GPU for cuda).
bool backend_supports(const std::string& name, OpId op, DType dtype);

// Wraps `device` so that its ops take host tensors (see above).
std::unique_ptr<Backend> host_facing(Backend& device);

// The backend under test of the running TEST_P, as host_facing; and the device backend itself.
Backend& fast();
Backend& fast_device();

// Makes `name` the backend under test of fast() and fast_device() until release_backend().
void use_backend(const std::string& name);
void release_backend();

class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override;
  void TearDown() override;
};

// The same with a second parameter P of the suite's own: every backend times every P.
template <class P>
class BackendTestWith : public ::testing::TestWithParam<std::tuple<std::string, P>> {
 protected:
  void SetUp() override {
    std::string why;
    const std::string& name = std::get<0>(this->GetParam());
    if (!backend_available(name, &why)) GTEST_SKIP() << name << " backend unavailable: " << why;
    use_backend(name);
  }
  void TearDown() override { release_backend(); }
  const P& param() const { return std::get<1>(this->GetParam()); }
};

}  // namespace moe::test

#define MOE_BACKEND_SUITE(Suite)                                                                  \
  class Suite : public ::moe::test::BackendTest {};                                               \
  INSTANTIATE_TEST_SUITE_P(Backends, Suite, ::testing::ValuesIn(::moe::test::backends_under_test()), \
                           [](const ::testing::TestParamInfo<std::string>& i) { return i.param; })

// values: a ::testing generator of P; name_of: a function P -> std::string (a test name part).
#define MOE_BACKEND_SUITE_WITH(Suite, P, values, name_of)                                         \
  class Suite : public ::moe::test::BackendTestWith<P> {};                                        \
  INSTANTIATE_TEST_SUITE_P(                                                                       \
      Backends, Suite, ::testing::Combine(::testing::ValuesIn(::moe::test::backends_under_test()), values), \
      [](const ::testing::TestParamInfo<std::tuple<std::string, P>>& i) {                         \
        return std::get<0>(i.param) + "_" + name_of(std::get<1>(i.param));                       \
      })

// Skips the rest of the test, reported as skipped, when the backend under test lacks the case.
#define MOE_SKIP_UNLESS_SUPPORTED(op, dtype)                                                       \
  do {                                                                                            \
    if (!::moe::test::fast_device().supports(op, dtype))                                          \
      GTEST_SKIP() << ::moe::test::fast_device().name() << " does not support " << ::moe::op_name(op) \
                   << " in " << ::moe::dtype_name(dtype);                                         \
  } while (0)
