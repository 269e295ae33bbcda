// SHA-256 (FIPS 180-4), for the fixture hashes of exported files and checkpoint integrity.
#pragma once

#include <cstddef>
#include <string>

namespace moe {

// Lower-case hex digest of the bytes.
std::string sha256_hex(const void* data, size_t size);
inline std::string sha256_hex(const std::string& bytes) { return sha256_hex(bytes.data(), bytes.size()); }
// Digest of a whole file; throws naming the file if it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace moe
