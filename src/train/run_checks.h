// Checks before a run trains: every rank runs the same config, build and data; a parameter
// file given by train.init_from was made for the model this run trains.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "parallel/communicator.h"

namespace moe {

// SHA-256 of config_to_toml(config), first 16 hex digits (events.jsonl "config_hash").
std::string config_hash(const Config& config);

// Config keys that may differ between ranks (docs/PARALLEL.md, "Same config, build and data on
// every rank"): train.threads (the result does not depend on it, and nodes may differ in cores).
bool may_differ_between_ranks(const std::string& key);

// What every rank must agree on, as (name, value) pairs: the build (build_description()),
// every resolved config key but the exceptions, and with data files each token file of
// data.train_path and data.valid_path (its size and a hash of its first and last MiB).
std::vector<std::pair<std::string, std::string>> rank_agreement_items(const Config& config, bool with_data_files);

// Collective over world: compares every rank's items with rank 0's and throws on every rank,
// naming the first differing item, the rank and both values. One all-gather of a 64-bit digest
// when all agree.
void check_ranks_agree(const Config& config, Communicator& world, bool with_data_files);

// The model settings a parameter file stores with its weights (import-hf, save_our_params: the
// "config" metadata) against this run's: every model key, plus data.eos_id and data.bos_id.
// changes_function is false for the settings that change nothing the weights compute: init_std
// (the weights replace the initialization), router_bias_gamma (loss-free balancing biases start
// at zero), max_position_embeddings (metadata), pad_id and the token ids (what the run labels and
// masks). Values as config_to_toml writes them.
struct SettingDifference {
  std::string key, run_value, file_value;
  bool changes_function = true;
};
std::vector<SettingDifference> init_from_differences(const Config& run, const Config& stored);
struct InitFromCheck {
  bool settings_checked = false;   // false: the file stores no settings (only tensor shapes are checked)
  std::vector<std::string> notes;  // differences that change no computation: the run's values apply
};
// Throws naming train.init_from, the file and every difference that changes the function
// ("model.rope_theta = 10000.0 (this run) differs from 500000.0 (the file)", with the --set flags
// that adopt the file's values); the others come back as notes for the log.
InitFromCheck check_init_from(const Config& run, const SafetensorsFile& file);

}  // namespace moe
