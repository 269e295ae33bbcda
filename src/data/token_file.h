// Token files as OLMo-core writes them: flat little-endian uint16 or uint32 arrays (often named
// .npy without a header), memory-mapped and never read whole. Several files concatenate into one
// token stream, cut into fixed-length instances; the instance order is a Fisher-Yates shuffle
// over a counter-based RNG keyed by (seed, epoch), so it never depends on the C++ library.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moe {

class TokenFile {
 public:
  TokenFile(const std::string& path, const std::string& dtype, int64_t vocab_size);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  int64_t size() const { return num_tokens_; }
  // Token i, checked against the vocabulary (the error names the file and offset).
  int32_t at(int64_t i) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  size_t bytes_ = 0;   // mapped bytes
  size_t header_ = 0;  // .npy header bytes skipped
  int elem_size_ = 2;
  int64_t num_tokens_ = 0;
  int64_t vocab_size_ = 0;
};

class TokenDataset {
 public:
  TokenDataset(const std::vector<std::string>& paths, const std::string& dtype, int64_t vocab_size,
               int64_t seq_len);
  int64_t num_instances() const { return num_instances_; }
  int64_t seq_len() const { return seq_len_; }
  // Writes instance `index` (in file order) into ids (seq_len) and labels (seq_len):
  // labels[s] = ids[s+1]; the last position has no label (-1).
  void instance(int64_t index, int32_t* ids, int32_t* labels) const;

 private:
  std::vector<std::unique_ptr<TokenFile>> files_;
  std::vector<int64_t> file_start_;  // first global token of each file
  int64_t total_tokens_ = 0, seq_len_ = 0, num_instances_ = 0;
  int32_t token(int64_t global) const;
};

// Permutation of [0, n) for (seed, epoch): Fisher-Yates driven by Philox draws.
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, uint64_t epoch);

// Fills a step's batch (batch, seq_len) from the shuffled instance stream, starting at global
// instance position `position` (epoch = position / num_instances).
void fill_batch(const TokenDataset& data, uint64_t seed, int64_t position, const Tensor& ids,
                const Tensor& labels, std::vector<int64_t>& order_cache, int64_t& cached_epoch);

}  // namespace moe
