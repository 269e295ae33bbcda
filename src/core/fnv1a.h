// 64-bit FNV-1a: a fast, stable (platform- and library-independent) hash for names, states and
// fingerprints. Not cryptographic; SHA-256 (checkpoint/sha256.h) where that matters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moe {

constexpr uint64_t kFnv1aOffset = 1469598103934665603ull;

// Continues hash h over n bytes.
inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnv1aOffset) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
inline uint64_t fnv1a(std::string_view s, uint64_t h = kFnv1aOffset) { return fnv1a(s.data(), s.size(), h); }

}  // namespace moe
