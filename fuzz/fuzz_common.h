// Harness helper: readers under test take paths, so each input is written to a per-process file.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>

inline std::string fuzz_input_file(const uint8_t* data, size_t size, const char* suffix) {
  static const std::string path = "/tmp/moecore_fuzz_" + std::to_string(::getpid()) + suffix;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                               static_cast<std::streamsize>(size));
  return path;
}
