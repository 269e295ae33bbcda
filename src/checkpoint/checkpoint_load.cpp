// Reading a checkpoint: the manifest and every file verified (checkpoint_verify.cpp), then the
// pieces of any layout placed into this rank's parameters and moments.
#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_format.h"
#include "checkpoint/checkpoint_verify.h"
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
using checkpoint_verify::field;
using checkpoint_verify::Verified;

constexpr const char* kFlatTensors[] = {"params", "exp_avg", "exp_avg_sq"};  // piece kinds

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

CheckpointInfo load_checkpoint(const std::string& path, const TrainingState& run) {
  Verified v = checkpoint_verify::verify(path);
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
