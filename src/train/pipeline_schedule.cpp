#include "train/pipeline_schedule.h"

#include <algorithm>

#include "core/check.h"

namespace moe {

std::string PipelineAction::name() const {
  std::string s(1, forward ? 'F' : 'B');
  s += std::to_string(micro);
  return s;
}

std::vector<PipelineAction> one_f_one_b(int64_t stages, int64_t stage, int64_t micro_batches) {
  MOE_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1, "1F1B: stage ", stage, " of ",
            stages, " over ", micro_batches, " micro-batches");
  std::vector<PipelineAction> order;
  const int64_t warmup = std::min(stages - stage - 1, micro_batches);
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) order.push_back({true, f});
  while (f < micro_batches) {
    order.push_back({true, f++});
    order.push_back({false, b++});
  }
  while (b < micro_batches) order.push_back({false, b++});
  return order;
}

int64_t pipeline_slots(int64_t stages, int64_t stage, int64_t micro_batches) {
  return std::min(stages - stage, micro_batches);
}

}  // namespace moe
