#include "train/evaluate.h"

#include <cmath>

#include "core/buffer.h"
#include "core/check.h"
#include "model/attention_masks.h"

namespace moe {

EvalResult evaluate(Transformer& model, const TokenDataset& data, int64_t batch, int64_t batches) {
  const int64_t B = batch, S = data.seq_len();
  MOE_CHECK(data.num_instances() > 0, "evaluate: the dataset has no instance of ", S, " tokens");
  if (batches <= 0) batches = (data.num_instances() + B - 1) / B;
  Backend& ops = model.ops();
  OwnedTensor ids(DType::kI32, {B, S}), labels(DType::kI32, {B, S});          // host
  OwnedTensor d_ids(ops, DType::kI32, {B, S}), d_labels(ops, DType::kI32, {B, S}), sum(ops, DType::kF64, {1});
  AttentionMasks masks;  // sliding windows only (evaluation runs without document masking)
  masks.build(ops, model.config().attention_windows(), Tensor(), B, S);
  ops.fill(sum.t, 0.0);
  EvalResult r;
  for (int64_t m = 0; m < batches; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t index = (m * B + b) % data.num_instances();
      data.instance(index, ids.as<int32_t>() + b * S, labels.as<int32_t>() + b * S);
    }
    for (int64_t i = 0; i < B * S; ++i) r.tokens += labels.as<int32_t>()[i] >= 0;
    ops.upload(ids.t.data, d_ids.t);
    ops.upload(labels.t.data, d_labels.t);
    MicroBatch mb;
    mb.ids = d_ids;
    mb.labels = d_labels;
    masks.fill(mb, 0, B);
    model.forward_loss(mb, sum);
  }
  r.batches = batches;
  double total = 0;
  ops.download(sum.t, &total);
  ops.wait(ops.record());
  r.loss = total / static_cast<double>(r.tokens);
  r.perplexity = std::exp(r.loss);
  return r;
}

}  // namespace moe
