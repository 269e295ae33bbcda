// Reading a Hugging Face config.json: typed fields with their defaults, each error naming the
// field (shared by the olmoe and olmo3moe formats).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "core/check.h"

namespace moe::hf_json {

inline bool present(const nlohmann::json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

inline int64_t positive_int(const nlohmann::json& j, const char* key, int64_t dflt) {
  if (!present(j, key)) return dflt;
  const auto& v = j[key];
  MOE_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, "config.json: '", key, "' = ", v.dump(),
            " (need a positive integer)");
  return v.get<int64_t>();
}

inline double positive_number(const nlohmann::json& j, const char* key, double dflt) {
  if (!present(j, key)) return dflt;
  const auto& v = j[key];
  MOE_CHECK(v.is_number() && v.get<double>() > 0, "config.json: '", key, "' = ", v.dump(), " (need a positive number)");
  return v.get<double>();
}

inline bool boolean(const nlohmann::json& j, const char* key, bool dflt) {
  if (!present(j, key)) return dflt;
  MOE_CHECK(j[key].is_boolean(), "config.json: '", key, "' = ", j[key].dump(), " (need true or false)");
  return j[key].get<bool>();
}

// A token id in [0, vocab) or null / absent (dflt; -1 = none). moecore keeps one id of each kind.
inline int64_t token_id(const nlohmann::json& j, const char* key, int64_t vocab, int64_t dflt = -1) {
  if (!j.contains(key)) return dflt;
  if (j[key].is_null()) return -1;
  const auto& v = j[key];
  MOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < vocab, "config.json: '", key,
            "' = ", v.dump(), " (need null or one token id in [0, vocab_size = ", vocab,
            "); a list of several ids is not supported)");
  return v.get<int64_t>();
}

inline nlohmann::json id_or_null(int64_t id) { return id >= 0 ? nlohmann::json(id) : nlohmann::json(nullptr); }

}  // namespace moe::hf_json
