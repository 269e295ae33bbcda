// `moecore train`'s loop on process groups: data slicing per data-parallel rank, rank-0 metrics,
// collective checkpoints, and a single process resuming a distributed run's checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/rng.h"
#include "parity_common.h"
#include "train/train_loop.h"
#include "world.h"

namespace moe::test {
namespace {
namespace fs = std::filesystem;

// Per step: loss, and validation CE where evaluated (else NaN).
std::vector<std::pair<double, double>> losses(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  std::vector<std::pair<double, double>> out;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    out.emplace_back(j.at("loss").get<double>(), j.contains("valid_ce") ? j.at("valid_ce").get<double>() : std::nan(""));
  }
  return out;
}

TEST(TrainLoop, DistributedRunFollowsOneProcessAndOneProcessResumesIt) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "needs two or more ranks";
  int32_t pid = ::getpid();
  world().broadcast(&pid, 1, DType::kI32, 0);
  const fs::path dir = fs::temp_directory_path() / ("moecore_trainloop_" + std::to_string(pid));
  Config c = parity_config();
  c.data.train_path = (dir / "train.bin").string();
  c.data.valid_path = c.data.train_path;  // validation split over dp ranks (3 batches over 2 or 4)
  c.train.eval_every = 6;
  c.train.eval_batches = 3;
  c.train.steps = 6;
  c.train.log_every = 100;
  c.train.threads = 1;
  c.checkpoint.every = 3;
  c.optim.schedule = "constant";  // the learning rate must not depend on train.steps (6 vs 8)
  if (world().rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::vector<uint16_t> tokens(20000);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<uint16_t>(random_words(5, 0, i)[0] % static_cast<uint32_t>(c.model.vocab_size));
    std::ofstream(c.data.train_path, std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  }
  world().barrier();

  Config dist = c;
  dist.parallel.dp = n;
  dist.parallel.zero1 = true;
  dist.train.out_dir = (dir / "dist").string();
  ProcessGroups g = make_process_groups(world(), layout_from_config(dist.parallel));
  std::ostringstream log;
  run_training(dist, log, false, &g);
  world().barrier();

  if (world().rank() == 0) {
    // One process: the same 6 steps, then 2 more resumed from the distributed run's checkpoint.
    Config one = c;
    one.train.steps = 8;
    one.train.out_dir = (dir / "one").string();
    std::ostringstream log1, log2;
    run_training(one, log1, false, nullptr);
    Config resume = one;
    resume.train.out_dir = dist.train.out_dir;
    run_training(resume, log2, true, nullptr);
    EXPECT_NE(log2.str().find("resumed from"), std::string::npos) << log2.str();
    const auto a = losses(dist.train.out_dir + "/metrics.jsonl"), b = losses(one.train.out_dir + "/metrics.jsonl");
    ASSERT_EQ(a.size(), 8u);  // 6 distributed steps, then 2 resumed (appended)
    ASSERT_EQ(b.size(), 8u);
    // fp32: reduction order differs (see parity_test.cpp), 1e-6 relative.
    for (size_t s = 0; s < 8; ++s) EXPECT_NEAR(a[s].first, b[s].first, 1e-6 * std::abs(b[s].first)) << "step " << s + 1;
    ASSERT_FALSE(std::isnan(a[5].second));  // step 6: validation of the distributed run
    EXPECT_NEAR(a[5].second, b[5].second, 1e-6 * b[5].second);
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace moe::test
