// Shared test helpers: owned random tensors, poisoning, and the error measure every test uses,
// max|a - b| / max|b| over a tensor.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"

namespace moe::test {

// The message of what f throws, or "(no error)".
std::string error_of(const std::function<void()>& f);

// Seed for random test inputs: MOE_TEST_SEED if set, else fresh each run. Printed on failure
// by the tests through SCOPED_TRACE so a failure can be replayed.
uint64_t test_seed();

// Uniform in [lo, hi) from a counter-based RNG keyed by (seed, salt).
void fill_uniform(const Tensor& t, uint64_t seed, uint64_t salt, double lo = -1.0, double hi = 1.0);
// Ids uniform in [0, n).
void fill_ids(const Tensor& t, uint64_t seed, uint64_t salt, int32_t n);
// NaN for floats, INT32_MIN for ints: an output a kernel forgets to write is caught.
void poison(const Tensor& t);
// Elementwise copy between float dtypes (f64 <-> f32 <-> bf16), or identical i32.
void copy_tensor(const Tensor& src, const Tensor& dst);
OwnedTensor clone(const Tensor& src, DType dtype);
OwnedTensor clone(const Tensor& src);
std::vector<double> to_vector(const Tensor& t);
// max|a-b| / max|b| (b is the reference); NaN anywhere gives +inf.
double rel_error(const Tensor& a, const Tensor& b);
bool bitwise_equal(const Tensor& a, const Tensor& b);
double get(const Tensor& t, int64_t i);
void set(const Tensor& t, int64_t i, double value);

}  // namespace moe::test

namespace moe::test {

// Central finite differences in double: for each element i of `x` (f64), perturbs it by +-h,
// evaluates loss(), and compares (L+ - L-)/2h with analytic[i]. Returns max|fd - an| / max|an|
// (max|an| floored at `min_scale`). Checks at most `max_checks` evenly spread elements.
// fourth_order: the 5-point stencil (-f(x+2h) + 8f(x+h) - 8f(x-h) + f(x-2h)) / 12h, whose
// truncation error is O(h^4) instead of O(h^2): for strongly nonlinear functions (a whole model).
// extrapolate: Richardson's combination of the stencil at h and h/2, which cancels its leading
// truncation term (twice the loss evaluations).
// min_scale: the floor of max|an|; raise it where a parameter's true gradient is structurally near
// zero, so that the stencil's rounding (~1e-11 absolute for a whole model) is not compared with it.
double fd_check(const Tensor& x, const Tensor& analytic, const std::function<double()>& loss,
                double h = 1e-6, int64_t max_checks = 64, bool fourth_order = false, bool extrapolate = false,
                double min_scale = 1e-12);
// sum(a * b) in double for same-shape float tensors: the scalar "loss" of FD checks.
double dot(const Tensor& a, const Tensor& b);
// Central differences of loss() with respect to every element of param (f64), step h: truncation
// ~h^2 |f'''| and rounding ~1e-16 |loss| / h (h = 1e-5: ~1e-10 and ~1e-11 |loss|).
OwnedTensor numeric_grad(const Tensor& param, const std::function<double()>& loss, double h = 1e-5);
// A tensor filled uniformly in [lo, hi) from test_seed() and salt.
OwnedTensor random_tensor(DType dtype, std::initializer_list<int64_t> dims, uint64_t salt,
                          double lo = -1.0, double hi = 1.0);

// Files: the whole of one as bytes; one written (replaced) with text; a path in this process's
// scratch folder <tmp>/<prefix>_<pid>/ (made if missing).
std::string read_file(const std::string& path);
void write_file(const std::string& path, const std::string& text);
std::string scratch_path(const std::string& prefix, const std::string& name);

}  // namespace moe::test
