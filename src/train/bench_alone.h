// `moecore bench --alone`: each phase's GEMM and attention kernels timed alone at the shapes the
// step ran them (cpu backend, one process), after the timed steps. Against the phases' own times
// it says how far a phase falls short of its kernels: issue #30 asks, for a step that misses its
// MFU target, each phase's rate against its GEMMs' benchmark rate for its shapes, from the same run.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/phase_timer.h"
#include "kernels/ops.h"

namespace moe {

struct KernelsAlone {
  // Seconds per step by phase: attention (the q, k, v, o projections' forward, data and weight
  // gradients, and the attention kernels), router (its GEMMs), expert_gemm (the routed experts'
  // grouped GEMMs at the step's loads), lm_head_loss (the LM head's GEMMs); 0 elsewhere.
  std::array<double, PhaseTimer::kNum> seconds{};
  std::string not_measured;  // why nothing was measured ("" when measured)
};

// counts: per MoE layer, tokens per expert over the step (StepResult::counts of a timed step);
// each micro-batch's grouped GEMMs run on its share. Every kernel group: once to warm up, then the
// median of 5 rounds of at least 30 ms each (the phases are means over the timed steps).
KernelsAlone time_kernels_alone(const Config& config, Backend& ops, const std::vector<std::vector<int32_t>>& counts);

}  // namespace moe
