#include "train/train_callbacks.h"

#include <iomanip>
#include <limits>

#include "core/buffer.h"

namespace moe {

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

namespace {

// Every `every` steps (0: never).
bool every_n(int64_t step, int64_t every) { return every > 0 && step % every == 0; }

class Validation final : public TrainCallback {
 public:
  Validation(Trainer& trainer, const TokenDataset& valid, RunRecorder& recorder)
      : trainer_(trainer), valid_(valid), recorder_(recorder) {}
  bool needs_model_state(int64_t step) const override { return every_n(step, trainer_.config().train.eval_every); }
  void post_step(const StepEnd& s, nlohmann::json& record) override {
    if (!needs_model_state(s.step) && !s.last) return;
    const double vl = validation_loss(trainer_, valid_, trainer_.config().train.eval_batches);
    recorder_.summary().final_valid_loss = vl;
    record["valid_ce"] = vl;
    recorder_.note() << "  validation ce " << std::setprecision(std::numeric_limits<double>::max_digits10) << vl
                     << std::defaultfloat << std::setprecision(6) << " nats/token\n" << std::flush;
    recorder_.events().write("eval", {{"step", s.step}, {"valid_ce", vl}});
  }

 private:
  Trainer& trainer_;
  const TokenDataset& valid_;
  RunRecorder& recorder_;
};

class Checkpoints final : public TrainCallback {
 public:
  Checkpoints(Trainer& trainer, const DataAnchor& anchor, RunRecorder& recorder)
      : trainer_(trainer), anchor_(anchor), recorder_(recorder) {}
  bool needs_model_state(int64_t step) const override { return every_n(step, trainer_.config().checkpoint.every); }
  void post_record(const StepEnd& s) override {
    const SavedCheckpoint saved = maybe_save_checkpoint(trainer_.config(), trainer_.state(), s.step, s.next_instance, s.last,
                                                        anchor_, recorder_.elapsed(now_s()), recorder_.log());
    if (saved.path.empty()) return;
    recorder_.events().write("checkpoint",
                             {{"step", s.step}, {"path", saved.path}, {"bytes", saved.bytes}, {"seconds", saved.seconds}});
    if (!s.last) recorder_.write_report();  // the last step's page follows the stop event
  }

 private:
  Trainer& trainer_;
  DataAnchor anchor_;
  RunRecorder& recorder_;
};

}  // namespace

std::unique_ptr<TrainCallback> validation_callback(Trainer& trainer, const TokenDataset& valid, RunRecorder& recorder) {
  return std::make_unique<Validation>(trainer, valid, recorder);
}

std::unique_ptr<TrainCallback> checkpoint_callback(Trainer& trainer, const DataAnchor& anchor, RunRecorder& recorder) {
  return std::make_unique<Checkpoints>(trainer, anchor, recorder);
}

}  // namespace moe
