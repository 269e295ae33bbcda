#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "core/rng.h"
#include "core/user_path.h"

namespace moe {
namespace {

int elem_size_of(const std::string& dtype) {
  MOE_CHECK(dtype == "uint8" || dtype == "uint16" || dtype == "uint32", "token dtype '", dtype,
            "' (allowed: uint8, uint16, uint32)");
  return dtype == "uint8" ? 1 : dtype == "uint16" ? 2 : 4;
}

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// The value text of 'key' in a .npy header dict (Python literal), or "" when absent.
std::string npy_value(const std::string& dict, const std::string& key) {
  size_t k = dict.find("'" + key + "'");
  if (k == std::string::npos) return "";
  size_t colon = dict.find(':', k);
  if (colon == std::string::npos) return "";
  size_t v = dict.find_first_not_of(" ", colon + 1);
  if (v == std::string::npos) return "";
  if (dict[v] == '(') {
    size_t e = dict.find(')', v);
    return e == std::string::npos ? "" : dict.substr(v, e - v + 1);
  }
  if (dict[v] == '\'' || dict[v] == '"') {
    size_t e = dict.find(dict[v], v + 1);
    return e == std::string::npos ? "" : dict.substr(v + 1, e - v - 1);
  }
  size_t e = dict.find_first_of(",}", v);
  return trim(dict.substr(v, e == std::string::npos ? std::string::npos : e - v));
}

// Parses a real .npy header (the file starts with "\x93NUMPY"): checks descr against dtype,
// fortran_order False and a 1-D shape consistent with the data bytes. Returns the header size.
size_t parse_npy_header(int fd, const std::string& path, size_t file_bytes, const std::string& dtype,
                        int elem) {
  unsigned char head[12];
  MOE_CHECK(file_bytes >= 10 && ::pread(fd, head, 10, 0) == 10, "'", path, "': .npy file too short for a header");
  const int major = head[6];
  MOE_CHECK(major >= 1 && major <= 3, "'", path, "': .npy version ", major, " at byte offset 6 (supported: 1, 2, 3)");
  size_t len = 0, pre = 10;
  if (major == 1) {
    len = static_cast<size_t>(head[8]) | (static_cast<size_t>(head[9]) << 8);
  } else {
    MOE_CHECK(file_bytes >= 12 && ::pread(fd, head, 12, 0) == 12, "'", path, "': .npy file too short for a header");
    len = static_cast<size_t>(head[8]) | (static_cast<size_t>(head[9]) << 8) |
          (static_cast<size_t>(head[10]) << 16) | (static_cast<size_t>(head[11]) << 24);
    pre = 12;
  }
  MOE_CHECK(pre + len <= file_bytes, "'", path, "': .npy header of ", len, " bytes at byte offset ", pre,
            " runs past the end of the file (", file_bytes, " bytes): truncated");
  std::string dict(len, '\0');
  MOE_CHECK(::pread(fd, dict.data(), len, static_cast<off_t>(pre)) == static_cast<ssize_t>(len), "'", path,
            "': cannot read the .npy header");
  const std::string descr = npy_value(dict, "descr"), fortran = npy_value(dict, "fortran_order"),
                    shape = npy_value(dict, "shape");
  MOE_CHECK(!descr.empty() && !fortran.empty() && !shape.empty(), "'", path,
            "': malformed .npy header at byte offset ", pre, " (needs descr, fortran_order, shape): ", trim(dict));
  const std::string want = elem == 1 ? "|u1" : elem == 2 ? "<u2" : "<u4";
  std::string have = descr;
  if (have == "u1" || have == "<u1") have = "|u1";
  MOE_CHECK(have == want, "'", path, "': .npy descr '", descr, "' (header at byte offset ", pre,
            ") does not match token dtype ", dtype, " ('", want,
            "'); set data.token_dtype to the file's type (|u1 = uint8, <u2 = uint16, <u4 = uint32)");
  MOE_CHECK(fortran == "False", "'", path, "': .npy fortran_order ", fortran, " (must be False)");
  // shape: "(N,)" exactly one dimension.
  std::string inner = trim(shape.substr(1, shape.size() - 2));
  if (!inner.empty() && inner.back() == ',') inner.pop_back();
  inner = trim(inner);
  MOE_CHECK(!inner.empty() && inner.find(',') == std::string::npos &&
                inner.find_first_not_of("0123456789") == std::string::npos && inner.size() <= 18,
            "'", path, "': .npy shape ", shape, " is not 1-D (token files are flat arrays)");
  const unsigned long long n = std::stoull(inner);
  const size_t header = pre + len, data = file_bytes - header;
  MOE_CHECK(n * static_cast<unsigned long long>(elem) == data, "'", path, "': .npy shape ", shape, " needs ",
            n * static_cast<unsigned long long>(elem), " data bytes but the file holds ", data,
            " after the header (data from byte offset ", header, "): truncated or wrong shape");
  return header;
}

}  // namespace

std::vector<std::string> split_paths(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string p = trim(list.substr(start, end - start));
    if (!p.empty()) out.push_back(p);
    start = end + 1;
  }
  return out;
}

TokenFile::TokenFile(const std::string& path, const std::string& dtype, int64_t vocab_size, std::string_view what)
    : path_(path), vocab_size_(vocab_size) {
  elem_size_ = elem_size_of(dtype);
  check_input_file(path, what);  // before open(): a FIFO would block it
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
  unsigned char magic[6];
  if (bytes_ >= 6 && ::pread(fd, magic, 6, 0) == 6 && std::memcmp(magic, "\x93NUMPY", 6) == 0) {
    header = parse_npy_header(fd, path, bytes_, dtype, elem_size_);
    MOE_CHECK(header <= bytes_, "'", path, "': .npy header of ", header, " bytes exceeds the file (",
              bytes_, " bytes)");
  }
  if ((bytes_ - header) % static_cast<size_t>(elem_size_) != 0) {
    MOE_FAIL("token file '", path, "' has ", bytes_ - header, " data bytes, not a multiple of ", elem_size_,
             " (", dtype, "): truncated or wrong token_dtype (last partial token at byte offset ",
             bytes_ - (bytes_ - header) % static_cast<size_t>(elem_size_), ")");
  }
  num_tokens_ = static_cast<int64_t>((bytes_ - header) / static_cast<size_t>(elem_size_));
  MOE_CHECK(num_tokens_ > 0, what, " '", path, "' holds no tokens (a .npy header and no data)");
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
  if (elem_size_ == 1) {
    v = data_[i];
  } else if (elem_size_ == 2) {
    uint16_t s;
    std::memcpy(&s, data_ + i * 2, 2);
    v = s;
  } else {
    std::memcpy(&v, data_ + i * 4, 4);
  }
  MOE_CHECK(static_cast<int64_t>(v) < vocab_size_, "token id ", v, " >= vocab_size ", vocab_size_,
            " in '", path_, "' at token offset ", i, " (byte offset ",
            header_ + static_cast<size_t>(i) * static_cast<size_t>(elem_size_), ")");
  return static_cast<int32_t>(v);
}

TokenDataset::TokenDataset(const std::vector<std::string>& paths, const std::string& dtype,
                           int64_t vocab_size, int64_t seq_len, std::string_view what, int64_t pad_id)
    : seq_len_(seq_len), pad_id_(pad_id) {
  MOE_CHECK(!paths.empty(), what, ": no token file given (name one or more files, comma-separated)");
  for (const auto& p : paths) {
    files_.push_back(std::make_unique<TokenFile>(p, dtype, vocab_size, what));
    file_start_.push_back(total_tokens_);
    total_tokens_ += files_.back()->size();
  }
  num_instances_ = total_tokens_ / seq_len;  // the remainder is dropped, as OLMo-core does
  MOE_CHECK(num_instances_ > 0, what, ": the token files hold ", total_tokens_,
            " tokens, fewer than one instance of train.seq_len = ", seq_len, " (", paths.front(),
            paths.size() > 1 ? ", ..." : "", ")");
}

int32_t TokenDataset::token(int64_t g) const {
  // Binary search for the last file starting at or before g (empty files are skipped).
  size_t lo = 0, hi = files_.size();
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (file_start_[mid] <= g) lo = mid;
    else hi = mid;
  }
  while (g - file_start_[lo] >= files_[lo]->size()) ++lo;
  return files_[lo]->at(g - file_start_[lo]);
}

void TokenDataset::instance(int64_t index, int32_t* ids, int32_t* labels) const {
  MOE_CHECK(index >= 0 && index < num_instances_, "instance ", index, " out of range");
  const int64_t base = index * seq_len_;
  for (int64_t s = 0; s < seq_len_; ++s) ids[s] = token(base + s);
  for (int64_t s = 0; s + 1 < seq_len_; ++s) labels[s] = pad_id_ >= 0 && ids[s + 1] == pad_id_ ? -1 : ids[s + 1];
  labels[seq_len_ - 1] = -1;
}

void document_starts(const int32_t* ids, int64_t S, int32_t eos_id, int32_t* doc_start) {
  int32_t start = 0;
  for (int64_t s = 0; s < S; ++s) {
    doc_start[s] = start;
    if (eos_id >= 0 && ids[s] == eos_id) start = static_cast<int32_t>(s + 1);
  }
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

int64_t InstanceOrder::at(int64_t position) {
  MOE_CHECK(position >= 0, "negative data position ", position);
  const int64_t epoch = position / n_;
  if (epoch != epoch_) {
    order_ = shuffled_order(n_, seed_, static_cast<uint64_t>(epoch));
    epoch_ = epoch;
  }
  return order_[static_cast<size_t>(position % n_)];
}

std::vector<int64_t> InstanceOrder::range(int64_t position, int64_t count) {
  std::vector<int64_t> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = at(position + i);
  return out;
}

std::vector<int64_t> rank_slice(const std::vector<int64_t>& global, int64_t rank, int64_t world) {
  MOE_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " out of range for world size ", world);
  MOE_CHECK(static_cast<int64_t>(global.size()) % world == 0, "global batch of ", global.size(),
            " instances is not a multiple of the world size ", world);
  // Contiguous blocks: data-parallel rank r's micro-batches are global micro-batches
  // r*n/world ..., so a distributed step sees the same micro-batches as one process.
  const size_t n = global.size() / static_cast<size_t>(world), begin = static_cast<size_t>(rank) * n;
  return std::vector<int64_t>(global.begin() + static_cast<std::ptrdiff_t>(begin),
                              global.begin() + static_cast<std::ptrdiff_t>(begin + n));
}

void fill_batch(const TokenDataset& data, InstanceOrder& order, int64_t position, const Tensor& ids,
                const Tensor& labels, int64_t rank, int64_t world, const Tensor* doc_start, int32_t eos_id) {
  const int64_t B = ids.dim(0), S = ids.dim(1);
  MOE_CHECK(S == data.seq_len(), "batch seq_len ", S, " != dataset seq_len ", data.seq_len());
  const std::vector<int64_t> mine = rank_slice(order.range(position, B * world), rank, world);
  for (int64_t b = 0; b < B; ++b) {
    int32_t* row = ids.as<int32_t>() + b * S;
    data.instance(mine[static_cast<size_t>(b)], row, labels.as<int32_t>() + b * S);
    if (doc_start) document_starts(row, S, eos_id, doc_start->as<int32_t>() + b * S);
  }
}

void fill_batch(const TokenDataset& data, uint64_t seed, int64_t position, const Tensor& ids,
                const Tensor& labels, std::vector<int64_t>& order_cache, int64_t& cached_epoch,
                int64_t rank, int64_t world) {
  const int64_t B = ids.dim(0), S = ids.dim(1), n = data.num_instances();
  MOE_CHECK(S == data.seq_len(), "batch seq_len ", S, " != dataset seq_len ", data.seq_len());
  std::vector<int64_t> global(static_cast<size_t>(B * world));
  for (int64_t i = 0; i < B * world; ++i) {
    const int64_t p = position + i, epoch = p / n;
    if (epoch != cached_epoch) {
      order_cache = shuffled_order(n, seed, static_cast<uint64_t>(epoch));
      cached_epoch = epoch;
    }
    global[static_cast<size_t>(i)] = order_cache[static_cast<size_t>(p % n)];
  }
  const std::vector<int64_t> mine = rank_slice(global, rank, world);
  for (int64_t b = 0; b < B; ++b)
    data.instance(mine[static_cast<size_t>(b)], ids.as<int32_t>() + b * S, labels.as<int32_t>() + b * S);
}

}  // namespace moe
