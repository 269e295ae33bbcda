// The alignment a pointer has, as cuBLASLt's MIN_ALIGNMENT preferences take it: the largest power
// of two dividing the address, capped at 256 bytes (cuBLASLt's default, which assumes it; our arena
// tensors are only 64-byte aligned). Plain C++: the host tests check it without a GPU.
#pragma once

#include <cstdint>

namespace moe::cuda {

constexpr uint32_t kMaxAlignment = 256;

constexpr uint32_t pointer_alignment(uintptr_t address, uint32_t cap = kMaxAlignment) {
  if (address == 0) return cap;
  const uintptr_t low = address & (~address + 1);  // the lowest set bit
  return low < cap ? static_cast<uint32_t>(low) : cap;
}
inline uint32_t pointer_alignment(const void* p) { return pointer_alignment(reinterpret_cast<uintptr_t>(p)); }

}  // namespace moe::cuda
