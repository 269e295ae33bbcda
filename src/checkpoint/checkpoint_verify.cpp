// Verifying a checkpoint (checkpoint_verify.h) and the CRC-32C both sides of the format use.
#include "checkpoint/checkpoint_verify.h"

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "checkpoint/checkpoint_format.h"
#include "checkpoint/safetensors.h"
#include "core/user_path.h"

namespace moe {

namespace fs = std::filesystem;

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const std::array<std::array<uint32_t, 256>, 8> table = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    return t;
  }();
  const unsigned char* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (n >= 8) {  // slicing-by-8 (little-endian load)
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
          table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
          table[1][(w >> 48) & 0xff] ^ table[0][(w >> 56) & 0xff];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
  return ~crc;
}

namespace checkpoint_verify {
namespace {

using namespace checkpoint_format;  // the format both sides share

std::vector<unsigned char> read_file(const std::string& path) {
  check_input_file(path, "checkpoint file", /*allow_empty=*/true);  // sizes are checked against the manifest
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open '", path, "'");
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return bytes;
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

}  // namespace

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

}  // namespace checkpoint_verify

CheckpointInfo verify_checkpoint(const std::string& path) { return checkpoint_verify::verify(path).info; }

}  // namespace moe
