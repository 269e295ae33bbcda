// A config as text: TOML and JSON (checkpoints, run records, config_hash) and the config
// reference (docs/CONFIG.md), all printed from the field table (config_fields.h).
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "config/config.h"
#include "config/config_fields.h"
#include "config/config_reference.h"

namespace moe {

using config_fields::Field;
using config_fields::for_each_value;
using config_fields::Ref;

namespace {
// A TOML basic string: double quotes, with ", \ and control characters escaped.
std::string toml_quote(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// The shortest text in fixed or scientific notation that reads back as x.
std::string shortest_text(double x, bool fixed) {
#if defined(__EMSCRIPTEN__)
  // Emscripten 3.1.6's libc++ has no floating-point to_chars: the fewest digits that round-trip.
  char buf[400];
  for (int digits = 0; digits <= 340; ++digits) {
    std::snprintf(buf, sizeof buf, fixed ? "%.*f" : "%.*e", digits, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
#else
  char buf[400];
  const auto res = std::to_chars(buf, buf + sizeof buf, x, fixed ? std::chars_format::fixed : std::chars_format::scientific);
  return std::string(buf, res.ptr);
#endif
}

std::string value_text(Ref ref) {
  std::ostringstream out;
  out.precision(17);
  std::visit(
      [&](auto* p) {
        using T = std::decay_t<decltype(*p)>;
        if constexpr (std::is_same_v<T, bool>) out << (*p ? "true" : "false");
        else if constexpr (std::is_same_v<T, std::string>) out << toml_quote(*p);
        else if constexpr (std::is_same_v<T, double>) {
          // The shortest text that reads back as the same double: fixed ("0.003", "500000") for
          // moderate magnitudes, else scientific ("1e-05").
          const double a = std::fabs(*p);
          std::string s = shortest_text(*p, a == 0 || (a >= 1e-4 && a < 1e15));
          if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
          out << s;
        } else out << *p;
      },
      ref);
  return out.str();
}
}  // namespace

std::string config_to_toml(const Config& config) {
  std::ostringstream out;
  std::string section;
  for_each_value(config, [&](const Field& f, Ref ref) {
    if (f.section != section) {
      out << (section.empty() ? "" : "\n") << "[" << f.section << "]\n";
      section = f.section;
    }
    out << f.key << " = " << value_text(ref) << "\n";
  });
  return out.str();
}

std::vector<std::pair<std::string, std::string>> config_entries(const Config& config) {
  std::vector<std::pair<std::string, std::string>> out;
  for_each_value(config, [&](const Field& f, Ref ref) { out.emplace_back(f.section + "." + f.key, value_text(ref)); });
  return out;
}

std::string config_to_json(const Config& config) {
  nlohmann::json root;
  for_each_value(config, [&](const Field& f, Ref ref) {
    std::visit([&](auto* p) { root[f.section][f.key] = *p; }, ref);
  });
  return root.dump(2);
}

namespace {
const char* type_name(Ref ref) {
  if (std::holds_alternative<int64_t*>(ref)) return "integer";
  if (std::holds_alternative<uint64_t*>(ref)) return "unsigned integer";
  if (std::holds_alternative<double*>(ref)) return "number";
  if (std::holds_alternative<bool*>(ref)) return "boolean";
  return "string";
}

std::string allowed_text(const Field& f, Ref ref) {
  if (std::holds_alternative<bool*>(ref)) return "true, false";
  if (std::holds_alternative<std::string*>(ref)) {
    if (f.choices.empty()) return "text";
    std::string s;
    for (const std::string& c : f.choices) s.append(s.empty() ? "" : ", ").append(c);
    return s;
  }
  return config_fields::range_text(f);
}

// A markdown table cell: '|' would end the cell.
std::string cell(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '|') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}
}  // namespace

std::vector<ConfigKeyDoc> config_reference() {
  std::vector<ConfigKeyDoc> out;
  const Config defaults;
  for_each_value(defaults, [&](const Field& f, Ref ref) {
    out.push_back({f.section + "." + f.key, type_name(ref), value_text(ref), allowed_text(f, ref), f.help});
  });
  return out;
}

std::string config_reference_markdown() {
  std::string out, section;
  for (const ConfigKeyDoc& k : config_reference()) {
    const std::string s = k.name.substr(0, k.name.find('.'));
    if (s != section) {
      out.append(section.empty() ? "" : "\n").append("### [").append(s).append("]\n\n");
      out.append("| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n");
      section = s;
    }
    out.append("| `").append(k.name).append("` | ").append(k.type).append(" | `").append(cell(k.default_value));
    out.append("` | ").append(cell(k.allowed)).append(" | ").append(cell(k.help)).append(" |\n");
  }
  return out;
}

}  // namespace moe
