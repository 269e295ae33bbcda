#include "core/buffer.h"

#include <cstdlib>
#include <cstring>

namespace moe {

Buffer::Buffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  MOE_CHECK(p != nullptr, "out of memory allocating ", bytes, " bytes");
  std::memset(p, 0, rounded);
  mem_.reset(p);
}

void Buffer::Free::operator()(void* p) const { std::free(p); }

OwnedTensor::OwnedTensor(DType dtype, std::initializer_list<int64_t> dims)
    : t(nullptr, dtype, dims) {
  buffer = Buffer(t.nbytes());
  t.data = buffer.data();
}

size_t Arena::footprint(DType dtype, std::initializer_list<int64_t> dims) {
  Tensor t(nullptr, dtype, dims);
  return (t.nbytes() + kAlign - 1) / kAlign * kAlign;
}

Tensor Arena::alloc(DType dtype, std::initializer_list<int64_t> dims) {
  size_t need = footprint(dtype, dims);
  MOE_CHECK(used_ + need <= buffer_.bytes(), "arena exhausted: need ", need, " bytes, ",
            buffer_.bytes() - used_, " left of ", buffer_.bytes());
  Tensor t(static_cast<char*>(buffer_.data()) + used_, dtype, dims);
  used_ += need;
  return t;
}

}  // namespace moe
