// Reading a checkpoint: the manifest and every file verified (sizes, checksums, the data
// position), then the pieces of any layout placed into this rank's parameters and moments.
#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_format.h"
#include "checkpoint/safetensors.h"
#include "core/check.h"
#include "core/user_path.h"
#include "model/transformer.h"
#include "optim/adamw.h"

namespace moe {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using namespace checkpoint_format;  // the format both sides share

constexpr const char* kFlatTensors[] = {"params", "exp_avg", "exp_avg_sq"};  // piece kinds

std::vector<unsigned char> read_file(const std::string& path) {
  check_input_file(path, "checkpoint file", /*allow_empty=*/true);  // sizes are checked against the manifest
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open '", path, "'");
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return bytes;
}

// ---- manifest -----------------------------------------------------------------------------------
template <class T> T field(const json& j, const char* key, const std::string& where) {
  MOE_CHECK(j.is_object() && j.contains(key), "malformed manifest '", where, "': missing '", key, "'");
  try {
    return j.at(key).get<T>();
  } catch (const std::exception& e) {
    MOE_FAIL("malformed manifest '", where, "': '", key, "' has the wrong type (", e.what(), ")");
  }
}

json read_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / "manifest.json").string();
  check_input_dir(dir, "checkpoint");
  MOE_CHECK(path_entry_exists(path), "checkpoint '", dir, "' has no manifest.json (incomplete or not a checkpoint)");
  const std::vector<unsigned char> bytes = read_file(path);
  json j;
  try {
    j = json::parse(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    MOE_FAIL("malformed manifest '", path, "': ", e.what());
  }
  MOE_CHECK(j.is_object(), "malformed manifest '", path, "': not a JSON object");
  const std::string stored = field<std::string>(j, "manifest_crc32c", path);
  j.erase("manifest_crc32c");
  const std::string body = j.dump();
  MOE_CHECK(stored == hex32(crc32c(body.data(), body.size())), "manifest '", path,
            "' fails its checksum (stored ", stored, ", computed ", hex32(crc32c(body.data(), body.size())),
            "): corrupted");
  MOE_CHECK(field<std::string>(j, "format", path) == kFormat, "manifest '", path, "': format is not ", kFormat);
  const int version = field<int>(j, "version", path);
  MOE_CHECK(version == kFormatVersion, "manifest '", path, "': format version ", version,
            " is not supported (this build reads version ", kFormatVersion, ")");
  return j;
}

// Model shape and optimizer dtype must match; other differences that change the continuation
// are warnings.
std::vector<std::string> compare_configs(const Config& saved, const Config& now) {
  const json a = json::parse(config_to_json(saved)), b = json::parse(config_to_json(now));
  std::vector<std::string> warnings;
  for (auto& [section, keys] : a.items()) {
    for (auto& [key, value] : keys.items()) {
      const json& other = b.at(section).at(key);
      if (value == other) continue;
      // Values echoed at most kEchoBytes each (a 10 MB path must not make a 10 MB warning line).
      const std::string what =
          section + "." + key + " = " + echo(other.dump()) + " differs from the checkpoint's " + echo(value.dump());
      if (section == "model") MOE_FAIL("cannot resume: ", what, " (the model shape must not change)");
      if (section == "parallel") {  // resharding is supported; only reduction order changes
        warnings.push_back(what + " (layout changed: the same run up to floating-point reduction order)");
        continue;
      }
      const bool benign = section == "checkpoint" || section == "data" ||
                          (section == "train" && (key == "threads" || key == "log_every" || key == "eval_every" ||
                                                  key == "eval_batches" || key == "time_limit_s" || key == "out_dir"));
      if (!benign || (section == "data" && key == "train_path")) warnings.push_back(what + " (resume is not bit-exact)");
    }
  }
  return warnings;
}

// The data position must be where the anchor and batch size put it (CheckpointInfo, DataAnchor).
void check_data_position(const CheckpointInfo& i, const std::string& mpath, bool has_anchor) {
  MOE_CHECK(i.step >= 0, "manifest '", mpath, "': step = ", i.step, " is negative");
  MOE_CHECK(i.next_instance >= 0, "manifest '", mpath, "': data.next_instance = ", i.next_instance, " is negative");
  MOE_CHECK(i.batch_size >= 1, "manifest '", mpath, "': data.batch_size = ", i.batch_size, " (must be at least 1)");
  MOE_CHECK(i.anchor.step >= 0 && i.anchor.step <= i.step, "manifest '", mpath, "': data.anchor_step = ",
            i.anchor.step, " is not in [0, step = ", i.step, "]");
  MOE_CHECK(i.anchor.next_instance >= 0, "manifest '", mpath, "': data.anchor_instance = ", i.anchor.next_instance,
            " is negative");
  const int64_t want = i.anchor.next_instance + (i.step - i.anchor.step) * i.batch_size;
  const std::string anchor = has_anchor ? "data.anchor_instance " + std::to_string(i.anchor.next_instance) +
                                              " at data.anchor_step " + std::to_string(i.anchor.step)
                                        : std::string("(no anchor recorded: 0 at step 0)");
  MOE_CHECK(i.next_instance == want, "manifest '", mpath, "': data.next_instance = ", i.next_instance,
            " disagrees with the run: ", anchor, " + (step ", i.step, " - ", i.anchor.step, ") x data.batch_size ",
            i.batch_size, " = ", want, " (edited, or written by a bug; resuming would train on other data)");
}

struct Verified {
  CheckpointInfo info;
  json manifest;
  // file name -> bytes of its data section start and contents
  std::vector<std::pair<json, std::vector<unsigned char>>> shards;  // manifest entry, file bytes
};

Verified verify(const std::string& dir) {
  Verified v;
  v.manifest = read_manifest(dir);
  const std::string mpath = (fs::path(dir) / "manifest.json").string();
  v.info.path = dir;
  v.info.step = field<int64_t>(v.manifest, "step", mpath);
  const json data = field<json>(v.manifest, "data", mpath);
  v.info.next_instance = field<int64_t>(data, "next_instance", mpath);
  v.info.batch_size = field<int64_t>(data, "batch_size", mpath);
  // Manifests before the anchor was recorded: a run never resumed with another batch size.
  v.info.anchor.step = data.contains("anchor_step") ? field<int64_t>(data, "anchor_step", mpath) : 0;
  v.info.anchor.next_instance = data.contains("anchor_instance") ? field<int64_t>(data, "anchor_instance", mpath) : 0;
  v.info.elapsed_s = v.manifest.contains("elapsed_s") ? field<double>(v.manifest, "elapsed_s", mpath) : 0.0;
  check_data_position(v.info, mpath, data.contains("anchor_step"));
  v.info.config_toml = field<std::string>(v.manifest, "config_toml", mpath);
  const json shards = field<json>(v.manifest, "shards", mpath);
  MOE_CHECK(shards.is_array() && !shards.empty() &&
                static_cast<int64_t>(shards.size()) == field<int64_t>(v.manifest, "world_size", mpath),
            "malformed manifest '", mpath, "': 'shards' must list one file per rank of 'world_size'");
  for (const json& shard : shards) {
    const std::string file = field<std::string>(shard, "file", mpath);
    MOE_CHECK(file.find('/') == std::string::npos && !file.empty() && file[0] != '.', "malformed manifest '",
              mpath, "': bad file name '", file, "'");
    const std::string path = (fs::path(dir) / file).string();
    MOE_CHECK(path_entry_exists(path), "checkpoint '", dir, "': missing file '", file, "' listed in the manifest");
    check_input_file(path, "checkpoint file", /*allow_empty=*/true);
    const uint64_t want = field<uint64_t>(shard, "bytes", mpath);
    const uint64_t have = fs::file_size(path);
    MOE_CHECK(have == want, "checkpoint file '", path, "' is ", have, " bytes, the manifest says ", want,
              have < want ? " (truncated)" : " (extra bytes)");
    std::vector<unsigned char> bytes = read_file(path);
    MOE_CHECK(bytes.size() == want, "checkpoint file '", path, "': short read");
    uint64_t header_len = 0;
    for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(bytes[static_cast<size_t>(i)]) << (8 * i);
    std::map<std::string, SafetensorsEntry> entries;
    try {
      entries = SafetensorsFile(path).entries();
    } catch (const std::exception& e) {
      MOE_FAIL("checkpoint file '", path, "' is not a valid safetensors file: ", e.what());
    }
    for (const json& t : field<json>(shard, "tensors", mpath)) {
      const std::string name = field<std::string>(t, "name", mpath);
      auto it = entries.find(name);
      MOE_CHECK(it != entries.end(), "checkpoint file '", path, "' has no tensor '", name, "'");
      const SafetensorsEntry& e = it->second;
      MOE_CHECK(e.dtype == field<std::string>(t, "dtype", mpath) && e.end - e.begin == field<uint64_t>(t, "bytes", mpath),
                "tensor '", name, "' in '", path, "' does not match the manifest (dtype or size)");
      const unsigned char* p = bytes.data() + 8 + header_len + e.begin;
      const std::string got = hex32(crc32c(p, e.end - e.begin)), stored = field<std::string>(t, "crc32c", mpath);
      MOE_CHECK(got == stored, "tensor '", name, "' in '", path, "' fails its checksum (manifest crc32c ",
                stored, ", file ", got, "): corrupted checkpoint");
    }
    const std::string got = hex32(crc32c(bytes.data(), bytes.size())), stored = field<std::string>(shard, "crc32c", mpath);
    MOE_CHECK(got == stored, "checkpoint file '", path, "' fails its checksum (manifest crc32c ", stored,
              ", file ", got, "): corrupted header");
    v.shards.emplace_back(shard, std::move(bytes));
  }
  return v;
}

// ---- loading ------------------------------------------------------------------------------------
// The config the checkpoint was written with (its manifest's config_toml).
Config saved_config(const Verified& v, const std::string& mpath) {
  Config saved;
  try {
    saved = parse_config(v.info.config_toml, {}, mpath + " config_toml");
  } catch (const std::exception& e) {
    MOE_FAIL("malformed manifest '", mpath, "': its config does not parse: ", e.what());
  }
  return saved;
}

// The optimizer state's dtype and the whole model's parameter list must be this run's.
void check_same_parameters(const json& manifest, const std::string& path, const std::string& mpath,
                           const ParamLayout& whole, const std::string& want_dt) {
  const std::string opt_dt = field<std::string>(field<json>(manifest, "optimizer", mpath), "dtype", mpath);
  MOE_CHECK(opt_dt == want_dt, "cannot resume '", path, "': parameters and optimizer state are ", opt_dt,
            ", this run keeps them in ", want_dt);
  MOE_CHECK(field<int64_t>(manifest, "flat_numel", mpath) == whole.total(), "cannot resume '", path,
            "': the checkpoint holds ", field<int64_t>(manifest, "flat_numel", mpath), " parameters, the model has ",
            whole.total());
  const json params = field<json>(manifest, "params", mpath);
  MOE_CHECK(params.is_array() && params.size() == whole.entries().size(), "cannot resume '", path,
            "': parameter list differs from the model's");
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = whole.entries()[i];
    MOE_CHECK(field<std::string>(params[i], "name", mpath) == p.name &&
                  field<std::vector<int64_t>>(params[i], "shape", mpath) == p.shape &&
                  field<int64_t>(params[i], "offset", mpath) == p.offset,
              "cannot resume '", path, "': parameter '", p.name, "' differs in name, shape or offset");
  }
}

// A piece of a flat tensor (parameters or an Adam moment): whole-model elements [begin, end).
struct FlatPiece {
  int64_t begin, end;
  const unsigned char* data;
};
using FlatPieces = std::array<std::vector<FlatPiece>, 3>;  // by kind (kFlatTensors)

// A router bias tensor ("router_bias.<moe layer>") copied into the host state now.
void load_router_bias(const std::string& name, const std::string& fpath, const SafetensorsEntry& e,
                      const unsigned char* src, HostState& host, std::vector<bool>& bias_loaded) {
  const size_t i = std::stoul(name.substr(12));
  MOE_CHECK(i < host.router_bias.size(), "tensor '", name, "' in '", fpath, "': the model has ",
            host.router_bias.size(), " MoE layers");
  const Tensor& dst = host.router_bias[i].tensor();
  MOE_CHECK(e.dtype == st_dtype(dst.dtype) && e.end - e.begin == dst.nbytes(), "tensor '", name, "' in '",
            fpath, "' has dtype ", e.dtype, " and ", e.end - e.begin, " bytes, expected ", st_dtype(dst.dtype),
            " and ", dst.nbytes());
  std::memcpy(dst.data, src, dst.nbytes());
  bias_loaded[i] = true;
}

// One rank file's tensors: pieces of the flat tensors into the index by kind and whole-model
// range, router biases straight into the host state; anything else is an error.
void index_shard(const std::string& path, const std::string& mpath, const json& shard, const std::vector<unsigned char>& bytes,
                 const ParamLayout& whole, const std::string& want_dt, size_t es, FlatPieces& pieces, HostState& host,
                 std::vector<bool>& bias_loaded) {
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(bytes[static_cast<size_t>(i)]) << (8 * i);
  const std::string fpath = (fs::path(path) / shard.at("file").get<std::string>()).string();
  const std::map<std::string, SafetensorsEntry> entries = SafetensorsFile(fpath).entries();
  for (const json& t : shard.at("tensors")) {
    const std::string name = t.at("name").get<std::string>();
    const SafetensorsEntry& e = entries.at(name);
    const unsigned char* src = bytes.data() + 8 + header_len + e.begin;
    const int64_t b = field<int64_t>(t, "global_begin", mpath), end = field<int64_t>(t, "global_end", mpath);
    const std::string kind = name.substr(0, name.find(':'));
    int k = -1;
    for (int i = 0; i < 3; ++i)
      if (name.find(':') != std::string::npos && kind == kFlatTensors[i]) k = i;
    if (k >= 0) {
      MOE_CHECK(e.dtype == want_dt && 0 <= b && b <= end && end <= whole.total() &&
                    e.end - e.begin == static_cast<size_t>(end - b) * es,
                "tensor '", name, "' in '", fpath, "': range [", b, ", ", end, ") or dtype ", e.dtype, " does not fit");
      pieces[static_cast<size_t>(k)].push_back({b, end, src});
    } else if (name.rfind("router_bias.", 0) == 0) {
      load_router_bias(name, fpath, e, src, host, bias_loaded);
    } else {
      MOE_FAIL("tensor '", name, "' in '", fpath, "' is not part of the training state");
    }
  }
}

// Each kind's pieces in range order; pieces of one kind must not overlap.
void sort_pieces(FlatPieces& pieces, const std::string& path) {
  for (int k = 0; k < 3; ++k) {
    auto& list = pieces[static_cast<size_t>(k)];
    std::sort(list.begin(), list.end(), [](const FlatPiece& a, const FlatPiece& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < list.size(); ++i)
      MOE_CHECK(list[i].begin >= list[i - 1].end, "checkpoint '", path, "': pieces of '", kFlatTensors[k],
                "' overlap at element ", list[i].begin);
  }
}

// Copies whole-model elements [begin, begin + count) of a kind into dst; every element must be
// in some piece (a missing rank file or a gap is an error naming the parameter).
void fill_from_pieces(const FlatPieces& pieces, int k, int64_t begin, int64_t count, unsigned char* dst,
                      const std::string& what, const std::string& path, size_t es) {
  const auto& list = pieces[static_cast<size_t>(k)];
  auto it = std::upper_bound(list.begin(), list.end(), begin, [](int64_t x, const FlatPiece& s) { return x < s.begin; });
  if (it != list.begin()) --it;
  int64_t at = begin;
  for (; it != list.end() && at < begin + count; ++it) {
    if (it->end <= at) continue;
    MOE_CHECK(it->begin <= at, "checkpoint '", path, "': no '", kFlatTensors[k], "' data for ", what, " at element ",
              at - begin);
    const int64_t hi = std::min(it->end, begin + count);
    std::memcpy(dst + static_cast<size_t>(at - begin) * es, it->data + static_cast<size_t>(at - it->begin) * es,
                static_cast<size_t>(hi - at) * es);
    at = hi;
  }
  MOE_CHECK(at == begin + count, "checkpoint '", path, "': '", kFlatTensors[k], "' covers ", at - begin, " of ",
            count, " elements of ", what);
}

// This rank's parameters and Adam moments from the pieces; every router bias of the layers its
// stage holds must have been loaded.
void fill_training_state(const TrainingState& run, const FlatPieces& pieces, const ParamLayout& whole, HostState& host,
                         const std::vector<bool>& bias_loaded, const std::string& path, size_t es) {
  Transformer& model = run.model;
  auto* pbase = static_cast<unsigned char*>(host.params.data());
  for (const ParamInfo& p : model.layout().entries())
    fill_from_pieces(pieces, 0, whole.find(p.name).offset + p.global_begin, p.numel,
                     pbase + static_cast<size_t>(p.offset) * es, "parameter '" + p.name + "'", path, es);
  AdamW& opt = run.optimizer;
  unsigned char* states[2] = {static_cast<unsigned char*>(host.exp_avg.data()),
                              static_cast<unsigned char*>(host.exp_avg_sq.data())};
  for (int k = 1; k < 3; ++k)
    for (const StateSlice& s : opt.slices())
      fill_from_pieces(pieces, k, whole.find(s.param->name).offset + s.param->global_begin + s.param_begin, s.count,
                       states[k - 1] + static_cast<size_t>(s.state_offset) * es, "parameter '" + s.param->name + "'",
                       path, es);
  const ModelConfig& mc = run.config.model;
  for (size_t i = 0; i < bias_loaded.size(); ++i)
    if (model.layout().shard().holds_layer(mc.moe_layer(static_cast<int64_t>(i))))
      MOE_CHECK(bias_loaded[i], "checkpoint '", path, "' has no tensor 'router_bias.", i, "'");
}

}  // namespace

CheckpointInfo verify_checkpoint(const std::string& path) { return verify(path).info; }

CheckpointInfo load_checkpoint(const std::string& path, const TrainingState& run) {
  Verified v = verify(path);
  const std::string mpath = (fs::path(path) / "manifest.json").string();
  v.info.warnings = compare_configs(saved_config(v, mpath), run.config);

  Transformer& model = run.model;
  const DType dt = model.params().flat.dtype;
  // The manifest's layout is the whole model's; this rank may hold any part of it.
  const ParamLayout whole(run.config.model);
  const std::string want_dt = st_dtype(dt);
  check_same_parameters(v.manifest, path, mpath, whole, want_dt);

  // Index every piece by kind and whole-model range, then fill this rank's part from them.
  FlatPieces pieces;
  const size_t es = dtype_size(dt);
  std::vector<bool> bias_loaded(model.router_bias().size(), false);
  HostState host(run, HostView::kWrite);  // every element below is written before commit()
  for (auto& [shard, bytes] : v.shards)
    index_shard(path, mpath, shard, bytes, whole, want_dt, es, pieces, host, bias_loaded);
  sort_pieces(pieces, path);
  fill_training_state(run, pieces, whole, host, bias_loaded, path, es);
  const int64_t steps = field<int64_t>(field<json>(v.manifest, "optimizer", mpath), "steps_taken", mpath);
  MOE_CHECK(steps == v.info.step, "malformed manifest '", mpath, "': optimizer steps_taken ", steps, " != step ", v.info.step);
  host.commit();
  run.optimizer.set_steps_taken(steps);
  model.refresh_operand_weights();
  return v.info;
}

}  // namespace moe
