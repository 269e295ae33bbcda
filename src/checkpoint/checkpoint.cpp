#include "checkpoint/checkpoint.h"
#include "kernels/host_view.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>

#include "checkpoint/safetensors.h"
#include "core/check.h"
#include "core/user_path.h"
#include "parallel/communicator.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/process_groups.h"

namespace moe {

int64_t TrainingState::steps_taken() const { return optimizer.steps_taken(); }
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kFormatVersion = 2;  // 2: pieces in whole-model coordinates, any layout
constexpr const char* kFormat = "moecore-checkpoint";
constexpr const char* kFlatTensors[] = {"params", "exp_avg", "exp_avg_sq"};  // piece kinds

// ---- crash points -------------------------------------------------------------------------------
int tensors_written = 0;  // per save, for after_tensor:N

void crash_point(const std::string& name) {
  const char* env = std::getenv("MOE_CRASH_AT");
  if (env != nullptr && name == env) _exit(77);
}
void tensor_written() {
  ++tensors_written;
  crash_point("after_tensor:" + std::to_string(tensors_written));
}

// ---- durable file I/O ---------------------------------------------------------------------------
void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    MOE_CHECK(w > 0, "cannot write '", path, "': ", std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  MOE_CHECK(fd >= 0, "cannot open '", path, "' to fsync: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  MOE_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(err));
}

std::vector<unsigned char> read_file(const std::string& path) {
  check_input_file(path, "checkpoint file", /*allow_empty=*/true);  // sizes are checked against the manifest
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open '", path, "'");
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return bytes;
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

const char* st_dtype(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kE4M3: return "F8_E4M3";
    case DType::kE5M2: return "F8_E5M2";
    case DType::kE8M0: return "F8_E8M0";
  }
  return "?";
}

struct Piece {
  std::string name;
  const unsigned char* data;
  size_t bytes;
  std::string dtype;
  int64_t global_begin, global_end;  // elements of the global tensor
};

// One safetensors file written piece by piece (a crash point after each); returns its manifest entry.
json write_shard(const std::string& path, const std::vector<Piece>& pieces) {
  json header = json::object();
  size_t offset = 0;
  for (const Piece& p : pieces) {
    const int64_t n = p.global_end - p.global_begin;
    header[p.name] = {{"dtype", p.dtype}, {"shape", {n}}, {"data_offsets", {offset, offset + p.bytes}}};
    offset += p.bytes;
  }
  header["__metadata__"] = {{"format", kFormat}};
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h += ' ';
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((static_cast<uint64_t>(h.size()) >> (8 * i)) & 0xff);

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MOE_CHECK(fd >= 0, "cannot create '", path, "': ", std::strerror(errno));
  uint32_t file_crc = crc32c(len, 8);
  file_crc = crc32c(h.data(), h.size(), file_crc);
  write_all(fd, len, 8, path);
  write_all(fd, h.data(), h.size(), path);
  json tensors = json::array();
  for (const Piece& p : pieces) {
    write_all(fd, p.data, p.bytes, path);
    file_crc = crc32c(p.data, p.bytes, file_crc);
    tensors.push_back({{"name", p.name}, {"dtype", p.dtype}, {"global_begin", p.global_begin},
                       {"global_end", p.global_end}, {"bytes", p.bytes}, {"crc32c", hex32(crc32c(p.data, p.bytes))}});
    tensor_written();
  }
  const int rc = ::fsync(fd);
  ::close(fd);
  MOE_CHECK(rc == 0, "fsync of '", path, "' failed");
  return {{"file", fs::path(path).filename().string()}, {"bytes", 8 + h.size() + offset},
          {"crc32c", hex32(file_crc)}, {"tensors", tensors}};
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

void write_manifest(const std::string& dir, json j) {
  const std::string body = j.dump();
  j["manifest_crc32c"] = hex32(crc32c(body.data(), body.size()));
  const std::string text = j.dump(1);
  const std::string path = (fs::path(dir) / "manifest.json").string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MOE_CHECK(fd >= 0, "cannot create '", path, "': ", std::strerror(errno));
  write_all(fd, text.data(), text.size(), path);
  const int rc = ::fsync(fd);
  ::close(fd);
  MOE_CHECK(rc == 0, "fsync of '", path, "' failed");
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

std::vector<std::string> checkpoint_dirs(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() < 6 || name.compare(0, 5, "step_") != 0 || !e.is_directory()) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (!fs::exists(e.path() / "manifest.json")) continue;
    found.emplace_back(std::stoll(name.substr(5)), e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

void remove_checkpoint_dir(const fs::path& path) {
  const fs::path trash = path.parent_path() / (".trash." + path.filename().string());
  fs::remove_all(trash);
  fs::rename(path, trash);  // never a half-deleted step_* directory
  fs::remove_all(trash);
}

void prune_checkpoints(const fs::path& parent, const fs::path& keep_path, size_t keep) {
  std::vector<std::string> complete = checkpoint_dirs(parent.string());
  for (size_t i = 0; i + keep < complete.size(); ++i) {
    if (fs::path(complete[i]) == keep_path) continue;
    remove_checkpoint_dir(complete[i]);
    crash_point("during_prune");
  }
  for (const auto& e : fs::directory_iterator(parent)) {  // leftovers of crashed saves and prunes
    const std::string n = e.path().filename().string();
    if (n.rfind(".tmp.step_", 0) == 0 || n.rfind(".trash.step_", 0) == 0) fs::remove_all(e.path());
  }
  fsync_path(parent.string(), true);
}

// What this rank writes, each piece named "<kind>:<parameter>" with its range in the whole
// model's flat layout (ParamLayout(config), the manifest's "params"), so any layout can read it:
//  - parameters: the first replica writes them (dp rank 0 for dense, edp rank 0 for experts);
//  - Adam moments: every rank writes the slices it owns (all of its parameters, or its ZeRO-1
//    chunks; replicas without ZeRO-1 skip like parameters);
//  - loss-free router biases of the MoE layers this rank's stage holds, by dp rank 0.
// The training state on the host: the backend's own memory (ref, cpu) or staged copies, kept
// alive while the pieces pointing into them are written (save) or filled (load, then commit).
struct HostState {
  HostState(const TrainingState& run, HostView::Mode mode)
      : params(run.model.ops(), run.model.params().flat, mode),
        exp_avg(run.model.ops(), run.optimizer.exp_avg(), mode),
        exp_avg_sq(run.model.ops(), run.optimizer.exp_avg_sq(), mode) {
    // Biases of layers another stage holds are not loaded: keep their contents (kRead).
    for (const OwnedTensor& b : run.model.router_bias()) router_bias.emplace_back(run.model.ops(), b.t);
  }
  void commit() {
    for (HostView* v : {&params, &exp_avg, &exp_avg_sq}) v->commit();
    for (HostView& v : router_bias) v.commit();
  }
  HostView params, exp_avg, exp_avg_sq;
  std::vector<HostView> router_bias;
};

std::vector<Piece> checkpoint_pieces(const TrainingState& run, const HostState& host) {
  Transformer& model = run.model;
  const ParamLayout& local = model.layout();
  const ParamLayout whole(run.config.model);
  ProcessGroups* g = run.groups;
  const bool zero1 = g && run.config.parallel.zero1;
  auto first_replica = [&](const ParamInfo& p) { return !g || (p.is_expert ? g->coords.edp == 0 : g->coords.dp == 0); };
  const DType dt = model.params().flat.dtype;
  const size_t es = dtype_size(dt);
  std::vector<Piece> out;
  for (const ParamInfo& p : local.entries()) {
    if (!first_replica(p)) continue;
    const int64_t gb = whole.find(p.name).offset + p.global_begin;
    out.push_back({"params:" + p.name, static_cast<const unsigned char*>(host.params.data()) + static_cast<size_t>(p.offset) * es,
                   static_cast<size_t>(p.numel) * es, st_dtype(dt), gb, gb + p.numel});
  }
  const AdamW& opt = run.optimizer;
  MOE_CHECK(opt.exp_avg().dtype == dt, "optimizer state dtype differs from the parameters'");
  const char* kinds[2] = {"exp_avg", "exp_avg_sq"};
  const HostView* states[2] = {&host.exp_avg, &host.exp_avg_sq};
  for (int k = 0; k < 2; ++k)
    for (const StateSlice& s : opt.slices()) {
      if (!zero1 && !first_replica(*s.param)) continue;
      const int64_t gb = whole.find(s.param->name).offset + s.param->global_begin + s.param_begin;
      out.push_back({std::string(kinds[k]) + ":" + s.param->name,
                     static_cast<const unsigned char*>(states[k]->data()) + static_cast<size_t>(s.state_offset) * es,
                     static_cast<size_t>(s.count) * es, st_dtype(dt), gb, gb + s.count});
    }
  if (!g || g->coords.dp == 0) {
    const ModelConfig& c = run.config.model;
    for (int64_t m = 0; m < c.num_moe_layers(); ++m) {
      if (!local.shard().holds_layer(c.moe_layer(m))) continue;
      const Tensor& t = host.router_bias[static_cast<size_t>(m)].tensor();
      out.push_back({"router_bias." + std::to_string(m), static_cast<const unsigned char*>(t.data), t.nbytes(),
                     st_dtype(t.dtype), 0, t.numel()});
    }
  }
  return out;
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::string save_checkpoint(const std::string& dir, const TrainingState& run, int64_t next_instance, const SaveOptions& options) {
  MOE_CHECK(options.keep_last >= 1 && options.num_shards >= 1, "save_checkpoint: keep_last and num_shards must be >= 1");
  ProcessGroups* groups = run.groups;
  Communicator* world = groups ? groups->world : nullptr;
  const int rank = world ? world->rank() : 0;
  MOE_CHECK(!world || options.num_shards == 1, "save_checkpoint: num_shards is for single-process tests");
  const int64_t num_files = world ? world->size() : options.num_shards;
  tensors_written = 0;
  const int64_t step = run.steps_taken();
  const fs::path parent = fs::absolute(dir);
  const std::string name = checkpoint_name(step);
  const fs::path final_path = parent / name;
  // Rank 0's pid names the temp dir (two runs sharing a directory never collide).
  int32_t pid = ::getpid();
  if (world) world->broadcast(&pid, 1, DType::kI32, 0);
  const fs::path tmp = parent / (".tmp." + name + "." + std::to_string(pid));
  if (rank == 0) {
    fs::create_directories(parent);
    fs::remove_all(tmp);
    fs::create_directory(tmp);
  }
  if (world) world->barrier();

  // This rank's pieces, in whole-model coordinates (checkpoint_pieces), one file per rank.
  std::vector<std::vector<Piece>> files(static_cast<size_t>(num_files));
  const HostState host(run, HostView::kRead);
  std::vector<Piece> mine = checkpoint_pieces(run, host);
  for (size_t i = 0; i < mine.size(); ++i)
    files[world ? 0 : i % static_cast<size_t>(num_files)].push_back(std::move(mine[i]));
  std::vector<std::string> entries;
  for (int64_t f = 0; f < (world ? 1 : num_files); ++f) {
    char file[64];
    std::snprintf(file, sizeof file, "rank_%05lld.safetensors", static_cast<long long>(world ? rank : f));
    entries.push_back(write_shard((tmp / file).string(), files[static_cast<size_t>(f)]).dump());
  }
  if (world) entries = all_gather_strings(*world, entries[0]);  // rank 0 gets every rank's entry

  if (rank == 0) {
    json shards = json::array();
    for (const std::string& e : entries) shards.push_back(json::parse(e));
    const Config& c = run.config;
    const ParamLayout whole(c.model);
    json params = json::array();
    for (const ParamInfo& p : whole.entries())
      params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}, {"numel", p.numel}});
    const DType dt = run.model.params().flat.dtype;
    json m = {{"format", kFormat},
              {"version", kFormatVersion},
              {"step", step},
              {"optimizer", {{"type", "adamw"}, {"steps_taken", step}, {"dtype", st_dtype(dt)}}},
              {"data", {{"next_instance", next_instance}, {"batch_size", c.train.batch_size}, {"seed", c.train.seed},
                        {"anchor_step", options.anchor.step}, {"anchor_instance", options.anchor.next_instance}}},
              {"elapsed_s", options.elapsed_s},
              {"rng", "stateless: every random draw is a pure function of (train.seed, stream, index); nothing to save"},
              {"schedule", "learning rate is a pure function of (optim.*, train.steps, step)"},
              {"config_toml", config_to_toml(c)},
              {"layout", {{"dp", c.parallel.dp}, {"ep", c.parallel.ep}, {"pp", c.parallel.pp}, {"zero1", c.parallel.zero1}}},
              {"world_size", num_files},
              {"flat_numel", whole.total()},
              {"params", params},
              {"num_router_bias", c.model.num_moe_layers()},
              {"shards", shards}};
    crash_point("before_manifest");
    write_manifest(tmp.string(), m);
    fsync_path(tmp.string(), true);
    crash_point("before_rename");
    if (fs::exists(final_path)) {  // re-saving a step: move the old one aside; removed after the fsync
      const fs::path old = parent / (".trash." + name);
      fs::remove_all(old);
      fs::rename(final_path, old);
    }
    fs::rename(tmp, final_path);
    crash_point("before_dir_fsync");
    fsync_path(parent.string(), true);
    crash_point("before_prune");
    prune_checkpoints(parent, final_path, static_cast<size_t>(options.keep_last));
  }
  if (world) world->barrier();  // nobody runs ahead of a save that is not complete
  return final_path.string();
}

std::vector<std::string> list_checkpoints(const std::string& dir) { return checkpoint_dirs(dir); }

std::string latest_checkpoint(const std::string& dir) {
  std::vector<std::string> all = checkpoint_dirs(dir);
  return all.empty() ? "" : all.back();
}

CheckpointInfo verify_checkpoint(const std::string& path) { return verify(path).info; }

CheckpointInfo load_checkpoint(const std::string& path, const TrainingState& run) {
  Verified v = verify(path);
  const std::string mpath = (fs::path(path) / "manifest.json").string();
  Config saved;
  try {
    saved = parse_config(v.info.config_toml, {}, mpath + " config_toml");
  } catch (const std::exception& e) {
    MOE_FAIL("malformed manifest '", mpath, "': its config does not parse: ", e.what());
  }
  v.info.warnings = compare_configs(saved, run.config);

  Transformer& model = run.model;
  const DType dt = model.params().flat.dtype;
  const std::string want_dt = st_dtype(dt);
  const std::string opt_dt = field<std::string>(field<json>(v.manifest, "optimizer", mpath), "dtype", mpath);
  MOE_CHECK(opt_dt == want_dt, "cannot resume '", path, "': parameters and optimizer state are ", opt_dt,
            ", this run keeps them in ", want_dt);
  // The manifest's layout is the whole model's; this rank may hold any part of it.
  const ParamLayout whole(run.config.model);
  MOE_CHECK(field<int64_t>(v.manifest, "flat_numel", mpath) == whole.total(), "cannot resume '", path,
            "': the checkpoint holds ", field<int64_t>(v.manifest, "flat_numel", mpath), " parameters, the model has ",
            whole.total());
  const json params = field<json>(v.manifest, "params", mpath);
  MOE_CHECK(params.is_array() && params.size() == whole.entries().size(), "cannot resume '", path,
            "': parameter list differs from the model's");
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = whole.entries()[i];
    MOE_CHECK(field<std::string>(params[i], "name", mpath) == p.name &&
                  field<std::vector<int64_t>>(params[i], "shape", mpath) == p.shape &&
                  field<int64_t>(params[i], "offset", mpath) == p.offset,
              "cannot resume '", path, "': parameter '", p.name, "' differs in name, shape or offset");
  }

  // Index every piece by kind and whole-model range; pieces of one kind must not overlap.
  struct Src {
    int64_t begin, end;
    const unsigned char* data;
  };
  std::array<std::vector<Src>, 3> pieces;
  const size_t es = dtype_size(dt);
  std::vector<bool> bias_loaded(model.router_bias().size(), false);
  HostState host(run, HostView::kWrite);  // every element below is written before commit()
  for (auto& [shard, bytes] : v.shards) {
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
        const size_t i = std::stoul(name.substr(12));
        MOE_CHECK(i < model.router_bias().size(), "tensor '", name, "' in '", fpath, "': the model has ",
                  model.router_bias().size(), " MoE layers");
        const Tensor& dst = host.router_bias[i].tensor();
        MOE_CHECK(e.dtype == st_dtype(dst.dtype) && e.end - e.begin == dst.nbytes(), "tensor '", name, "' in '",
                  fpath, "' has dtype ", e.dtype, " and ", e.end - e.begin, " bytes, expected ", st_dtype(dst.dtype),
                  " and ", dst.nbytes());
        std::memcpy(dst.data, src, dst.nbytes());
        bias_loaded[i] = true;
      } else {
        MOE_FAIL("tensor '", name, "' in '", fpath, "' is not part of the training state");
      }
    }
  }
  for (int k = 0; k < 3; ++k) {
    auto& list = pieces[static_cast<size_t>(k)];
    std::sort(list.begin(), list.end(), [](const Src& a, const Src& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < list.size(); ++i)
      MOE_CHECK(list[i].begin >= list[i - 1].end, "checkpoint '", path, "': pieces of '", kFlatTensors[k],
                "' overlap at element ", list[i].begin);
  }
  // Copies whole-model elements [begin, begin + count) of a kind into dst; every element must be
  // in some piece (a missing rank file or a gap is an error naming the parameter).
  auto fill = [&](int k, int64_t begin, int64_t count, unsigned char* dst, const std::string& what) {
    const auto& list = pieces[static_cast<size_t>(k)];
    auto it = std::upper_bound(list.begin(), list.end(), begin, [](int64_t x, const Src& s) { return x < s.begin; });
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
  };
  auto* pbase = static_cast<unsigned char*>(host.params.data());
  for (const ParamInfo& p : model.layout().entries())
    fill(0, whole.find(p.name).offset + p.global_begin, p.numel, pbase + static_cast<size_t>(p.offset) * es,
         "parameter '" + p.name + "'");
  AdamW& opt = run.optimizer;
  unsigned char* states[2] = {static_cast<unsigned char*>(host.exp_avg.data()),
                              static_cast<unsigned char*>(host.exp_avg_sq.data())};
  for (int k = 1; k < 3; ++k)
    for (const StateSlice& s : opt.slices())
      fill(k, whole.find(s.param->name).offset + s.param->global_begin + s.param_begin, s.count,
           states[k - 1] + static_cast<size_t>(s.state_offset) * es, "parameter '" + s.param->name + "'");
  const ModelConfig& mc = run.config.model;
  for (size_t i = 0; i < bias_loaded.size(); ++i)
    if (model.layout().shard().holds_layer(mc.moe_layer(static_cast<int64_t>(i))))
      MOE_CHECK(bias_loaded[i], "checkpoint '", path, "' has no tensor 'router_bias.", i, "'");
  const int64_t steps = field<int64_t>(field<json>(v.manifest, "optimizer", mpath), "steps_taken", mpath);
  MOE_CHECK(steps == v.info.step, "malformed manifest '", mpath, "': optimizer steps_taken ", steps, " != step ", v.info.step);
  host.commit();
  run.optimizer.set_steps_taken(steps);
  model.refresh_operand_weights();
  return v.info;
}

}  // namespace moe
