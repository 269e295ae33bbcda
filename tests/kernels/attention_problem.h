// One attention problem for the attention tests (attention_test.cpp, attention_window_test.cpp):
// its shape, every tensor of a forward and backward call, the reference and the backend under
// test behind one interface, and the fp32-vs-f64 tolerances.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/backends.h"
#include "common/test_util.h"
#include "kernels/ref/ref_ops.h"

namespace moe::attention_test {

struct Shape {
  int64_t B, S, H, G, hd;
  double amp = 1.0;  // q and k are uniform in [-amp, amp]: larger means peakier softmax
};

inline std::string name(const Shape& s) {
  std::string out(1, 'B');  // appended: g++ 12 -O3 reports a false -Wrestrict on "literal" + string
  out.append(std::to_string(s.B)).append(" S").append(std::to_string(s.S)).append(" H").append(std::to_string(s.H));
  out.append(" G").append(std::to_string(s.G)).append(" hd").append(std::to_string(s.hd));
  return out.append(" amp").append(std::to_string(s.amp));
}

// Every tensor of one attention call, forward and backward.
struct Problem {
  OwnedTensor q, k, v, dout, o, lse, dq, dk, dv;
  Problem(const Shape& s, DType t)
      : q(t, {s.B, s.S, s.H, s.hd}), k(t, {s.B, s.S, s.G, s.hd}), v(t, {s.B, s.S, s.G, s.hd}),
        dout(t, {s.B, s.S, s.H, s.hd}), o(t, {s.B, s.S, s.H, s.hd}), lse(t, {s.B, s.H, s.S}),
        dq(t, {s.B, s.S, s.H, s.hd}), dk(t, {s.B, s.S, s.G, s.hd}), dv(t, {s.B, s.S, s.G, s.hd}) {}
  void fill(const Shape& s, uint64_t seed) {
    test::fill_uniform(q, seed, 1, -s.amp, s.amp);
    test::fill_uniform(k, seed, 2, -s.amp, s.amp);
    test::fill_uniform(v, seed, 3);
    test::fill_uniform(dout, seed, 4);
  }
  void poison_outputs() {
    for (const OwnedTensor* t : {&o, &lse, &dq, &dk, &dv}) test::poison(*t);
  }
  // Same inputs in another dtype, outputs poisoned.
  Problem converted(const Shape& s, DType t) const {
    Problem p(s, t);
    test::copy_tensor(q, p.q);
    test::copy_tensor(k, p.k);
    test::copy_tensor(v, p.v);
    test::copy_tensor(dout, p.dout);
    p.poison_outputs();
    return p;
  }
};

template <class Ns> void run(Problem& p, const Tensor& doc = Tensor(), bool bf16_products = false) {
  Ns::attention_fwd(p.q, p.k, p.v, p.o, p.lse, doc, bf16_products);
  Ns::attention_bwd(p.dout, p.q, p.k, p.v, p.o, p.lse, p.dq, p.dk, p.dv, doc, bf16_products);
}
struct Ref {
  static void attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                            const Tensor& lse, const Tensor& doc = Tensor(), bool bf16 = false) {
    ref::attention_fwd(q, k, v, o, lse, doc, bf16);
  }
  static void attention_bwd(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& d,
                            const Tensor& e, const Tensor& f, const Tensor& g, const Tensor& h,
                            const Tensor& i, const Tensor& doc = Tensor(), bool bf16 = false) {
    ref::attention_bwd(a, b, c, d, e, f, g, h, i, doc, bf16);
  }
};
// The backend under test (test::fast()).
struct Fast {
  static void attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                            const Tensor& lse, const Tensor& doc = Tensor(), bool bf16 = false) {
    test::fast().attention_fwd(q, k, v, o, lse, doc, bf16);
  }
  static void attention_bwd(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& d,
                            const Tensor& e, const Tensor& f, const Tensor& g, const Tensor& h,
                            const Tensor& i, const Tensor& doc = Tensor(), bool bf16 = false) {
    test::fast().attention_bwd(a, b, c, d, e, f, g, h, i, doc, bf16);
  }
};

// Tolerances, as max|fast - ref| / max|ref| over a tensor (fp32 kernel vs f64 reference of the
// same inputs; inputs are rounded to fp32 first, relative 6e-8 each). Observed maxima over 40
// seeds of the shapes below: o 2.1e-6, lse 4.1e-7, dq/dk/dv 2.0e-6.
// - o: each output is a convex combination of v rows with softmax weights over <= S terms. The
//   weights carry the fp32 error of the scores (hd-term dot products; scaled scores have std
//   amp^2 / 3) and of exp2 (~2e-7), and the sums add ~sqrt(S) * 6e-8 relative (random walk). So ~1e-6;
//   1e-5 leaves a 5x margin without hiding a real bug (a wrong mask, scale or tile boundary
//   gives errors of order 1e-2 to 1).
// - lse: log-sum-exp of scores of size up to ~10 (amp 3, hd 64): absolute error ~|s| * 1e-7,
//   and |lse| >= ~log(S) for most rows: ~1e-7 relative; bound 5e-6.
// - dq, dk, dv: one more matmul and the cancellation in ds = p (dp - D), with D = dO . O built
//   from the fp32 o, so the error is relative to |dp| rather than |ds|; dk and dv also sum over
//   H/G heads and up to S queries. A little looser than o: 2e-5.
// These hold for amp <= 3 (scaled scores |s| up to ~10). Score magnitudes grow as amp^2 and the
// fp32 error of p = exp(s - lse) grows with |s| (about 1e-7 |s| relative), which no fp32 kernel
// avoids, so the bounds are scaled by max(1, amp^2 / 9): amp 12 (|s| up to ~200) observes
// (30 seeds) o <= 3.6e-5 and grads <= 3.1e-5 against bounds 1.6e-4 and 3.2e-4.
constexpr double kTolO = 1e-5, kTolLse = 5e-6, kTolGrad = 2e-5;

// Document starts (B,S) from per-row lists of document boundaries (first positions of documents).
inline OwnedTensor doc_starts(int64_t B, int64_t S, const std::vector<std::vector<int64_t>>& starts) {
  OwnedTensor t(DType::kI32, {B, S});
  for (int64_t b = 0; b < B; ++b) {
    int32_t cur = 0;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t x : starts[static_cast<size_t>(b)])
        if (x == s) cur = static_cast<int32_t>(s);
      t.as<int32_t>()[b * S + s] = cur;
    }
  }
  return t;
}

}  // namespace moe::attention_test
