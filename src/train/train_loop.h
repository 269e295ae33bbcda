// The `moecore train` loop: data, steps, validation, progress lines and a JSONL metrics file.
#pragma once

#include <iosfwd>

#include "config/config.h"
#include "parallel/process_groups.h"

namespace moe {

struct TrainSummary {
  int64_t steps = 0;
  double final_train_loss = 0;
  double final_valid_loss = -1;  // nats per labeled token; -1 without a validation set
  double tokens_per_s = 0;
  double seconds = 0;
};

// resume: continue from the latest good checkpoint in checkpoint_dir(config).
// Under mpirun/srun (src/parallel/communicator.h launch_world) every rank calls this; the layout
// comes from [parallel] and must match the number of ranks.
TrainSummary run_training(const Config& config, std::ostream& log, bool resume = false);
// The same on given process groups (nullptr: one process); log is written by world rank 0 only.
TrainSummary run_training(const Config& config, std::ostream& log, bool resume, ProcessGroups* groups);

}  // namespace moe
