// Where each Hugging Face tensor of a format goes in our flat parameter buffer (shared by export
// and import, hf_export.cpp and hf_import.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/hf_export.h"
#include "checkpoint/safetensors.h"
#include "model/params.h"

namespace moe::hf {

enum class Kind { kCopy, kFusedGateUp };
// One HF tensor's place in our flat buffer.
struct Target {
  std::string ours;             // our parameter name
  std::vector<int64_t> shape;   // expected HF shape
  int64_t offset = 0;           // element offset in the flat buffer (kCopy)
  int64_t gate_offset = 0, up_offset = 0, F = 0, D = 0, E = 0;  // kFusedGateUp
  Kind kind = Kind::kCopy;
};

// Every HF key the format accepts and where it goes. Routed experts per expert
// (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight); OLMoE also the fused layout
// (mlp.experts.gate_up_proj (E, 2F, D), gate rows first, and mlp.experts.down_proj (E, D, F)).
std::map<std::string, Target> targets(const ModelConfig& c, const ParamLayout& layout, HfFormat format);

std::string shape_str(const std::vector<int64_t>& shape);
// A safetensors tensor of n values from src, f32 or rounded to bf16.
SafetensorsTensorOut make_tensor(const std::string& name, const std::vector<int64_t>& shape, const float* src,
                                 int64_t n, bool bf16);

}  // namespace moe::hf
