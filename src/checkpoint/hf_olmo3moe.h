// Olmo-core 3's Hugging Face model type olmo3moe: config.json both ways and tensor names
// (used by hf_export.cpp; the public entry points are in hf_export.h).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/config.h"

namespace moe {

// Why Olmo3MoeForCausalLM cannot compute this model, or "" if it can.
std::string olmo3moe_unsupported_reason(const ModelConfig& config);
// The config.json object of an export. carried: the config.json an import read (nullptr: none);
// its fields moecore does not model are written back unchanged.
nlohmann::ordered_json olmo3moe_config(const Config& config, const std::string& torch_dtype, const nlohmann::json* carried);
// [model], data.eos_id and data.bos_id from an olmo3moe config.json object; fields it lacks take
// Olmo3MoeConfig's defaults. notes (when given) receive what the import changed or ignored.
Config config_from_olmo3moe(const nlohmann::json& config_json, std::vector<std::string>* notes);
// The olmo3moe tensor name of one of our parameters (routed experts excepted: per expert).
std::string olmo3moe_name_of(const std::string& ours);

}  // namespace moe
