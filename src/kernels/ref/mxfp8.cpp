// Reference MXFP8 ops: plain loops. Quantization is the block function every backend shares
// (kernels/math/mx_blocks.h); the GEMMs dequantize each element exactly and accumulate in the output's
// precision in increasing k order (f64: every product exact and the sum all but exact, the
// oracle the fast kernels and the PyTorch emulation are compared with).
#include <cmath>
#include <cstdint>

#include "kernels/checks/gemm_checks.h"
#include "kernels/checks/mx_checks.h"
#include "kernels/host/host_args.h"
#include "kernels/math/mx_blocks.h"
#include "kernels/ref/ref_ops.h"

namespace moe::ref {
namespace {

template <class T>
void quantize(const T* x, const MxQuantizeShape& s, int64_t rows, bool columnwise, mx::Elem e, mx::ScaleRule rule,
              uint8_t* codes, uint8_t* scales, mx::BlockStats& st) {
  const int64_t nb = (columnwise ? s.n : s.c) / mx::kBlock;
  for (int64_t g = 0; g < s.groups; ++g) {
    const T* xg = x + g * s.n * s.c;
    uint8_t* cg = codes + g * s.n * s.c;
    uint8_t* sg = scales + g * s.n * s.c / mx::kBlock;
    if (!columnwise) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < nb; ++j)
          sg[r * nb + j] = mx::quantize_block(xg + r * s.c + j * mx::kBlock, e, rule, cg + r * s.c + j * mx::kBlock, st);
    } else {  // block j of column c: x[32j + i][c] -> codes[c][32j + i]
      T block[mx::kBlock];
      for (int64_t c = 0; c < s.c; ++c)
        for (int64_t j = 0; j < nb; ++j) {
          for (int i = 0; i < mx::kBlock; ++i) block[i] = xg[(j * mx::kBlock + i) * s.c + c];
          sg[c * nb + j] = mx::quantize_block(block, e, rule, cg + c * s.n + j * mx::kBlock, st);
        }
    }
  }
}

template <class A>
A dequantized(uint8_t code, uint8_t scale, mx::Elem e) {
  return static_cast<A>(mx::dequantize(code, scale, e));
}

// y(rows, n) (+)= deq(a rows) * deq(b)^T over k, in y's precision A.
template <class A>
void gemm(const uint8_t* a, const uint8_t* as, mx::Elem ea, const uint8_t* b, const uint8_t* bs,
          mx::Elem eb, A* y, int64_t rows, int64_t n, int64_t k, bool accumulate) {
  const int64_t kb = k / mx::kBlock;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) {
      A acc = 0;
      for (int64_t l = 0; l < k; ++l)
        acc += dequantized<A>(a[i * k + l], as[i * kb + l / mx::kBlock], ea) *
               dequantized<A>(b[j * k + l], bs[j * kb + l / mx::kBlock], eb);
      y[i * n + j] = accumulate ? y[i * n + j] + acc : acc;
    }
}

template <class F>
void with_out_type(const Tensor& y, F&& f) {
  if (y.dtype == DType::kF64) f(y.as<double>());
  else f(y.as<float>());
}

}  // namespace

void mx_quantize(const Tensor& x, bool columnwise, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales,
                 const Tensor& stats, const Tensor& row_end) {
  const MxQuantizeShape s = check_mx_quantize_args(x, columnwise, rule, codes, scales, stats, row_end);
  check_host({&x, &codes, &scales, &stats, &row_end}, "mx_quantize");
  const int64_t rows = mx_row_limit(row_end, s.n, "mx_quantize");
  const mx::Elem e = mx_elem(codes, "mx_quantize");
  mx::BlockStats st;
  auto* c = static_cast<uint8_t*>(codes.data);
  auto* sc = static_cast<uint8_t*>(scales.data);
  if (x.dtype == DType::kF64) quantize(x.as<double>(), s, rows, columnwise, e, rule, c, sc, st);
  else if (x.dtype == DType::kF32) quantize(x.as<float>(), s, rows, columnwise, e, rule, c, sc, st);
  else quantize(x.as<bf16>(), s, rows, columnwise, e, rule, c, sc, st);
  if (stats.data) mx::update_stats(stats.as<double>(), st);
}

void mx_quantize_swizzled(const Tensor& x, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales, const Tensor& offsets) {
  check_host({&x, &codes, &scales, &offsets}, "mx_quantize_swizzled");
  const MxSwizzledShape s = check_mx_quantize_swizzled_args(x, rule, codes, scales, offsets);
  auto* sc = static_cast<uint8_t*>(scales.data);
  for (int64_t i = 0; i < s.bytes; ++i) sc[i] = 0;
  for (int64_t g = 0; g < s.groups; ++g)
    mx::quantize_rows_swizzled(x, s.begin.data(), s.padded_before.data(), g, s.begin[g], s.begin[g + 1], s.elem,
                               s.rule, static_cast<uint8_t*>(codes.data), sc);
}

void mx_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& y, const Tensor& row_end) {
  check_mx_dequantize_args(codes, scales, y, row_end);
  check_host({&codes, &scales, &y, &row_end}, "mx_dequantize");
  const mx::Elem e = mx_elem(codes, "mx_dequantize");
  const auto* c = static_cast<const uint8_t*>(codes.data);
  const auto* s = static_cast<const uint8_t*>(scales.data);
  const int64_t n = mx_row_limit(row_end, codes.shape[0], "mx_dequantize") * codes.shape[1];
  for (int64_t i = 0; i < n; ++i) {
    const double v = mx::dequantize(c[i], s[i / mx::kBlock], e);
    if (y.dtype == DType::kF64) y.as<double>()[i] = v;
    else if (y.dtype == DType::kF32) y.as<float>()[i] = static_cast<float>(v);
    else y.as<bf16>()[i] = bf16(static_cast<float>(v));
  }
}

void mx_linear(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
               const Tensor& y, bool accumulate) {
  const MxGemmShape s = check_mx_linear_args(a, a_scales, b, b_scales, y, true);
  check_host({&a, &a_scales, &b, &b_scales, &y}, "mx_linear");
  with_out_type(y, [&](auto* out) {
    gemm(static_cast<const uint8_t*>(a.data), static_cast<const uint8_t*>(a_scales.data),
         mx_elem(a, "mx_linear"), static_cast<const uint8_t*>(b.data),
         static_cast<const uint8_t*>(b_scales.data), mx_elem(b, "mx_linear"), out, s.m, s.n, s.k,
         accumulate);
  });
}

void mx_grouped_linear(const Tensor& a, const Tensor& a_scales, const Tensor& b, const Tensor& b_scales,
                       const Tensor& offsets, const Tensor& y) {
  const MxGemmShape s = check_mx_grouped_linear_args(a, a_scales, b, b_scales, offsets, y, true);
  check_host({&a, &a_scales, &b, &b_scales, &offsets, &y}, "mx_grouped_linear");
  const int32_t* off = checked_offsets(offsets, s.groups, s.m, "mx_grouped_linear");
  const int64_t kb = s.k / mx::kBlock;
  const auto* ap = static_cast<const uint8_t*>(a.data);
  const auto* asp = static_cast<const uint8_t*>(a_scales.data);
  const auto* bp = static_cast<const uint8_t*>(b.data);
  const auto* bsp = static_cast<const uint8_t*>(b_scales.data);
  with_out_type(y, [&](auto* out) {
    for (int64_t g = 0; g < s.groups; ++g) {
      const int64_t r0 = off[g], rows = off[g + 1] - off[g];
      if (rows == 0) continue;
      gemm(ap + r0 * s.k, asp + r0 * kb, mx_elem(a, "mx_grouped_linear"), bp + g * s.n * s.k,
           bsp + g * s.n * kb, mx_elem(b, "mx_grouped_linear"), out + r0 * s.n, rows, s.n, s.k, false);
    }
  });
}

}  // namespace moe::ref
