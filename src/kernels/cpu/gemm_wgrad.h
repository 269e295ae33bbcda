// Weight-gradient chunks on our own AVX-512 micro-kernels (gemm_wgrad.cpp), used by the GEMM tiles
// (gemm_tiles.cpp) in place of oneDNN's matmul for every weight-gradient call where this build
// has them: fp32 with AVX-512F, bf16 with AVX512-BF16. oneDNN ran these at 64-72% of the peak
// (kernels_bench, Zen 5: dw = dy^T x has its reduction over the tokens, dy's columns as the
// rows of dw, so its A is a transposed, strided block that oneDNN's brgemm wants copied dense).
//
// One call: c (band x k, dense) = (overwrite ? 0 : c) + P, P[i][j] = sum over r < rows of
// a[r][i] * b[r][j], with a (rows x band at leading dimension lda) and b (rows x k at ldb) of
// `t`. Each P[i][j] is one chain over r in order (fp32: an FMA per r from 0; bf16: a vdpbf16ps
// per pair of rows, a missing last row zero), then added to c in one rounding: its bits depend on
// its own column of a and b only, never on band, k, the thread or the alignment.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"

namespace moe::cpu::wgrad {

// Whether this build has the micro-kernel for operands of `t`.
bool available(DType t);
// Per-thread scratch that chunk() needs for these sizes.
size_t scratch_bytes(DType t, int64_t rows, int64_t band, int64_t k);
void chunk(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, int64_t rows, int64_t band, int64_t k,
           float* c, bool overwrite, void* scratch);

}  // namespace moe::cpu::wgrad
