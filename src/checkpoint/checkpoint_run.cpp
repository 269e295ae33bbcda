// Train-loop glue (resume, periodic saves), the CRC-32C and the state hash.
#include <array>
#include "kernels/host_view.h"
#include <chrono>
#include <cstring>
#include <filesystem>
#include <ostream>

#include "checkpoint/checkpoint.h"
#include "core/check.h"
#include "core/fnv1a.h"
#include "parallel/communicator.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/process_groups.h"

namespace moe {
namespace fs = std::filesystem;

CheckpointInfo resume_latest(const std::string& dir, const TrainingState& run, std::ostream& log) {
  std::vector<std::string> all = list_checkpoints(dir);
  MOE_CHECK(!all.empty(), "--resume: no complete checkpoint in '", dir, "'");
  std::string errors;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      return load_checkpoint(*it, run);
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      if (msg.find("cannot resume") != std::string::npos) throw;  // a config mismatch: no fallback
      log << "warning: skipping checkpoint '" << *it << "': " << msg << "\n";
      errors += "\n  " + msg;
    }
  }
  MOE_FAIL("--resume: no checkpoint in '", dir, "' verifies:", errors);
}

uint64_t training_state_hash(const TrainingState& run) {
  uint64_t h = kFnv1aOffset;
  auto mix = [&](const void* data, size_t n) { h = fnv1a(data, n, h); };
  Transformer& m = run.model;
  Backend& ops = m.ops();
  const auto mix_tensor = [&](const Tensor& t) {
    const HostView host(ops, t);
    mix(host.data(), t.nbytes());
  };
  mix_tensor(m.params().flat);
  mix_tensor(run.optimizer.exp_avg());
  mix_tensor(run.optimizer.exp_avg_sq());
  for (const OwnedTensor& b : m.router_bias()) mix_tensor(b.t);
  const int64_t steps = run.steps_taken();
  mix(&steps, sizeof steps);
  return h;
}

std::string checkpoint_dir(const Config& config) {
  return config.checkpoint.dir.empty() ? (fs::path(config.train.out_dir) / "checkpoints").string() : config.checkpoint.dir;
}

SavedCheckpoint maybe_save_checkpoint(const Config& config, const TrainingState& run, int64_t step, int64_t next_instance,
                                      bool last, const DataAnchor& anchor, double elapsed_s, std::ostream& log) {
  const CheckpointConfig& cc = config.checkpoint;
  const bool periodic = cc.every > 0 && step % cc.every == 0;
  if (!periodic && !(last && cc.at_end)) return {};
  SaveOptions o;
  o.keep_last = cc.keep_last;
  o.anchor = anchor;
  o.elapsed_s = elapsed_s;
  const auto t0 = std::chrono::steady_clock::now();
  SavedCheckpoint saved;
  saved.path = save_checkpoint(checkpoint_dir(config), run, next_instance, o);
  saved.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& e : fs::directory_iterator(saved.path)) saved.bytes += e.file_size();
  if (last || step % config.train.log_every == 0)
    log << "checkpoint " << saved.path << " (" << static_cast<double>(saved.bytes) / 1e6 << " MB in " << saved.seconds
        << " s)\n" << std::flush;
  return saved;
}

CheckpointInfo begin_checkpointing(const Config& config, const TrainingState& run, bool resume, std::ostream& log) {
  const std::string dir = checkpoint_dir(config);
  if (!resume) {
    Communicator* world = run.groups ? run.groups->world : nullptr;
    const std::vector<std::string> earlier = list_checkpoints(dir);
    if (world) world->barrier();  // every rank listed the directory before rank 0 moves it
    if (!earlier.empty() && (!world || world->rank() == 0)) {  // a fresh run must not prune (or be mixed with) an earlier run's checkpoints
      const std::string aside = fs::path(dir).lexically_normal().string() + ".previous";
      fs::remove_all(aside);
      fs::rename(dir, aside);
      log << "warning: '" << dir << "' held " << earlier.size() << " checkpoint(s) of an earlier run (latest "
          << fs::path(earlier.back()).filename().string() << "); moved to '" << aside
          << "' (pass --resume to continue a run)\n";
    }
    if (world) world->barrier();
    return {};
  }
  const auto t0 = std::chrono::steady_clock::now();
  CheckpointInfo start = resume_latest(dir, run, log);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log << "resumed from " << start.path << " (step " << start.step << ", next instance " << start.next_instance
      << ", verified and loaded in " << seconds << " s)\n";
  for (const std::string& w : start.warnings) log << "warning: " << w << "\n";
  return start;
}

}  // namespace moe
