#include "train/train_loop.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <unistd.h>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/safetensors.h"
#include "core/buffer.h"
#include "core/build_info.h"
#include "core/user_path.h"
#include "data/token_file.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "train/evaluate.h"
#include "train/events.h"
#include "train/fault_injection.h"
#include "train/run_checks.h"
#include "train/run_recorder.h"
#include "train/train_callbacks.h"
#include "train/trainer.h"

namespace moe {
namespace {

// What the run is, before its first step: sizes, layout, MFU's peak, data, activations.
void log_run_header(const Config& config, Trainer& trainer, const TokenDataset& train, const TokenDataset* valid,
                    const MfuPeak& peak, std::ostream& log) {
  const TrainConfig& tc = config.train;
  ProcessGroups* groups = trainer.groups();
  log << "moecore train: " << config.model.num_params() << " parameters ("
      << config.model.num_active_matmul_params() << " active matmul), "
      << config.model.train_flops_per_token(tc.seq_len) / 1e6 << " MFLOP/token, " << cpu::num_threads()
      << " threads, " << tc.precision << ", " << train.num_instances() << " training instances of " << tc.seq_len
      << " tokens from " << train.num_files() << " file(s)\n";
  if (groups)
    log << "parallel: " << groups->world->size() << " ranks (" << groups->world->backend() << "), pp="
        << groups->layout.pp << " x dp=" << groups->layout.dp << " (ep=" << groups->layout.ep << ")"
        << ", " << trainer.local_batch() << " sequences per data-parallel rank\n";
  log << "MFU against " << peak.tflops * 1e3 << " GFLOP/s (" << peak.source << ": " << peak.detail << ")\n";
  if (valid) log << "validation: " << valid->num_instances() << " instances from " << valid->num_files() << " file(s)\n";
  const double act_bytes = trainer.model().activation_bytes_per_token();
  log << "saved activations: " << act_bytes << " bytes/token (" << act_bytes / static_cast<double>(config.model.n_layers)
      << " per layer per token" << (tc.recompute ? ", block recompute on" : "") << ")\n";
  if (config.data.intra_doc_mask)
    log << "intra-document masking: documents end with token " << config.data.eos_id << "\n";
}

// data.valid_path: one file or several comma-separated, concatenated in order; none at all means
// no validation, a partly missing list is an error.
std::unique_ptr<TokenDataset> open_validation(const Config& config) {
  const std::vector<std::string> valid_paths = split_paths(config.data.valid_path);
  size_t valid_found = 0;
  for (const auto& p : valid_paths) valid_found += path_entry_exists(p) ? 1 : 0;  // a dangling link counts (and fails)
  MOE_CHECK(valid_found == 0 || valid_found == valid_paths.size(), "data.valid_path: ",
            valid_paths.size() - valid_found, " of ", valid_paths.size(), " files missing ('", config.data.valid_path, "')");
  if (valid_found == 0) return nullptr;
  return std::make_unique<TokenDataset>(valid_paths, config.data.token_dtype, config.model.vocab_size,
                                        config.train.seq_len, "data.valid_path", config.model.pad_id);
}

// train.init_from: continue training from imported weights (e.g. a Hugging Face OLMoE checkpoint,
// import-hf), read once: settings, then weights.
void init_from_file(const Config& config, Trainer& trainer, std::ostream& log) {
  const SafetensorsFile file(config.train.init_from, "train.init_from");
  const InitFromCheck checked = check_init_from(config, file);
  load_into(load_our_params(file, config.model), trainer.model());
  log << "parameters initialized from " << config.train.init_from
      << (checked.settings_checked ? " (its stored model settings match this run's)"
                                   : " (it stores no model settings: only tensor shapes were checked)") << "\n";
  for (const std::string& n : checked.notes) log << "  note: " << n << "\n";
}

using Callbacks = std::vector<std::unique_ptr<TrainCallback>>;

// The steps from start to train.steps (or the time limit): each step's batch, the step, its
// record and the callbacks. step_now follows the loop (for the stop event).
TrainSummary run_steps(const Config& config, Trainer& trainer, const TokenDataset& train, RunRecorder& recorder,
                       const Callbacks& callbacks, const CheckpointInfo& start, int64_t& step_now) {
  const TrainConfig& tc = config.train;
  ProcessGroups* groups = trainer.groups();
  const int64_t dp_rank = groups ? groups->coords.dp : 0, dp = config.parallel.dp;
  InjectedFaults faults(groups ? groups->world->rank() : 0);  // MOE_INJECT_FAULT (the failure tests)
  trainer.set_step_hooks(&faults);
  const int64_t local = trainer.local_batch();
  OwnedTensor ids(DType::kI32, {local, tc.seq_len}), labels(DType::kI32, {local, tc.seq_len}),
      doc(DType::kI32, {local, tc.seq_len});
  const bool doc_mask = config.data.intra_doc_mask;
  const Tensor doc_start = doc_mask ? doc.t : Tensor();
  InstanceOrder order(train.num_instances(), tc.seed);  // state: the global instance position
  std::string stop_reason = "completed";
  // One step's record: recorded, then the callbacks. may_end: the step's state is the model's
  // (nothing in flight), so the time limit may end the run here. Returns true when last.
  const auto handle = [&](const StepResult& r, int64_t step, int64_t position, bool may_end) -> bool {
    const double t = now_s();
    const bool out_of_time = may_end && recorder.out_of_time(t);
    const StepEnd end{r, step, position + tc.batch_size, step == tc.steps || out_of_time};
    if (out_of_time && step < tc.steps) stop_reason = "time_limit";
    nlohmann::json record = recorder.record(r, step, end.last, t, trainer.skipped_steps());
    for (const auto& c : callbacks) c->post_step(end, record);
    recorder.write(record, r, step, end.last, t);
    for (const auto& c : callbacks) c->post_record(end);
    return end.last;
  };
  // train.overlap_host: step n+1 is enqueued before step n's record is read (Trainer::submit),
  // so a record is handled one step late; before a step whose callbacks need the model's state,
  // or the last, the step in flight is drained (collect).
  const auto drains = [&](int64_t step) {
    return step == tc.steps ||
           std::any_of(callbacks.begin(), callbacks.end(), [&](const auto& c) { return c->needs_model_state(step); });
  };
  struct InFlight {
    int64_t step = 0, position = 0;
  };
  std::optional<InFlight> flight;
  for (int64_t step = start.step + 1; step <= tc.steps; ++step) {
    step_now = step;
    const int64_t position = start.next_instance + (step - start.step - 1) * tc.batch_size;
    if (flight && recorder.out_of_time(now_s())) {
      // Out of time with a step in flight: it is the last (its state is the model's once read).
      const InFlight f = *std::exchange(flight, std::nullopt);
      step_now = f.step;
      if (const StepResult* r = trainer.collect()) handle(*r, f.step, f.position, true);
      break;
    }
    try {
      fill_batch(train, order, position, ids, labels, dp_rank, dp, doc_mask ? &doc.t : nullptr,
                 static_cast<int32_t>(config.data.eos_id));
      faults.before_step(trainer, step);
      if (!tc.overlap_host) {
        if (handle(trainer.step(ids, labels, doc_start), step, position, true)) break;
        continue;
      }
      step_now = flight ? flight->step : step;  // an error now is most likely the record's being read
      const StepResult* previous = trainer.submit(ids, labels, doc_start);
      step_now = step;
      const std::optional<InFlight> before = std::exchange(flight, InFlight{step, position});
      if (previous) handle(*previous, before->step, before->position, false);
    } catch (...) {
      // The step before this one was enqueued and may be fine: record it before the error ends the run.
      try {
        if (trainer.in_flight() && flight && flight->step < step) {
          const InFlight f = *std::exchange(flight, std::nullopt);
          if (const StepResult* r = trainer.collect()) handle(*r, f.step, f.position, false);
        }
      } catch (...) {
      }
      throw;
    }
    if (drains(step)) {
      const InFlight f = *std::exchange(flight, std::nullopt);
      if (handle(*trainer.collect(), f.step, f.position, true)) break;
    }
  }
  MOE_CHECK(!trainer.in_flight(), "training loop: a step is still in flight at the end");
  return recorder.finish(stop_reason, trainer.skipped_steps());
}

// Data, model, resume, then the steps; step_now follows the loop (for the stop event).
TrainSummary train_steps(const Config& config, std::ostream& log, bool resume, ProcessGroups* groups,
                         RunEvents& events, int64_t& step_now) {
  const TrainConfig& tc = config.train;
  const bool rank0 = !groups || groups->world->rank() == 0;
  std::unique_ptr<Backend> ops = make_backend(tc.backend);
  ops->set_deterministic_attention(tc.deterministic_attention);
  // data.train_path: one file or several comma-separated, concatenated in order.
  TokenDataset train(split_paths(config.data.train_path), config.data.token_dtype, config.model.vocab_size,
                     tc.seq_len, "data.train_path", config.model.pad_id);
  const std::unique_ptr<TokenDataset> valid = open_validation(config);
  // parallel.communicator = "nccl": tensors go over NCCL groups of the same ranks.
  const std::unique_ptr<DeviceGroups> nccl = device_groups(config.parallel.communicator, groups, *ops);
  if (nccl) groups = &nccl->groups;
  Trainer trainer(config, *ops, DType::kF32, groups);
  if (!tc.init_from.empty() && !resume) init_from_file(config, trainer, log);
  const CheckpointInfo start = begin_checkpointing(config, trainer.state(), resume, log);  // step, data position
  step_now = start.step;
  // The data position is anchored at the last resume (checkpoint.h, DataAnchor).
  const DataAnchor anchor = resume ? DataAnchor{start.step, start.next_instance} : DataAnchor{};
  // MFU's denominator, named in every record (peak_tflops, peak_source) and in the log.
  const MfuPeak peak = mfu_peak(config, groups ? groups->world : nullptr);
  RunRecorder recorder(config, log, rank0, resume, start, events, peak);
  log_run_header(config, trainer, train, valid.get(), peak, log);
  Callbacks callbacks;
  if (valid) callbacks.push_back(validation_callback(trainer, *valid, recorder));
  callbacks.push_back(checkpoint_callback(trainer, anchor, recorder));
  return run_steps(config, trainer, train, recorder, callbacks, start, step_now);
}

// The training run on given process groups (nullptr: one process); log is written by world
// rank 0 only. Everything after the start event is recorded in events.jsonl (stop with the
// error's message when it throws).
TrainSummary train(const Config& config, std::ostream& log, bool resume, ProcessGroups* groups) {
  const TrainConfig& tc = config.train;
  const bool rank0 = !groups || groups->world->rank() == 0;
  if (rank0) std::filesystem::create_directories(tc.out_dir);
  RunEvents events(rank0 ? tc.out_dir + "/events.jsonl" : "");
  if (tc.threads > 0) cpu::set_num_threads(static_cast<int>(tc.threads));
  const Layout lay = groups ? groups->layout : Layout{};
  events.write("start", {{"version", moecore_version()},
                         {"git", moecore_git_hash()},
                         {"build", build_description()},
                         {"resume", resume},
                         {"threads", cpu::num_threads()},
                         {"ranks", groups ? groups->world->size() : 1},
                         {"layout", {{"pp", lay.pp}, {"dp", lay.dp}, {"ep", lay.ep}, {"zero1", config.parallel.zero1}}},
                         {"precision", tc.precision},
                         {"backend", tc.backend},
                         {"config_hash", config_hash(config)},
                         {"steps", tc.steps}});
  int64_t step_now = 0;
  try {
    return train_steps(config, log, resume, groups, events, step_now);
  } catch (const std::exception& e) {
    events.write("stop", {{"step", step_now}, {"reason", "error"}, {"message", echo(e.what(), 4096)}});
    throw;
  }
}

}  // namespace

TrainSummary run_training(const Config& config, std::ostream& log, bool resume) {
  // Under mpirun/srun every rank runs this loop; rank 0 alone logs and writes metrics.
  std::unique_ptr<Communicator> world = launch_world();
  // First, before the layout is read: ranks given different configs must not train (or fail
  // later as a truncated message).
  check_ranks_agree(config, *world, /*with_data_files=*/true);
  const Layout layout = layout_from_config(config.parallel);
  validate_layout(layout, world->size(), config.model.num_experts, config.model.n_layers);
  std::unique_ptr<ProcessGroups> groups;
  if (world->size() > 1) groups = std::make_unique<ProcessGroups>(make_process_groups(*world, layout));
  std::ostream quiet(nullptr);
  return train(config, world->rank() == 0 ? log : quiet, resume, groups.get());
}

TrainSummary run_training(const Config& config, std::ostream& log, bool resume, ProcessGroups* groups) {
  if (groups) check_ranks_agree(config, *groups->world, /*with_data_files=*/true);
  return train(config, log, resume, groups);
}

}  // namespace moe
