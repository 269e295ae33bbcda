#include "kernels/checks/mx_checks.h"

#include "core/mx_scale_layout.h"

#include "core/check.h"

namespace moe {
namespace {

void check_block_multiple(int64_t len, const char* what, const char* dim) {
  MOE_CHECK(len % mx::kBlock == 0, what, ": ", dim, " = ", len, " is not a multiple of the ",
            mx::kBlock, "-value MXFP8 block");
}

void check_float_out(const Tensor& y, bool allow_f64, const char* what) {
  MOE_CHECK(y.dtype == DType::kF32 || (allow_f64 && y.dtype == DType::kF64), what, ": y has dtype ",
            dtype_name(y.dtype), ", expected f32", allow_f64 ? " or f64" : "");
}

void check_row_end(const Tensor& row_end, const char* what) {
  if (row_end.data == nullptr) return;
  check_dtype(row_end, DType::kI32, what);
  MOE_CHECK(row_end.ndim == 1 && row_end.shape[0] >= 1, what, ": row_end has shape ", row_end.shape_str(),
            ", expected (n >= 1)");
}

// A scale rule the format defines (an enum value made by a cast can be any other).
void check_mx_rule(mx::ScaleRule rule, const char* what) {
  MOE_CHECK(rule == mx::ScaleRule::kRceil || rule == mx::ScaleRule::kFloor, what, ": scale rule ",
            static_cast<int>(rule), ", expected rceil or floor");
}

}  // namespace

mx::Elem mx_elem(const Tensor& codes, const char* what) {
  MOE_CHECK(codes.dtype == DType::kE4M3 || codes.dtype == DType::kE5M2, what, ": codes have dtype ",
            dtype_name(codes.dtype), ", expected e4m3 or e5m2");
  return codes.dtype == DType::kE4M3 ? mx::Elem::kE4M3 : mx::Elem::kE5M2;
}

int64_t mx_row_limit(const Tensor& row_end, int64_t n, const char* what) {
  if (row_end.data == nullptr) return n;
  const int64_t r = row_end.as<int32_t>()[row_end.shape[0] - 1];
  MOE_CHECK(r >= 0 && r <= n, what, ": row_end = ", r, " outside [0, ", n, "]");
  return r;
}

MxQuantizeShape check_mx_quantize_args(const Tensor& x, bool columnwise, mx::ScaleRule rule, const Tensor& codes,
                                       const Tensor& scales, const Tensor& stats, const Tensor& row_end) {
  const char* what = "mx_quantize";
  check_mx_rule(rule, what);
  mx_elem(codes, what);
  MOE_CHECK(x.dtype == DType::kF32 || x.dtype == DType::kF64 || x.dtype == DType::kBF16, what,
            ": x has dtype ", dtype_name(x.dtype), ", expected f32, f64 or bf16");
  MOE_CHECK(x.ndim == 2 || (x.ndim == 3 && columnwise), what, ": x has shape ", x.shape_str(),
            ", expected (N,C)", columnwise ? " or (G,N,C)" : "");
  MxQuantizeShape s;
  if (x.ndim == 3) s.groups = x.shape[0];
  s.n = x.shape[x.ndim - 2];
  s.c = x.shape[x.ndim - 1];
  check_dtype(scales, DType::kE8M0, what);
  if (!columnwise) {
    check_block_multiple(s.c, what, "C");
    check_shape(codes, {s.n, s.c}, "mx_quantize codes");
    check_shape(scales, {s.n, s.c / mx::kBlock}, "mx_quantize scales");
  } else {
    check_block_multiple(s.n, what, "N");
    if (x.ndim == 3) {
      check_shape(codes, {s.groups, s.c, s.n}, "mx_quantize codes");
      check_shape(scales, {s.groups, s.c, s.n / mx::kBlock}, "mx_quantize scales");
    } else {
      check_shape(codes, {s.c, s.n}, "mx_quantize codes");
      check_shape(scales, {s.c, s.n / mx::kBlock}, "mx_quantize scales");
    }
  }
  if (stats.data != nullptr) {
    check_dtype(stats, DType::kF64, "mx_quantize stats");
    check_shape(stats, {4}, "mx_quantize stats");
  }
  check_row_end(row_end, what);
  MOE_CHECK(row_end.data == nullptr || !columnwise, what, ": row_end is for row-wise quantization only");
  return s;
}

MxSwizzledShape check_mx_quantize_swizzled_args(const Tensor& x, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales,
                                                const Tensor& offsets) {
  const char* what = "mx_quantize_swizzled";
  MxSwizzledShape s;
  check_mx_rule(rule, what);
  s.rule = rule;
  s.elem = mx_elem(codes, what);
  MOE_CHECK(x.dtype == DType::kF32 || x.dtype == DType::kF64 || x.dtype == DType::kBF16, what,
            ": x has dtype ", dtype_name(x.dtype), ", expected f32, f64 or bf16");
  MOE_CHECK(x.ndim == 2, what, ": x has shape ", x.shape_str(), ", expected (N,C)");
  s.n = x.shape[0];
  s.c = x.shape[1];
  check_block_multiple(s.c, what, "C");
  check_shape(codes, {s.n, s.c}, "mx_quantize_swizzled codes");
  check_dtype(scales, DType::kE8M0, what);
  MOE_CHECK(scales.ndim == 1, what, ": scales has shape ", scales.shape_str(), ", expected (S)");
  if (offsets.data != nullptr) {
    check_dtype(offsets, DType::kI32, "mx_quantize_swizzled offsets");
    MOE_CHECK(offsets.ndim == 1 && offsets.shape[0] >= 2, what, ": offsets has shape ", offsets.shape_str(),
              ", expected (G+1) with G >= 1");
    s.groups = offsets.shape[0] - 1;
  }
  if (offsets.data == nullptr || offsets.device == Device::kCpu) {
    const int32_t* off = offsets.data ? offsets.as<int32_t>() : nullptr;
    MOE_CHECK(!off || off[0] == 0, what, ": offsets[0] = ", off ? off[0] : 0, ", expected 0");
    int64_t padded = 0;
    s.begin.push_back(0);
    for (int64_t g = 0; g < s.groups; ++g) {
      const int64_t begin = off ? off[g] : 0, end = off ? off[g + 1] : s.n;
      MOE_CHECK(begin <= end && end <= s.n, what, ": offsets[", g + 1, "] = ", end, " out of order or past the ",
                s.n, " rows");
      s.begin.push_back(end);
      s.padded_before.push_back(padded);
      padded += mx::padded_group_rows(end - begin);
    }
    s.bytes = mx::swizzled_scale_bytes(padded, s.c / mx::kBlock);
    MOE_CHECK(scales.numel() >= s.bytes, what, ": scales has ", scales.numel(), " bytes, the swizzled layout of ",
              s.groups, " group(s) needs ", s.bytes);
  }
  return s;
}

void check_mx_dequantize_args(const Tensor& codes, const Tensor& scales, const Tensor& y, const Tensor& row_end) {
  const char* what = "mx_dequantize";
  check_row_end(row_end, what);
  mx_elem(codes, what);
  MOE_CHECK(codes.ndim == 2, what, ": codes have shape ", codes.shape_str(), ", expected (N,C)");
  check_block_multiple(codes.shape[1], what, "C");
  check_dtype(scales, DType::kE8M0, what);
  check_shape(scales, {codes.shape[0], codes.shape[1] / mx::kBlock}, "mx_dequantize scales");
  MOE_CHECK(y.dtype == DType::kF32 || y.dtype == DType::kF64 || y.dtype == DType::kBF16, what,
            ": y has dtype ", dtype_name(y.dtype), ", expected f32, f64 or bf16");
  check_shape(y, {codes.shape[0], codes.shape[1]}, "mx_dequantize y");
}

MxGemmShape check_mx_linear_args(const Tensor& a, const Tensor& a_scales, const Tensor& b,
                                 const Tensor& b_scales, const Tensor& y, bool allow_f64) {
  const char* what = "mx_linear";
  mx_elem(a, what);
  mx_elem(b, what);
  MOE_CHECK(a.ndim == 2 && b.ndim == 2 && a.shape[1] == b.shape[1], what, ": a ", a.shape_str(),
            " and b ", b.shape_str(), " must be (M,K) and (N,K)");
  MxGemmShape s{1, a.shape[0], b.shape[0], a.shape[1]};
  check_block_multiple(s.k, what, "K");
  check_dtype(a_scales, DType::kE8M0, what);
  check_dtype(b_scales, DType::kE8M0, what);
  check_shape(a_scales, {s.m, s.k / mx::kBlock}, "mx_linear a_scales");
  check_shape(b_scales, {s.n, s.k / mx::kBlock}, "mx_linear b_scales");
  check_float_out(y, allow_f64, what);
  check_shape(y, {s.m, s.n}, "mx_linear y");
  return s;
}

MxGemmShape check_mx_grouped_linear_args(const Tensor& a, const Tensor& a_scales, const Tensor& b,
                                         const Tensor& b_scales, const Tensor& offsets, const Tensor& y,
                                         bool allow_f64) {
  const char* what = "mx_grouped_linear";
  mx_elem(a, what);
  mx_elem(b, what);
  MOE_CHECK(a.ndim == 2 && b.ndim == 3 && a.shape[1] == b.shape[2], what, ": a ", a.shape_str(),
            " and b ", b.shape_str(), " must be (R,K) and (E,N,K)");
  MxGemmShape s{b.shape[0], a.shape[0], b.shape[1], a.shape[1]};
  check_block_multiple(s.k, what, "K");
  check_dtype(a_scales, DType::kE8M0, what);
  check_dtype(b_scales, DType::kE8M0, what);
  check_shape(a_scales, {s.m, s.k / mx::kBlock}, "mx_grouped_linear a_scales");
  check_shape(b_scales, {s.groups, s.n, s.k / mx::kBlock}, "mx_grouped_linear b_scales");
  check_dtype(offsets, DType::kI32, "mx_grouped_linear offsets");
  check_shape(offsets, {s.groups + 1}, "mx_grouped_linear offsets");
  check_float_out(y, allow_f64, what);
  check_shape(y, {s.m, s.n}, "mx_grouped_linear y");
  return s;
}

}  // namespace moe
