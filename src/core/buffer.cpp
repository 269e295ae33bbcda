#include "core/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace moe {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

class HostMemory final : public Allocator {
 public:
  Device device() const override { return Device::kCpu; }
  void* allocate(size_t bytes) override {
    // Buffers of a huge page or more (the arena, parameters, gradients, optimizer state, the
    // kernels' grow-only panels) are aligned to huge pages and asked for them where the kernel
    // gives them on request (transparent_hugepage = madvise), before the zeroing touches them.
    const size_t align = bytes >= kHugePage ? kHugePage : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    MOE_CHECK(p != nullptr, "out of memory allocating ", bytes, " bytes");
    if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: its failure changes nothing
    std::memset(p, 0, rounded);
    return p;
  }
  void deallocate(void* p, size_t) noexcept override { std::free(p); }
};

}  // namespace

Allocator& host_memory() {
  // Never destroyed: thread_local Buffers of pool threads (kernel scratch) are freed at thread
  // exit, which can come after static destruction at process exit.
  static HostMemory* const host = new HostMemory;
  return *host;
}

Buffer::Buffer(Allocator& from, size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  data_ = from.allocate(bytes);
  from_ = &from;
}

Buffer::~Buffer() {
  if (from_) from_->deallocate(data_, bytes_);
}

void Buffer::swap(Buffer& o) noexcept {
  std::swap(from_, o.from_);
  std::swap(data_, o.data_);
  std::swap(bytes_, o.bytes_);
}

Tensor Buffer::view(DType dtype, std::initializer_list<int64_t> dims) const {
  Tensor t(data_, dtype, dims, device());
  MOE_CHECK(t.nbytes() <= bytes_, "view ", t.shape_str(), " ", dtype_name(dtype), " needs ", t.nbytes(),
            " bytes, the buffer has ", bytes_);
  return t;
}

OwnedTensor::OwnedTensor(DType dtype, std::initializer_list<int64_t> dims) : OwnedTensor(host_memory(), dtype, dims) {}

OwnedTensor::OwnedTensor(Allocator& from, DType dtype, std::initializer_list<int64_t> dims)
    : t(nullptr, dtype, dims) {
  buffer = Buffer(from, t.nbytes());
  t.data = buffer.data();
  t.device = from.device();
}

uint64_t Arena::footprint(DType dtype, std::initializer_list<int64_t> dims) {
  // 64-bit whatever size_t is: the planner measures plans of many GiB in WebAssembly (32-bit).
  uint64_t n = dtype_size(dtype);
  for (int64_t d : dims) n *= static_cast<uint64_t>(d);
  return (n + kAlign - 1) / kAlign * kAlign;
}

Tensor Arena::alloc(DType dtype, std::initializer_list<int64_t> dims) {
  const auto need = static_cast<size_t>(footprint(dtype, dims));
  MOE_CHECK(used_ + need <= buffer_.bytes(), "arena exhausted: need ", need, " bytes, ",
            buffer_.bytes() - used_, " left of ", buffer_.bytes());
  Tensor t(static_cast<char*>(buffer_.data()) + used_, dtype, dims, buffer_.device());
  used_ += need;
  return t;
}

namespace {
thread_local const char* g_allocation_scope = "";
}  // namespace

AllocationScope::AllocationScope(const char* what) : previous_(g_allocation_scope) { g_allocation_scope = what; }
AllocationScope::~AllocationScope() { g_allocation_scope = previous_; }
const char* AllocationScope::current() { return g_allocation_scope; }

}  // namespace moe
