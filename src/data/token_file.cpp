#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>

#include "core/rng.h"

namespace moe {

TokenFile::TokenFile(const std::string& path, const std::string& dtype, int64_t vocab_size)
    : path_(path), vocab_size_(vocab_size) {
  MOE_CHECK(dtype == "uint16" || dtype == "uint32", "token dtype '", dtype, "' (allowed: uint16, uint32)");
  elem_size_ = dtype == "uint16" ? 2 : 4;
  int fd = ::open(path.c_str(), O_RDONLY);
  MOE_CHECK(fd >= 0, "cannot open token file '", path, "': ", std::strerror(errno));
  struct CloseOnExit {  // every error below throws: the descriptor must not leak (found by fuzzing)
    int fd;
    ~CloseOnExit() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  ::fstat(fd, &st);
  bytes_ = static_cast<size_t>(st.st_size);
  size_t header = 0;
  if (bytes_ >= 10) {
    // A real .npy file: skip its header (magic, version, header length, dict).
    unsigned char head[10];
    if (::pread(fd, head, 10, 0) == 10 && std::memcmp(head, "\x93NUMPY", 6) == 0) {
      const size_t len = head[6] == 1 ? static_cast<size_t>(head[8] | (head[9] << 8)) : 0;
      header = 10 + len;
      MOE_CHECK(head[6] == 1, "'", path, "': only .npy version 1 headers are supported");
      MOE_CHECK(header <= bytes_, "'", path, "': .npy header of ", header, " bytes exceeds the file (",
                bytes_, " bytes)");
    }
  }
  MOE_CHECK((bytes_ - header) % static_cast<size_t>(elem_size_) == 0, "token file '", path, "' has ",
            bytes_ - header, " data bytes, not a multiple of ", elem_size_, " (", dtype,
            "): truncated or wrong token_dtype");
  num_tokens_ = static_cast<int64_t>((bytes_ - header) / static_cast<size_t>(elem_size_));
  if (bytes_ > 0) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    MOE_CHECK(p != MAP_FAILED, "cannot map token file '", path, "'");
    data_ = static_cast<const unsigned char*>(p) + header;
    header_ = header;
  }
}

TokenFile::~TokenFile() {
  if (data_) ::munmap(const_cast<unsigned char*>(data_ - header_), bytes_);
}

int32_t TokenFile::at(int64_t i) const {
  uint32_t v;
  if (elem_size_ == 2) {
    uint16_t s;
    std::memcpy(&s, data_ + i * 2, 2);
    v = s;
  } else {
    std::memcpy(&v, data_ + i * 4, 4);
  }
  MOE_CHECK(static_cast<int64_t>(v) < vocab_size_, "token id ", v, " >= vocab_size ", vocab_size_,
            " in '", path_, "' at token offset ", i);
  return static_cast<int32_t>(v);
}

TokenDataset::TokenDataset(const std::vector<std::string>& paths, const std::string& dtype,
                           int64_t vocab_size, int64_t seq_len)
    : seq_len_(seq_len) {
  MOE_CHECK(!paths.empty(), "no token files given");
  for (const auto& p : paths) {
    files_.push_back(std::make_unique<TokenFile>(p, dtype, vocab_size));
    file_start_.push_back(total_tokens_);
    total_tokens_ += files_.back()->size();
  }
  num_instances_ = total_tokens_ / seq_len;  // the remainder is dropped, as OLMo-core does
  MOE_CHECK(num_instances_ > 0, "token files hold ", total_tokens_, " tokens, fewer than one instance of ",
            seq_len, " (", paths.front(), ")");
}

int32_t TokenDataset::token(int64_t g) const {
  size_t f = files_.size() - 1;
  while (file_start_[f] > g) --f;
  return files_[f]->at(g - file_start_[f]);
}

void TokenDataset::instance(int64_t index, int32_t* ids, int32_t* labels) const {
  MOE_CHECK(index >= 0 && index < num_instances_, "instance ", index, " out of range");
  const int64_t base = index * seq_len_;
  for (int64_t s = 0; s < seq_len_; ++s) ids[s] = token(base + s);
  for (int64_t s = 0; s + 1 < seq_len_; ++s) labels[s] = ids[s + 1];
  labels[seq_len_ - 1] = -1;
}

std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, uint64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  const uint64_t stream = static_cast<uint64_t>(RngStream::kDataShuffle) | (epoch << 8);
  for (int64_t i = n - 1; i > 0; --i) {
    // j uniform in [0, i] from 53 random bits (bias < 2^-20 for any n here).
    const double u = random_uniform(seed, stream, static_cast<uint64_t>(i));
    int64_t j = static_cast<int64_t>(u * static_cast<double>(i + 1));
    if (j > i) j = i;
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

void fill_batch(const TokenDataset& data, uint64_t seed, int64_t position, const Tensor& ids,
                const Tensor& labels, std::vector<int64_t>& order_cache, int64_t& cached_epoch) {
  const int64_t B = ids.dim(0), S = ids.dim(1), n = data.num_instances();
  MOE_CHECK(S == data.seq_len(), "batch seq_len ", S, " != dataset seq_len ", data.seq_len());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = position + b, epoch = p / n;
    if (epoch != cached_epoch) {
      order_cache = shuffled_order(n, seed, static_cast<uint64_t>(epoch));
      cached_epoch = epoch;
    }
    data.instance(order_cache[static_cast<size_t>(p % n)], ids.as<int32_t>() + b * S, labels.as<int32_t>() + b * S);
  }
}

}  // namespace moe
