#include "parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/check.h"
#include "core/phase_timer.h"

namespace moe {
namespace {
constexpr int kActivationTag = 101, kGradientTag = 102, kFlushTag = 103;
// Messages to a chunk: a tag per kind and receiving chunk (two chunks of one pair of ranks may
// have messages in flight at once; MPI keeps each tag's messages in order).
int message_tag(int kind, int64_t chunk) { return kind + 8 * static_cast<int>(chunk); }
}  // namespace

Pipeline::Pipeline(Transformer& model, Communicator* pp) : model_(model), pp_(pp), comm_(model.ops()) {
  if (pp_ && pp_->size() > 1) {
    stages_ = pp_->size();
    stage_ = pp_->rank();
  } else {
    pp_ = nullptr;
  }
  chunks_ = model_.pipeline_chunks();
  MOE_CHECK(model_.first_stage() == (stage_ == 0) && model_.last_stage() == (stage_ == stages_ - 1),
            "pipeline stage ", stage_, " of ", stages_, " does not match the model's layer range");
  MOE_CHECK(chunks_ == 1 || stages_ > 1, "interleaved pipelining (", chunks_, " chunks) needs two or more stages");
  const auto chunks = static_cast<size_t>(chunks_);
  act_sent_.resize(chunks);
  grad_sent_.resize(chunks);
  act_host_.resize(chunks);
  grad_host_.resize(chunks);
  grad_out_.resize(chunks);
  for (int64_t c = 0; c < chunks_; ++c) {
    const auto k = static_cast<size_t>(c), slots = static_cast<size_t>(model_.pipeline_slots(c));
    act_sent_[k].resize(slots);
    grad_sent_[k].resize(slots);
    act_host_[k].resize(slots);
    grad_host_[k].resize(slots);
    if (!model_start(c) && pp_)
      for (size_t i = 0; i < slots; ++i) {
        const Tensor& in = model_.stage_input(c, static_cast<int64_t>(i));
        grad_out_[k].emplace_back(model_.ops(), in.dtype, std::initializer_list<int64_t>{in.dim(0), in.dim(1)});
      }
  }
}

void Pipeline::receive(const Tensor& t, int64_t from, int tag) {
  PhaseScope phase(Phase::kCommunication);
  const auto t0 = std::chrono::steady_clock::now();
  if (t.data == nullptr) pp_->recv(&flush_token_, 1, DType::kI32, static_cast<int>(from), tag);  // host token
  else comm_.recv(*pp_, t, static_cast<int>(from), tag);
  bubble_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Pipeline::forward(const MicroBatch& mb, int64_t chunk, int64_t m) {
  const int64_t slot = m % model_.pipeline_slots(chunk);
  const auto c = static_cast<size_t>(chunk), k = static_cast<size_t>(slot);
  if (!model_start(chunk)) receive(model_.stage_input(chunk, slot), prev_rank(), message_tag(kActivationTag, chunk));
  if (!model_end(chunk)) {
    PhaseScope phase(Phase::kCommunication);
    act_sent_[c][k].wait();  // the slot's output is about to be rewritten
  }
  const auto t0 = std::chrono::steady_clock::now();
  model_.stage_forward(chunk, slot, mb);
  forward_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!model_end(chunk)) {
    const Tensor& out = model_.stage_output(chunk, slot);
    act_sent_[c][k] = comm_.isend(*pp_, out, next_rank(), message_tag(kActivationTag, next_chunk(chunk)), act_host_[c][k]);
  }
}

void Pipeline::backward(const MicroBatch& mb, int64_t chunk, int64_t m, StepStats& stats) {
  const int64_t slot = m % model_.pipeline_slots(chunk);
  const auto c = static_cast<size_t>(chunk), k = static_cast<size_t>(slot);
  if (!model_end(chunk)) {
    receive(model_.stage_grad(), next_rank(), message_tag(kGradientTag, chunk));
    // Recompute rewrites the stage output (same values); MPI forbids touching a buffer in flight.
    // The next stage already received it (its gradient just arrived), so this does not block.
    PhaseScope phase(Phase::kCommunication);
    act_sent_[c][k].wait();
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (model_end(chunk)) model_.head_step(slot, mb, stats);
  model_.stage_backward(chunk, slot, mb, stats);
  backward_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!model_start(chunk)) {
    {
      PhaseScope phase(Phase::kCommunication);
      grad_sent_[c][k].wait();
    }
    const Tensor& dx = model_.stage_grad();
    const Tensor& out = grad_out_[c][k].t;
    model_.ops().copy(dx, out);  // stage_grad is rewritten by the next backward while this is in flight
    grad_sent_[c][k] = comm_.isend(*pp_, out, prev_rank(), message_tag(kGradientTag, prev_chunk(chunk)), grad_host_[c][k]);
  }
}

void Pipeline::wait_sends() {
  if (!pp_) return;
  PhaseScope phase(Phase::kCommunication);
  for (auto& sent : act_sent_) wait_all(sent);
  for (auto& sent : grad_sent_) wait_all(sent);
  wait_all(flush_sent_);
  flush_sent_.clear();
}

double Pipeline::run(const std::vector<MicroBatch>& micro, StepStats& stats) {
  const auto M = static_cast<int64_t>(micro.size());
  log_.clear();
  bubble_s_ = forward_s_ = backward_s_ = 0;
  if (static_cast<int64_t>(schedule_micro_) != M) {  // computed once per micro-batch count: no allocation per step
    schedule_ = interleaved_1f1b(stages_, stage_, M, chunks_);
    schedule_micro_ = M;
    const std::vector<int64_t> need = chunk_slots(schedule_, chunks_);
    for (int64_t c = 0; c < chunks_; ++c)
      MOE_CHECK(need[static_cast<size_t>(c)] <= model_.pipeline_slots(c), "pipeline stage ", stage_, " of ", stages_,
                " needs ", need[static_cast<size_t>(c)], " activation slots in chunk ", c, " for ", M,
                " micro-batches; the model has ", model_.pipeline_slots(c));
  }
  for (const PipelineAction& a : schedule_) {
    const MicroBatch& mb = micro[static_cast<size_t>(a.micro)];
    if (a.forward) forward(mb, a.chunk, a.micro);
    else backward(mb, a.chunk, a.micro, stats);
    log_.push_back(a.name(chunks_ > 1));
  }
  // Cool-down: stage 0's last backward ends the pipeline; the later stages finished earlier and
  // their wait for it is bubble too (the step's next collective would wait as long), so they
  // block on stage 0's end-of-step token here, where the wait is measured.
  if (stages_ > 1) {
    if (stage_ == 0) {
      for (int64_t s = 1; s < stages_; ++s)
        flush_sent_.push_back(pp_->isend(&flush_token_, 1, DType::kI32, static_cast<int>(s), kFlushTag));
    } else {
      receive(Tensor(), 0, kFlushTag);
    }
  }
  wait_sends();
  return bubble_s_;
}

// Each chunk in turn, virtual stage by virtual stage: stage 0's chunk 0 first, the last stage's
// last chunk computes the loss, which then reaches every stage.
void Pipeline::forward_loss(const MicroBatch& mb, const Tensor& out) {
  if (!pp_) {
    model_.forward_loss(mb, out);
    return;
  }
  for (int64_t chunk = 0; chunk < chunks_; ++chunk) {
    if (!model_start(chunk)) receive(model_.stage_input(chunk, 0), prev_rank(), message_tag(kActivationTag, chunk));
    {
      PhaseScope phase(Phase::kCommunication);
      act_sent_[static_cast<size_t>(chunk)][0].wait();
    }
    model_.stage_forward(chunk, 0, mb);
    if (!model_end(chunk))
      comm_.send(*pp_, model_.stage_output(chunk, 0), next_rank(), message_tag(kActivationTag, next_chunk(chunk)));
    else
      model_.stage_loss(0, mb.labels, out);
  }
  PhaseScope phase(Phase::kCommunication);
  comm_.broadcast(*pp_, out, static_cast<int>(stages_ - 1));
}

}  // namespace moe
