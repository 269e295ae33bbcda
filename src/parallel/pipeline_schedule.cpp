#include "parallel/pipeline_schedule.h"

#include <algorithm>

#include "core/check.h"

namespace moe {

std::string PipelineAction::name(bool with_chunk) const {
  std::string s(1, forward ? 'F' : 'B');
  s += std::to_string(micro);
  if (with_chunk) {
    s.push_back('.');
    s += std::to_string(chunk);
  }
  return s;
}

std::vector<PipelineAction> one_f_one_b(int64_t stages, int64_t stage, int64_t micro_batches) {
  return interleaved_1f1b(stages, stage, micro_batches, 1);
}

std::vector<PipelineAction> interleaved_1f1b(int64_t stages, int64_t stage, int64_t micro_batches, int64_t chunks) {
  const int64_t P = stages, M = micro_batches, v = chunks;
  MOE_CHECK(P >= 1 && stage >= 0 && stage < P && M >= 1 && v >= 1, "pipeline schedule: stage ", stage, " of ", P,
            " over ", M, " micro-batches, ", v, " chunks per stage");
  MOE_CHECK(v == 1 || M % P == 0, "interleaved pipeline: ", M, " micro-batches per step are not a multiple of pp = ",
            P, " (the interleaved schedule takes them in groups of pp)");
  // With v = 1 a "group" is every micro-batch: the k-th forward is micro-batch k.
  const int64_t group = v == 1 ? M : P;
  const auto fwd = [&](int64_t k) {
    return PipelineAction{true, (k / (group * v)) * group + k % group, (k / group) % v};
  };
  const auto bwd = [&](int64_t k) {
    return PipelineAction{false, (k / (group * v)) * group + k % group, v - 1 - (k / group) % v};
  };
  const int64_t total = M * v;
  const int64_t warmup = std::min(v == 1 ? P - stage - 1 : (P - stage - 1) * 2 + (v - 1) * P, total);
  std::vector<PipelineAction> order;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) order.push_back(fwd(f));
  while (f < total) {
    order.push_back(fwd(f++));
    order.push_back(bwd(b++));
  }
  while (b < total) order.push_back(bwd(b++));
  return order;
}

int64_t pipeline_slots(int64_t stages, int64_t stage, int64_t micro_batches) {
  return std::min(stages - stage, micro_batches);
}

std::vector<int64_t> chunk_slots(const std::vector<PipelineAction>& order, int64_t chunks) {
  std::vector<int64_t> now(static_cast<size_t>(chunks), 0), most(static_cast<size_t>(chunks), 0);
  for (const PipelineAction& a : order) {
    MOE_CHECK(a.chunk >= 0 && a.chunk < chunks, "pipeline action on chunk ", a.chunk, " of ", chunks);
    const auto c = static_cast<size_t>(a.chunk);
    now[c] += a.forward ? 1 : -1;
    most[c] = std::max(most[c], now[c]);
  }
  return most;
}

std::vector<int64_t> stage_chunk_slots(int64_t stages, int64_t stage, int64_t micro_batches, int64_t chunks) {
  if (chunks == 1) return {pipeline_slots(stages, stage, micro_batches)};
  return chunk_slots(interleaved_1f1b(stages, stage, micro_batches, chunks), chunks);
}

}  // namespace moe
