// Intra-document masking through the whole model: a document packed after another one, with
// its document start passed to attention, gives the same logits and gradients as the document
// alone at the start of a row. RoPE positions stay positions within the instance; attention
// scores depend only on relative positions, so this holds exactly (f64 rounding).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <sstream>

#include "common/test_util.h"
#include "config/config.h"
#include "data/token_file.h"
#include "kernels/ops.h"
#include "train/trainer.h"

namespace moe {
namespace {

Config small_config(const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"model.vocab_size=32", "model.d_model=16", "model.n_layers=2", "model.n_heads=4",
                                "model.n_kv_heads=2", "model.num_experts=4", "model.top_k=2",
                                "model.expert_hidden=12", "model.n_dense_layers=1", "train.seq_len=16",
                                "train.batch_size=2", "train.micro_batch_size=2", "optim.warmup_steps=0",
                                "train.backend=ref", "data.eos_id=0", "data.intra_doc_mask=true"};
  o.insert(o.end(), extra.begin(), extra.end());
  return parse_config("", o);
}

TEST(DocMask, PackedDocumentMatchesTheDocumentAlone) {
  Config c = small_config({});
  std::unique_ptr<Backend> ops = make_backend("ref");
  Trainer trainer(c, *ops, DType::kF64);
  const int64_t S = 16, V = 32;
  // Row 0: doc A (6 tokens, ends with EOS 0) then doc B (10 tokens). Row 1: doc B, then filler.
  const std::vector<int32_t> A = {5, 9, 3, 7, 2, 0}, Bdoc = {4, 8, 8, 1, 6, 11, 13, 2, 9, 0};
  OwnedTensor ids(DType::kI32, {2, S}), doc(DType::kI32, {2, S});
  int32_t* id = ids.as<int32_t>();
  for (int i = 0; i < 6; ++i) id[i] = A[static_cast<size_t>(i)];
  for (int i = 0; i < 10; ++i) id[6 + i] = id[S + i] = Bdoc[static_cast<size_t>(i)];
  for (int i = 10; i < 16; ++i) id[S + i] = 20 + i % 5;
  document_starts(id, S, 0, doc.as<int32_t>());
  document_starts(id + S, S, 0, doc.as<int32_t>() + S);
  EXPECT_EQ(doc.as<int32_t>()[6], 6);
  EXPECT_EQ(doc.as<int32_t>()[S + 10], 10);

  OwnedTensor logits(DType::kF64, {2 * S, V}), plain(DType::kF64, {2 * S, V});
  trainer.model().forward_logits(ids, logits, doc);
  trainer.model().forward_logits(ids, plain);
  double worst = 0, moved = 0;
  for (int i = 0; i < 10; ++i)
    for (int64_t v = 0; v < V; ++v) {
      const double packed = test::get(logits, (6 + i) * V + v), alone = test::get(logits, (S + i) * V + v);
      worst = std::max(worst, std::fabs(packed - alone));
      moved = std::max(moved, std::fabs(test::get(plain, (6 + i) * V + v) - alone));
    }
  EXPECT_LT(worst, 1e-12);  // masked: doc B does not see doc A
  EXPECT_GT(moved, 1e-6);   // unmasked: it does

  // Gradients through the step: masking changes them, and the step is finite.
  OwnedTensor labels(DType::kI32, {2, S});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t s = 0; s + 1 < S; ++s) labels.as<int32_t>()[b * S + s] = id[b * S + s + 1];
    labels.as<int32_t>()[b * S + S - 1] = -1;
  }
  StepResult masked = trainer.compute_gradients(ids, labels, doc);
  StepResult unmasked = trainer.compute_gradients(ids, labels);
  EXPECT_TRUE(std::isfinite(masked.ce));
  EXPECT_NE(masked.ce, unmasked.ce);
}

}  // namespace
}  // namespace moe
