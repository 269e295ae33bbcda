// oneDNN matmul primitives behind the CPU GEMM ops (kernels/cpu/gemm.cpp).
//
// Every primitive here is created while OpenMP reports one thread, so its blocking (and hence
// its summation order) never depends on the thread count, and is executed on one thread inside
// the ops' own OpenMP regions. Primitives are cached by their full description (shape, strides,
// dtypes, accumulate), so a training step creates none after its first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace moe::cpu {

// The three GEMMs of a linear layer, in the ops' own terms:
//   kForward:        y(m,n)  = x(m,k) * w(n,k)^T
//   kBackwardData:   dx(m,k) = dy(m,n) * w(n,k)
//   kBackwardWeight: dw(n,k) += dy(m,n)^T * x(m,k)
enum class GemmOp { kForward, kBackwardData, kBackwardWeight };

// oneDNN's implementation string (primitive_desc::impl_info_str(), e.g. "brg:avx512_core_bf16")
// for the primitive the CPU backend would use for one tile of this GEMM with operands of
// `dtype` (f32 or bf16).
std::string gemm_impl_info(GemmOp op, DType dtype, int64_t m, int64_t n, int64_t k);

namespace gemm {

enum class Trans : uint8_t { kN, kT };

// C(m,n) (= or +=) A(m,k) * B(k,n), with A and B of `dtype` (f32 or bf16) and C f32.
// A is stored row-major as (m,k) with leading dimension lda (kN) or as (k,m) (kT); B as (k,n)
// with leading dimension ldb (kN) or as (n,k) (kT); C is row-major (m,n) with leading dim ldc.
struct Desc {
  DType dtype = DType::kF32;
  Trans ta = Trans::kN, tb = Trans::kN;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  bool accumulate = false;
  bool operator==(const Desc&) const = default;
};

struct Primitive;  // a created oneDNN matmul with its memory descriptors

// The cached primitive for d, created on first use. Serial code only (not thread-safe).
const Primitive* primitive(const Desc& d);
// Primitives for every length 1..step (unless multiples_only) and every multiple of step up to
// max_len of the varying dimension (`vary_k` ? k : m) of d (whose own m or k is ignored), all
// created together on first use: grouped GEMMs see row counts that change every step, and must
// still create nothing after the first. Entry i has length i (null for lengths not in the
// family). A row-major A (ta = kN) given lda 0 with vary_k is dense: each entry's lda is its k.
// Serial code only.
const Primitive* const* family(Desc d, bool vary_k, int64_t step, int64_t max_len,
                               bool multiples_only = false);

size_t scratch_bytes(const Primitive* p);
// Whether oneDNN runs bf16 products on AMX tiles on this CPU (its effective ISA is
// avx512_core_amx): there its brgemm kernels run bf16 several times faster than any AVX-512 loop
// (vdpbf16ps is no faster than fp32 FMAs on Sapphire and Emerald Rapids: a register-only loop on
// the Emerald Rapids VM, 86-88 against 173-179 GFLOP/s per core), so the bf16 GEMMs leave
// our own micro-kernels and strided tiles (gemm_tiles.cpp) for oneDNN's dense ones, and the
// attention's bf16 products go to AMX tiles too (attention_amx.h).
bool amx_bf16();
// Number of primitives created so far (tests check that a new expert load creates none).
size_t primitive_count();
// Every cached primitive's description and oneDNN implementation string (for tests).
std::vector<std::pair<Desc, std::string>> cached_primitives();
std::string impl_info(const Primitive* p);

// Makes per-thread execution state (oneDNN stream, scratchpad of at least `scratch` bytes) ready
// for threads 0..threads-1. Serial code only.
void prepare_threads(int threads, size_t scratch);
// Runs p on the calling thread, which is thread `thread` (< the prepared count) of the ops' own
// OpenMP region. a, b, c point at the first element of this call's A, B and C.
void execute(const Primitive* p, const void* a, const void* b, float* c, int thread);

}  // namespace gemm
}  // namespace moe::cpu
