// libFuzzer harness: the checkpoint manifest reader. Each input is a manifest.json in a fresh
// checkpoint directory (with no rank files); verification must refuse it with moe::Error or,
// for a manifest that lists no shards, accept it; never crash.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "core/check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = "/tmp/moecore_fuzz_manifest_" + std::to_string(::getpid()) + "/step_00000001";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/manifest.json", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  try {
    (void)moe::verify_checkpoint(dir);
  } catch (const moe::Error&) {
  }
  return 0;
}
