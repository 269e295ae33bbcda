// Checkpoints across layouts: a run saved under one layout continues under another and stays on
// the single-process loss curve (f64, 1e-9: reduction order only, see parity_test.cpp); the
// Hugging Face export of a resharded checkpoint has the same bytes as the original's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "parity_common.h"
#include "train/trainer.h"
#include "world.h"

namespace moe::test {
namespace {
namespace fs = std::filesystem;

// A directory every rank agrees on (rank 0's pid), removed by rank 0 at the end.
struct SharedDir {
  explicit SharedDir(const std::string& tag) {
    int32_t pid = ::getpid();
    world().broadcast(&pid, 1, DType::kI32, 0);
    path = (fs::temp_directory_path() / ("moecore_reshard_" + tag + "_" + std::to_string(pid))).string();
    if (world().rank() == 0) fs::remove_all(path);
    world().barrier();
  }
  ~SharedDir() {
    world().barrier();
    if (world().rank() == 0) fs::remove_all(path);
  }
  std::string path;
};

void expect_on_curve(const RunResult& got, const RunResult& ref, size_t first_step, const char* what) {
  for (size_t i = 0; i < got.total.size(); ++i) {
    const size_t s = first_step + i;
    EXPECT_NEAR(got.total[i], ref.total[s], 1e-9 * std::abs(ref.total[s])) << what << ", step " << s + 1;
    EXPECT_NEAR(got.grad_norm[i], ref.grad_norm[s], 1e-9 * ref.grad_norm[s]) << what << ", step " << s + 1;
  }
}

// world size n (2 or 4): dp=n, ep=2 with ZeRO-1 for steps 1-4 -> dp=n/2 (ranks 0..n/2-1) for
// steps 5-6 -> one process for steps 7-8, each loading the previous layout's checkpoint.
TEST(Reshard, CheckpointContinuesUnderOtherLayouts) {
  const int n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  Config base = parity_config();
  base.train.steps = 8;
  std::unique_ptr<Backend> ops = make_backend("ref");
  const RunResult ref = run_single(base, DType::kF64);
  SharedDir dir("continue");

  Config a = base;
  a.parallel.dp = n;
  a.parallel.ep = 2;
  a.parallel.zero1 = true;
  {
    ProcessGroups g = make_process_groups(world(), layout_from_config(a.parallel));
    Trainer t(a, *ops, DType::kF64, &g);
    RunResult r;
    train_steps(t, 0, 4, r);
    expect_on_curve(r, ref, 0, "dp=n zero1");
    save_checkpoint(dir.path + "/a", t.state(), 4 * a.train.batch_size);
  }

  Config b = base;
  b.parallel.dp = n / 2;
  const bool in_b = world().rank() < n / 2;
  std::unique_ptr<Communicator> sub = world().split(in_b ? 0 : 1, world().rank());
  if (in_b) {
    std::unique_ptr<ProcessGroups> g;
    if (b.parallel.dp > 1) g = std::make_unique<ProcessGroups>(make_process_groups(*sub, layout_from_config(b.parallel)));
    Trainer t(b, *ops, DType::kF64, g.get());
    const CheckpointInfo info = load_checkpoint(latest_checkpoint(dir.path + "/a"), t.state());
    EXPECT_EQ(info.step, 4);
    RunResult r;
    train_steps(t, 4, 6, r);
    expect_on_curve(r, ref, 4, "dp=n/2");
    save_checkpoint(dir.path + "/b", t.state(), 6 * b.train.batch_size);
  }
  world().barrier();

  Trainer t(base, *ops, DType::kF64);  // every rank, alone
  EXPECT_EQ(load_checkpoint(latest_checkpoint(dir.path + "/b"), t.state()).step, 6);
  RunResult r;
  train_steps(t, 6, 8, r);
  expect_on_curve(r, ref, 6, "one process");
}

// Interleaved pipelining's checkpoints (each rank two layer chunks) continue in one process, and
// one process's continue interleaved: pp = 2 with 2 chunks per stage for steps 1-3, one process
// for 4-5, interleaved again for 6-8.
TEST(Reshard, InterleavedCheckpointsContinueInOneProcessAndBack) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  Config base = parity_config();
  base.train.steps = 8;
  std::unique_ptr<Backend> ops = make_backend("ref");
  const RunResult ref = run_single(base, DType::kF64);
  SharedDir dir("interleaved");
  Config a = base;
  a.parallel.pp = 2;
  a.parallel.pp_interleave = 2;
  ProcessGroups g = make_process_groups(world(), layout_from_config(a.parallel));
  {
    Trainer t(a, *ops, DType::kF64, &g);
    RunResult r;
    train_steps(t, 0, 3, r);
    expect_on_curve(r, ref, 0, "interleaved");
    save_checkpoint(dir.path + "/a", t.state(), 3 * a.train.batch_size);
  }
  if (world().rank() == 0) {
    Trainer t(base, *ops, DType::kF64);
    EXPECT_EQ(load_checkpoint(latest_checkpoint(dir.path + "/a"), t.state()).step, 3);
    RunResult r;
    train_steps(t, 3, 5, r);
    expect_on_curve(r, ref, 3, "one process");
    save_checkpoint(dir.path + "/b", t.state(), 5 * base.train.batch_size);
  }
  world().barrier();
  Trainer t(a, *ops, DType::kF64, &g);
  EXPECT_EQ(load_checkpoint(latest_checkpoint(dir.path + "/b"), t.state()).step, 5);
  RunResult r;
  train_steps(t, 5, 8, r);
  expect_on_curve(r, ref, 5, "interleaved again");
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A single-process checkpoint, loaded and saved again by a distributed layout, exports to the
// same Hugging Face bytes: resharding moves every parameter bit.
TEST(Reshard, HfExportOfAReshardedCheckpointIsByteIdentical) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "needs two or more ranks";
  Config base = parity_config();
  base.model.n_dense_layers = 0;      // OLMoE: every layer MoE,
  base.model.router_bias_gamma = 0;   // no router bias
  std::unique_ptr<Backend> ops = make_backend("cpu");
  SharedDir dir("export");
  Trainer single(base, *ops, DType::kF32);
  RunResult r;
  train_steps(single, 0, 3, r);
  if (world().rank() == 0) save_checkpoint(dir.path + "/single", single.state(), 3 * base.train.batch_size);
  world().barrier();

  // Layouts: EP=2 (dp=2), PP=2 (dp=n/2); at 4 ranks also PP=2 x DP=2 x EP=2 with ZeRO-1.
  std::vector<ParallelConfig> layouts(2);
  layouts[0].dp = 2;
  layouts[0].ep = 2;
  layouts[1].pp = 2;
  layouts[1].dp = n / 2;
  if (n == 4) {
    ParallelConfig all;
    all.pp = 2;
    all.dp = 2;
    all.ep = 2;
    all.zero1 = true;
    layouts.push_back(all);
  }
  for (size_t i = 0; i < layouts.size(); ++i) {
    Config d = base;
    d.parallel = layouts[i];
    const int64_t world_needed = d.parallel.dp * d.parallel.pp;
    const bool in = world().rank() < world_needed;
    std::unique_ptr<Communicator> sub = world().split(in ? 0 : 1, world().rank());
    const std::string out = dir.path + "/dist" + std::to_string(i);
    if (in) {
      ProcessGroups g = make_process_groups(*sub, layout_from_config(d.parallel));
      Trainer dist(d, *ops, DType::kF32, &g);
      load_checkpoint(latest_checkpoint(dir.path + "/single"), dist.state());
      save_checkpoint(out, dist.state(), 3 * base.train.batch_size);
    }
    world().barrier();
    if (world().rank() != 0) continue;
    for (const std::string& name : {std::string("single"), "dist" + std::to_string(i)}) {
      Trainer back(base, *ops, DType::kF32);
      load_checkpoint(latest_checkpoint(dir.path + "/" + name), back.state());
      export_hf(back.model(), back.config(), dir.path + "/hf_" + name, "bf16");
    }
    for (const char* f : {"config.json", "model.safetensors"}) {
      const std::string x = file_bytes(dir.path + "/hf_single/" + f),
                        y = file_bytes(dir.path + "/hf_dist" + std::to_string(i) + "/" + f);
      EXPECT_FALSE(x.empty()) << f;
      EXPECT_TRUE(x == y) << f << " differs after resharding through layout " << i;
    }
  }
}

}  // namespace
}  // namespace moe::test
