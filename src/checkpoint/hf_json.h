// Reading a Hugging Face config.json: typed fields with their defaults, each error naming the
// field (shared by the olmoe and olmo3moe formats).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

// RoPE's base: top-level rope_theta (transformers 4.x), overridden by rope_parameters.rope_theta
// (5.x); only default RoPE is accepted there, naming the field.
inline double rope_theta(const nlohmann::json& j, double dflt) {
  double theta = positive_number(j, "rope_theta", dflt);
  if (!present(j, "rope_parameters")) return theta;
  const auto& rp = j["rope_parameters"];
  MOE_CHECK(rp.is_object(), "config.json: rope_parameters is not an object");
  for (auto& [k, v] : rp.items()) {
    MOE_CHECK(k == "rope_theta" || k == "rope_type", "config.json: unsupported rope_parameters field '", k, "' = ",
              v.dump(), " (only default RoPE)");
    if (k == "rope_type")
      MOE_CHECK(v == "default", "config.json: rope_parameters.rope_type ", v.dump(), " (only \"default\" RoPE)");
  }
  return positive_number(rp, "rope_theta", theta);
}

// A pad id equal to the eos id (common for models without a pad token) would unlabel every
// document end and freeze its embedding: only the eos id is kept, with a note. Returns the pad id.
inline int64_t pad_unless_eos(int64_t pad, int64_t eos, std::vector<std::string>* notes) {
  if (pad < 0 || pad != eos) return pad;
  if (notes)
    notes->push_back("pad_token_id = eos_token_id = " + std::to_string(pad) +
                     ": kept as data.eos_id only (a pad id equal to the end-of-text id would unlabel every "
                     "document end); model.pad_id = -1");
  return -1;
}

inline nlohmann::json id_or_null(int64_t id) { return id >= 0 ? nlohmann::json(id) : nlohmann::json(nullptr); }

}  // namespace moe::hf_json
