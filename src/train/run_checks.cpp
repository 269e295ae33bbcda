#include "train/run_checks.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/sha256.h"
#include "core/build_info.h"
#include "core/check.h"
#include "core/user_path.h"
#include "data/token_file.h"

namespace moe {
namespace {

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// "size 123456 bytes, first+last MiB fnv1a 0123456789abcdef" (or why it cannot be read: every
// rank then reports the same reason, or the ranks differ in it).
std::string file_fingerprint(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::string("unreadable: ") + std::strerror(errno);
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return std::string("unreadable: ") + std::strerror(errno);
  constexpr size_t kMiB = 1 << 20;
  const size_t size = static_cast<size_t>(st.st_size);
  std::vector<unsigned char> buf(std::min(size, kMiB));
  uint64_t h = fnv1a(&size, sizeof size);
  auto hash_at = [&](size_t offset, size_t n) {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(fd, buf.data() + got, n - got, static_cast<off_t>(offset + got));
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    h = fnv1a(buf.data(), got, h);
  };
  hash_at(0, buf.size());
  if (size > kMiB) hash_at(size - std::min(size - kMiB, kMiB), std::min(size - kMiB, kMiB));
  ::close(fd);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return "size " + std::to_string(size) + " bytes, first+last MiB fnv1a " + hex;
}

std::string serialize(const std::vector<std::pair<std::string, std::string>>& items) {
  std::string s;
  for (const auto& [k, v] : items) s += k + '\t' + v + '\n';
  return s;
}

std::vector<std::pair<std::string, std::string>> deserialize(const std::string& s) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t at = 0;
  while (at < s.size()) {
    const size_t tab = s.find('\t', at), nl = s.find('\n', tab);
    out.emplace_back(s.substr(at, tab - at), s.substr(tab + 1, nl - tab - 1));
    at = nl + 1;
  }
  return out;
}

}  // namespace

std::string config_hash(const Config& config) { return sha256_hex(config_to_toml(config)).substr(0, 16); }

bool may_differ_between_ranks(const std::string& key) { return key == "train.threads"; }

std::vector<std::pair<std::string, std::string>> rank_agreement_items(const Config& config, bool with_data_files) {
  std::vector<std::pair<std::string, std::string>> items;
  items.emplace_back("build", build_description());
  for (auto& [key, value] : config_entries(config))
    if (!may_differ_between_ranks(key)) items.emplace_back(key, value);
  if (with_data_files)
    for (const char* key : {"data.train_path", "data.valid_path"}) {
      const std::vector<std::string> paths = split_paths(key == std::string("data.train_path") ? config.data.train_path
                                                                                             : config.data.valid_path);
      for (size_t i = 0; i < paths.size(); ++i)
        items.emplace_back(std::string("token file ") + key + "[" + std::to_string(i) + "] '" + paths[i] + "'",
                           file_fingerprint(paths[i]));
    }
  return items;
}

void check_ranks_agree(const Config& config, Communicator& world, bool with_data_files) {
  if (world.size() == 1) return;
  const std::string mine = serialize(rank_agreement_items(config, with_data_files));
  const uint64_t digest = fnv1a(mine.data(), mine.size());
  std::vector<uint64_t> all(static_cast<size_t>(world.size()));
  // Two i32 words per digest (the communicator's integer type).
  world.all_gather(&digest, all.data(), 2, DType::kI32);
  bool same = true;
  for (uint64_t d : all) same = same && d == all[0];
  if (same) return;
  const std::vector<std::string> lists = all_gather_strings(world, mine);
  const auto ref = deserialize(lists[0]);
  for (int r = 1; r < world.size(); ++r) {
    const auto other = deserialize(lists[static_cast<size_t>(r)]);
    for (size_t i = 0; i < std::max(ref.size(), other.size()); ++i) {
      if (i < ref.size() && i < other.size() && ref[i] == other[i]) continue;
      if (i < ref.size() && i < other.size() && ref[i].first == other[i].first)
        MOE_FAIL("rank ", r, " runs with ", other[i].first, " = ", other[i].second, ", rank 0 with ", ref[i].second,
                 ": every rank must run the same build, config and data (only train.threads may differ)");
      MOE_FAIL("rank ", r, " and rank 0 differ: rank ", r, " has ",
               i < other.size() ? other[i].first + " = " + echo(other[i].second) : std::string("nothing"), " where rank 0 has ",
               i < ref.size() ? ref[i].first + " = " + echo(ref[i].second) : std::string("nothing"),
               " (every rank must run the same build, config and data files)");
    }
  }
  MOE_FAIL("ranks disagree on their configuration digest but list the same items (hash collision?)");
}

std::vector<std::string> init_from_differences(const Config& run, const Config& stored) {
  const auto a = config_entries(run), b = config_entries(stored);
  std::vector<std::string> out;
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string& key = a[i].first;
    const bool compared = (key.rfind("model.", 0) == 0 && key != "model.init_std" && key != "model.router_bias_gamma") ||
                          key == "data.eos_id" || key == "data.bos_id";
    if (compared && a[i].second != b[i].second)
      out.push_back(key + " = " + echo(a[i].second) + " (this run) differs from " + echo(b[i].second) + " (the file)");
  }
  return out;
}

bool check_init_from(const Config& run, const std::string& path) {
  const SafetensorsFile st(path, "train.init_from");
  auto it = st.metadata().find("config");
  if (it == st.metadata().end()) return false;
  Config stored;
  try {
    stored = config_from_json(it->second);
  } catch (const std::exception& e) {
    MOE_FAIL("train.init_from '", path, "': its stored model settings do not parse: ", e.what());
  }
  const std::vector<std::string> diffs = init_from_differences(run, stored);
  if (diffs.empty()) return true;
  std::string lines, flags;
  for (const std::string& d : diffs) {
    lines += "\n  " + d;
    const std::string key = d.substr(0, d.find(' '));
    for (const auto& [k, v] : config_entries(stored))
      if (k == key) flags += " --set " + k + "=" + v;
  }
  MOE_FAIL("train.init_from '", path, "' holds weights of a different model:", whole(lines),
           "\nthe weights were made with the file's settings; train with them:", whole(flags));
}

}  // namespace moe
