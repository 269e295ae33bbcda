// The cases each backend under test skips (Backend::supports false) are exactly the committed
// list tests/kernels/expected_skips.txt: coverage is neither lost nor gained silently.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include "common/paths.h"
#include "common/backends.h"
#include "kernels/ops.h"

namespace moe {
namespace {

using Case = std::tuple<std::string, std::string, std::string>;  // backend, op, dtype

constexpr DType kDtypes[] = {DType::kF64, DType::kF32, DType::kBF16};

std::string show(const Case& c) {
  return std::get<0>(c) + " " + std::get<1>(c) + " " + std::get<2>(c);
}

TEST(BackendCoverage, SkipsAreExactlyTheCommittedList) {
  const std::string path = std::string(::moe::test::source_dir()) + "/tests/kernels/expected_skips.txt";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  std::set<std::string> ops, dtypes;
  for (int i = 0; i < static_cast<int>(OpId::kCount); ++i) ops.insert(op_name(static_cast<OpId>(i)));
  for (DType d : kDtypes) dtypes.insert(dtype_name(d));
  const auto& under_test = test::backends_under_test();
  const std::set<std::string> backends(under_test.begin(), under_test.end());

  // The committed list, restricted to the backends under test (lines for others, e.g. a backend
  // not built here, are checked for form only).
  std::set<Case> seen, listed;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string backend, op, dtype, extra;
    if (!(words >> backend)) continue;  // blank or comment only
    const bool three = static_cast<bool>(words >> op >> dtype) && !(words >> extra);
    ASSERT_TRUE(three) << path << ":" << number << ": expected \"backend op dtype\", got \"" << line
                       << "\"";
    EXPECT_TRUE(ops.count(op)) << path << ":" << number << ": unknown op '" << op << "'";
    EXPECT_TRUE(dtypes.count(dtype)) << path << ":" << number << ": unknown dtype '" << dtype
                                     << "' (f64, f32 or bf16)";
    const Case c{backend, op, dtype};
    EXPECT_TRUE(seen.insert(c).second) << path << ":" << number << ": listed twice: " << show(c);
    if (backends.count(backend)) listed.insert(c);
  }

  std::set<Case> skipped;
  for (const std::string& name : under_test) {
    for (int i = 0; i < static_cast<int>(OpId::kCount); ++i)
      for (DType d : kDtypes)
        if (!test::backend_supports(name, static_cast<OpId>(i), d))
          skipped.insert({name, op_name(static_cast<OpId>(i)), dtype_name(d)});
  }

  for (const Case& c : skipped)
    EXPECT_TRUE(listed.count(c)) << "skipped but not listed in expected_skips.txt: " << show(c);
  for (const Case& c : listed)
    EXPECT_TRUE(skipped.count(c)) << "listed in expected_skips.txt but not skipped: " << show(c);
}

}  // namespace
}  // namespace moe
