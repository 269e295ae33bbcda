// Hugging Face interop: our parameters <-> transformers' OlmoeForCausalLM (model_type olmoe) and
// Olmo-core 3's Olmo3MoeForCausalLM (olmo3moe) checkpoints. Export writes config.json +
// model.safetensors (or shards of at most max_shard_bytes with model.safetensors.index.json) with
// the per-expert keys both use (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight). Import reads those,
// sharded save_pretrained output (model.safetensors.index.json), bf16 files and the fused
// layout (model.layers.L.mlp.experts.gate_up_proj (E, 2F, D), gate rows first, and
// model.layers.L.mlp.experts.down_proj (E, D, F)). Both work on the flat f32 parameter buffer
// of ParamLayout, so they do not care where the parameters come from (fixture, checkpoint,
// a live Trainer).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"

namespace moe {

enum class HfFormat { kOlmoe, kOlmo3moe };
// "olmoe" | "olmo3moe" (the config.json model_type), naming the option on error.
HfFormat hf_format_from_name(const std::string& name);
const char* hf_format_name(HfFormat format);

// What an import read that our config does not hold, carried to the next export in the same
// format: the imported config.json (its fields moecore does not model are written back as they
// were) and the tokenizer files beside it.
struct HfCarried {
  std::string format;       // "olmoe" | "olmo3moe"; "" = nothing carried
  std::string config_json;  // the imported config.json text
  std::map<std::string, std::string> files;  // file name -> bytes (tokenizer.json, ...)
};
// The tokenizer files an import carries when present.
const std::vector<std::string>& hf_tokenizer_files();

struct HfExportOptions {
  HfFormat format = HfFormat::kOlmoe;
  std::string dtype = "f32";                 // f32 | bf16
  int64_t max_shard_bytes = 5'000'000'000;   // larger exports are sharded, with an index
  const HfCarried* carried = nullptr;        // used when its format is this export's
};

// Why OlmoeForCausalLM cannot express this model, or "" if it can.
std::string olmoe_unsupported_reason(const ModelConfig& config);

// config.json text for the model (fixed key order, 2-space indent, trailing newline).
// dtype: "f32" or "bf16". Throws with olmoe_unsupported_reason if the model is not OLMoE.
// Beyond the architecture: bos/eos/pad_token_id from data.bos_id, data.eos_id, model.pad_id
// (null when -1) and max_position_embeddings from model.max_position_embeddings (0: train.seq_len,
// the longest sequence the model was trained on).
std::string hf_config_json(const Config& config, const std::string& dtype);
// The same for either format (olmo3moe: hf_olmo3moe.cpp; refuses by name what it cannot express).
std::string hf_config_json(const Config& config, const HfExportOptions& options);
// generation_config.json: the same token ids, so transformers' generate() stops at the end token.
std::string hf_generation_config_json(const Config& config);

// Writes DIR/config.json, DIR/generation_config.json and DIR/model.safetensors (creating DIR).
// params: the f32 flat buffer in ParamLayout(config.model) layout. Deterministic bytes for the
// same inputs.
void export_hf(const Config& config, const float* params, const std::string& out_dir,
               const std::string& dtype = "f32");
void export_hf(const Config& config, const float* params, const std::string& out_dir, const HfExportOptions& options);

class Transformer;
// The same from a live model's master parameters (f32 or f64 compute dtype); config: the run's
// (model.* must be the model's; token ids and lengths as above).
void export_hf(const Transformer& model, const Config& config, const std::string& out_dir,
               const HfExportOptions& options);
void export_hf(const Transformer& model, const Config& config, const std::string& out_dir,
               const std::string& dtype = "f32");
// Copies imported parameters into a model of the same config (then refreshes its bf16 copies).
void load_into(const std::vector<float>& params, Transformer& model);

// Our config from a config.json text of either format (model_type olmoe or olmo3moe; olmo3moe: a
// missing field takes Olmo3MoeConfig's default). OLMoE: [model], plus data.eos_id and data.bos_id (the
// token ids; model.pad_id and model.max_position_embeddings are in [model]). Refuses fields and
// values we cannot express, naming the field. Other sections keep their defaults. A pad id equal
// to the eos id is dropped, with a line in notes (when given) saying so.
Config config_from_hf_json(const std::string& json_text, std::vector<std::string>* notes = nullptr);

struct HfModel {
  Config config;              // config_from_hf_json
  std::vector<float> params;  // flat, ParamLayout(config.model) layout
  std::vector<std::string> notes;  // what the import changed (e.g. a pad id equal to the eos id dropped)
  HfCarried carried;               // the format, config.json and tokenizer files
};

// Reads DIR (config.json + model.safetensors or model.safetensors.index.json and its shards).
// Every expected tensor must be present exactly once with the expected shape; unknown tensors are
// refused by name.
HfModel import_hf(const std::string& dir);

// The parameters of a safetensors file with our names ("NAME" or, in golden fixtures,
// "param.NAME"), into the flat f32 buffer of ParamLayout(config); shapes are checked.
// what: the key or option that named the file ("train.init_from", "export-hf --from").
std::vector<float> load_our_params(const std::string& path, const ModelConfig& config,
                                   std::string_view what = "parameter file");
class SafetensorsFile;
std::vector<float> load_our_params(const SafetensorsFile& file, const ModelConfig& config);
// Writes our parameters (f32, our names) with the settings they belong to as metadata "config"
// (config JSON: [model] and data.eos_id / data.bos_id; train.init_from checks them, export-hf
// --from writes them).
void save_our_params(const std::string& path, const Config& config, const float* params,
                     const HfCarried* carried = nullptr);
// What save_our_params stored of an import (format "" when the file holds none).
HfCarried load_hf_carried(const SafetensorsFile& file);

}  // namespace moe
