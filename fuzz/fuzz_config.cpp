// libFuzzer harness: the TOML config parser. Any input must either parse into a valid config or
// throw moe::Error; anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "config/config.h"
#include "core/check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    moe::Config c = moe::parse_config(text, {}, "fuzz");
    (void)moe::config_to_toml(c);
  } catch (const moe::Error&) {
  }
  return 0;
}
