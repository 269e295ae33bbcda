// Writing a checkpoint: every rank's pieces into its file, the manifest, the atomic rename and
// the pruning of older ones (reading them back: checkpoint_load.cpp).
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <ostream>

#include "checkpoint/checkpoint_format.h"
#include "checkpoint/safetensors.h"
#include "core/check.h"
#include "parallel/communicator.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/process_groups.h"

namespace moe {

int64_t TrainingState::steps_taken() const { return optimizer.steps_taken(); }
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using namespace checkpoint_format;  // the format both sides share

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

}  // namespace moe
