// Validation loss and perplexity of an in-memory model over a token dataset.
#pragma once

#include <cstdint>

#include "data/token_file.h"
#include "model/transformer.h"

namespace moe {

struct EvalResult {
  double loss = 0;        // mean cross-entropy, nats per labeled token
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // labeled tokens evaluated
  int64_t batches = 0;
};

// Forward-only cross-entropy over `batches` micro-batches of shape (batch, seq_len) (the
// model's micro-batch shape), instances taken in file order starting at instance 0 and wrapping
// around; batches <= 0 evaluates every instance once (the last micro-batch wraps to fill up).
EvalResult evaluate(Transformer& model, const TokenDataset& data, int64_t batch, int64_t batches);

}  // namespace moe
