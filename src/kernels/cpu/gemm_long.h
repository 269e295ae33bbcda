// The bf16 data gradient of a long reduction on our own micro-kernels (gemm_long.cpp), used by the
// GEMM tiles (gemm_tiles.cpp) in place of oneDNN where this build has AVX512-BF16: an LM head's
// dx(m,k) = dy(m,n) * w(n,k), reducing over the vocabulary n. oneDNN ran it at ~70% of the bf16
// peak (its JIT GEMM on dy's strided column blocks; its brgemm over the whole reduction was
// slower): dy's rows already hold the pairs along n that vdpbf16ps wants, and w is paired once per
// op (pair_rows), so nothing else is packed.
//
// Each dx element is one chain over n in order (pairs of n, a missing last one zero), from zero:
// its bits depend on its own row of dy and column of w only, never on the band or the thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"

namespace moe::cpu::longred {

// Whether this build has the kernel for operands of `t` (bf16 with AVX512-BF16 only: fp32's
// JIT GEMM already runs at ~88% there).
bool available(DType t);
// w (n x k bf16, row-major) as pair rows: wp[p][j] = (w[2p][j], w[2p+1][j]) for p in [p0, p1),
// pair_stride(k) words each (k rounded up to the micro-kernel's width: its loads never pass a
// row, zeros past k); a missing row 2p+1 is zero. pair_words(n, k) words in all.
int64_t pair_stride(int64_t k);
int64_t pair_words(int64_t n, int64_t k);
void pair_rows(const void* w, int64_t n, int64_t k, int64_t p0, int64_t p1, uint32_t* wp);
// dx rows [0, rows) (k columns at ldc) = dy rows (n values at ldy) * w, from the pair rows wp.
void band(const void* dy, int64_t ldy, const uint32_t* wp, int64_t n, int64_t k, int64_t rows, float* dx,
          int64_t ldc);

}  // namespace moe::cpu::longred
