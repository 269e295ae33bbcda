#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/phase_timer.h"
#include "kernels/host_view.h"
#include "kernels/math/step_control_math.h"
#include "kernels/step_control.h"
#include "plan/memory.h"
#include "optim/schedule.h"

namespace moe {

Trainer::Trainer(const Config& config, Backend& ops, DType compute, ProcessGroups* groups)
    : config_(config), ops_(ops), groups_(groups) {
  config_.validate();
  check_interleave(config_);
  windows_ = config_.model.attention_windows();
  const Layout layout = layout_from_config(config_.parallel);
  MOE_CHECK(groups_ || layout.world() == 1, "parallel.dp x parallel.pp = ", layout.world(),
            " ranks, but this is a single process (launch with mpirun -np ", layout.world(), ")");
  skip_nonfinite_ = config_.train.on_nonfinite == "skip";
  const ParamLayout whole(config_.model);
  for (const ParamInfo& p : whole.entries()) global_param_names_.push_back(p.name);
  if (groups_)
    MOE_CHECK(groups_->layout.dp == layout.dp && groups_->layout.ep == layout.ep && groups_->layout.pp == layout.pp,
              "process groups were built for another layout than [parallel]");
  const ModelOptions o = model_options(config_, compute, groups_);
  try {
    model_ = std::make_unique<Transformer>(config_.model, config_.loss, o, ops_);
    model_->init_params(config_.train.seed);
    sync_ = std::make_unique<GradSync>(ops_, model_->layout(), groups_, config_.parallel.zero1,
                                       config_.parallel.overlap_grad_reduce);
    parallel_ = parallelize(*model_, config_, groups_, *sync_, ops_);
    const AllocationScope scope("AdamW moments");
    optim_ = std::make_unique<AdamW>(ops_, model_->layout(), config_.optim, compute, sync_->owned_ranges());
    const AllocationScope stats_scope("step statistics");
    stats_ = model_->make_stats();
  } catch (const Error& e) {
    // Out of device memory names the component (the backend's message); add this rank's estimate.
    if (std::string(e.what()).find("out of device memory") == std::string::npos) throw;
    MOE_FAIL(e.what(), "; this rank's estimate is ", estimate_memory(config_).total() / (1 << 30),
             " GiB in all (moecore config lists it by component)");
  }
  // The learning rate of every optimizer step n = 1 .. steps (+1: a skipped last step still
  // reports one), read on the device by step_control.
  std::vector<double> lr(static_cast<size_t>(config_.train.steps + 2), 0.0);
  for (size_t n = 1; n < lr.size(); ++n)
    lr[n] = learning_rate(config_.optim, config_.train.steps, static_cast<int64_t>(n));
  lr_table_ = OwnedTensor(ops_, DType::kF64, {static_cast<int64_t>(lr.size())});
  ops_.upload(lr.data(), lr_table_.t);
  pipeline_ = std::make_unique<Pipeline>(*model_, groups_ ? groups_->pp.get() : nullptr);
  // Both record slots at their full size now: a step allocates nothing for its record.
  const auto layers = static_cast<size_t>(stats_.num_moe_layers), E = static_cast<size_t>(config_.model.num_experts);
  for (StepSlot& slot : slots_) {
    slot.host.resize(static_cast<size_t>(stats_.words.numel()));
    slot.r.lbl.reserve(layers);
    slot.r.router_z.reserve(layers);
    slot.r.counts.assign(layers, std::vector<int32_t>(E));
    slot.r.mean_prob.assign(layers, std::vector<double>(E));
    if (!stats_.quant.empty()) slot.r.mx_quant.reserve(layers);
    if (model_->ep_size() > 1) {
      slot.r.ep_drop_fraction.reserve(static_cast<size_t>(stats_.exchange.dim(0)));
      slot.r.ep_rows_received.assign(static_cast<size_t>(stats_.exchange.dim(0)),
                                     std::vector<int64_t>(static_cast<size_t>(model_->ep_size())));
    }
  }
}

void Trainer::forward_loss(const Tensor& ids, const Tensor& labels, const Tensor& out, const Tensor& doc_start) {
  MicroBatch mb;
  mb.ids = on_device(ids, eval_ids_);
  mb.labels = on_device(labels, eval_labels_);
  eval_masks_.build(ops_, windows_, doc_start, ids.dim(0), ids.dim(1));
  eval_masks_.fill(mb, 0, ids.dim(0));
  pipeline_->forward_loss(mb, out);
}

TransferStats Trainer::staged() const {
  TransferStats s = sync_->staged() + pipeline_->staged();
  if (parallel_.exchange) s = s + parallel_.exchange->staged();
  return s;
}

Tensor Trainer::on_device(const Tensor& host, OwnedTensor& slot) {
  if (ops_.host_addressable()) return host;
  if (slot.t.numel() != host.numel() || slot.t.dtype != host.dtype) slot = OwnedTensor(ops_, host.dtype, {host.numel()});
  Tensor t = host;
  t.data = slot.t.data;
  t.device = slot.t.device;
  ops_.upload(host.data, t);
  return t;
}

int64_t Trainer::local_batch() const { return config_.train.batch_size / config_.parallel.dp; }

// The step_control op's own formula (kernels/math/step_control_math.h).
double total_loss(const LossConfig& loss, const StepResult& r) {
  return step_total_loss(r.ce, r.lm_z, r.lbl.data(), static_cast<int64_t>(r.lbl.size()), r.router_z.data(),
                         static_cast<int64_t>(r.router_z.size()), loss.lm_z_coef, loss.lbl_coef, loss.router_z_coef);
}

const StepResult& Trainer::step(const Tensor& ids, const Tensor& labels, const Tensor& doc_start) {
  // The one way a step runs (submit), with nothing left in flight: everything is enqueued --
  // gradients, the step's decisions (step_control) and the update they gate -- and the host
  // reads the outcome once, at the end.
  MOE_CHECK(!in_flight_, "Trainer::step: a submitted step is in flight (collect() it first)");
  submit(ids, labels, doc_start);
  return *collect();
}

const StepResult* Trainer::submit(const Tensor& ids, const Tensor& labels, const Tensor& doc_start) {
  StepSlot& s = slots_[cur_];
  enqueue_step(ids, labels, doc_start, s);
  StepSlot& prev = slots_[cur_ ^ 1];
  cur_ ^= 1;
  if (!in_flight_) {
    in_flight_ = true;
    return nullptr;
  }
  // The step before: read now, while the device works on this one.
  read_step(prev);
  in_flight_ = false;
  if (!resolve(prev.r)) {
    // Non-finite, skipped: the device left this step's update out (the sticky flag). Again, now
    // from the host's count; the first attempt's transfers are the skipped step's, its time this one's.
    const TransferStats wasted = s.r.transfers, wasted_staged = s.r.staged;
    const Event first_from = s.from;
    const double first_host_from = s.host_from;
    enqueue_step(ids, labels, doc_start, s);
    s.from = first_from;
    s.host_from = first_host_from;
    prev.r.transfers = prev.r.transfers + wasted;
    prev.r.staged = prev.r.staged + wasted_staged;
  }
  in_flight_ = true;
  return &prev.r;
}

const StepResult* Trainer::collect() {
  if (!in_flight_) return nullptr;
  StepSlot& s = slots_[cur_ ^ 1];
  read_step(s);
  in_flight_ = false;
  resolve(s.r);
  return &s.r;
}

void Trainer::enqueue_step(const Tensor& ids, const Tensor& labels, const Tensor& doc_start, StepSlot& s) {
  const TransferStats before = ops_.transfers(), staged_before = staged();
  start_clock(s);
  enqueue_gradients(ids, labels, doc_start, s.r, /*counter_from_host=*/!in_flight_);
  enqueue_update();
  enqueue_record(s);
  s.r.staged = staged() - staged_before;
  s.r.transfers = ops_.transfers() - before - s.r.staged;
}

bool Trainer::resolve(StepResult& r) {
  if (r.finite) {
    optim_->set_steps_taken(optim_->steps_taken() + 1);
    return true;
  }
  handle_nonfinite(r);  // the update ops changed nothing
  return false;
}

namespace {
// Element i of a float tensor (f32, f64 or bf16) as double.
double read_real(const Tensor& t, int64_t i) {
  if (t.dtype == DType::kF64) return t.as<double>()[i];
  MOE_CHECK(t.dtype == DType::kF32, "read_real: expected an f32 or f64 tensor");
  return t.as<float>()[i];
}
}  // namespace

std::string Trainer::first_nonfinite_grad() {
  // Only after a non-finite step: the whole gradient is staged to the host (if not host memory).
  const HostView host(ops_, model_->grads().flat);
  const Tensor& flat = host.tensor();
  for (const ParamInfo& p : model_->layout().entries())
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i)
      if (!std::isfinite(read_real(flat, i))) return p.name;
  return "";
}

void Trainer::handle_nonfinite(StepResult& r) {
  const std::string where = r.nonfinite_tensor.empty()
                                ? std::string("the loss terms (all gradients finite)")
                                : "gradient of '" + r.nonfinite_tensor + "' (first offending tensor)";
  MOE_CHECK(skip_nonfinite_, "non-finite values at step ", r.step, ": loss = ", r.total,
            ", grad norm = ", r.grad_norm, ", first in ", where,
            " (no update applied; train.on_nonfinite = \"skip\" skips such steps)");
  r.skipped = true;
  ++skipped_steps_;
}

namespace {
// A fresh record that keeps the vectors' memory (no allocation per step once sizes are known).
void reset_keeping_capacity(StepResult& r) {
  StepResult fresh;
  fresh.lbl.swap(r.lbl);
  fresh.router_z.swap(r.router_z);
  fresh.counts.swap(r.counts);
  fresh.mean_prob.swap(r.mean_prob);
  fresh.ep_drop_fraction.swap(r.ep_drop_fraction);
  fresh.ep_rows_received.swap(r.ep_rows_received);
  fresh.lbl.clear();
  fresh.router_z.clear();
  fresh.ep_drop_fraction.clear();
  fresh.mx_quant.swap(r.mx_quant);
  fresh.mx_quant.clear();
  r = std::move(fresh);  // counts, mean_prob, ep_rows_received: resized and refilled in place
}
}  // namespace

StepResult& Trainer::compute_gradients(const Tensor& ids, const Tensor& labels, const Tensor& doc_start) {
  MOE_CHECK(!in_flight_, "Trainer::compute_gradients: a submitted step is in flight (collect() it first)");
  StepSlot& s = slots_[cur_];
  start_clock(s);
  enqueue_gradients(ids, labels, doc_start, s.r);
  enqueue_record(s);
  read_step(s);
  return s.r;
}

void Trainer::enqueue_step_on_device(const Tensor& ids, const Tensor& labels) {
  MOE_CHECK(!in_flight_, "Trainer::enqueue_step_on_device: a submitted step is in flight (collect() it first)");
  enqueue_gradients(ids, labels, Tensor(), slots_[cur_].r, /*counter_from_host=*/false);
  enqueue_update();
}

void Trainer::enqueue_gradients(const Tensor& ids, const Tensor& labels, const Tensor& doc_start, StepResult& r,
                                bool counter_from_host) {
  const TrainConfig& tc = config_.train;
  const int64_t local = local_batch();
  check_shape(ids, {local, tc.seq_len}, "step ids");
  check_shape(labels, {local, tc.seq_len}, "step labels");
  if (doc_start.data) check_shape(doc_start, {local, tc.seq_len}, "step doc_start");
  reset_keeping_capacity(r);
  // With a step in flight the host has not read its outcome yet: numbered as if it were applied
  // (if it was not, this step is enqueued again: submit()).
  r.step = optim_->steps_taken() + (in_flight_ ? 2 : 1);
  r.tokens = tc.batch_size * tc.seq_len;
  // The loss is normalized by the loss tokens of the whole global step (not a mean of
  // micro-batch means). Labels live in host memory with the batch: no device sync.
  const int32_t* lab = labels.as<int32_t>();
  for (int64_t i = 0; i < labels.numel(); ++i) r.loss_tokens += lab[i] >= 0;
  r.loss_tokens = sync_->sum_over_dp(r.loss_tokens);
  MOE_CHECK(r.loss_tokens > 0, "step ", r.step, ": the batch has no labeled positions");

  // The batch as the backend sees it (uploaded unless the backend's memory is the host's).
  const Tensor d_ids = on_device(ids, batch_ids_), d_labels = on_device(labels, batch_labels_);
  batch_masks_.build(ops_, windows_, doc_start, local, tc.seq_len);
  // The step's decisions start from the host's count of applied updates and a clear non-finite
  // flag once the host has read the last step's outcome; with a step in flight (submit) from the
  // device's count and flag as that step leaves them, so a non-finite step also stops this one.
  if (counter_from_host)
    ops_.fill(stats_.control.slice(kCtlUpdates, kCtlUpdates + 1), static_cast<double>(optim_->steps_taken()));
  if (!in_flight_) ops_.fill(stats_.control.slice(kCtlNonfinite, kCtlNonfinite + 1), 0.0);
  model_->start_gradients();
  model_->zero_stats(stats_);
  if (parallel_.exchange) parallel_.exchange->reset_counts();
  model_->reset_quant_stats();
  const int64_t mbs = tc.micro_batch_size, num_micro = local / mbs, global_micro = tc.batch_size / mbs;
  const bool aux_by_labels = config_.loss.aux_divisor == "labelled";
  std::vector<MicroBatch>& micro = micro_;  // reused: no allocation per step
  micro.resize(static_cast<size_t>(num_micro));
  for (int64_t m = 0; m < num_micro; ++m) {
    const int64_t g = sync_->dp_rank() * num_micro + m;  // index in the global batch
    MicroBatch& mb = micro[static_cast<size_t>(m)];
    mb.ids = d_ids.slice(m * mbs, (m + 1) * mbs);
    mb.labels = d_labels.slice(m * mbs, (m + 1) * mbs);
    batch_masks_.fill(mb, m * mbs, (m + 1) * mbs);
    mb.scales.ce_scale = 1.0 / static_cast<double>(r.loss_tokens);
    mb.scales.stat_weight = 1.0 / static_cast<double>(global_micro);  // equal-size micro-batches: T_m / T_step
    mb.scales.aux_weight = aux_by_labels ? static_cast<double>(mbs * tc.seq_len) / static_cast<double>(r.loss_tokens)
                                         : mb.scales.stat_weight;
    mb.scales.token_base = (r.step - 1) * r.tokens + g * mbs * tc.seq_len;
  }
  sync_->begin_step(model_->grads().flat, num_micro);
  // One stage: F0 B0 F1 B1 ...; pipeline stages: 1F1B with activations and gradients sent between them.
  r.pp_bubble_s = pipeline_->run(micro, stats_);
  model_->grad_writes().zero_unwritten(GradWrites::kEvery);  // what no backward wrote: zeros, not the last step's
  sync_->reduce_stats(stats_);
  sync_->reduce_gradients(model_->grads().flat);
  if (hooks_) hooks_->after_gradients(ops_, model_->layout(), model_->grads().flat, stats_);
  {
    PhaseScope phase(Phase::kOptimizer);  // grad norm and the step's decisions
    sync_->grad_sumsq(model_->grads().flat, stats_.grad_sumsq);
    const LossConfig& lc = config_.loss;
    ops_.step_control(stats_.values, stats_.grad_sumsq, lc.lm_z_coef, lc.lbl_coef, lc.router_z_coef,
                      config_.optim.max_grad_norm, lr_table_.t, stats_.control);
  }
  if (parallel_.exchange) ops_.copy(parallel_.exchange->counts(), stats_.exchange);
  if (!stats_.quant.empty()) ops_.copy(model_->quant_stats(), stats_.quant);
}

namespace {
double host_clock_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void Trainer::start_clock(StepSlot& s) {
  // Back to back behind a step in flight, the stream runs nothing else in between: this step's
  // time starts where that one ends. Otherwise at this step's own start.
  s.from = in_flight_ ? slots_[cur_ ^ 1].done : ops_.record();
  s.host_from = host_clock_s();
}

void Trainer::enqueue_record(StepSlot& s) {
  // Loss terms, the step's decisions, grad norm sums, expert counts, probabilities and exchange
  // counters: the step's one download.
  s.host.resize(static_cast<size_t>(stats_.words.numel()));  // reused: no allocation per step
  ops_.download(stats_.words, s.host.data());
  s.done = ops_.record();
  s.drop_wait = hooks_ && hooks_->read_record_without_wait();
}

void Trainer::read_step(StepSlot& s) {
  if (!s.drop_wait) ops_.wait(s.done);
  StepResult& r = s.r;
  // Stream time while the backend still holds both events' times (a step that recorded more
  // than kEventHistory events: the host's clock since the step was enqueued).
  const uint64_t newest = ops_.record().seq;
  if (!s.drop_wait && newest - s.from.seq < kEventHistory) {
    r.step_s = ops_.elapsed_seconds(s.from, s.done);
  } else {
    r.step_s = host_clock_s() - s.host_from;
  }
  const char* host = reinterpret_cast<const char*>(s.host.data());
  const auto host_real = [&](const Tensor& t, int64_t i) {  // element i of t's downloaded copy
    const char* p = host + stats_.offset_of(t) + static_cast<size_t>(i) * dtype_size(t.dtype);
    if (t.dtype == DType::kF64) {
      double d;
      std::memcpy(&d, p, sizeof d);
      return d;
    }
    MOE_CHECK(t.dtype == DType::kF32, "step statistics: expected f32 or f64, got ", dtype_name(t.dtype));
    float f;
    std::memcpy(&f, p, sizeof f);
    return static_cast<double>(f);
  };
  r.ce = host_real(stats_.values, 0);
  r.lm_z = host_real(stats_.values, 1);
  const int64_t nm = stats_.num_moe_layers, E = config_.model.num_experts;
  r.counts.resize(static_cast<size_t>(nm));
  r.mean_prob.resize(static_cast<size_t>(nm));
  for (int64_t i = 0; i < nm; ++i) {
    r.lbl.push_back(host_real(stats_.values, 2 + i));
    r.router_z.push_back(host_real(stats_.values, 2 + nm + i));
    std::vector<int32_t>& counts = r.counts[static_cast<size_t>(i)];
    counts.resize(static_cast<size_t>(E));
    std::memcpy(counts.data(), host + stats_.offset_of(stats_.counts[static_cast<size_t>(i)]),
                static_cast<size_t>(E) * sizeof(int32_t));
    std::vector<double>& probs = r.mean_prob[static_cast<size_t>(i)];
    probs.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) probs[static_cast<size_t>(e)] = host_real(stats_.mean_prob[static_cast<size_t>(i)], e);
  }
  if (model_->ep_size() > 1) expert_parallel_stats(host, r);
  for (int64_t m = 0; m < (stats_.quant.empty() ? 0 : stats_.quant.dim(0)); ++m) {
    std::array<double, 8> q;
    for (int i = 0; i < 8; ++i) q[static_cast<size_t>(i)] = host_real(stats_.quant, m * 8 + i);
    r.mx_quant.push_back(q);
  }
  r.total = host_real(stats_.control, kCtlLoss);
  r.grad_norm = host_real(stats_.control, kCtlGradNorm);
  r.lr = host_real(stats_.control, kCtlLr);
  r.finite = host_real(stats_.control, kCtlNonfinite) == 0;
  r.clipped = r.finite && host_real(stats_.control, kCtlClipped) != 0;
  if (!r.finite) {
    // The first offending tensor, from the per-parameter sums of squares that came with the
    // download (a NaN or Inf element makes its parameter's sum non-finite; the same name on
    // every rank, since the sums are global): no second read of the gradients.
    for (int64_t p = 0; p < stats_.grad_sumsq.numel(); ++p)
      if (!std::isfinite(host_real(stats_.grad_sumsq, p))) {
        r.nonfinite_tensor = global_param_names_[static_cast<size_t>(p)];
        break;
      }
  }
}

void Trainer::expert_parallel_stats(const char* host, StepResult& r) {
  // The counters, (MoE layers, 4 + ep) i32, arrived with the step's download.
  const int32_t* counters = reinterpret_cast<const int32_t*>(host + stats_.offset_of(stats_.exchange));
  PhaseScope phase(Phase::kCommunication);
  reduce_exchange_stats(counters, stats_.exchange.dim(0), model_->ep_size(), groups_->edp.get(), ep_stats_,
                        r.ep_drop_fraction, r.ep_rows_received);
}

void Trainer::enqueue_update() {
  // Every call reads the device decisions (stats_.control): the clip factor, the LR, AdamW's
  // step, and whether the step is finite (if not, nothing below changes any state).
  PhaseScope phase(Phase::kOptimizer);  // AdamW (clipping and the bf16 copies in its pass), bias update
  // Without ZeRO-1 AdamW updates every parameter here and writes the bf16 operand copies as it
  // goes; with it, the copies wait for the all-gather of the other ranks' chunks.
  const Weights* copies = sync_->zero1() ? nullptr : model_->bf16_operands();
  optim_->step_by_control(ops_, model_->params(), model_->grads(), stats_.control, copies);
  sync_->gather_params(model_->params().flat);
  if (config_.model.router_bias_gamma > 0)
    for (int64_t i = 0; i < stats_.num_moe_layers; ++i)
      ops_.router_bias_update_by_control(stats_.counts[static_cast<size_t>(i)], config_.model.router_bias_gamma,
                                         model_->router_bias()[static_cast<size_t>(i)].t, stats_.control);
  model_->refresh_operand_weights(/*bf16_done=*/copies != nullptr);
}

}  // namespace moe
