#include "train/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/check.h"
#include "core/phase_timer.h"

namespace moe {
namespace {
constexpr int kActivationTag = 101, kGradientTag = 102, kFlushTag = 103;
}  // namespace

Pipeline::Pipeline(Transformer& model, Communicator* pp) : model_(model), pp_(pp), comm_(model.ops()) {
  if (pp_ && pp_->size() > 1) {
    stages_ = pp_->size();
    stage_ = pp_->rank();
  } else {
    pp_ = nullptr;
  }
  MOE_CHECK(model_.first_stage() == (stage_ == 0) && model_.last_stage() == (stage_ == stages_ - 1),
            "pipeline stage ", stage_, " of ", stages_, " does not match the model's layer range");
  const auto slots = static_cast<size_t>(model_.pipeline_slots());
  act_sent_.resize(slots);
  grad_sent_.resize(slots);
  act_host_.resize(slots);
  grad_host_.resize(slots);
  if (stage_ > 0)
    for (size_t i = 0; i < slots; ++i) {
      const Tensor& in = model_.stage_input(static_cast<int64_t>(i));
      grad_out_.emplace_back(model_.ops(), in.dtype, std::initializer_list<int64_t>{in.dim(0), in.dim(1)});
    }
}

void Pipeline::receive(const Tensor& t, int64_t from, int tag) {
  PhaseScope phase(Phase::kCommunication);
  const auto t0 = std::chrono::steady_clock::now();
  if (t.data == nullptr) pp_->recv(&flush_token_, 1, DType::kI32, static_cast<int>(from), tag);  // host token
  else comm_.recv(*pp_, t, static_cast<int>(from), tag);
  bubble_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Pipeline::forward(const MicroBatch& mb, int64_t m) {
  const int64_t slot = m % model_.pipeline_slots();
  if (stage_ > 0) receive(model_.stage_input(slot), stage_ - 1, kActivationTag);
  if (stage_ < stages_ - 1) {
    PhaseScope phase(Phase::kCommunication);
    act_sent_[static_cast<size_t>(slot)].wait();  // the slot's output is about to be rewritten
  }
  model_.stage_forward(slot, mb);
  if (stage_ < stages_ - 1) {
    const Tensor& out = model_.stage_output(slot);
    act_sent_[static_cast<size_t>(slot)] =
        comm_.isend(*pp_, out, static_cast<int>(stage_ + 1), kActivationTag, act_host_[static_cast<size_t>(slot)]);
  }
}

void Pipeline::backward(const MicroBatch& mb, int64_t m, StepStats& stats) {
  const auto slot = static_cast<size_t>(m % model_.pipeline_slots());
  if (stage_ < stages_ - 1) {
    receive(model_.stage_grad(), stage_ + 1, kGradientTag);
    // Recompute rewrites the stage output (same values); MPI forbids touching a buffer in flight.
    // The next stage already received it (its gradient just arrived), so this does not block.
    PhaseScope phase(Phase::kCommunication);
    act_sent_[slot].wait();
  }
  if (model_.last_stage()) model_.head_step(static_cast<int64_t>(slot), mb, stats);
  model_.stage_backward(static_cast<int64_t>(slot), mb, stats);
  if (stage_ > 0) {
    {
      PhaseScope phase(Phase::kCommunication);
      grad_sent_[slot].wait();
    }
    const Tensor& dx = model_.stage_grad();
    const Tensor& out = grad_out_[slot].t;
    model_.ops().copy(dx, out);  // stage_grad is rewritten by the next backward while this is in flight
    grad_sent_[slot] = comm_.isend(*pp_, out, static_cast<int>(stage_ - 1), kGradientTag, grad_host_[slot]);
  }
}

void Pipeline::wait_sends() {
  if (!pp_) return;
  PhaseScope phase(Phase::kCommunication);
  wait_all(act_sent_);
  wait_all(grad_sent_);
  wait_all(flush_sent_);
  flush_sent_.clear();
}

double Pipeline::run(const std::vector<MicroBatch>& micro, StepStats& stats) {
  const auto M = static_cast<int64_t>(micro.size());
  MOE_CHECK(pipeline_slots(stages_, stage_, M) <= model_.pipeline_slots(), "pipeline stage ", stage_, " of ",
            stages_, " needs ", pipeline_slots(stages_, stage_, M), " activation slots for ", M,
            " micro-batches; the model has ", model_.pipeline_slots());
  log_.clear();
  bubble_s_ = 0;
  if (static_cast<int64_t>(schedule_micro_) != M) {  // computed once per micro-batch count: no allocation per step
    schedule_ = one_f_one_b(stages_, stage_, M);
    schedule_micro_ = M;
  }
  for (const PipelineAction& a : schedule_) {
    const MicroBatch& mb = micro[static_cast<size_t>(a.micro)];
    if (a.forward) forward(mb, a.micro);
    else backward(mb, a.micro, stats);
    log_.push_back(a.name());
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

void Pipeline::forward_loss(const MicroBatch& mb, const Tensor& out) {
  if (!pp_) {
    model_.forward_loss(mb, out);
    return;
  }
  if (stage_ > 0) receive(model_.stage_input(0), stage_ - 1, kActivationTag);
  {
    PhaseScope phase(Phase::kCommunication);
    act_sent_[0].wait();
  }
  model_.stage_forward(0, mb);
  if (stage_ < stages_ - 1) {
    comm_.send(*pp_, model_.stage_output(0), static_cast<int>(stage_ + 1), kActivationTag);
  } else {
    model_.stage_loss(0, mb.labels, out);
  }
  PhaseScope phase(Phase::kCommunication);
  comm_.broadcast(*pp_, out, static_cast<int>(stages_ - 1));
}

}  // namespace moe
