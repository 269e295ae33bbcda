// <immintrin.h> for the cpu kernels' AVX-512 code (attention_simd.h, moe_routing.cpp), read with
// GCC 12's false -W(maybe-)uninitialized off: it raises them inside avx512fintrin.h for
// intrinsics whose pass-through operand is _mm512_undefined_ps() (max, unpack, shuffle, the
// reductions, ...). The state must be set before the header is read, since the warning is located
// in the header. Nothing without AVX-512. Also the one mask every 16-lane loop's tail takes.
#pragma once

#if defined(__AVX512F__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace moe::cpu {
// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1u);
}
}  // namespace moe::cpu
#endif
