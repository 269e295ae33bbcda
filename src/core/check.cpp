#include "core/check.h"

namespace moe {

std::string echo(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t cut = max_bytes;
  // Cut before a UTF-8 continuation byte (top bits 10), never inside a multi-byte character.
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return std::string(s.substr(0, cut)) + "... (" + std::to_string(s.size()) + " bytes)";
}

namespace detail {
void fail(const char* file, int line, const std::string& message) {
  std::string where = file;
  size_t cut = where.rfind("src/");
  if (cut != std::string::npos) where = where.substr(cut);
  throw Error(message + " [" + where + ":" + std::to_string(line) + "]");
}
}  // namespace detail

}  // namespace moe
