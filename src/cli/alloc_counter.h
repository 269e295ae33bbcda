// Heap allocation counter for `moecore bench` (alloc_counter.cpp replaces operator new/delete in
// the moecore executable only). nullptr when not counting (sanitizer builds).
#pragma once

#include <atomic>
#include <cstdint>

namespace moe::cli {

const std::atomic<uint64_t>* alloc_counter();
// The calling thread's count, or nullptr.
using ThreadAllocReader = uint64_t (*)();
ThreadAllocReader thread_alloc_reader();

}  // namespace moe::cli
