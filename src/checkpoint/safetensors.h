// safetensors reader (the format of Hugging Face checkpoints and of our golden fixtures):
// 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, and
// "__metadata__": {string: string}}, then the raw little-endian data. Malformed headers, offsets
// out of range, overlapping tensors and dtype/shape mismatches are refused with the reason.
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/buffer.h"

namespace moe {

struct SafetensorsEntry {
  std::string dtype;  // "F64", "F32", "BF16", "I32", "I64", ...
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;  // byte offsets into the data section
};

// One tensor to write: raw little-endian bytes of dtype ("F32", "BF16", ...) and shape.
struct SafetensorsTensorOut {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

// Writes a safetensors file deterministically: header keys and data in name order, compact JSON,
// header padded with spaces to a multiple of 8 bytes. Throws naming the path on I/O errors.
void write_safetensors(const std::string& path, std::vector<SafetensorsTensorOut> tensors,
                       const std::map<std::string, std::string>& metadata = {});

class SafetensorsFile {
 public:
  // what: the key or option that named the file, for errors ("train.init_from", ...).
  explicit SafetensorsFile(const std::string& path, std::string_view what = "safetensors file");
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  // The tensor converted to dtype (floats: F64/F32/BF16/F16 sources; ints: I32/I64 sources).
  OwnedTensor read(const std::string& name, DType dtype) const;
  // The tensor's raw little-endian bytes as stored (any dtype).
  std::span<const unsigned char> bytes(const std::string& name) const;
  std::string meta(const std::string& key) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<unsigned char> data_;  // the data section
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moe
