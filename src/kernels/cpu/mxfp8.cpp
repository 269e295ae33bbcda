// CPU MXFP8 ops. Quantization runs the shared block function (kernels/math/mx_blocks.h) over blocks in
// parallel: the bytes are the reference's by construction and do not depend on the thread count
// (the statistics are counts and a max).
//
// GEMMs: this CPU has no FP8 arithmetic, so the operands are dequantized into bf16 and the
// existing bf16 GEMMs (oneDNN's vdpbf16ps kernels, fp32 accumulation; kernels/cpu/gemm.cpp) run
// on them. A dequantized element is an exact bf16 and the product of two an exact fp32 only in a
// range of scales (core/mxfp8.h: bf16_exact_*, product_exact_*: the instruction reads bf16
// subnormals as zero and flushes subnormal products). A K-block whose scales (over the group's
// rows of a and of b) leave that range is zeroed in the bf16 copies and summed instead in fp32:
// the 32 products of the raw elements (exact in fp32), times 2^(s_a + s_b). So every product is
// the exact product of the dequantized operands, and only the fp32 summation order differs from
// the f64 reference. Real activations and weights never leave the range (their scales sit near
// 2^0); tests/kernels/mxfp8_test.cpp crosses every boundary.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/checks/gemm_checks.h"
#include "kernels/checks/mx_checks.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elem_common.h"
#include "kernels/host/host_args.h"
#include "kernels/math/mx_blocks.h"

namespace moe::cpu {
namespace {

constexpr int64_t kParallelBlocks = 256;  // fewer blocks run on the calling thread

// Per-thread statistics (grown once per calling thread, then reused: no allocation per call),
// combined after the loop (sums of counts and a max: order-free).
template <class Body>
mx::BlockStats parallel_blocks(int64_t count, Body body) {
  static thread_local std::vector<mx::BlockStats> calling_thread;
  std::vector<mx::BlockStats>& per = calling_thread;  // the caller's, shared by the region's threads
  per.assign(std::max<size_t>(per.size(), static_cast<size_t>(std::max(1, omp_get_max_threads()))), mx::BlockStats{});
#pragma omp parallel for schedule(static) if (count >= kParallelBlocks)
  for (int64_t i = 0; i < count; ++i) body(i, per[static_cast<size_t>(omp_get_thread_num())]);
  mx::BlockStats all;
  for (const auto& s : per) all.add(s);
  return all;
}

// The 32 x C slab of rows [32j, 32j+32) of a matrix, transposed into per-thread memory so each
// column's block is contiguous (column-wise quantization reads whole rows, not strided columns).
template <class T>
const float* transposed_slab(const T* x, int64_t c, int64_t j) {
  static thread_local std::vector<float> slab;
  if (slab.size() < static_cast<size_t>(c * mx::kBlock)) slab.resize(static_cast<size_t>(c * mx::kBlock));
  for (int i = 0; i < mx::kBlock; ++i) {
    const T* row = x + (j * mx::kBlock + i) * c;
    for (int64_t l = 0; l < c; ++l) slab[static_cast<size_t>(l * mx::kBlock + i)] = mx::load(row + l);
  }
  return slab.data();
}

template <class T>
mx::BlockStats quantize(const T* x, const MxQuantizeShape& s, int64_t rows, bool columnwise, mx::Elem e,
                        mx::ScaleRule rule, uint8_t* codes, uint8_t* scales) {
  const int64_t lines = columnwise ? s.c : rows;        // lines of blocks per matrix
  const int64_t nb = (columnwise ? s.n : s.c) / mx::kBlock;
  const int64_t mat = s.n * s.c;
  if (columnwise) {  // per (matrix, block row): the slab transposed, then each column's block
    return parallel_blocks(s.groups * nb, [&](int64_t gj, mx::BlockStats& st) {
      const int64_t g = gj / nb, j = gj % nb;
      const float* slab = transposed_slab(x + g * mat, s.c, j);
      uint8_t* cg = codes + g * mat;
      uint8_t* sg = scales + g * mat / mx::kBlock;
      for (int64_t l = 0; l < s.c; ++l)
        sg[l * nb + j] = mx::quantize_block(slab + l * mx::kBlock, e, rule, cg + l * s.n + j * mx::kBlock, st);
    });
  }
  return parallel_blocks(s.groups * lines, [&](int64_t gl, mx::BlockStats& st) {
    const int64_t g = gl / lines, l = gl % lines;
    const T* xg = x + g * mat;
    uint8_t* cg = codes + g * mat;
    uint8_t* sg = scales + g * mat / mx::kBlock;
    for (int64_t j = 0; j < nb; ++j)
      sg[l * nb + j] = mx::quantize_block(xg + l * s.c + j * mx::kBlock, e, rule, cg + l * s.c + j * mx::kBlock, st);
  });
}

}  // namespace

void mx_quantize(const Tensor& x, bool columnwise, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales,
                 const Tensor& stats, const Tensor& row_end) {
  const MxQuantizeShape s = check_mx_quantize_args(x, columnwise, rule, codes, scales, stats, row_end);
  check_host({&x, &codes, &scales, &stats, &row_end}, "mx_quantize");
  const int64_t rows = mx_row_limit(row_end, s.n, "mx_quantize");
  const mx::Elem e = mx_elem(codes, "mx_quantize");
  auto* c = static_cast<uint8_t*>(codes.data);
  auto* sc = static_cast<uint8_t*>(scales.data);
  mx::BlockStats st;
  if (x.dtype == DType::kF64) st = quantize(x.as<double>(), s, rows, columnwise, e, rule, c, sc);
  else if (x.dtype == DType::kF32) st = quantize(x.as<float>(), s, rows, columnwise, e, rule, c, sc);
  else st = quantize(x.as<bf16>(), s, rows, columnwise, e, rule, c, sc);
  if (stats.data) mx::update_stats(stats.as<double>(), st);
}

void mx_quantize_swizzled(const Tensor& x, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales, const Tensor& offsets) {
  check_host({&x, &codes, &scales, &offsets}, "mx_quantize_swizzled");
  const MxSwizzledShape s = check_mx_quantize_swizzled_args(x, rule, codes, scales, offsets);
  auto* sc = static_cast<uint8_t*>(scales.data);
  std::memset(sc, 0, static_cast<size_t>(s.bytes));
  // Chunks of 32 rows of one group each: every chunk writes its own codes and scale bytes.
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (group, first row)
  for (int64_t g = 0; g < s.groups; ++g)
    for (int64_t r0 = s.begin[g]; r0 < s.begin[g + 1]; r0 += 32) chunks.emplace_back(g, r0);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < chunks.size(); ++i) {
    const auto [g, r0] = chunks[i];
    mx::quantize_rows_swizzled(x, s.begin.data(), s.padded_before.data(), g, r0, std::min(r0 + 32, s.begin[g + 1]),
                               s.elem, s.rule, static_cast<uint8_t*>(codes.data), sc);
  }
}

void mx_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& y, const Tensor& row_end) {
  check_mx_dequantize_args(codes, scales, y, row_end);
  check_host({&codes, &scales, &y, &row_end}, "mx_dequantize");
  const mx::DecodeTable& table = mx::decode_table(mx_elem(codes, "mx_dequantize"));
  const auto* c = static_cast<const uint8_t*>(codes.data);
  const auto* s = static_cast<const uint8_t*>(scales.data);
  const int64_t blocks = mx_row_limit(row_end, codes.shape[0], "mx_dequantize") * codes.shape[1] / mx::kBlock;
  // f32 and bf16: code value times the scale as one fp32 multiply by a power of two (2^-127 is
  // a representable subnormal), correctly rounded like the exact product rounded once.
  auto body = [&](auto* out, int64_t b) {
    using T = std::remove_pointer_t<decltype(out)>;
    const uint8_t sb = s[b];
    const float scale = sb == mx::kScaleNaN ? NAN : mx::bits_float(sb == 0 ? 1u << 22 : static_cast<uint32_t>(sb) << 23);
    const double scale64 = mx::scale_value(sb);
    const uint8_t* cb = c + b * mx::kBlock;
    T* o = out + b * mx::kBlock;
    for (int i = 0; i < mx::kBlock; ++i) {
      if constexpr (std::is_same_v<T, double>) o[i] = static_cast<double>(table.v[cb[i]]) * scale64;
      else if constexpr (std::is_same_v<T, float>) o[i] = table.v[cb[i]] * scale;
      else elem::store(o + i, table.v[cb[i]] * scale);
    }
  };
  if (y.dtype == DType::kF64) parallel_blocks(blocks, [&](int64_t b, mx::BlockStats&) { body(y.as<double>(), b); });
  else if (y.dtype == DType::kF32) parallel_blocks(blocks, [&](int64_t b, mx::BlockStats&) { body(y.as<float>(), b); });
  else parallel_blocks(blocks, [&](int64_t b, mx::BlockStats&) { body(y.as<bf16>(), b); });
}

// ---------------------------------------------------------------- GEMMs
namespace {

struct Operand {
  const uint8_t* codes;
  const uint8_t* scales;
  mx::Elem elem;
};

// The dequantized bf16 operands and the per-(group, K-block) flags, grown once and reused.
struct Scratch {
  std::vector<bf16> a, b;
  std::vector<uint8_t> exact;  // groups x kb: 1 where the bf16 path is exact
};
Scratch& scratch() {
  static Scratch s;
  return s;
}
std::mutex& gemm_mutex() {
  static std::mutex m;
  return m;
}

// Whether a block's codes are all +-0: its products are zeros whatever its (non-NaN) scale (an
// all-zero block's rceil scale is the clamped 2^-127, far outside the exact range; gradients of
// positions without loss have them).
bool zero_block(const uint8_t* codes) {
  uint8_t any = 0;
  for (int i = 0; i < mx::kBlock; ++i) any |= codes[i] & 0x7f;
  return any == 0;
}

// Whether K-block j of a's rows [r0, r1) and b's rows [0, n) (codes at leading dimension k,
// scales at kb) stays in the exact bf16 range; all-zero blocks do not count.
bool block_exact(const Operand& a, int64_t r0, int64_t r1, const Operand& b, int64_t n, int64_t k, int64_t j) {
  const int64_t kb = k / mx::kBlock;
  int amin = 255, amax = 0, bmin = 255, bmax = 0;
  for (int64_t r = r0; r < r1; ++r) {
    if (a.scales[r * kb + j] != mx::kScaleNaN && zero_block(a.codes + r * k + j * mx::kBlock)) continue;
    amin = std::min<int>(amin, a.scales[r * kb + j]);
    amax = std::max<int>(amax, a.scales[r * kb + j]);
  }
  for (int64_t r = 0; r < n; ++r) {
    if (b.scales[r * kb + j] != mx::kScaleNaN && zero_block(b.codes + r * k + j * mx::kBlock)) continue;
    bmin = std::min<int>(bmin, b.scales[r * kb + j]);
    bmax = std::max<int>(bmax, b.scales[r * kb + j]);
  }
  if (amin > amax || bmin > bmax) return true;  // one side all zeros: zero products
  const int bias = mx::kScaleBias;
  return amin - bias >= mx::bf16_exact_min(a.elem) && amax - bias <= mx::bf16_exact_max(a.elem) &&
         bmin - bias >= mx::bf16_exact_min(b.elem) && bmax - bias <= mx::bf16_exact_max(b.elem) &&
         amin + bmin - 2 * bias >= mx::product_exact_min(a.elem, b.elem) &&
         amax + bmax - 2 * bias <= mx::product_exact_max(a.elem, b.elem);
}

// Every code's value as bf16 bits (exact: 3 or 2 mantissa bits), for dequantize_bf16.
struct Bf16Table {
  uint16_t bits[256];
  explicit Bf16Table(mx::Elem e) {
    for (int c = 0; c < 256; ++c) bits[c] = bf16(mx::decode(static_cast<uint8_t>(c), e)).bits;
  }
};
const Bf16Table& bf16_table(mx::Elem e) {
  static const Bf16Table e4m3(mx::Elem::kE4M3), e5m2(mx::Elem::kE5M2);
  return e == mx::Elem::kE4M3 ? e4m3 : e5m2;
}

// rows x k codes -> bf16, the blocks whose flag (exact[j]) is 0 written as zeros. In an exact
// block every nonzero value times its scale is a normal bf16 (and no code is NaN or Inf: such a
// block's scale is NaN or past the range), so scaling is adding s - 127 to the exponent field of
// the code's bf16 bits; zeros stay zero. Integer adds: the loop vectorizes.
void dequantize_bf16(const Operand& x, int64_t rows, int64_t k, const uint8_t* exact, bf16* out) {
  const uint16_t* table = bf16_table(x.elem).bits;
  const int64_t kb = k / mx::kBlock;
  parallel_blocks(rows, [&](int64_t r, mx::BlockStats&) {
    for (int64_t j = 0; j < kb; ++j) {
      uint16_t* o = reinterpret_cast<uint16_t*>(out + r * k + j * mx::kBlock);
      const uint8_t* c = x.codes + r * k + j * mx::kBlock;
      if (!exact[j]) {
        std::fill(o, o + mx::kBlock, uint16_t{0});
        continue;
      }
      const auto shift = static_cast<uint16_t>((static_cast<int>(x.scales[r * kb + j]) - mx::kScaleBias) * 128);
      for (int i = 0; i < mx::kBlock; ++i)
        o[i] = static_cast<uint16_t>(table[c[i]] + ((c[i] & 0x7f) != 0 ? shift : 0));
    }
  });
}

// y(rows, n) += the blocks not flagged exact, in fp32: per block the raw elements' products
// (exact), summed, times 2^(s_a + s_b); blocks in increasing order per output.
void add_inexact_blocks(const Operand& a, const Operand& b, int64_t rows, int64_t n, int64_t k,
                        const uint8_t* exact, float* y) {
  const int64_t kb = k / mx::kBlock;
  bool any = false;
  for (int64_t j = 0; j < kb; ++j) any |= !exact[j];
  if (!any) return;
  const mx::DecodeTable& ta = mx::decode_table(a.elem);
  const mx::DecodeTable& tb = mx::decode_table(b.elem);
  parallel_blocks(rows, [&](int64_t r, mx::BlockStats&) {
    for (int64_t col = 0; col < n; ++col) {
      float acc = y[r * n + col];
      for (int64_t j = 0; j < kb; ++j) {
        if (exact[j]) continue;
        const uint8_t* ca = a.codes + r * k + j * mx::kBlock;
        const uint8_t* cb = b.codes + col * k + j * mx::kBlock;
        float part = 0;
        for (int i = 0; i < mx::kBlock; ++i) part += ta.v[ca[i]] * tb.v[cb[i]];
        const uint8_t sa = a.scales[r * kb + j], sb = b.scales[col * kb + j];
        acc += (sa == mx::kScaleNaN || sb == mx::kScaleNaN)
                   ? NAN
                   : std::ldexp(part, static_cast<int>(sa) + static_cast<int>(sb) - 2 * mx::kScaleBias);
      }
      y[r * n + col] = acc;
    }
  });
}

Tensor host_view(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.device = Device::kCpu;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) t.shape[i++] = d;
  return t;
}

Operand operand(const Tensor& codes, const Tensor& scales, const char* what) {
  return {static_cast<const uint8_t*>(codes.data), static_cast<const uint8_t*>(scales.data),
          mx_elem(codes, what)};
}

}  // namespace

void mx_linear(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
               const Tensor& y, bool accumulate) {
  const MxGemmShape s = check_mx_linear_args(a, a_scales, b, b_scales, y, false);
  check_host({&a, &a_scales, &b, &b_scales, &y}, "mx_linear");
  const Operand oa = operand(a, a_scales, "mx_linear"), ob = operand(b, b_scales, "mx_linear");
  const int64_t kb = s.k / mx::kBlock;
  if (s.m == 0 || s.n == 0) return;
  std::lock_guard<std::mutex> lock(gemm_mutex());
  Scratch& sc = scratch();
  sc.exact.resize(static_cast<size_t>(kb));
  for (int64_t j = 0; j < kb; ++j) sc.exact[j] = block_exact(oa, 0, s.m, ob, s.n, s.k, j);
  sc.a.resize(static_cast<size_t>(s.m * s.k));
  sc.b.resize(static_cast<size_t>(s.n * s.k));
  dequantize_bf16(oa, s.m, s.k, sc.exact.data(), sc.a.data());
  dequantize_bf16(ob, s.n, s.k, sc.exact.data(), sc.b.data());
  linear_fwd(host_view(sc.a.data(), DType::kBF16, {s.m, s.k}),
             host_view(sc.b.data(), DType::kBF16, {s.n, s.k}), y, accumulate);
  add_inexact_blocks(oa, ob, s.m, s.n, s.k, sc.exact.data(), y.as<float>());
}

void mx_grouped_linear(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
                       const Tensor& offsets, const Tensor& y) {
  const MxGemmShape s = check_mx_grouped_linear_args(a, a_scales, b, b_scales, offsets, y, false);
  check_host({&a, &a_scales, &b, &b_scales, &offsets, &y}, "mx_grouped_linear");
  const Operand oa = operand(a, a_scales, "mx_grouped_linear");
  const Operand ob = operand(b, b_scales, "mx_grouped_linear");
  const int32_t* off = checked_offsets(offsets, s.groups, s.m, "mx_grouped_linear");
  const int64_t kb = s.k / mx::kBlock, rows = off[s.groups];
  if (rows == 0 || s.n == 0) return;
  std::lock_guard<std::mutex> lock(gemm_mutex());
  Scratch& sc = scratch();
  sc.exact.resize(static_cast<size_t>(s.groups * kb));
  sc.a.resize(static_cast<size_t>(s.m * s.k));  // the row capacity, so a new load allocates nothing
  sc.b.resize(static_cast<size_t>(s.groups * s.n * s.k));
  for (int64_t g = 0; g < s.groups; ++g) {
    uint8_t* ex = sc.exact.data() + g * kb;
    const Operand bg{ob.codes + g * s.n * s.k, ob.scales + g * s.n * kb, ob.elem};
    for (int64_t j = 0; j < kb; ++j) ex[j] = off[g] == off[g + 1] || block_exact(oa, off[g], off[g + 1], bg, s.n, s.k, j);
    const Operand ag{oa.codes + off[g] * s.k, oa.scales + off[g] * kb, oa.elem};
    dequantize_bf16(ag, off[g + 1] - off[g], s.k, ex, sc.a.data() + off[g] * s.k);
    dequantize_bf16(bg, s.n, s.k, ex, sc.b.data() + g * s.n * s.k);
  }
  grouped_linear_fwd(host_view(sc.a.data(), DType::kBF16, {s.m, s.k}),
                     host_view(sc.b.data(), DType::kBF16, {s.groups, s.n, s.k}), offsets, y);
  for (int64_t g = 0; g < s.groups; ++g) {
    const Operand ag{oa.codes + off[g] * s.k, oa.scales + off[g] * kb, oa.elem};
    const Operand bg{ob.codes + g * s.n * s.k, ob.scales + g * s.n * kb, ob.elem};
    add_inexact_blocks(ag, bg, off[g + 1] - off[g], s.n, s.k, sc.exact.data() + g * kb,
                       y.as<float>() + off[g] * s.n);
  }
}

}  // namespace moe::cpu
