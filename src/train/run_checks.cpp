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
#include "core/fnv1a.h"
#include "core/user_path.h"
#include "data/token_file.h"

namespace moe {
namespace {

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
  if (!with_data_files) return items;
  const std::pair<const char*, const std::string*> lists[] = {{"data.train_path", &config.data.train_path},
                                                               {"data.valid_path", &config.data.valid_path}};
  for (const auto& [key, list] : lists) {
    const std::vector<std::string> paths = split_paths(*list);
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
  // "KEY = VALUE" of item i, or "nothing more" past the end of the list.
  auto item = [](const std::vector<std::pair<std::string, std::string>>& list, size_t i) {
    return i < list.size() ? list[i].first + " = " + echo(list[i].second) : std::string("nothing more");
  };
  for (int r = 1; r < world.size(); ++r) {
    const auto other = deserialize(lists[static_cast<size_t>(r)]);
    for (size_t i = 0; i < std::max(ref.size(), other.size()); ++i) {
      if (i < ref.size() && i < other.size() && ref[i] == other[i]) continue;
      const bool same_key = i < ref.size() && i < other.size() && ref[i].first == other[i].first;
      MOE_FAIL("rank ", r, " runs with ", item(other, i), ", rank 0 with ",
               same_key ? echo(ref[i].second) : item(ref, i),
               ": every rank must run the same build, config and data (only train.threads may differ)");
    }
  }
  MOE_FAIL("ranks disagree on their configuration digest but list the same items (hash collision?)");
}

namespace {
// Settings stored with weights that change nothing the weights compute: the run's values apply.
bool changes_no_computation(const std::string& key) {
  return key == "model.init_std" || key == "model.router_bias_gamma" || key == "model.max_position_embeddings" ||
         key == "model.pad_id" || key == "data.eos_id" || key == "data.bos_id";
}
}  // namespace

std::vector<SettingDifference> init_from_differences(const Config& run, const Config& stored) {
  const auto a = config_entries(run), b = config_entries(stored);
  std::vector<SettingDifference> out;
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string& key = a[i].first;
    const bool stored_key = key.rfind("model.", 0) == 0 || key == "data.eos_id" || key == "data.bos_id";
    if (stored_key && a[i].second != b[i].second)
      out.push_back({key, a[i].second, b[i].second, !changes_no_computation(key)});
  }
  return out;
}

InitFromCheck check_init_from(const Config& run, const SafetensorsFile& file) {
  InitFromCheck result;
  auto it = file.metadata().find("config");
  if (it == file.metadata().end()) return result;
  result.settings_checked = true;
  Config stored;
  try {
    stored = config_from_json(it->second);
  } catch (const std::exception& e) {
    MOE_FAIL("train.init_from '", file.path(), "': its stored model settings do not parse: ", e.what());
  }
  std::string lines, flags;
  for (const SettingDifference& d : init_from_differences(run, stored)) {
    if (!d.changes_function) {
      result.notes.push_back(d.key + " = " + echo(d.run_value) + " (this run; the file has " + echo(d.file_value) +
                             "): the run's value applies, it changes nothing the weights compute");
      continue;
    }
    lines += "\n  " + d.key + " = " + echo(d.run_value) + " (this run) differs from " + echo(d.file_value) + " (the file)";
    flags += " --set " + d.key + "=" + echo(d.file_value);
  }
  if (lines.empty()) return result;
  MOE_FAIL("train.init_from '", file.path(), "' holds weights of a different model:", whole(lines),
           "\nthe weights were made with the file's settings; train with them:", whole(flags));
}

}  // namespace moe
