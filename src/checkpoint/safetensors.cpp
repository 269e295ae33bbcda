#include "checkpoint/safetensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/user_path.h"

namespace moe {
namespace {

size_t element_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2" ||
      dtype == "F8_E8M0")
    return 1;
  return 0;
}

double load_float(const unsigned char* p, const std::string& dtype) {
  if (dtype == "F64") { double v; std::memcpy(&v, p, 8); return v; }
  if (dtype == "F32") { float v; std::memcpy(&v, p, 4); return v; }
  if (dtype == "BF16") { bf16 v; std::memcpy(&v.bits, p, 2); return static_cast<float>(v); }
  if (dtype == "F16") {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (exp == 0) return sign * std::ldexp(man, -24);
    if (exp == 31) return man ? std::nan("") : sign * HUGE_VAL;
    return sign * std::ldexp(1024 + man, exp - 25);
  }
  if (dtype == "I32") { int32_t v; std::memcpy(&v, p, 4); return v; }
  if (dtype == "I64") { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
  MOE_FAIL("unsupported safetensors dtype ", dtype);
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path, std::string_view what) : path_(path) {
  check_input_file(path, what);
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open '", path, "'");
  in.seekg(0, std::ios::end);
  const size_t size = static_cast<size_t>(in.tellg());
  in.seekg(0);
  MOE_CHECK(size >= 8, "'", path, "' is ", size, " bytes: too short for a safetensors header");
  uint64_t header_len = 0;
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  MOE_CHECK(header_len <= size - 8 && header_len <= (100u << 20), "'", path, "': header length ",
            header_len, " exceeds the file (", size, " bytes)");
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  data_.resize(size - 8 - header_len);
  in.read(reinterpret_cast<char*>(data_.data()), static_cast<std::streamsize>(data_.size()));
  MOE_CHECK(in.good() || in.eof(), "'", path, "': read failed");

  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    MOE_FAIL("'", path, "': malformed JSON header: ", e.what());
  }
  MOE_CHECK(j.is_object(), "'", path, "': header is not a JSON object");
  std::vector<std::pair<size_t, size_t>> ranges;
  for (auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      MOE_CHECK(v.is_object(), "'", path, "': __metadata__ is not an object");
      for (auto& [k, s] : v.items()) {
        MOE_CHECK(s.is_string(), "'", path, "': metadata '", k, "' is not a string");
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    MOE_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
              "'", path, "': tensor '", name, "' lacks dtype, shape or data_offsets");
    MOE_CHECK(v["dtype"].is_string() && v["shape"].is_array(), "'", path, "': tensor '", name,
              "' has a non-string dtype or a non-array shape");
    SafetensorsEntry e;
    e.dtype = v["dtype"].get<std::string>();
    const size_t es = element_size(e.dtype);
    MOE_CHECK(es > 0, "'", path, "': tensor '", name, "' has unknown dtype ", e.dtype);
    size_t numel = 1;
    for (auto& d : v["shape"]) {
      MOE_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, "'", path, "': tensor '", name, "' has a bad shape");
      e.shape.push_back(d.get<int64_t>());
      numel *= static_cast<size_t>(d.get<int64_t>());
    }
    auto& off = v["data_offsets"];
    MOE_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
              "'", path, "': tensor '", name, "' has bad data_offsets (need two non-negative integers)");
    e.begin = off[0].get<size_t>();
    e.end = off[1].get<size_t>();
    MOE_CHECK(e.begin <= e.end && e.end <= data_.size(), "'", path, "': tensor '", name, "' offsets [",
              e.begin, ", ", e.end, ") out of range of the ", data_.size(), "-byte data section");
    MOE_CHECK(e.end - e.begin == numel * es, "'", path, "': tensor '", name, "' has ", e.end - e.begin,
              " bytes, but shape and dtype ", e.dtype, " need ", numel * es);
    ranges.emplace_back(e.begin, e.end);
    entries_[name] = e;
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    MOE_CHECK(ranges[i].first >= ranges[i - 1].second, "'", path, "': tensors overlap at byte ", ranges[i].first);
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  MOE_CHECK(it != entries_.end(), "'", path_, "' has no tensor '", name, "'");
  return it->second;
}

std::string SafetensorsFile::meta(const std::string& key) const {
  auto it = metadata_.find(key);
  MOE_CHECK(it != metadata_.end(), "'", path_, "' has no metadata '", key, "'");
  return it->second;
}

std::span<const unsigned char> SafetensorsFile::bytes(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  return {data_.data() + e.begin, e.end - e.begin};
}

OwnedTensor SafetensorsFile::read(const std::string& name, DType dtype) const {
  const SafetensorsEntry& e = entry(name);
  MOE_CHECK(e.shape.size() <= 4, "'", name, "' has rank ", e.shape.size());
  OwnedTensor out(dtype, {1});
  out.t.ndim = static_cast<int>(e.shape.size());
  for (size_t i = 0; i < e.shape.size(); ++i) out.t.shape[i] = e.shape[i];
  out.buffer = Buffer(out.t.nbytes());
  out.t.data = out.buffer.data();
  const size_t es = element_size(e.dtype);
  const unsigned char* src = data_.data() + e.begin;
  for (int64_t i = 0; i < out.t.numel(); ++i) {
    const double v = load_float(src + static_cast<size_t>(i) * es, e.dtype);
    switch (dtype) {
      case DType::kF64: out.as<double>()[i] = v; break;
      case DType::kF32: out.as<float>()[i] = static_cast<float>(v); break;
      case DType::kBF16: out.as<bf16>()[i] = bf16(static_cast<float>(v)); break;
      case DType::kI32: out.as<int32_t>()[i] = static_cast<int32_t>(v); break;
      case DType::kI64: out.as<int64_t>()[i] = static_cast<int64_t>(v); break;
      case DType::kE4M3:
      case DType::kE5M2:
      case DType::kE8M0: MOE_FAIL("'", name, "': FP8 tensors are read as bytes (SafetensorsFile::bytes)");
    }
  }
  return out;
}

void write_safetensors(const std::string& path, std::vector<SafetensorsTensorOut> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  nlohmann::json header = nlohmann::json::object();  // std::map underneath: keys sorted
  if (!metadata.empty()) {
    nlohmann::json m = nlohmann::json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  size_t offset = 0;
  for (const auto& t : tensors) {
    MOE_CHECK(t.name != "__metadata__" && !header.contains(t.name), "safetensors writer: duplicate tensor name '",
              t.name, "'");
    size_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<size_t>(d);
    MOE_CHECK(numel * element_size(t.dtype) == t.bytes.size(), "safetensors writer: tensor '", t.name, "' has ",
              t.bytes.size(), " bytes for its shape and dtype ", t.dtype);
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MOE_CHECK(out.good(), "cannot write '", path, "'");
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  out.flush();
  MOE_CHECK(out.good(), "writing '", path, "' failed");
}

}  // namespace moe
