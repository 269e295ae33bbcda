// Ranks started with different configs, builds or data refuse to train: every rank stops with
// the same message naming the first differing key (or file) and both values. Table of
// differences, each on the last rank only; train.threads may differ.
#include <gtest/gtest.h>

#include <functional>

#include "config/config.h"
#include "train/run_checks.h"
#include "world.h"

namespace moe::test {
namespace {

std::string agreement_error(const Config& c) {
  try {
    check_ranks_agree(c, world(), /*with_data_files=*/false);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(RankAgreement, AnyDifferingKeyIsRefusedOnEveryRankNamingIt) {
  const int n = world().size();
  const int odd = n - 1;  // the rank given a different setting
  EXPECT_EQ(agreement_error(Config{}), "") << "identical configs agree";
  Config threads;
  if (world().rank() == odd) threads.train.threads = 7;
  EXPECT_EQ(agreement_error(threads), "") << "train.threads may differ";
  if (n == 1) GTEST_SKIP() << "one rank agrees with itself";
  struct Case {
    std::function<void(Config&)> edit;
    std::string key, odd_value, rank0_value;
  };
  const std::vector<Case> cases = {
      {[](Config& c) { c.optim.lr = 1e-4; }, "optim.lr", "0.0001", "0.003"},
      {[](Config& c) { c.train.seed = 7; }, "train.seed", "7", "1234"},
      {[](Config& c) { c.model.d_model = 128; }, "model.d_model", "128", "256"},
      {[](Config& c) { c.parallel.dp = 2; c.train.batch_size = 16; }, "parallel.dp", "2", "1"},
      {[](Config& c) { c.data.train_path = "other.bin"; }, "data.train_path", "\"other.bin\"", "\"data/kjv/train.bin\""},
      {[](Config& c) { c.train.precision = "bf16"; }, "train.precision", "\"bf16\"", "\"fp32\""},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.key);
    Config c;
    if (world().rank() == odd) k.edit(c);
    const std::string msg = agreement_error(c);
    const std::string want = "rank " + std::to_string(odd) + " runs with " + k.key + " = " + k.odd_value +
                             ", rank 0 with " + k.rank0_value;
    EXPECT_NE(msg.find(want), std::string::npos) << "rank " << world().rank() << ": " << msg;
  }
}

}  // namespace
}  // namespace moe::test
