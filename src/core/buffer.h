// Owned, 64-byte aligned host memory, and Arena: one allocation carved into tensors up front so
// that the training step itself never allocates.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>

#include "core/tensor.h"

namespace moe {

class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);
  void* data() const { return mem_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> mem_;
  size_t bytes_ = 0;
};

// An owned tensor: a Buffer plus the view over it.
struct OwnedTensor {
  Buffer buffer;
  Tensor t;
  OwnedTensor() = default;
  OwnedTensor(DType dtype, std::initializer_list<int64_t> dims);
  operator const Tensor&() const { return t; }
  template <class T> T* as() const { return t.as<T>(); }
};

// Bump allocator over one Buffer. Plan sizes with a dry run (measure mode), then allocate.
class Arena {
 public:
  static constexpr size_t kAlign = 64;
  Arena() = default;
  explicit Arena(size_t bytes) : buffer_(bytes) {}
  Tensor alloc(DType dtype, std::initializer_list<int64_t> dims);
  size_t used() const { return used_; }
  size_t capacity() const { return buffer_.bytes(); }
  void reset() { used_ = 0; }
  // Bytes needed for a tensor, including alignment padding.
  static size_t footprint(DType dtype, std::initializer_list<int64_t> dims);

 private:
  Buffer buffer_;
  size_t used_ = 0;
};

}  // namespace moe
