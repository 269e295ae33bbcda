// Token files as OLMo-core writes them: flat little-endian uint16 or uint32 arrays (often named
// .npy without a header) or real .npy files (header parsed and checked), memory-mapped and never
// read whole. Several files concatenate into one token stream, cut into fixed-length instances;
// the instance order is a Fisher-Yates shuffle over a counter-based RNG keyed by (seed, epoch),
// so it never depends on the C++ library. Documents are separated by an EOS id; with
// intra-document masking each position also gets the start of its document inside the instance.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace moe {

// "a.npy,b.npy" -> {"a.npy", "b.npy"} (empty entries and surrounding spaces dropped). The config
// keeps data.train_path / data.valid_path as strings, so several files are comma-separated.
std::vector<std::string> split_paths(const std::string& list);

class TokenFile {
 public:
  // dtype: uint8 | uint16 | uint32. A .npy header's descr must match it (|u1, <u2, <u4).
  // what: the key that named the file (errors name it); the file must be a non-empty regular file.
  TokenFile(const std::string& path, const std::string& dtype, int64_t vocab_size,
            std::string_view what = "token file");
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  int64_t size() const { return num_tokens_; }
  // Token i, checked against the vocabulary (the error names the file and offset).
  int32_t at(int64_t i) const;
  const std::string& path() const { return path_; }
  size_t header_bytes() const { return header_; }

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
  // what: the key that gave the paths ("data.train_path"), named by every error.
  // pad_id >= 0: positions whose next token is pad_id carry no label (model.pad_id).
  TokenDataset(const std::vector<std::string>& paths, const std::string& dtype, int64_t vocab_size,
               int64_t seq_len, std::string_view what = "token files", int64_t pad_id = -1);
  int64_t num_instances() const { return num_instances_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t num_tokens() const { return total_tokens_; }
  int64_t num_files() const { return static_cast<int64_t>(files_.size()); }
  // Writes instance `index` (in stream order) into ids (seq_len) and labels (seq_len):
  // labels[s] = ids[s+1] (-1 where ids[s+1] is the pad id); the last position has no label (-1).
  // Instances may span files.
  void instance(int64_t index, int32_t* ids, int32_t* labels) const;

 private:
  std::vector<std::unique_ptr<TokenFile>> files_;
  std::vector<int64_t> file_start_;  // first global token of each file
  int64_t total_tokens_ = 0, seq_len_ = 0, num_instances_ = 0, pad_id_ = -1;
  int32_t token(int64_t global) const;
};

// Intra-document masking: doc_start[s] = first position of the document holding position s,
// within one instance of S ids. A document ends with its EOS token (the EOS belongs to the
// document it closes); the next position starts a new one. Position s may attend to t iff
// doc_start[s] <= t <= s. RoPE positions stay positions within the instance.
void document_starts(const int32_t* ids, int64_t S, int32_t eos_id, int32_t* doc_start);

// Permutation of [0, n) for (seed, epoch): Fisher-Yates driven by Philox draws.
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, uint64_t epoch);

// The instance indices of global stream positions [position, position + count): position p is
// instance shuffled_order(n, seed, p / n)[p % n]. The loader's whole state is `position`.
class InstanceOrder {
 public:
  InstanceOrder(int64_t num_instances, uint64_t seed) : n_(num_instances), seed_(seed) {}
  int64_t at(int64_t position);
  std::vector<int64_t> range(int64_t position, int64_t count);

 private:
  int64_t n_;
  uint64_t seed_;
  std::vector<int64_t> order_;
  int64_t epoch_ = -1;
};

// Data parallelism: rank r of W takes the contiguous block global[r*n/W, (r+1)*n/W) of a global
// batch of n (so its micro-batches are the global batch's micro-batches r*n/W/mbs, ...; OLMo-core
// strides, indices[rank::world], which changes the micro-batches). n must be a multiple of W.
std::vector<int64_t> rank_slice(const std::vector<int64_t>& global, int64_t rank, int64_t world);

// Fills a step's batch (batch, seq_len) from the shuffled instance stream. The global batch is
// positions [position, position + batch * world); this rank gets rank_slice of it. doc_start,
// when given (batch, seq_len) i32, receives document_starts of each row for eos_id.
void fill_batch(const TokenDataset& data, uint64_t seed, int64_t position, const Tensor& ids,
                const Tensor& labels, std::vector<int64_t>& order_cache, int64_t& cached_epoch,
                int64_t rank = 0, int64_t world = 1);
void fill_batch(const TokenDataset& data, InstanceOrder& order, int64_t position, const Tensor& ids,
                const Tensor& labels, int64_t rank = 0, int64_t world = 1,
                const Tensor* doc_start = nullptr, int32_t eos_id = -1);

}  // namespace moe
