// Outputs stored rounded to bf16 (op_list.inc: "may be bf16 (rounded)"): RMSNorm forward and
// backward (and its backward accumulated into the residual gradient), SwiGLU forward (with the
// bf16 copies of g and u) and backward, and the cross-entropy gradient. Each backend under test
// (RoundedOutput, through test::fast()) and ref (RoundedOutputRef) must give bitwise the bf16
// rounding of its own fp32 output: the fusion removes a convert pass and changes no bit of bf16
// training. Inputs span the ranges where rounding, exp overflow/underflow and ties matter
// (values up to +-40).
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/backends.h"
#include "common/test_util.h"
#include "core/check.h"
#include "kernels/ops.h"

namespace moe {
namespace {

using test::bitwise_equal;
using test::clone;
using test::poison;
using test::random_tensor;

// Each check runs on one backend taking host tensors: test::fast() (the backend under test, in
// RoundedOutput) or the ref backend itself (in RoundedOutputRef).
MOE_BACKEND_SUITE(RoundedOutput);

OwnedTensor poisoned(DType dtype, std::initializer_list<int64_t> dims) {
  OwnedTensor t(dtype, dims);
  poison(t);
  return t;
}

void rmsnorm_forward(Backend& b) {
  SCOPED_TRACE(b.name());
  // 70 x 300: large enough for the cpu kernel's threaded path.
  for (auto [n, c] : {std::pair<int64_t, int64_t>{3, 7}, {70, 300}, {200, 256}}) {
    OwnedTensor x = random_tensor(DType::kF32, {n, c}, 1, -40, 40);
    OwnedTensor w = random_tensor(DType::kF32, {c}, 2, -3, 3);
    OwnedTensor y32 = poisoned(DType::kF32, {n, c}), r32 = poisoned(DType::kF32, {n});
    OwnedTensor ybf = poisoned(DType::kBF16, {n, c}), rbf = poisoned(DType::kF32, {n});
    b.rmsnorm_fwd(x, w, 1e-5, y32, r32);
    b.rmsnorm_fwd(x, w, 1e-5, ybf, rbf);
    EXPECT_TRUE(bitwise_equal(ybf, clone(y32, DType::kBF16))) << n << "x" << c;
    EXPECT_TRUE(bitwise_equal(rbf, r32));
  }
}
TEST_P(RoundedOutput, RmsNormBf16OutputIsTheRoundedFp32Output) { rmsnorm_forward(test::fast()); }
TEST(RoundedOutputRef, RmsNormBf16OutputIsTheRoundedFp32Output) { rmsnorm_forward(*make_backend("ref")); }

// The input gradient rounded into a bf16 operand, and accumulated into the residual stream's
// gradient: bitwise what a separate convert / add pass gives (dw accumulates the same either way).
void rmsnorm_backward(Backend& b) {
  SCOPED_TRACE(b.name());
  for (auto [n, c] : {std::pair<int64_t, int64_t>{3, 7}, {70, 300}, {200, 256}}) {
    OwnedTensor x = random_tensor(DType::kF32, {n, c}, 12, -4, 4);
    OwnedTensor w = random_tensor(DType::kF32, {c}, 13, -3, 3);
    OwnedTensor dy = random_tensor(DType::kF32, {n, c}, 14, -2, 2);
    OwnedTensor y(DType::kF32, {n, c}), r(DType::kF32, {n});
    b.rmsnorm_fwd(x, w, 1e-5, y, r);
    OwnedTensor dx32 = poisoned(DType::kF32, {n, c}), dxbf = poisoned(DType::kBF16, {n, c});
    OwnedTensor dw32 = random_tensor(DType::kF32, {c}, 15), dwbf = clone(dw32), dwacc = clone(dw32);
    b.rmsnorm_bwd(dy, x, w, r, dx32, dw32, false);
    b.rmsnorm_bwd(dy, x, w, r, dxbf, dwbf, false);
    EXPECT_TRUE(bitwise_equal(dxbf, clone(dx32, DType::kBF16))) << n << "x" << c;
    EXPECT_TRUE(bitwise_equal(dwbf, dw32));
    // Accumulate into a residual gradient: resid + dx, element by element.
    OwnedTensor resid = random_tensor(DType::kF32, {n, c}, 16, -1, 1), expect = clone(resid);
    for (int64_t i = 0; i < n * c; ++i) expect.as<float>()[i] += dx32.as<float>()[i];
    b.rmsnorm_bwd(dy, x, w, r, resid, dwacc, true);
    EXPECT_TRUE(bitwise_equal(resid, expect)) << n << "x" << c;
    EXPECT_TRUE(bitwise_equal(dwacc, dw32));
    OwnedTensor bad(DType::kBF16, {n, c});
    EXPECT_THROW(b.rmsnorm_bwd(dy, x, w, r, bad, dwacc, true), Error);  // += needs f32
  }
}
TEST_P(RoundedOutput, RmsNormBackwardBf16AndAccumulatedInputGradient) { rmsnorm_backward(test::fast()); }
TEST(RoundedOutputRef, RmsNormBackwardBf16AndAccumulatedInputGradient) {
  rmsnorm_backward(*make_backend("ref"));
}

void swiglu_forward(Backend& b) {
  SCOPED_TRACE(b.name());
  for (int64_t n : {5, 40000}) {  // serial and threaded
    OwnedTensor g = random_tensor(DType::kF32, {n, 1}, 3, -40, 40);
    OwnedTensor u = random_tensor(DType::kF32, {n, 1}, 4, -40, 40);
    OwnedTensor h32 = poisoned(DType::kF32, {n, 1}), hbf = poisoned(DType::kBF16, {n, 1});
    OwnedTensor gc = poisoned(DType::kBF16, {n, 1}), uc = poisoned(DType::kBF16, {n, 1});
    b.swiglu_fwd(g, u, h32, Tensor(), Tensor());
    b.swiglu_fwd(g, u, hbf, gc, uc);
    EXPECT_TRUE(bitwise_equal(hbf, clone(h32, DType::kBF16))) << n;
    EXPECT_TRUE(bitwise_equal(gc, clone(g, DType::kBF16)));
    EXPECT_TRUE(bitwise_equal(uc, clone(u, DType::kBF16)));
    // Copies next to an fp32 output (allowed; the fp32 output is unchanged by them).
    OwnedTensor h32c = poisoned(DType::kF32, {n, 1});
    poison(gc);
    b.swiglu_fwd(g, u, h32c, gc, uc);
    EXPECT_TRUE(bitwise_equal(h32c, h32));
    EXPECT_TRUE(bitwise_equal(gc, clone(g, DType::kBF16)));
  }
}
TEST_P(RoundedOutput, SwigluForwardBf16OutputAndCopies) { swiglu_forward(test::fast()); }
TEST(RoundedOutputRef, SwigluForwardBf16OutputAndCopies) { swiglu_forward(*make_backend("ref")); }

void swiglu_backward(Backend& b) {
  SCOPED_TRACE(b.name());
  for (int64_t n : {5, 40000}) {
    // Saved g and u in bf16 (as bf16 mode keeps them) and in f32.
    for (DType saved : {DType::kBF16, DType::kF32}) {
      OwnedTensor g = clone(random_tensor(DType::kF32, {n, 1}, 5, -40, 40), saved);
      OwnedTensor u = clone(random_tensor(DType::kF32, {n, 1}, 6, -4, 4), saved);
      OwnedTensor dh = random_tensor(DType::kF32, {n, 1}, 7, -2, 2);
      OwnedTensor dg32 = poisoned(DType::kF32, {n, 1}), du32 = poisoned(DType::kF32, {n, 1});
      OwnedTensor dgbf = poisoned(DType::kBF16, {n, 1}), dubf = poisoned(DType::kBF16, {n, 1});
      b.swiglu_bwd(dh, g, u, dg32, du32);
      b.swiglu_bwd(dh, g, u, dgbf, dubf);
      EXPECT_TRUE(bitwise_equal(dgbf, clone(dg32, DType::kBF16))) << n;
      EXPECT_TRUE(bitwise_equal(dubf, clone(du32, DType::kBF16))) << n;
    }
  }
}
TEST_P(RoundedOutput, SwigluBackwardBf16Gradients) { swiglu_backward(test::fast()); }
TEST(RoundedOutputRef, SwigluBackwardBf16Gradients) { swiglu_backward(*make_backend("ref")); }

void cross_entropy_gradient(Backend& b) {
  SCOPED_TRACE(b.name());
  for (auto [n, v] : {std::pair<int64_t, int64_t>{4, 1}, {9, 1000}, {64, 700}}) {
    OwnedTensor logits = random_tensor(DType::kF32, {n, v}, 8, -30, 30);
    OwnedTensor labels(DType::kI32, {n});
    for (int64_t r = 0; r < n; ++r) labels.as<int32_t>()[r] = r == 1 ? -1 : static_cast<int32_t>((r * 37) % v);
    // fp32 in place (what fp32 training does) against bf16 output from a fresh copy.
    OwnedTensor d32 = clone(logits), work = clone(logits);
    OwnedTensor ce32 = poisoned(DType::kF32, {n}), z32 = poisoned(DType::kF32, {n});
    OwnedTensor cebf = poisoned(DType::kF32, {n}), zbf = poisoned(DType::kF32, {n});
    OwnedTensor dbf = poisoned(DType::kBF16, {n, v});
    b.cross_entropy(d32, labels, 0.25, 1e-3, d32, ce32, z32);
    b.cross_entropy(work, labels, 0.25, 1e-3, dbf, cebf, zbf);
    EXPECT_TRUE(bitwise_equal(dbf, clone(d32, DType::kBF16))) << n << "x" << v;
    EXPECT_TRUE(bitwise_equal(cebf, ce32));
    EXPECT_TRUE(bitwise_equal(zbf, z32));
  }
}
TEST_P(RoundedOutput, CrossEntropyBf16Gradient) { cross_entropy_gradient(test::fast()); }
TEST(RoundedOutputRef, CrossEntropyBf16Gradient) { cross_entropy_gradient(*make_backend("ref")); }

void bf16_outputs_need_fp32_compute(Backend& b) {
  SCOPED_TRACE(b.name());
  OwnedTensor x = random_tensor(DType::kF64, {4, 8}, 9), w = random_tensor(DType::kF64, {8}, 10);
  OwnedTensor r(DType::kF64, {4}), ybf(DType::kBF16, {4, 8}), y32(DType::kF32, {4, 8});
  EXPECT_THROW(b.rmsnorm_fwd(x, w, 1e-5, ybf, r), Error);  // f64 is the reference path
  EXPECT_THROW(b.rmsnorm_fwd(x, w, 1e-5, y32, r), Error);
  OwnedTensor h(DType::kF64, {4, 8}), gc(DType::kBF16, {4, 8}), uc(DType::kBF16, {4, 8});
  EXPECT_THROW(b.swiglu_fwd(x, x, h, gc, uc), Error);
  EXPECT_THROW(b.swiglu_fwd(x, x, ybf, Tensor(), Tensor()), Error);
  OwnedTensor x32 = random_tensor(DType::kF32, {4, 8}, 11), h32(DType::kF32, {4, 8});
  EXPECT_THROW(b.swiglu_fwd(x32, x32, h32, gc, Tensor()), Error);  // copies come in pairs
}
TEST_P(RoundedOutput, Bf16OutputsNeedFp32Compute) { bf16_outputs_need_fp32_compute(test::fast()); }
TEST(RoundedOutputRef, Bf16OutputsNeedFp32Compute) { bf16_outputs_need_fp32_compute(*make_backend("ref")); }

}  // namespace
}  // namespace moe
