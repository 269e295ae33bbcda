// The `moecore train` loop: data, steps, validation, progress lines and a JSONL metrics file.
#pragma once

#include <iosfwd>

#include "config/config.h"

namespace moe {

struct TrainSummary {
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_valid_loss = -1;  // nats per labeled token; -1 without a validation set
  double tokens_per_s = 0;
  double seconds = 0;
};

// resume: continue from the latest good checkpoint in checkpoint_dir(config).
TrainSummary run_training(const Config& config, std::ostream& log, bool resume = false);

}  // namespace moe
