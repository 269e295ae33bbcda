// Token data and safetensors input: every malformed file is refused with a message that names
// the file and what is wrong; valid files give exactly the tokens written.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>

#include "common/paths.h"
#include "checkpoint/safetensors.h"
#include "common/test_util.h"
#include "data/prepare.h"
#include "data/token_file.h"
#include "train/train_loop.h"

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

// A real .npy file: magic, version, little-endian header length, dict padded to 64 bytes.
std::string npy_bytes(const std::string& descr, const std::string& shape, const std::string& data,
                      const std::string& fortran = "False", int version = 1) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
  const size_t pre = version == 1 ? 10 : 12;
  while ((pre + dict.size() + 1) % 64 != 0) dict += ' ';
  dict += '\n';
  std::string h("\x93NUMPY", 6);
  h += static_cast<char>(version);
  h += '\0';
  const size_t n = dict.size();
  h += static_cast<char>(n & 0xff);
  h += static_cast<char>((n >> 8) & 0xff);
  if (version > 1) {
    h += static_cast<char>((n >> 16) & 0xff);
    h += static_cast<char>((n >> 24) & 0xff);
  }
  return h + dict + data;
}

void expect_mentions(const std::string& msg, std::initializer_list<const char*> words) {
  EXPECT_FALSE(msg.empty()) << "no error raised";
  for (const char* w : words) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' missing in: " << msg;
}

TEST(TokenData, RealNpyHeadersAreParsedAndChecked) {
  std::vector<uint32_t> v = {70000, 1, 2, 3, 4, 5};
  write_bytes(temp_path("u4.npy"), npy_bytes("<u4", "(6,)", pack(v)));
  TokenDataset d({temp_path("u4.npy")}, "uint32", 100000, 3);
  int32_t ids[3], labels[3];
  d.instance(0, ids, labels);
  EXPECT_EQ(ids[0], 70000);
  write_bytes(temp_path("u4v2.npy"), npy_bytes("<u4", "(6,)", pack(v), "False", 2));
  TokenDataset d2({temp_path("u4v2.npy")}, "uint32", 100000, 3);
  d2.instance(1, ids, labels);
  EXPECT_EQ(ids[2], 5);
  std::vector<uint8_t> bytes = {9, 8, 7, 6};
  write_bytes(temp_path("u1.npy"), npy_bytes("|u1", "(4,)", pack(bytes)));
  TokenDataset d8({temp_path("u1.npy")}, "uint8", 256, 2);
  d8.instance(1, ids, labels);
  EXPECT_EQ(ids[0], 7);

  // dtype mismatch, fortran order, 2-D shape, truncated data, broken header: each names the file.
  expect_mentions(error_of([&] { TokenFile f(temp_path("u4.npy"), "uint16", 100000); }),
                  {"u4.npy", "descr '<u4'", "uint16", "byte offset"});
  write_bytes(temp_path("f.npy"), npy_bytes("<u2", "(4,)", std::string(8, '\0'), "True"));
  expect_mentions(error_of([&] { TokenFile f(temp_path("f.npy"), "uint16", 10); }), {"f.npy", "fortran_order"});
  write_bytes(temp_path("2d.npy"), npy_bytes("<u2", "(2, 2)", std::string(8, '\0')));
  expect_mentions(error_of([&] { TokenFile f(temp_path("2d.npy"), "uint16", 10); }), {"2d.npy", "not 1-D"});
  write_bytes(temp_path("huge.npy"), npy_bytes("<u2", "(99999999999999999999999,)", std::string(8, '\0')));
  expect_mentions(error_of([&] { TokenFile f(temp_path("huge.npy"), "uint16", 10); }), {"huge.npy", "not 1-D"});
  write_bytes(temp_path("short.npy"), npy_bytes("<u2", "(5,)", std::string(8, '\0')));
  expect_mentions(error_of([&] { TokenFile f(temp_path("short.npy"), "uint16", 10); }),
                  {"short.npy", "needs 10 data bytes", "holds 8", "truncated"});
  write_bytes(temp_path("cut.npy"), npy_bytes("<u2", "(5,)", "").substr(0, 30));
  expect_mentions(error_of([&] { TokenFile f(temp_path("cut.npy"), "uint16", 10); }), {"cut.npy", "truncated"});
  write_bytes(temp_path("f4.npy"), npy_bytes("<f4", "(2,)", std::string(8, '\0')));
  expect_mentions(error_of([&] { TokenFile f(temp_path("f4.npy"), "uint32", 10); }), {"f4.npy", "<f4"});
  // Out-of-vocabulary ids are caught when an instance is read, with the byte offset after the header.
  std::vector<uint16_t> w = {1, 2, 3, 999};
  write_bytes(temp_path("oov.npy"), npy_bytes("<u2", "(4,)", pack(w)));
  TokenDataset oov({temp_path("oov.npy")}, "uint16", 100, 2);
  oov.instance(0, ids, labels);
  expect_mentions(error_of([&] { oov.instance(1, ids, labels); }), {"oov.npy", "999", "token offset 3", "byte offset 134"});
}

TEST(TokenData, SeveralFilesConcatenateIntoOneStream) {
  std::vector<uint16_t> a = {0, 1, 2, 3, 4}, b = {}, c = {5, 6, 7, 8, 9, 10, 11};
  write_bytes(temp_path("m0.bin"), pack(a));
  write_bytes(temp_path("m1.bin"), pack(b));
  write_bytes(temp_path("m2.npy"), npy_bytes("<u2", "(7,)", pack(c)));  // flat and .npy mix
  const std::string list = temp_path("m0.bin") + ", " + temp_path("m1.bin") + "," + temp_path("m2.npy");
  const std::vector<std::string> paths = split_paths(list);
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_EQ(paths[1], temp_path("m1.bin"));
  // An empty file in the list is a mistake (a failed tokenizer shard?): refused by name.
  const std::string empty_error = error_of([&] { TokenDataset e(paths, "uint16", 100, 4, "data.train_path"); });
  EXPECT_NE(empty_error.find("data.train_path '" + temp_path("m1.bin") + "' is empty"), std::string::npos) << empty_error;
  const std::vector<std::string> two = {paths[0], paths[2]};
  TokenDataset d(two, "uint16", 100, 4);
  EXPECT_EQ(d.num_tokens(), 12);
  EXPECT_EQ(d.num_instances(), 3);
  EXPECT_EQ(d.num_files(), 2);
  int32_t ids[4], labels[4];
  for (int i = 0; i < 3; ++i) {
    d.instance(i, ids, labels);  // instance 1 spans the file boundary
    for (int s = 0; s < 4; ++s) EXPECT_EQ(ids[s], 4 * i + s);
  }
}

TEST(TokenData, DocumentStartsFollowEos) {
  const int32_t ids[] = {5, 6, 0, 7, 8, 9, 0, 0, 4};
  int32_t ds[9];
  document_starts(ids, 9, 0, ds);
  EXPECT_EQ(std::vector<int32_t>(ds, ds + 9), (std::vector<int32_t>{0, 0, 0, 3, 3, 3, 3, 7, 8}));
  document_starts(ids, 9, -1, ds);  // no EOS id: one document
  for (int32_t x : ds) EXPECT_EQ(x, 0);
}

TEST(TokenData, ShuffleMatchesTheCommittedPermutation) {
  // tests/golden/shuffle_seed1234_n1000.txt was written once by this code (MOE_REGEN_GOLDEN=1)
  // and reviewed: a permutation of 0..999, one index per line, for seed 1234, epoch 0.
  const std::string path = std::string(::moe::test::source_dir()) + "/tests/golden/shuffle_seed1234_n1000.txt";
  const std::vector<int64_t> order = shuffled_order(1000, 1234, 0);
  if (std::getenv("MOE_REGEN_GOLDEN")) {
    std::ofstream out(path, std::ios::trunc);
    for (int64_t x : order) out << x << "\n";
  }
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing " << path;
  std::vector<int64_t> golden;
  for (int64_t x; in >> x;) golden.push_back(x);
  EXPECT_EQ(order, golden);
  // The loader's state is the global position: epoch 1 continues with a fresh permutation.
  InstanceOrder io(1000, 1234);
  EXPECT_EQ(io.at(999), golden[999]);
  EXPECT_EQ(io.at(1000), shuffled_order(1000, 1234, 1)[0]);
  EXPECT_EQ(io.at(5), golden[5]);
}

TEST(TokenData, RanksSliceTheGlobalBatch) {
  const std::vector<int64_t> global = {10, 11, 12, 13, 14, 15, 16, 17};
  EXPECT_EQ(rank_slice(global, 0, 4), (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(rank_slice(global, 3, 4), (std::vector<int64_t>{16, 17}));
  EXPECT_EQ(rank_slice(global, 0, 1), global);
  expect_mentions(error_of([&] { rank_slice(global, 0, 3); }), {"multiple of the world size 3"});
  expect_mentions(error_of([&] { rank_slice(global, 4, 4); }), {"rank 4"});

  // fill_batch for rank r of W gives exactly rows r, r+W, ... of the single-process global batch.
  std::vector<uint16_t> v(200);
  std::iota(v.begin(), v.end(), 0);
  write_bytes(temp_path("ranks.bin"), pack(v));
  TokenDataset d({temp_path("ranks.bin")}, "uint16", 1000, 5);  // 40 instances
  const int64_t W = 4, Bl = 3, S = 5, position = 33;  // the global batch crosses into epoch 1
  OwnedTensor gids(DType::kI32, {Bl * W, S}), glab(DType::kI32, {Bl * W, S});
  std::vector<int64_t> cache;
  int64_t epoch = -1;
  fill_batch(d, 77, position, gids, glab, cache, epoch);
  for (int64_t r = 0; r < W; ++r) {
    OwnedTensor ids(DType::kI32, {Bl, S}), lab(DType::kI32, {Bl, S}), ds(DType::kI32, {Bl, S});
    InstanceOrder order(d.num_instances(), 77);
    fill_batch(d, order, position, ids, lab, r, W, &ds.t, 3);
    std::vector<int64_t> cache2;
    int64_t epoch2 = -1;
    OwnedTensor ids2(DType::kI32, {Bl, S}), lab2(DType::kI32, {Bl, S});
    fill_batch(d, 77, position, ids2, lab2, cache2, epoch2, r, W);
    for (int64_t b = 0; b < Bl; ++b)
      for (int64_t s = 0; s < S; ++s) {
        EXPECT_EQ(ids.as<int32_t>()[b * S + s], gids.as<int32_t>()[(r * Bl + b) * S + s]);
        EXPECT_EQ(lab.as<int32_t>()[b * S + s], glab.as<int32_t>()[(r * Bl + b) * S + s]);
        EXPECT_EQ(ids2.as<int32_t>()[b * S + s], ids.as<int32_t>()[b * S + s]);
      }
  }
}

TEST(TokenData, TrainingReadsSeveralFilesAndValidates) {
  std::vector<uint16_t> a(300), b(200);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint16_t>(i % 7);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>((i * 3) % 7);
  write_bytes(temp_path("tr0.bin"), pack(a));
  write_bytes(temp_path("tr1.npy"), npy_bytes("<u2", "(200,)", pack(b)));
  write_bytes(temp_path("va0.bin"), pack(b));
  write_bytes(temp_path("va1.bin"), pack(a));
  Config c = parse_config("", {"model.vocab_size=16", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
                               "model.n_kv_heads=1", "model.num_experts=2", "model.top_k=1",
                               "model.expert_hidden=16", "train.seq_len=8", "train.batch_size=4",
                               "train.micro_batch_size=2", "train.steps=3", "optim.warmup_steps=1",
                               "train.eval_every=2", "train.eval_batches=2", "train.log_every=1",
                               "train.out_dir=" + temp_path("run"),
                               "data.train_path=" + temp_path("tr0.bin") + "," + temp_path("tr1.npy"),
                               "data.valid_path=" + temp_path("va0.bin") + "," + temp_path("va1.bin")});
  std::ostringstream log;
  TrainSummary s = run_training(c, log);
  EXPECT_EQ(s.steps, 3);
  EXPECT_GT(s.final_valid_loss, 0.0);
  EXPECT_NE(log.str().find("62 training instances of 8 tokens from 2 file(s)"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("validation: 62 instances from 2 file(s)"), std::string::npos) << log.str();
  // Intra-document masking (EOS = 0, frequent here) runs through training and validation.
  Config masked = c;
  masked.data.eos_id = 0;
  masked.data.intra_doc_mask = true;
  TrainSummary sm = run_training(masked, log);
  EXPECT_GT(sm.final_valid_loss, 0.0);
  EXPECT_NE(sm.final_train_loss, s.final_train_loss);
  EXPECT_NE(log.str().find("intra-document masking"), std::string::npos);
  Config bad = c;
  bad.data.valid_path = temp_path("va0.bin") + "," + temp_path("nope.bin");
  expect_mentions(error_of([&] { run_training(bad, log); }), {"1 of 2 files missing"});
}

TEST(TokenData, EosAndIntraDocumentMaskConfig) {
  expect_mentions(error_of([] { parse_config("", {"data.eos_id=300"}); }), {"data.eos_id", "300", "vocab_size"});
  expect_mentions(error_of([] { parse_config("", {"data.intra_doc_mask=true"}); }), {"intra_doc_mask", "eos_id"});
  EXPECT_TRUE(parse_config("", {"data.eos_id=0", "data.intra_doc_mask=true"}).data.intra_doc_mask);
  EXPECT_EQ(parse_config("", {"data.eos_id=0"}).data.eos_id, 0);
}

TEST(Prepare, WritesByteTokensAndTheBigramEntropy) {
  write_bytes(temp_path("t.txt"), "abababababababab");
  PrepareResult r = prepare_text(temp_path("t.txt"), temp_path("prep"), 4, 2);
  EXPECT_EQ(r.train_tokens + r.valid_tokens, 16);
  EXPECT_EQ(r.valid_tokens, 8);  // every second 4-byte block
  EXPECT_NEAR(r.bigram_entropy_nats, 0.0, 1e-12);  // 'a' -> 'b' -> 'a' is deterministic
  EXPECT_NEAR(r.unigram_entropy_nats, std::log(2.0), 1e-12);
}

// A text too short for 20 blocks of 16 KiB still holds out a validation slice (smaller blocks);
// a slice too short for the default sequence length, or none at all, is said plainly.
TEST(Prepare, SmallTextsStillHoldOutValidationAndSaySoWhenTheyCannot) {
  struct Case {
    size_t bytes;
    bool valid_written;
    const char* warning;  // "" = none
  };
  const std::vector<Case> cases = {
      {300 * 1024, true, ""},         // the issue's case: 5% held out
      {40 * 1024, true, ""},
      {4000, true, "not enough for one instance"},  // 200 validation tokens
      {39, false, "no validation slice"},
      {2, false, "no validation slice"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.bytes);
    std::string text;
    for (size_t i = 0; i < c.bytes; ++i) text += static_cast<char>('a' + (i * 7 + i / 5) % 26);
    write_bytes(temp_path("small.txt"), text);
    const std::string out = temp_path("small_prep");
    std::filesystem::create_directories(out);
    write_bytes(out + "/valid.bin", "stale");  // an earlier prepare's slice must not survive
    const PrepareResult r = prepare_text(temp_path("small.txt"), out);
    EXPECT_EQ(r.train_tokens + r.valid_tokens, static_cast<int64_t>(c.bytes));
    EXPECT_EQ(std::filesystem::exists(out + "/valid.bin"), c.valid_written);
    if (c.valid_written) {
      EXPECT_GT(r.valid_tokens, 0);
      EXPECT_NEAR(static_cast<double>(r.valid_tokens) / static_cast<double>(c.bytes), 0.05, 0.01);
      EXPECT_EQ(static_cast<int64_t>(std::filesystem::file_size(out + "/valid.bin")), 2 * r.valid_tokens);
    } else {
      EXPECT_EQ(r.valid_tokens, 0);
    }
    if (*c.warning == 0) {
      EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
    } else {
      ASSERT_EQ(r.warnings.size(), 1u);
      EXPECT_NE(r.warnings[0].find(c.warning), std::string::npos) << r.warnings[0];
    }
  }
  // The default 16 KiB blocks are kept for texts of 20 blocks or more.
  std::string big(20 * 16384 + 10, 'q');
  write_bytes(temp_path("big.txt"), big);
  const PrepareResult r = prepare_text(temp_path("big.txt"), temp_path("big_prep"));
  EXPECT_EQ(r.block, 16384);
  EXPECT_EQ(r.valid_tokens, 16384);
}

// model.pad_id: a position whose next token is the pad id carries no label.
TEST(TokenData, PadPositionsCarryNoLabel) {
  std::vector<uint16_t> toks = {5, 6, 0, 0, 7, 8, 0, 9};
  write_bytes(temp_path("pad.bin"), pack(toks));
  TokenDataset d({temp_path("pad.bin")}, "uint16", 16, 8, "data.train_path", 0);
  int32_t ids[8], labels[8];
  d.instance(0, ids, labels);
  const std::vector<int32_t> want = {6, -1, -1, 7, 8, -1, 9, -1};
  EXPECT_EQ(std::vector<int32_t>(labels, labels + 8), want);
  TokenDataset no_pad({temp_path("pad.bin")}, "uint16", 16, 8);
  no_pad.instance(0, ids, labels);
  EXPECT_EQ(labels[1], 0);
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
