// Error messages that differ between backends. The cuda kernels (src/kernels/cuda) word their own
// argument checks, unlike the cpu kernels (which strict runs too, and whose wording ref shares for
// the checks tested here); and a value only the device reads (an id, label, count, segment or
// doc_start out of range) comes back from the next wait as
// "cuda backend: <op>: invalid value <v> at index <i> (found on the device: ...)".
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "common/backends.h"

namespace moe::test {

// Whether `what`, an error of the backend named `backend`, contains every phrase of its wording:
// `cuda`'s on the cuda backend, `cpu`'s on every other.
inline ::testing::AssertionResult says(const std::string& what, const std::string& backend,
                                       std::initializer_list<const char*> cpu, std::initializer_list<const char*> cuda) {
  for (const char* phrase : backend == "cuda" ? cuda : cpu)
    if (what.find(phrase) == std::string::npos)
      return ::testing::AssertionFailure() << backend << " error \"" << what << "\" lacks \"" << phrase << "\"";
  return ::testing::AssertionSuccess();
}

// The same for an error of the backend under test (test::fast()).
inline ::testing::AssertionResult says(const std::string& what, std::initializer_list<const char*> cpu,
                                       std::initializer_list<const char*> cuda) {
  return says(what, fast_device().name(), cpu, cuda);
}

}  // namespace moe::test
