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
#include "train/metrics.h"
#include "train/events.h"
#include "report/live_report.h"
#include "train/run_checks.h"
#include "train/trainer.h"

namespace moe {
namespace {

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// Mean cross-entropy over the first `batches` micro-batches of the validation set (stream
// order), with the same intra-document masking as training.
// Data-parallel ranks split the batches (rank d takes m = d, d + dp, ...) and sum; a rank with
// no batch left in the last round runs one with every label masked, because expert and pipeline
// parallelism need the whole group in every forward.
double validation_loss(Trainer& trainer, const TokenDataset& valid, int64_t batches) {
  const Config& c = trainer.config();
  const int64_t B = c.train.micro_batch_size, S = c.train.seq_len;
  ProcessGroups* g = trainer.groups();
  const int64_t dp = g ? g->layout.dp : 1, d = g ? g->coords.dp : 0;
  OwnedTensor ids(DType::kI32, {B, S}), labels(DType::kI32, {B, S}), doc(DType::kI32, {B, S});
  Backend& ops = trainer.model().ops();
  OwnedTensor sum(ops, DType::kF64, {1});  // the cross-entropy sum, accumulated on the device
  ops.fill(sum.t, 0.0);
  double labeled = 0;
  for (int64_t round = 0; round * dp < batches; ++round) {
    const int64_t m = round * dp + d;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t index = (std::min(m, batches - 1) * B + b) % valid.num_instances();
      valid.instance(index, ids.as<int32_t>() + b * S, labels.as<int32_t>() + b * S);
      if (c.data.intra_doc_mask)
        document_starts(ids.as<int32_t>() + b * S, S, static_cast<int32_t>(c.data.eos_id), doc.as<int32_t>() + b * S);
    }
    if (m >= batches) std::fill(labels.as<int32_t>(), labels.as<int32_t>() + B * S, -1);
    for (int64_t i = 0; i < B * S; ++i) labeled += labels.as<int32_t>()[i] >= 0;
    // Across pipeline stages when pp > 1.
    trainer.forward_loss(ids, labels, sum.t, c.data.intra_doc_mask ? doc.t : Tensor());
  }
  double total[2] = {0, labeled};
  ops.download(sum.t, total);
  ops.wait(ops.record());
  if (g && dp > 1) g->dp->all_reduce_sum(total, 2, DType::kF64);
  return total[0] / total[1];
}

// Fault injection for the failure tests: MOE_INJECT_FAULT="error@R:S" makes world rank R throw
// before step S; "nan@R:S" fills rank R's first parameter with NaN before step S (its replicas
// then disagree, and the non-finite loss must stop every rank); "nangrad@R:S" makes rank R's
// gradient of its first parameter NaN in step S only (a transient fault: with
// train.on_nonfinite = "skip" that one step is skipped and training goes on). Device-discipline
// tests: "nowait@R:S" drops the wait before the host reads step S's statistics (the strict
// backend then hands the host stale bytes), "extraread@R:S" adds one download to step S.
void maybe_inject_fault(Trainer& trainer, int64_t step, int rank) {
  const char* env = std::getenv("MOE_INJECT_FAULT");
  if (env == nullptr) return;
  char kind[16] = {};
  long long r = -1, s = -1;
  MOE_CHECK(std::sscanf(env, "%15[a-z]@%lld:%lld", kind, &r, &s) == 3, "MOE_INJECT_FAULT='", env,
            "': expected error@RANK:STEP, nan@RANK:STEP or nangrad@RANK:STEP");
  if (r != rank || s != step) return;
  if (std::string(kind) == "error") MOE_FAIL("injected fault (MOE_INJECT_FAULT=", env, ")");
  if (std::string(kind) == "nangrad") return trainer.inject_fault(Trainer::Fault::kNanGradient);
  if (std::string(kind) == "nowait") return trainer.inject_fault(Trainer::Fault::kNoWait);
  if (std::string(kind) == "extraread") return trainer.inject_fault(Trainer::Fault::kExtraRead);
  MOE_CHECK(std::string(kind) == "nan", "MOE_INJECT_FAULT: unknown kind '", kind, "'");
  const ParamInfo& p = trainer.model().layout().entries().front();
  trainer.model().ops().fill(param_view(p, trainer.model().params().flat), std::nan(""));
}

// Data, model, resume, then the steps; step_now follows the loop (for the stop event).
TrainSummary train_steps(const Config& config, std::ostream& log, bool resume, ProcessGroups* groups,
                         RunEvents& events, int64_t& step_now) {
  const TrainConfig& tc = config.train;
  const bool rank0 = !groups || groups->world->rank() == 0;
  std::unique_ptr<Backend> ops = make_backend(tc.backend);
  // data.train_path / data.valid_path: one file or several comma-separated, concatenated in order.
  TokenDataset train(split_paths(config.data.train_path), config.data.token_dtype, config.model.vocab_size,
                     tc.seq_len, "data.train_path", config.model.pad_id);
  std::unique_ptr<TokenDataset> valid;
  const std::vector<std::string> valid_paths = split_paths(config.data.valid_path);
  size_t valid_found = 0;
  for (const auto& p : valid_paths) valid_found += path_entry_exists(p) ? 1 : 0;  // a dangling link counts (and fails)
  // No validation file at all means no validation; a partly missing list is an error.
  MOE_CHECK(valid_found == 0 || valid_found == valid_paths.size(), "data.valid_path: ",
            valid_paths.size() - valid_found, " of ", valid_paths.size(), " files missing ('", config.data.valid_path, "')");
  if (valid_found > 0)
    valid = std::make_unique<TokenDataset>(valid_paths, config.data.token_dtype, config.model.vocab_size, tc.seq_len,
                                           "data.valid_path", config.model.pad_id);
  // parallel.communicator = "nccl": tensors go over NCCL groups of the same ranks.
  const std::unique_ptr<DeviceGroups> nccl = device_groups(config.parallel.communicator, groups, *ops);
  if (nccl) groups = &nccl->groups;
  Trainer trainer(config, *ops, DType::kF32, groups);
  const int64_t dp_rank = groups ? groups->coords.dp : 0, dp = config.parallel.dp;
  if (!tc.init_from.empty() && !resume) {
    // Continue training from imported weights (e.g. a Hugging Face OLMoE checkpoint, import-hf).
    const SafetensorsFile file(tc.init_from, "train.init_from");  // read once: settings, then weights
    const InitFromCheck checked = check_init_from(config, file);
    load_into(load_our_params(file, config.model), trainer.model());
    log << "parameters initialized from " << tc.init_from
        << (checked.settings_checked ? " (its stored model settings match this run's)"
                                     : " (it stores no model settings: only tensor shapes were checked)") << "\n";
    for (const std::string& n : checked.notes) log << "  note: " << n << "\n";
  }
  const CheckpointInfo start = begin_checkpointing(config, trainer, resume, log);  // step, data position
  step_now = start.step;
  // The data position is anchored at the last resume (checkpoint.h, DataAnchor).
  const DataAnchor anchor = resume ? DataAnchor{start.step, start.next_instance} : DataAnchor{};
  std::ofstream metrics;
  if (rank0) {
    const std::string metrics_path = tc.out_dir + "/metrics.jsonl";
    MetricsTrim trim;
    if (resume) trim = keep_metrics_through(metrics_path, start.step);  // continue exactly from the checkpoint
    metrics.open(metrics_path, resume ? std::ios::app : std::ios::trunc);
    // config.toml is the config the run started with; a resume with other settings keeps it
    // and writes its own beside it.
    const std::string toml = config_to_toml(config), config_path = tc.out_dir + "/config.toml";
    std::string resume_config;
    if (!resume || !std::filesystem::exists(config_path)) {
      std::ofstream(config_path, std::ios::trunc) << toml;
    } else {
      std::ifstream in(config_path);
      const std::string before((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (before != toml) {
        resume_config = tc.out_dir + "/config.resume_" + checkpoint_name(start.step) + ".toml";
        std::ofstream(resume_config, std::ios::trunc) << toml;
      }
    }
    if (resume) {
      if (trim.dropped + trim.bad_lines > 0)
        log << "metrics.jsonl: dropped " << trim.dropped << " record(s) after step " << start.step
            << (trim.bad_lines ? " and " + std::to_string(trim.bad_lines) + " incomplete line(s)" : "")
            << " (written before the run stopped, past its last checkpoint)\n";
      events.write("resume", {{"step", start.step},
                              {"checkpoint", start.path},
                              {"next_instance", start.next_instance},
                              {"elapsed_s", start.elapsed_s},
                              {"metrics_dropped", trim.dropped},
                              {"metrics_incomplete_lines", trim.bad_lines},
                              {"config_changes", start.warnings},
                              {"config", resume_config}});
    }
  }

  const double flops_per_token = config.model.train_flops_per_token(tc.seq_len);
  log << "moecore train: " << config.model.num_params() << " parameters ("
      << config.model.num_active_matmul_params() << " active matmul), " << flops_per_token / 1e6
      << " MFLOP/token, " << cpu::num_threads() << " threads, " << tc.precision << ", "
      << train.num_instances() << " training instances of " << tc.seq_len << " tokens from "
      << train.num_files() << " file(s)\n";
  if (groups)
    log << "parallel: " << groups->world->size() << " ranks (" << groups->world->backend() << "), pp=" << groups->layout.pp << " x dp=" << groups->layout.dp << " (ep=" << groups->layout.ep << ")"
        << ", " << trainer.local_batch() << " sequences per data-parallel rank\n";
  // MFU's denominator, named in every record (peak_tflops, peak_source) and here.
  const MfuPeak peak = mfu_peak(config, groups ? groups->world : nullptr);
  log << "MFU against " << peak.tflops * 1e3 << " GFLOP/s (" << peak.source << ": " << peak.detail << ")\n";
  if (valid) log << "validation: " << valid->num_instances() << " instances from " << valid->num_files() << " file(s)\n";
  const double act_bytes = trainer.model().activation_bytes_per_token();
  log << "saved activations: " << act_bytes << " bytes/token (" << act_bytes / static_cast<double>(config.model.n_layers)
      << " per layer per token" << (tc.recompute ? ", block recompute on" : "") << ")\n";

  const int64_t local = trainer.local_batch();
  OwnedTensor ids(DType::kI32, {local, tc.seq_len}), labels(DType::kI32, {local, tc.seq_len}),
      doc(DType::kI32, {local, tc.seq_len});
  const bool doc_mask = config.data.intra_doc_mask;
  if (doc_mask) log << "intra-document masking: documents end with token " << config.data.eos_id << "\n";
  InstanceOrder order(train.num_instances(), tc.seed);  // state: the global instance position
  TrainSummary summary;
  summary.steps = start.step;
  const double t_start = now_s();
  // elapsed_s continues from the checkpoint: training seconds stitched across resumes.
  auto elapsed = [&](double t) { return start.elapsed_s + (t - t_start); };
  double t_window = t_start;
  int64_t tokens_window = 0;
  // metrics.report: the page of plots, rank 0 (report/live_report.h).
  report::LiveReport live_report(tc.out_dir, rank0 && config.metrics.report);
  auto write_metrics = [&](const nlohmann::json& j) {
    if (!rank0) return;
    metrics << j.dump() << "\n" << std::flush;
    live_report.record(j);
  };
  auto write_report = [&] {
    const std::string line = live_report.write();
    if (!line.empty()) log << line << "\n" << std::flush;
  };
  // A live progress line, rewritten in place (train.progress; metrics.h show_progress).
  const bool live = rank0 && &log == &std::cout && show_progress(tc.progress, isatty(STDOUT_FILENO), launched_by_mpi());
  bool live_shown = false;
  auto clear_live = [&] {
    if (live_shown) log << "\r\033[K";
    live_shown = false;
  };
  GerrymanderOptions gopt;
  gopt.window = config.metrics.gerrymander_window;
  GerrymanderDetector gerrymander(gopt);
  std::string stop_reason = "completed";

  // train.overlap_host: step n+1 is enqueued before step n's record is read (Trainer::submit),
  // so a record is handled one step late; before a step that evaluates, checkpoints or ends the
  // run, the step in flight is drained (collect) so those see exactly that step's state.
  const bool lag = tc.overlap_host;
  const CheckpointConfig& cc = config.checkpoint;
  const auto drains = [&](int64_t step) {
    return step == tc.steps || (valid && tc.eval_every > 0 && step % tc.eval_every == 0) ||
           (cc.every > 0 && step % cc.every == 0);
  };
  struct InFlight {
    int64_t step = 0, position = 0;
  };
  // One step's record: logs, metrics, evaluation, checkpoint. may_end: the step's state is the
  // model's (nothing in flight), so the time limit may end the run here. Returns true when last.
  const auto handle = [&](const StepResult& r, int64_t step, int64_t position, bool may_end) -> bool {
    tokens_window += r.tokens;
    summary.steps = step;
    if (!r.skipped) summary.final_train_loss = r.ce;
    const double t = now_s();
    const bool vectors = config.metrics.vectors_every > 0 && step % config.metrics.vectors_every == 0;
    nlohmann::json j = step_record(r, elapsed(t), flops_per_token, peak, vectors);
    j["step"] = step;
    const bool out_of_time = may_end && tc.time_limit_s > 0 && t - t_start >= tc.time_limit_s;
    const bool last = step == tc.steps || out_of_time;
    if (out_of_time && step < tc.steps) stop_reason = "time_limit";
    if (r.skipped) {
      j["skipped_total"] = trainer.skipped_steps();
      clear_live();
      log << "step " << step << ": non-finite loss or gradients (first in "
          << (r.nonfinite_tensor.empty() ? "the loss terms" : r.nonfinite_tensor) << "); update skipped ("
          << trainer.skipped_steps() << " skipped so far)\n" << std::flush;
      events.write("skipped", {{"step", step},
                               {"tensor", r.nonfinite_tensor.empty() ? "the loss terms" : r.nonfinite_tensor},
                               {"skipped_total", trainer.skipped_steps()}});
    } else if (!r.counts.empty()) {
      double worst = 0;
      for (const auto& c : r.counts) worst = std::max(worst, load_stats(c).max_over_mean);
      if (auto w = gerrymander.observe(step, sum_of(r.lbl), worst)) {
        clear_live();
        log << *w << "\n" << std::flush;
        j["warning"] = *w;
      }
    }
    if (step % tc.log_every == 0 || last) {
      const double tps = static_cast<double>(tokens_window) / (t - t_window);
      clear_live();
      log << "step " << step << "/" << tc.steps << std::fixed << std::setprecision(4) << " | loss "
          << r.total << " | ce " << r.ce << " | grad " << r.grad_norm << std::scientific
          << std::setprecision(2) << " | lr " << r.lr << std::fixed << std::setprecision(0) << " | "
          << tps << " tok/s" << std::setprecision(3) << " | MFU " << peak.mfu(tps * flops_per_token / 1e12)
          << std::setprecision(1) << " | " << elapsed(t) << " s\n" << std::defaultfloat << std::setprecision(6)
          << std::flush;
      t_window = t;
      tokens_window = 0;
    }
    if (valid && ((tc.eval_every > 0 && step % tc.eval_every == 0) || last)) {
      const double vl = validation_loss(trainer, *valid, tc.eval_batches);
      summary.final_valid_loss = vl;
      j["valid_ce"] = vl;
      clear_live();
      log << "  validation ce " << std::setprecision(std::numeric_limits<double>::max_digits10) << vl
          << std::defaultfloat << std::setprecision(6) << " nats/token\n" << std::flush;
      events.write("eval", {{"step", step}, {"valid_ce", vl}});
    }
    if (live && !last) {
      Progress p;
      p.step = step;
      p.total = tc.steps;
      p.loss = r.total;
      // Pace of this process only: a resumed run counts from its first step.
      p.tokens_per_s = static_cast<double>((step - start.step) * r.tokens) / (t - t_start);
      p.eta_s = eta_seconds(step - start.step, tc.steps - start.step, t - t_start, tc.time_limit_s);
      log << "\r" << format_progress(p) << "\033[K" << std::flush;
      live_shown = true;
    }
    write_metrics(j);
    const SavedCheckpoint saved =
        maybe_save_checkpoint(config, trainer, step, position + tc.batch_size, last, anchor, elapsed(now_s()), log);
    if (!saved.path.empty()) {
      events.write("checkpoint", {{"step", step}, {"path", saved.path}, {"bytes", saved.bytes}, {"seconds", saved.seconds}});
      if (!last) write_report();  // the last step's page follows the stop event
    }
    return last;
  };
  std::optional<InFlight> flight;
  const auto flush_in_flight = [&] {  // the record of the step in flight, if any, handled as not last
    if (!flight) return;
    const InFlight f = *std::exchange(flight, std::nullopt);
    if (const StepResult* r = trainer.collect()) handle(*r, f.step, f.position, false);
  };
  for (int64_t step = start.step + 1; step <= tc.steps; ++step) {
    step_now = step;
    const int64_t position = start.next_instance + (step - start.step - 1) * tc.batch_size;
    if (flight && tc.time_limit_s > 0 && now_s() - t_start >= tc.time_limit_s) {
      // Out of time with a step in flight: it is the last (its state is the model's once read).
      const InFlight f = *std::exchange(flight, std::nullopt);
      step_now = f.step;
      if (const StepResult* r = trainer.collect()) handle(*r, f.step, f.position, true);
      break;
    }
    try {
      fill_batch(train, order, position, ids, labels, dp_rank, dp, doc_mask ? &doc.t : nullptr,
                 static_cast<int32_t>(config.data.eos_id));
      maybe_inject_fault(trainer, step, groups ? groups->world->rank() : 0);
      if (!lag) {
        if (handle(trainer.step(ids, labels, doc_mask ? doc.t : Tensor()), step, position, true)) break;
        continue;
      }
      step_now = flight ? flight->step : step;  // an error now is most likely the record's being read
      const StepResult* previous = trainer.submit(ids, labels, doc_mask ? doc.t : Tensor());
      step_now = step;
      const std::optional<InFlight> before = std::exchange(flight, InFlight{step, position});
      if (previous) handle(*previous, before->step, before->position, false);
    } catch (...) {
      // The step before this one was enqueued and may be fine: record it before the error ends the run.
      try {
        if (trainer.in_flight() && flight && flight->step < step) flush_in_flight();
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
  clear_live();
  if (trainer.skipped_steps() > 0) log << trainer.skipped_steps() << " steps skipped for non-finite values\n";
  summary.seconds = now_s() - t_start;
  summary.tokens_per_s = static_cast<double>((summary.steps - start.step) * tc.batch_size * tc.seq_len) / summary.seconds;
  events.write("stop", {{"step", summary.steps}, {"reason", stop_reason}, {"elapsed_s", elapsed(now_s())}});
  write_report();
  return summary;
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
