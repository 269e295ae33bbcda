// Learning-rate schedules: linear warm-up, then cosine, linear, WSD or constant.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace moe {

// LR at optimizer step n = 1, 2, ... (docs/MODEL.md, "Optimizer step").
double learning_rate(const OptimConfig& optim, int64_t total_steps, int64_t n);

}  // namespace moe
