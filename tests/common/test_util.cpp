#include "common/test_util.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>

#include "core/rng.h"

namespace moe::test {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

uint64_t test_seed() {
  static uint64_t seed = [] {
    if (const char* s = std::getenv("MOE_TEST_SEED")) return static_cast<uint64_t>(std::strtoull(s, nullptr, 10));
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  }();
  return seed;
}

double get(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32: return static_cast<const float*>(t.data)[i];
    case DType::kF64: return static_cast<const double*>(t.data)[i];
    case DType::kBF16: return static_cast<float>(static_cast<const bf16*>(t.data)[i]);
    case DType::kI32: return static_cast<const int32_t*>(t.data)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(t.data)[i]);
    case DType::kE4M3:  // MXFP8 codes and scales: the byte itself
    case DType::kE5M2:
    case DType::kE8M0: return static_cast<const uint8_t*>(t.data)[i];
  }
  return 0;
}

void set(const Tensor& t, int64_t i, double value) {
  switch (t.dtype) {
    case DType::kF32: static_cast<float*>(t.data)[i] = static_cast<float>(value); break;
    case DType::kF64: static_cast<double*>(t.data)[i] = value; break;
    case DType::kBF16: static_cast<bf16*>(t.data)[i] = bf16(static_cast<float>(value)); break;
    case DType::kI32: static_cast<int32_t*>(t.data)[i] = static_cast<int32_t>(value); break;
    case DType::kI64: static_cast<int64_t*>(t.data)[i] = static_cast<int64_t>(value); break;
    case DType::kE4M3:  // the byte; anything else (poison's NaN) becomes 0xff, a NaN in all three
    case DType::kE5M2:
    case DType::kE8M0:
      static_cast<uint8_t*>(t.data)[i] = value >= 0 && value <= 255 ? static_cast<uint8_t>(value) : 0xff;
      break;
  }
}

void fill_uniform(const Tensor& t, uint64_t seed, uint64_t salt, double lo, double hi) {
  for (int64_t i = 0; i < t.numel(); ++i)
    set(t, i, lo + (hi - lo) * random_uniform(seed, 1000 + salt, static_cast<uint64_t>(i)));
}

void fill_ids(const Tensor& t, uint64_t seed, uint64_t salt, int32_t n) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    int32_t v = static_cast<int32_t>(random_uniform(seed, 2000 + salt, static_cast<uint64_t>(i)) * n);
    set(t, i, v < n ? v : n - 1);
  }
}

void poison(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    set(t, i, t.dtype == DType::kI32 ? std::numeric_limits<int32_t>::min()
                                     : std::numeric_limits<double>::quiet_NaN());
}

void copy_tensor(const Tensor& src, const Tensor& dst) {
  MOE_CHECK(src.numel() == dst.numel(), "copy_tensor: sizes differ");
  if (src.dtype == dst.dtype) {
    std::memcpy(dst.data, src.data, src.nbytes());
    return;
  }
  for (int64_t i = 0; i < src.numel(); ++i) set(dst, i, get(src, i));
}

OwnedTensor clone(const Tensor& src, DType dtype) {
  OwnedTensor out(dtype, {1});
  out.t = src;
  out.t.dtype = dtype;
  out.buffer = Buffer(out.t.nbytes());
  out.t.data = out.buffer.data();
  copy_tensor(src, out.t);
  return out;
}

OwnedTensor clone(const Tensor& src) { return clone(src, src.dtype); }

std::vector<double> to_vector(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = get(t, i);
  return v;
}

double rel_error(const Tensor& a, const Tensor& b) {
  MOE_CHECK(a.numel() == b.numel(), "rel_error: sizes differ ", a.shape_str(), " vs ", b.shape_str());
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = get(a, i), y = get(b, i);
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::fabs(x - y));
    max_ref = std::max(max_ref, std::fabs(y));
  }
  if (max_ref == 0) return max_diff;
  return max_diff / max_ref;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

}  // namespace moe::test

namespace moe::test {

double fd_check(const Tensor& x, const Tensor& analytic, const std::function<double()>& loss, double h,
                int64_t max_checks, bool fourth_order, bool extrapolate, double min_scale) {
  MOE_CHECK(x.dtype == DType::kF64, "fd_check needs an f64 input");
  const int64_t n = x.numel();
  const int64_t stride = std::max<int64_t>(1, n / max_checks);
  double max_err = 0, max_an = min_scale;
  for (int64_t i = 0; i < n; i += stride) {
    double* p = x.as<double>() + i;
    const double saved = *p;
    auto at = [&](double dx) {
      *p = saved + dx;
      const double l = loss();
      *p = saved;
      return l;
    };
    auto stencil = [&](double hh) {
      return fourth_order ? (-at(2 * hh) + 8 * at(hh) - 8 * at(-hh) + at(-2 * hh)) / (12 * hh)
                          : (at(hh) - at(-hh)) / (2 * hh);
    };
    // Richardson: the stencil's leading truncation term is O(h^2) or O(h^4); combining h and h/2
    // cancels it. A wrong gradient is not hidden by it: both estimates agree with each other.
    const double order = fourth_order ? 16.0 : 4.0;
    const double fd = extrapolate ? (order * stencil(h / 2) - stencil(h)) / (order - 1) : stencil(h);
    const double an = get(analytic, i);
    max_err = std::max(max_err, std::fabs(fd - an));
    max_an = std::max(max_an, std::fabs(an));
  }
  return max_err / max_an;
}

double dot(const Tensor& a, const Tensor& b) {
  MOE_CHECK(a.numel() == b.numel(), "dot: sizes differ");
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += get(a, i) * get(b, i);
  return s;
}

OwnedTensor numeric_grad(const Tensor& param, const std::function<double()>& loss, double h) {
  OwnedTensor g = clone(param);
  for (int64_t i = 0; i < param.numel(); ++i) {
    const double x0 = get(param, i);
    set(param, i, x0 + h);
    const double lp = loss();
    set(param, i, x0 - h);
    const double lm = loss();
    set(param, i, x0);
    set(g, i, (lp - lm) / (2 * h));
  }
  return g;
}

OwnedTensor random_tensor(DType dtype, std::initializer_list<int64_t> dims, uint64_t salt, double lo,
                          double hi) {
  OwnedTensor t(dtype, dims);
  fill_uniform(t, test_seed(), salt, lo, hi);
  return t;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string scratch_path(const std::string& prefix, const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

}  // namespace moe::test
