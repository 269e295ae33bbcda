#include "core/tensor.h"

#include <sstream>

namespace moe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kE4M3:
    case DType::kE5M2:
    case DType::kE8M0: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kE4M3: return "e4m3";
    case DType::kE5M2: return "e5m2";
    case DType::kE8M0: return "e8m0";
  }
  return "?";
}

const char* device_name(Device d) {
  switch (d) {
    case Device::kCpu: return "cpu";
    case Device::kStrict: return "strict";
    case Device::kCuda: return "cuda";
  }
  return "?";
}

bool is_float(DType t) { return t != DType::kI32 && t != DType::kI64; }

Tensor::Tensor(void* ptr, DType t, std::initializer_list<int64_t> dims, Device dev)
    : data(ptr), dtype(t), device(dev), ndim(static_cast<int>(dims.size())) {
  MOE_CHECK(ndim <= kMaxDims, "tensor rank ", ndim, " exceeds ", kMaxDims);
  int i = 0;
  for (int64_t d : dims) {
    MOE_CHECK(d >= 0, "negative dimension ", d);
    shape[i++] = d;
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

int64_t Tensor::dim(int i) const {
  if (i < 0) i += ndim;
  MOE_CHECK(i >= 0 && i < ndim, "dimension ", i, " out of range for shape ", shape_str());
  return shape[i];
}

Tensor Tensor::view(std::initializer_list<int64_t> dims) const {
  Tensor t(data, dtype, dims, device);
  MOE_CHECK(t.numel() == numel(), "cannot view ", shape_str(), " as ", t.shape_str());
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  MOE_CHECK(ndim >= 1 && begin >= 0 && begin <= end && end <= shape[0], "slice [", begin, ",", end,
            ") out of range for shape ", shape_str());
  Tensor t = *this;
  int64_t row = numel() / (shape[0] == 0 ? 1 : shape[0]);
  t.data = static_cast<char*>(data) + static_cast<size_t>(begin * row) * dtype_size(dtype);
  t.shape[0] = end - begin;
  return t;
}

std::string Tensor::shape_str() const {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < ndim; ++i) s << (i ? "," : "") << shape[i];
  s << ")";
  return s.str();
}

void check_shape(const Tensor& t, std::initializer_list<int64_t> dims, const char* what) {
  bool ok = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && t.shape[i] != d) ok = false;  // d < 0 means "any"
    ++i;
  }
  if (!ok) {
    std::ostringstream want;
    i = 0;
    for (int64_t d : dims) {
      if (i++) want << ",";
      if (d < 0) want << "*"; else want << d;
    }
    MOE_FAIL(what, " has shape ", t.shape_str(), ", expected (", want.str(), ")");
  }
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* what) {
  bool ok = a.ndim == b.ndim;
  for (int i = 0; ok && i < a.ndim; ++i) ok = a.shape[i] == b.shape[i];
  MOE_CHECK(ok, what, ": shapes ", a.shape_str(), " and ", b.shape_str(), " differ");
}

void check_dtype(const Tensor& t, DType dtype, const char* what) {
  MOE_CHECK(t.dtype == dtype, what, " has dtype ", dtype_name(t.dtype), ", expected ",
            dtype_name(dtype));
}

void check_output_dtype(const Tensor& t, DType compute, const char* what) {
  const bool ok = t.dtype == compute || (compute == DType::kF32 && t.dtype == DType::kBF16);
  MOE_CHECK(ok, what, " has dtype ", dtype_name(t.dtype), ", expected ", dtype_name(compute),
            compute == DType::kF32 ? " or bf16" : "");
}

}  // namespace moe
