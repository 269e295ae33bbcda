// Verifying a checkpoint against its manifest: every file's size and checksums, every tensor's
// dtype, size and checksum, and the data position. Loading (checkpoint_load.cpp) starts from
// what this returns; it is apart from loading so that it links without the model (the manifest
// fuzzer builds it alone).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "core/check.h"

namespace moe::checkpoint_verify {

using nlohmann::json;

// A manifest field of the expected type, or an error naming the manifest and the key.
template <class T> T field(const json& j, const char* key, const std::string& where) {
  MOE_CHECK(j.is_object() && j.contains(key), "malformed manifest '", where, "': missing '", key, "'");
  try {
    return j.at(key).get<T>();
  } catch (const std::exception& e) {
    MOE_FAIL("malformed manifest '", where, "': '", key, "' has the wrong type (", e.what(), ")");
  }
}

struct Verified {
  CheckpointInfo info;
  json manifest;
  // file name -> bytes of its data section start and contents
  std::vector<std::pair<json, std::vector<unsigned char>>> shards;  // manifest entry, file bytes
};

// The manifest and every file it lists, verified; the files' bytes kept for loading.
Verified verify(const std::string& dir);

}  // namespace moe::checkpoint_verify
