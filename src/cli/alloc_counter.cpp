// Heap allocation counter for `moecore bench`: every operator new in this binary (scalar, array,
// aligned, nothrow: all funnel through these two) counts one. Direct malloc calls (e.g. inside
// oneDNN) are not counted. A relaxed atomic increment per allocation, in this binary only.
// Sanitizer builds keep their own allocator (replacing it there mismatches new/free pairs).
// Its own translation unit: GCC's -Wmismatched-new-delete misreads the replaced operators when
// they are inlined into callers.
#include "cli/alloc_counter.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#if defined(__SANITIZE_ADDRESS__)
#define MOE_COUNT_ALLOCS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOE_COUNT_ALLOCS 0
#endif
#endif
#ifndef MOE_COUNT_ALLOCS
#define MOE_COUNT_ALLOCS 1
#endif

namespace {
std::atomic<uint64_t> g_allocs{0};
// The same count per thread (initial-exec TLS of the executable: a plain increment), read by
// bench to tell oneDNN's internal allocations from ours.
thread_local uint64_t t_allocs = 0;
uint64_t thread_allocs() { return t_allocs; }
}  // namespace

namespace moe::cli {
const std::atomic<uint64_t>* alloc_counter() { return MOE_COUNT_ALLOCS ? &g_allocs : nullptr; }
ThreadAllocReader thread_alloc_reader() { return MOE_COUNT_ALLOCS ? &thread_allocs : nullptr; }
}  // namespace moe::cli

#if MOE_COUNT_ALLOCS
void* operator new(std::size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  ++t_allocs;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t al) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  ++t_allocs;
  const std::size_t a = static_cast<std::size_t>(al);
  if (void* p = std::aligned_alloc(a, (std::max<std::size_t>(n, 1) + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif
