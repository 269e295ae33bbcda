// model.pad_id behaves as transformers' padding_idx: the padding row of the embedding starts at
// zero and gets no gradient from the embedding lookup (so only weight decay moves it, exactly
// as torch's AdamW does with a zero gradient), positions whose next token is the pad carry no
// label, and everything else trains as usual. Checked over several optimizer steps with weight
// decay on the embedding, untied and tied (tied: the LM head's gradient still reaches the row).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/small_config.h"
#include "common/test_util.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "model/params.h"
#include "train/trainer.h"

namespace moe {
namespace {

constexpr int32_t kPad = 3;

// The shared small model without its shared expert and z-loss, a padding token, and weight decay
// that reaches the embedding.
Config pad_config(bool tied) {
  Config c = test::small_config();
  ModelConfig& m = c.model;
  m.vocab_size = 40;
  m.shared_hidden = 0;
  m.tie_embeddings = tied;
  m.pad_id = kPad;
  c.loss.lm_z_coef = 0;
  c.optim.no_decay_embeddings_norms = false;  // weight decay reaches the embedding
  c.optim.weight_decay = 0.1;
  c.optim.lr = 0.01;
  c.optim.min_lr = 0.001;
  c.train.seq_len = 20;
  return c;
}

// Rows of a step's batch: some left-padded, some with pads inside; labels as the loader makes
// them (-1 where the next token is the pad, and at the last position).
void padded_batch(const Config& c, int64_t step, OwnedTensor& ids, OwnedTensor& labels) {
  const int64_t B = c.train.batch_size, S = c.train.seq_len, V = c.model.vocab_size;
  ids = OwnedTensor(DType::kI32, {B, S});
  labels = OwnedTensor(DType::kI32, {B, S});
  int32_t* id = ids.as<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const double u = random_uniform(11, 5, static_cast<uint64_t>((step * B + b) * S + s));
      int32_t t = static_cast<int32_t>(u * static_cast<double>(V));
      if (t == kPad) t = kPad + 1;
      const bool pad = (b == 0 && s < 6) || (b == 2 && s % 7 == 3);
      id[b * S + s] = pad ? kPad : t;
    }
  for (int64_t i = 0; i < B * S; ++i)
    labels.as<int32_t>()[i] = (i % S == S - 1 || id[i + 1] == kPad) ? -1 : id[i + 1];
}

Tensor embed_row(Transformer& m, Weights& w, int64_t row) {
  const ParamInfo e = m.layout().find("embed");
  return param_view(e, w.flat).slice(row, row + 1);
}

void check_padding(bool tied) {
  SCOPED_TRACE(tied ? "tied embeddings" : "untied embeddings");
  const Config c = pad_config(tied);
  auto ops = make_backend("cpu");
  Trainer trainer(c, *ops, DType::kF32);
  Transformer& model = trainer.model();
  const int64_t D = c.model.d_model;
  // transformers' init zeroes the padding row.
  std::vector<float> row(static_cast<size_t>(D));
  std::memcpy(row.data(), embed_row(model, model.params(), kPad).data, row.size() * 4);
  for (float x : row) EXPECT_EQ(x, 0.0f);
  // Give it values (as an imported checkpoint would have) to watch the weight decay act.
  for (int64_t j = 0; j < D; ++j) row[static_cast<size_t>(j)] = 0.5f - 0.03f * static_cast<float>(j);
  std::memcpy(embed_row(model, model.params(), kPad).data, row.data(), row.size() * 4);
  model.refresh_operand_weights();
  std::vector<float> other_before(static_cast<size_t>(D));
  std::memcpy(other_before.data(), embed_row(model, model.params(), kPad + 1).data, other_before.size() * 4);

  const Tensor no_doc_start;
  for (int64_t step = 0; step < c.train.steps; ++step) {
    OwnedTensor ids, labels;
    padded_batch(c, step, ids, labels);
    const StepResult& r = trainer.step(ids, labels, no_doc_start);  // the gradients stay (clipped) after it
    int64_t labeled = 0;
    for (int64_t i = 0; i < labels.t.numel(); ++i) labeled += labels.as<int32_t>()[i] >= 0;
    EXPECT_EQ(r.loss_tokens, labeled);
    const float* g = static_cast<const float*>(embed_row(model, model.grads(), kPad).data);
    double gmax = 0;
    for (int64_t j = 0; j < D; ++j) gmax = std::max(gmax, std::fabs(static_cast<double>(g[j])));
    // Untied: no gradient at all. Tied: only the LM head's (the pad is never a label, so the
    // head pushes its logit down: a non-zero gradient, as in transformers).
    if (tied) EXPECT_GT(gmax, 0.0) << "step " << step;
    else EXPECT_EQ(gmax, 0.0) << "step " << step;
    ASSERT_FALSE(r.skipped);
    if (!tied)  // torch's AdamW with a zero gradient: p *= (1 - lr * wd); the Adam term is 0
      for (float& x : row) x *= static_cast<float>(1 - r.lr * c.optim.weight_decay);
  }
  const float* now = static_cast<const float*>(embed_row(model, model.params(), kPad).data);
  if (!tied) {
    EXPECT_EQ(std::memcmp(now, row.data(), row.size() * 4), 0) << "the padding row moved by more than weight decay";
    EXPECT_NE(now[0], 0.5f) << "weight decay must still shrink the padding row";
  }
  const float* other = static_cast<const float*>(embed_row(model, model.params(), kPad + 1).data);
  EXPECT_NE(std::memcmp(other, other_before.data(), other_before.size() * 4), 0) << "other rows train";
}

TEST(Padding, PadRowGetsNoGradientAndOnlyWeightDecayOverSteps) { check_padding(false); }
TEST(Padding, TiedEmbeddingsStillTrainThePadRowThroughTheHead) { check_padding(true); }

// The pad id changes nothing but the pad row and the labels: with no pad token in the batch,
// a run with model.pad_id set computes bitwise the same steps as one without (init aside).
TEST(Padding, WithoutPadTokensTheStepIsUnchanged) {
  Config with = pad_config(false), without = pad_config(false);
  without.model.pad_id = -1;
  auto ops = make_backend("cpu");
  Trainer a(with, *ops, DType::kF32), b(without, *ops, DType::kF32);
  std::memcpy(b.model().params().flat.data, a.model().params().flat.data, a.model().params().flat.nbytes());
  b.model().refresh_operand_weights();
  for (int64_t step = 0; step < 3; ++step) {
    OwnedTensor ids, labels;
    padded_batch(with, step, ids, labels);
    for (int64_t i = 0; i < ids.t.numel(); ++i)
      if (ids.as<int32_t>()[i] == kPad) ids.as<int32_t>()[i] = kPad + 2;
    for (int64_t i = 0; i < labels.t.numel(); ++i)
      if (i % with.train.seq_len != with.train.seq_len - 1) labels.as<int32_t>()[i] = ids.as<int32_t>()[i + 1];
    const double la = a.step(ids, labels).total, lb = b.step(ids, labels).total;
    EXPECT_EQ(la, lb) << "step " << step;
  }
  EXPECT_EQ(std::memcmp(a.model().params().flat.data, b.model().params().flat.data, a.model().params().flat.nbytes()), 0);
}

}  // namespace
}  // namespace moe
