// Owned memory. An Allocator says where bytes live (host, or a backend's device); a Buffer owns
// one allocation and stamps its device on every view; Arena carves one Buffer into tensors up
// front so that the training step itself never allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/tensor.h"

namespace moe {

// A source of memory. Backends implement it for their device (kernels/ops.h); host_memory() is
// plain host memory for host-only data (files, staging, test inputs).
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // At least `bytes` bytes, 64-byte aligned. Contents are undefined unless the allocator says
  // otherwise (the strict backend fills them with NaN bytes, as cudaMalloc does not zero).
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) noexcept = 0;
};

// Host memory, zero-filled.
Allocator& host_memory();

// What the allocations made while it lives are for ("the activation arena"), so a device
// allocator's out-of-memory error can name the component. Nested scopes: the innermost names it.
class AllocationScope {
 public:
  explicit AllocationScope(const char* what);
  ~AllocationScope();
  AllocationScope(const AllocationScope&) = delete;
  AllocationScope& operator=(const AllocationScope&) = delete;
  static const char* current();  // "" outside any scope

 private:
  const char* previous_;
};

class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes) : Buffer(host_memory(), bytes) {}
  Buffer(Allocator& from, size_t bytes);
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    Buffer(std::move(o)).swap(*this);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return from_ ? from_->device() : Device::kCpu; }
  // A view of the first numel(dims) elements, stamped with this buffer's device.
  Tensor view(DType dtype, std::initializer_list<int64_t> dims) const;

 private:
  void swap(Buffer& o) noexcept;
  Allocator* from_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// An owned tensor: a Buffer plus the view over it.
struct OwnedTensor {
  Buffer buffer;
  Tensor t;
  OwnedTensor() = default;
  OwnedTensor(DType dtype, std::initializer_list<int64_t> dims);  // host memory, zeroed
  OwnedTensor(Allocator& from, DType dtype, std::initializer_list<int64_t> dims);
  operator const Tensor&() const { return t; }
  template <class T> T* as() const { return t.as<T>(); }
  uint8_t* bytes() const { return t.bytes(); }
};

// Bump allocator over one Buffer. Plan sizes with a dry run (measure mode), then allocate.
class Arena {
 public:
  static constexpr size_t kAlign = 64;
  Arena() = default;
  explicit Arena(size_t bytes) : buffer_(bytes) {}
  Arena(Allocator& from, size_t bytes) : buffer_(from, bytes) {}
  Tensor alloc(DType dtype, std::initializer_list<int64_t> dims);
  size_t used() const { return used_; }
  size_t capacity() const { return buffer_.bytes(); }
  Device device() const { return buffer_.device(); }
  void reset() { used_ = 0; }
  // Bytes needed for a tensor, including alignment padding.
  static uint64_t footprint(DType dtype, std::initializer_list<int64_t> dims);

 private:
  Buffer buffer_;
  size_t used_ = 0;
};

}  // namespace moe
