// The config's field table, private to src/config: config.cpp declares every key in it and
// parses against it; config_text.cpp prints configs and the config reference (docs/CONFIG.md)
// from it.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "config/config.h"

namespace moe::config_fields {

using Ref = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*>;

struct Field {
  std::string section, key;
  std::function<Ref(Config&)> ref;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::vector<std::string> choices;
  std::string help;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// Every key, in the order config_to_toml writes them (config_hash hashes that text).
const std::vector<Field>& fields();

// "[0, 1]", "[1, inf)": the key's allowed numbers as error messages and the reference print them.
std::string range_text(const Field& f);

// Each key with its value in `config`, in table order.
template <class Emit> void for_each_value(const Config& config, Emit emit) {
  Config& c = const_cast<Config&>(config);  // fields() hands out mutable refs; we only read
  for (const Field& f : fields()) emit(f, f.ref(c));
}

}  // namespace moe::config_fields
