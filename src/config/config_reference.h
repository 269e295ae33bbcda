// The config reference: every key of the field table with its type, default, allowed values and
// help, as docs/CONFIG.md's tables (moecore config --reference prints them; a test compares).
#pragma once

#include <string>
#include <vector>

namespace moe {

// One key: "model.d_model", "integer", its default as config_to_toml writes it, what is allowed
// ("[1, 1048576]", "pre, peri, reordered", "true, false", "text"), and its help text.
struct ConfigKeyDoc {
  std::string name, type, default_value, allowed, help;
};
// Every key in table order; defaults are a default-constructed Config's.
std::vector<ConfigKeyDoc> config_reference();
// The reference as markdown, one table per section: what docs/CONFIG.md holds between its markers.
std::string config_reference_markdown();

}  // namespace moe
