// Tensor views: a pointer plus dtype, device and a row-major contiguous shape.
// A Tensor never owns memory (arenas and flat parameter buffers do); copying one is free.
// Ops take views so that a CUDA backend can accept device pointers without model code changing.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/bf16.h"
#include "core/check.h"

namespace moe {

// kI64: offsets past 2^31 (segment tables). kE4M3, kE5M2: FP8 element codes, kE8M0: their
// block scales (core/mxfp8.h), each one byte.
enum class DType : uint8_t { kF32, kF64, kBF16, kI32, kI64, kE4M3, kE5M2, kE8M0 };
// Where a tensor's bytes live. kCpu: host memory the host may read. kStrict: memory of the
// strict test backend (kernels/strict), which the host cannot dereference; kCuda: GPU memory.
enum class Device : uint8_t { kCpu, kStrict, kCuda };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* device_name(Device d);

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kF32; }
template <> constexpr DType dtype_of<double>() { return DType::kF64; }
template <> constexpr DType dtype_of<bf16>() { return DType::kBF16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::kI32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::kI64; }

struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCpu;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};

  Tensor() = default;
  Tensor(void* ptr, DType t, std::initializer_list<int64_t> dims, Device dev = Device::kCpu);

  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  // dim(-1) is the last dimension.
  int64_t dim(int i) const;
  // Number of rows when viewed as a matrix (product of all but the last dimension).
  int64_t rows() const {
    if (ndim == 0) return 1;
    int64_t r = 1;
    for (int i = 0; i + 1 < ndim; ++i) r *= shape[i];
    return r;
  }
  int64_t cols() const { return ndim == 0 ? 1 : dim(-1); }
  bool empty() const { return data == nullptr; }

  // Host access to the elements: only for host (kCpu) tensors. Device memory reaches the host
  // through the backend's counted staging copies (Backend::download), never through here.
  template <class T> T* as() const {
    MOE_CHECK(dtype == dtype_of<T>(), "tensor has dtype ", dtype_name(dtype), ", accessed as ",
              dtype_name(dtype_of<T>()));
    MOE_CHECK(device == Device::kCpu, "host access to a ", device_name(device), " tensor ", shape_str(),
              " (device memory is read through Backend::download)");
    return static_cast<T*>(data);
  }
  // Host access to a one-byte tensor's bytes (FP8 codes, E8M0 scales), as as() checks it.
  uint8_t* bytes() const {
    MOE_CHECK(dtype_size(dtype) == 1, "tensor has dtype ", dtype_name(dtype), ", accessed as bytes");
    MOE_CHECK(device == Device::kCpu, "host access to a ", device_name(device), " tensor ", shape_str(),
              " (device memory is read through Backend::download)");
    return static_cast<uint8_t*>(data);
  }
  // Same memory, new shape with the same number of elements.
  Tensor view(std::initializer_list<int64_t> dims) const;
  // Rows [begin, end) along dimension 0.
  Tensor slice(int64_t begin, int64_t end) const;
  std::string shape_str() const;
};

// Shape checks used by every op: they name the argument and both shapes.
void check_shape(const Tensor& t, std::initializer_list<int64_t> dims, const char* what);
void check_same_shape(const Tensor& a, const Tensor& b, const char* what);
void check_dtype(const Tensor& t, DType dtype, const char* what);
// An op's output that may be stored rounded: dtype `compute`, or bf16 when `compute` is f32 (a
// kernel that writes its fp32 result straight into a bf16 GEMM operand, bitwise equal to
// computing in fp32 and converting afterwards).
void check_output_dtype(const Tensor& t, DType compute, const char* what);
bool is_float(DType t);

}  // namespace moe
