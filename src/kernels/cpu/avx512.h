// <immintrin.h> for the cpu kernels' AVX-512 code (attention_simd.h, moe_routing.cpp), read with
// GCC 12's false -W(maybe-)uninitialized off: it raises them inside avx512fintrin.h for
// intrinsics whose pass-through operand is _mm512_undefined_ps() (max, unpack, shuffle, the
// reductions, ...). The state must be set before the header is read, since the warning is located
// in the header. Nothing without AVX-512.
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
#endif
