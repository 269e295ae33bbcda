// libFuzzer harness: the safetensors reader (checkpoints, fixtures, Hugging Face files). Every
// tensor it accepts must be readable in full; malformed files must throw moe::Error.
#include <cstddef>
#include <cstdint>

#include "checkpoint/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz_input_file(data, size, ".safetensors");
  try {
    moe::SafetensorsFile f(path);
    for (const auto& [name, entry] : f.entries()) {
      if (entry.end - entry.begin > (1u << 20) || entry.shape.size() > 4) continue;
      (void)f.read(name, moe::DType::kF64);
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
