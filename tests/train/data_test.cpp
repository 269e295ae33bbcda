// Token data and safetensors input: every malformed file is refused with a message that names
// the file and what is wrong; valid files give exactly the tokens written.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include "checkpoint/safetensors.h"
#include "common/test_util.h"
#include "data/prepare.h"
#include "data/token_file.h"

namespace moe {
namespace {

std::string temp_path(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("moecore_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <class T> std::string pack(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TokenData, FlatUint16And32FilesGiveShiftedLabels) {
  std::vector<uint16_t> a(25);
  std::iota(a.begin(), a.end(), 0);
  write_bytes(temp_path("a.bin"), pack(a));
  std::vector<uint32_t> b = {100, 101, 102, 103, 104, 105, 106, 107, 108, 109};
  write_bytes(temp_path("b.bin"), pack(b));
  TokenDataset d16({temp_path("a.bin")}, "uint16", 1000, 8);
  EXPECT_EQ(d16.num_instances(), 3);  // 25 tokens: the remainder is dropped
  int32_t ids[8], labels[8];
  d16.instance(2, ids, labels);
  for (int s = 0; s < 8; ++s) EXPECT_EQ(ids[s], 16 + s);
  for (int s = 0; s < 7; ++s) EXPECT_EQ(labels[s], 17 + s);
  EXPECT_EQ(labels[7], -1);  // the last position has no label
  TokenDataset d32({temp_path("b.bin")}, "uint32", 1000, 5);
  d32.instance(1, ids, labels);
  EXPECT_EQ(ids[0], 105);
}

TEST(TokenData, NpyHeaderIsSkipped) {
  std::string header("\x93NUMPY\x01\x00", 8);
  std::string dict = "{'descr': '<u2', 'fortran_order': False, 'shape': (6,), }";
  dict.resize(118 - 10, ' ');
  dict += '\n';
  header += static_cast<char>(dict.size() & 0xff);
  header += static_cast<char>(dict.size() >> 8);
  std::vector<uint16_t> v = {5, 6, 7, 8, 9, 10};
  write_bytes(temp_path("c.npy"), header + dict + pack(v));
  TokenDataset d({temp_path("c.npy")}, "uint16", 100, 3);
  int32_t ids[3], labels[3];
  d.instance(1, ids, labels);
  EXPECT_EQ(ids[0], 8);
}

TEST(TokenData, BadFilesAreRefusedNamingFileAndOffset) {
  write_bytes(temp_path("odd.bin"), std::string(7, '\0'));
  std::string msg = error_of([&] { TokenFile f(temp_path("odd.bin"), "uint16", 10); });
  EXPECT_NE(msg.find("odd.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  std::vector<uint16_t> v = {1, 2, 300, 4};
  write_bytes(temp_path("big.bin"), pack(v));
  TokenFile f(temp_path("big.bin"), "uint16", 256);
  msg = error_of([&] { f.at(2); });
  EXPECT_NE(msg.find("300"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset 2"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { TokenFile g(temp_path("missing.bin"), "uint16", 10); }).find("missing.bin"), std::string::npos);
  EXPECT_NE(error_of([&] { TokenDataset d({temp_path("big.bin")}, "uint16", 256, 9); }).find("fewer than one instance"),
            std::string::npos);
}

TEST(TokenData, ShuffleIsADeterministicPermutationPerEpoch) {
  auto a = shuffled_order(1000, 5, 0), b = shuffled_order(1000, 5, 0), c = shuffled_order(1000, 5, 1);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::set<int64_t> seen(a.begin(), a.end());
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_EQ(*seen.rbegin(), 999);
  // The order is our own Philox Fisher-Yates, pinned here so no library change can move it.
  auto small = shuffled_order(8, 1234, 0);
  EXPECT_EQ(small, (std::vector<int64_t>{2, 0, 1, 3, 7, 4, 5, 6}));
}

TEST(Prepare, WritesByteTokensAndTheBigramEntropy) {
  write_bytes(temp_path("t.txt"), "abababababababab");
  PrepareResult r = prepare_text(temp_path("t.txt"), temp_path("prep"), 4, 2);
  EXPECT_EQ(r.train_tokens + r.valid_tokens, 16);
  EXPECT_EQ(r.valid_tokens, 8);  // every second 4-byte block
  EXPECT_NEAR(r.bigram_entropy_nats, 0.0, 1e-12);  // 'a' -> 'b' -> 'a' is deterministic
  EXPECT_NEAR(r.unigram_entropy_nats, std::log(2.0), 1e-12);
}

std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

TEST(Safetensors, ReadsTensorsAndRefusesMalformedFiles) {
  std::vector<float> v = {1.5f, -2.0f, 3.25f, 4.0f};
  write_bytes(temp_path("ok.st"), safetensors_bytes(
      R"({"__metadata__":{"k":"v"},"x":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", pack(v)));
  SafetensorsFile ok(temp_path("ok.st"));
  OwnedTensor x = ok.read("x", DType::kF64);
  EXPECT_EQ(x.as<double>()[2], 3.25);
  EXPECT_EQ(ok.meta("k"), "v");
  auto refused = [&](const std::string& header, const std::string& data, const char* expect) {
    write_bytes(temp_path("bad.st"), safetensors_bytes(header, data));
    std::string msg = error_of([&] { SafetensorsFile f(temp_path("bad.st")); });
    EXPECT_NE(msg.find(expect), std::string::npos) << "expected '" << expect << "' in: " << msg;
  };
  refused(R"({"x":{"dtype":"F32","shape":[2,2],"data_offsets":[0,32]}})", pack(v), "out of range");
  refused(R"({"x":{"dtype":"F32","shape":[3,2],"data_offsets":[0,16]}})", pack(v), "need 24");
  refused(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          pack(v), "overlap");
  refused(R"({"x":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", pack(v), "unknown dtype");
  refused(R"({"x": [1, 2)", pack(v), "malformed JSON");
  write_bytes(temp_path("short.st"), "abc");
  EXPECT_NE(error_of([&] { SafetensorsFile f(temp_path("short.st")); }).find("too short"), std::string::npos);
  std::string huge(8, '\xff');
  write_bytes(temp_path("huge.st"), huge + "{}");
  EXPECT_NE(error_of([&] { SafetensorsFile f(temp_path("huge.st")); }).find("exceeds the file"), std::string::npos);
}

}  // namespace
}  // namespace moe
