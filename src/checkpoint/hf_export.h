// Hugging Face interop: our parameters <-> transformers' OlmoeForCausalLM checkpoints.
// Export writes config.json + model.safetensors with the per-expert keys published OLMoE
// checkpoints use (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight). Import reads those,
// sharded save_pretrained output (model.safetensors.index.json), bf16 files and the fused
// layout (model.layers.L.mlp.experts.gate_up_proj (E, 2F, D), gate rows first, and
// model.layers.L.mlp.experts.down_proj (E, D, F)). Both work on the flat f32 parameter buffer
// of ParamLayout, so they do not care where the parameters come from (fixture, checkpoint,
// a live Trainer).
#pragma once

#include <string>
#include <vector>

#include "config/config.h"

namespace moe {

// Why OlmoeForCausalLM cannot express this model, or "" if it can.
std::string olmoe_unsupported_reason(const ModelConfig& config);

// config.json text for the model (fixed key order, 2-space indent, trailing newline).
// dtype: "f32" or "bf16". Throws with olmoe_unsupported_reason if the model is not OLMoE.
std::string hf_config_json(const ModelConfig& config, const std::string& dtype);

// Writes DIR/config.json and DIR/model.safetensors (creating DIR). params: the f32 flat buffer
// in ParamLayout(config) layout. Deterministic bytes for the same inputs.
void export_hf(const ModelConfig& config, const float* params, const std::string& out_dir,
               const std::string& dtype = "f32");

class Transformer;
// The same from a live model's master parameters (f32 or f64 compute dtype).
void export_hf(const Transformer& model, const std::string& out_dir, const std::string& dtype = "f32");
// Copies imported parameters into a model of the same config (then refreshes its bf16 copies).
void load_into(const std::vector<float>& params, Transformer& model);

// Our ModelConfig from an OLMoE config.json text; refuses fields and values we cannot express,
// naming the field.
ModelConfig model_config_from_hf_json(const std::string& json_text);

struct HfModel {
  ModelConfig config;
  std::vector<float> params;  // flat, ParamLayout(config) layout
};

// Reads DIR (config.json + model.safetensors or model.safetensors.index.json and its shards).
// Every expected tensor must be present exactly once with the expected shape; unknown tensors are
// refused by name.
HfModel import_hf(const std::string& dir);

// The parameters of a safetensors file with our names ("NAME" or, in golden fixtures,
// "param.NAME"), into the flat f32 buffer of ParamLayout(config); shapes are checked.
std::vector<float> load_our_params(const std::string& path, const ModelConfig& config);
// Writes our parameters (f32, our names) with the config JSON as metadata "config".
void save_our_params(const std::string& path, const ModelConfig& config, const float* params);

}  // namespace moe
