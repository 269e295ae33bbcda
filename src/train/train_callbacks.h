// What runs between a training loop's steps besides recording them, in the manner of OLMo-core's
// trainer callbacks: validation (its cross-entropy joins the step's record) and checkpoints
// (after the record is written, so a crash after a save never loses the step it holds).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "data/token_file.h"
#include "train/run_recorder.h"
#include "train/trainer.h"

namespace moe {

// One step as the callbacks see it; the model holds its state (nothing is in flight).
struct StepEnd {
  const StepResult& r;
  int64_t step = 0;
  int64_t next_instance = 0;  // the data position after the step
  bool last = false;          // the run's last step (train.steps, or out of time)
};

class TrainCallback {
 public:
  virtual ~TrainCallback() = default;
  // Whether the step needs the model's own state after it (train.overlap_host drains the step in
  // flight before such a step's record is handled).
  virtual bool needs_model_state(int64_t step) const = 0;
  // The step's record made, not yet written: may add to it.
  virtual void post_step(const StepEnd&, nlohmann::json& /*record*/) {}
  // The step's record written.
  virtual void post_record(const StepEnd&) {}
};

// Mean cross-entropy over the first `batches` micro-batches of the validation set (stream
// order), with the same intra-document masking as training; collective over the trainer's ranks.
double validation_loss(Trainer& trainer, const TokenDataset& valid, int64_t batches);

// Every train.eval_every steps and at the last: validation's cross-entropy (valid_ce).
std::unique_ptr<TrainCallback> validation_callback(Trainer& trainer, const TokenDataset& valid, RunRecorder& recorder);
// Every checkpoint.every steps and at the last (checkpoint.at_end): a checkpoint, its event,
// the report's page (the last step's follows the stop event).
std::unique_ptr<TrainCallback> checkpoint_callback(Trainer& trainer, const DataAnchor& anchor, RunRecorder& recorder);

}  // namespace moe
