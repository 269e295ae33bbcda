// Causal grouped-query attention: the f64 reference against finite differences, each backend
// under test (fp32, and bf16 products) against the f64 reference, causality, intra-document
// masking, and bitwise thread-count independence.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include "attention_problem.h"
#include "backend_errors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "core/bf16.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

using test::clone;
using test::rel_error;
using namespace attention_test;

// A test-name part for a shape: B2_S150_H4_G2_hd8_amp1.
std::string shape_param_name(const Shape& s) {
  return "B" + std::to_string(s.B) + "_S" + std::to_string(s.S) + "_H" + std::to_string(s.H) +
         "_G" + std::to_string(s.G) + "_hd" + std::to_string(s.hd) + "_amp" +
         std::to_string(static_cast<int>(s.amp));
}

const Shape kShapes[] = {
    Shape{2, 150, 4, 2, 8},          // GQA, 3 tiles, last one partial, B=2
    Shape{1, 150, 2, 2, 64},         // MHA, hd 64
    Shape{1, 150, 8, 1, 64, 3.0},    // MQA, hd 64, peaky softmax
    Shape{1, 1, 4, 2, 8},            // a single position
    Shape{2, 64, 2, 2, 8},           // exactly one tile
    Shape{1, 65, 8, 1, 16},          // one tile plus one position, MQA
    Shape{1, 300, 4, 2, 32, 2.0},    // 5 tiles: several off-diagonal ones
    Shape{2, 70, 4, 4, 12},          // hd not a multiple of the 4-row blocks
    Shape{1, 40, 3, 1, 3},           // odd H and hd
    Shape{1, 130, 2, 1, 128, 2.0},   // hd 128
    Shape{1, 200, 2, 1, 64, 12.0},   // huge scores: no overflow in rescaling
    // Whole 16-row tiles and hd a multiple of 32: bf16 products on AMX tiles where the CPU has
    // them (kernels/cpu/attention_amx.h), on vdpbf16ps elsewhere.
    Shape{2, 128, 4, 2, 64},         // GQA, two whole tiles
    Shape{1, 80, 2, 1, 32, 2.0},     // a last tile of 16 rows: one reduction step, padded
    Shape{1, 176, 4, 4, 128}};       // a last tile of 48 rows (S % 32 = 16), hd 128

MOE_BACKEND_SUITE_WITH(AttentionShapes, Shape, ::testing::ValuesIn(kShapes), shape_param_name);

TEST_P(AttentionShapes, MatchesF64Reference) {
  const Shape s = param();
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(s));
  Problem ref64(s, DType::kF64);
  ref64.fill(s, seed);
  ref64.poison_outputs();
  Problem fast32 = ref64.converted(s, DType::kF32);
  run<Ref>(ref64);
  run<Fast>(fast32);  // the backend's backward reads its own forward's o and lse
  const double eo = rel_error(fast32.o, ref64.o), el = rel_error(fast32.lse, ref64.lse),
               eq = rel_error(fast32.dq, ref64.dq), ek = rel_error(fast32.dk, ref64.dk),
               ev = rel_error(fast32.dv, ref64.dv);
  RecordProperty("errors", std::to_string(eo) + " " + std::to_string(el) + " " +
                               std::to_string(eq) + " " + std::to_string(ek) + " " +
                               std::to_string(ev));
  const double grow = std::max(1.0, s.amp * s.amp / 9.0);
  EXPECT_LE(eo, kTolO * grow);
  EXPECT_LE(el, kTolLse * grow);
  EXPECT_LE(eq, kTolGrad * grow);
  EXPECT_LE(ek, kTolGrad * grow);
  EXPECT_LE(ev, kTolGrad * grow);
  if (std::getenv("MOE_ATTN_PRINT_ERRORS"))
    printf("%-40s o %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", name(s).c_str(), eo, el, eq, ek, ev);
}

// bf16 products (bf16 training mode). Oracle: the f64 reference on q, k, v and dO rounded to
// bf16, i.e. exact arithmetic on the operands the kernel rounds; what is left is the kernel's own
// rounding of the tile probabilities p and score gradients ds to bf16 (relative u = 2^-9 each)
// plus fp32 accumulation. Bounds, with u = 2^-9 = 1.95e-3 (observed maxima over 30 seeds of
// these shapes, amp <= 3, with MOE_ATTN_PRINT_ERRORS: o 1.7e-3, lse 1.7e-7, dq/dk/dv 5.7e-3; amp 12: 1.4e-3,
// 1.9e-2 against 16x the bounds):
// - o: a convex combination of v rows with weights rounded at relative u; the errors of
//   independent weights partly average out: bound 4u = 7.8e-3.
// - lse: from fp32 sums of unrounded probabilities: as the fp32 kernel, 5e-6.
// - dq, dk, dv: a rounded factor (p or ds) in every product, plus the forward's error in o
//   entering D = dO . o, which the cancellation in ds = p (dp - D) amplifies relative to |ds|:
//   bound 8u = 1.6e-2.
// Scaled like the fp32 bounds for huge scores. An odd head dim has no bf16 pairs: the kernel
// then computes exactly its fp32 products (checked bitwise).
constexpr double kTolOBf16 = 7.8e-3, kTolGradBf16 = 1.6e-2;

// bf16 mode saves q, k, v and o in bf16 (op_list.inc). On the same values, each backend's forward
// from bf16 q, k, v into a bf16 o gives lse bitwise and o bitwise its fp32 path's o rounded; the
// backward from them gives dq, dk, dv bitwise what the fp32 path gives from that o widened.
template <class Ns> void expect_stored_bf16_is_the_rounded_fp32_path(const Shape& s, uint64_t seed) {
  Problem p(s, DType::kF32);
  p.fill(s, seed);
  for (OwnedTensor* t : {&p.q, &p.k, &p.v}) *t = clone(clone(*t, DType::kBF16), DType::kF32);  // bf16 values
  p.poison_outputs();
  OwnedTensor q16 = clone(p.q, DType::kBF16), k16 = clone(p.k, DType::kBF16), v16 = clone(p.v, DType::kBF16);
  OwnedTensor o16(DType::kBF16, {s.B, s.S, s.H, s.hd}), lse16(DType::kF32, {s.B, s.H, s.S});
  for (const OwnedTensor* t : {&o16, &lse16}) test::poison(*t);
  Ns::attention_fwd(p.q, p.k, p.v, p.o, p.lse, Tensor(), true);
  Ns::attention_fwd(q16, k16, v16, o16, lse16, Tensor(), true);
  EXPECT_TRUE(test::bitwise_equal(lse16, p.lse));
  EXPECT_TRUE(test::bitwise_equal(o16, clone(p.o, DType::kBF16)));
  Problem g = p.converted(s, DType::kF32);
  const OwnedTensor o_wide = clone(o16, DType::kF32);
  Ns::attention_bwd(p.dout, p.q, p.k, p.v, o_wide, p.lse, p.dq, p.dk, p.dv, Tensor(), true);
  Ns::attention_bwd(p.dout, q16, k16, v16, o16, lse16, g.dq, g.dk, g.dv, Tensor(), true);
  for (auto [a, b] : {std::pair{&g.dq, &p.dq}, {&g.dk, &p.dk}, {&g.dv, &p.dv}})
    EXPECT_TRUE(test::bitwise_equal(*a, *b)) << (a == &g.dq ? "dq" : a == &g.dk ? "dk" : "dv") << " " << rel_error(*a, *b);
}

TEST_P(AttentionShapes, StoredBf16OperandsGiveTheRoundedFp32PathBitwise) {
  const Shape s = param();
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(s));
  expect_stored_bf16_is_the_rounded_fp32_path<Fast>(s, seed);
  expect_stored_bf16_is_the_rounded_fp32_path<Ref>(s, seed);
}

Problem rounded_to_bf16(const Problem& p, const Shape& s) {
  Problem r = p.converted(s, DType::kF64);
  for (OwnedTensor* t : {&r.q, &r.k, &r.v, &r.dout})
    for (int64_t i = 0; i < t->t.numel(); ++i)
      t->as<double>()[i] = static_cast<double>(static_cast<float>(bf16(static_cast<float>(t->as<double>()[i]))));
  return r;
}

TEST_P(AttentionShapes, Bf16ProductsMatchReferenceOnRoundedOperands) {
  const Shape s = param();
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(s));
  Problem fast32(s, DType::kF32);
  fast32.fill(s, seed);
  fast32.poison_outputs();
  if (s.hd % 2) {
    Problem f32 = fast32.converted(s, DType::kF32);
    run<Fast>(f32);
    Fast::attention_fwd(fast32.q, fast32.k, fast32.v, fast32.o, fast32.lse, Tensor(), true);
    Fast::attention_bwd(fast32.dout, fast32.q, fast32.k, fast32.v, fast32.o, fast32.lse, fast32.dq,
                        fast32.dk, fast32.dv, Tensor(), true);
    for (auto [a, b] : {std::pair{&fast32.o, &f32.o}, {&fast32.dq, &f32.dq}, {&fast32.dk, &f32.dk}})
      EXPECT_TRUE(test::bitwise_equal(*a, *b));
    return;
  }
  Problem ref64 = rounded_to_bf16(fast32, s);
  run<Ref>(ref64);
  Fast::attention_fwd(fast32.q, fast32.k, fast32.v, fast32.o, fast32.lse, Tensor(), true);
  Fast::attention_bwd(fast32.dout, fast32.q, fast32.k, fast32.v, fast32.o, fast32.lse, fast32.dq,
                      fast32.dk, fast32.dv, Tensor(), true);
  const double eo = rel_error(fast32.o, ref64.o), el = rel_error(fast32.lse, ref64.lse),
               eq = rel_error(fast32.dq, ref64.dq), ek = rel_error(fast32.dk, ref64.dk),
               ev = rel_error(fast32.dv, ref64.dv);
  const double grow = std::max(1.0, s.amp * s.amp / 9.0);
  EXPECT_LE(eo, kTolOBf16 * grow);
  EXPECT_LE(el, kTolLse * grow);
  EXPECT_LE(eq, kTolGradBf16 * grow);
  EXPECT_LE(ek, kTolGradBf16 * grow);
  EXPECT_LE(ev, kTolGradBf16 * grow);
  if (std::getenv("MOE_ATTN_PRINT_ERRORS"))
    printf("bf16 %-35s o %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", name(s).c_str(), eo, el, eq, ek, ev);
  // The reference's own bf16_products (f32 tensors) is the same oracle, to fp32 rounding.
  Problem ref32 = fast32.converted(s, DType::kF32);
  Ref::attention_fwd(ref32.q, ref32.k, ref32.v, ref32.o, ref32.lse, Tensor(), true);
  EXPECT_LE(rel_error(ref32.o, ref64.o), kTolO * grow);
}

// loss = sum(o * r); its gradient is attention_bwd with dout = r.
double loss(Problem& p, const Tensor& r, const Tensor& doc = Tensor()) {
  ref::attention_fwd(p.q, p.k, p.v, p.o, p.lse, doc, false);
  double sum = 0;
  for (int64_t i = 0; i < p.o.t.numel(); ++i) sum += test::get(p.o, i) * test::get(r, i);
  return sum;
}

MOE_BACKEND_SUITE(Attention);

TEST(AttentionRef, F64BackwardMatchesFiniteDifferences) {
  const Shape s{2, 13, 4, 2, 6, 2.0};
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(s, DType::kF64);
  p.fill(s, seed);
  p.poison_outputs();
  run<Ref>(p);
  // Fourth-order central differences, h = 1e-3: truncation ~h^4 f^(5) / 30 ~ 1e-13 and
  // rounding ~1e-16 |loss| / h ~ 1e-12, so ~1e-11 relative is expected (observed ~1e-11).
  const double h = 1e-3;
  for (auto [x, g, what] : {std::tuple{&p.q, &p.dq, "dq"}, std::tuple{&p.k, &p.dk, "dk"},
                            std::tuple{&p.v, &p.dv, "dv"}}) {
    OwnedTensor fd = clone(*g);
    for (int64_t i = 0; i < x->t.numel(); ++i) {
      const double x0 = test::get(*x, i);
      auto at = [&](double dx) {
        test::set(*x, i, x0 + dx);
        return loss(p, p.dout);
      };
      const double d1 = at(h) - at(-h), d2 = at(2 * h) - at(-2 * h);
      test::set(*x, i, x0);
      test::set(fd, i, (8 * d1 - d2) / (12 * h));
    }
    const double err = rel_error(*g, fd);
    EXPECT_LE(err, 1e-9) << what;
    if (std::getenv("MOE_ATTN_PRINT_ERRORS")) printf("finite differences %s %.2e\n", what, err);
  }
}

// The backend on the shape of the finite-difference check above, against its ref gradients.
TEST_P(Attention, MatchesRefOnTheFiniteDifferenceShape) {
  const Shape s{2, 13, 4, 2, 6, 2.0};
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(s, DType::kF64);
  p.fill(s, seed);
  p.poison_outputs();
  Problem fast32 = p.converted(s, DType::kF32);
  run<Ref>(p);
  run<Fast>(fast32);
  EXPECT_LE(rel_error(fast32.dq, p.dq), kTolGrad);
  EXPECT_LE(rel_error(fast32.dk, p.dk), kTolGrad);
  EXPECT_LE(rel_error(fast32.dv, p.dv), kTolGrad);
}

// Perturbing k and v at position j changes no output (o, lse) at positions < j, bitwise, and
// does change position j.
template <class Ns> void check_causal(DType t) {
  const Shape s{2, 150, 4, 2, 16};
  const uint64_t seed = test::test_seed();
  Problem p(s, DType::kF64);
  p.fill(s, seed);
  Problem a = p.converted(s, t);
  Ns::attention_fwd(a.q, a.k, a.v, a.o, a.lse, Tensor());
  for (int64_t j : {1, 63, 64, 100, 149}) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " j " + std::to_string(j));
    Problem b = p.converted(s, t);
    for (int64_t bb = 0; bb < s.B; ++bb)
      for (int64_t c = 0; c < s.G * s.hd; ++c) {
        const int64_t i = (bb * s.S + j) * s.G * s.hd + c;
        test::set(b.k, i, test::get(b.k, i) + 0.5);
        test::set(b.v, i, test::get(b.v, i) - 0.5);
      }
    Ns::attention_fwd(b.q, b.k, b.v, b.o, b.lse, Tensor());
    const int64_t row = s.H * s.hd;
    for (int64_t bb = 0; bb < s.B; ++bb) {
      const int64_t before = (bb * s.S + j) * row;
      const size_t bytes = dtype_size(t);
      EXPECT_EQ(std::memcmp(static_cast<char*>(a.o.t.data) + (before - j * row) * bytes,
                            static_cast<char*>(b.o.t.data) + (before - j * row) * bytes,
                            j * row * bytes),
                0);
      for (int64_t h = 0; h < s.H; ++h) {
        const int64_t l0 = (bb * s.H + h) * s.S;
        EXPECT_EQ(std::memcmp(static_cast<char*>(a.lse.t.data) + l0 * bytes,
                              static_cast<char*>(b.lse.t.data) + l0 * bytes, j * bytes),
                  0);
      }
      EXPECT_NE(test::get(a.o, before), test::get(b.o, before));
    }
  }
}

TEST(AttentionRef, Causal) { check_causal<Ref>(DType::kF64); }
TEST_P(Attention, Causal) { check_causal<Fast>(DType::kF32); }

TEST_P(Attention, BitwiseIndependentOfThreadCount) {
  const uint64_t seed = test::test_seed();
  const int saved = omp_get_max_threads();
  // fp32 products, then bf16 ones (the last shape: AMX tiles where the CPU has them).
  for (const auto& [s, bf16] : {std::pair{Shape{2, 150, 4, 2, 16}, false}, {Shape{1, 200, 4, 1, 64}, false},
                                {Shape{2, 150, 4, 2, 16}, true}, {Shape{2, 208, 4, 2, 64}, true}}) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(s) + (bf16 ? " bf16 products" : ""));
    Problem p(s, DType::kF32);
    p.fill(s, seed);
    Problem one = p.converted(s, DType::kF32), two = p.converted(s, DType::kF32);
    cpu::set_num_threads(1);  // cpu::, not omp_: it reaches a backend's own thread too (strict)
    run<Fast>(one, Tensor(), bf16);
    cpu::set_num_threads(2);
    run<Fast>(two, Tensor(), bf16);
    EXPECT_TRUE(test::bitwise_equal(one.o, two.o));
    EXPECT_TRUE(test::bitwise_equal(one.lse, two.lse));
    EXPECT_TRUE(test::bitwise_equal(one.dq, two.dq));
    EXPECT_TRUE(test::bitwise_equal(one.dk, two.dk));
    EXPECT_TRUE(test::bitwise_equal(one.dv, two.dv));
  }
  cpu::set_num_threads(saved);
}

// Where dq passes 2 MiB the cpu backward streams dq, dk and dv around the cache; each
// sequence's gradients are still bitwise those of the sequence alone (1 MiB: plain stores),
// with fp32 and with bf16 products.
TEST(AttentionCpu, StreamedGradientsEqualEachSequenceAlone) {
  const uint64_t seed = test::test_seed();
  const Shape all{3, 256, 8, 2, 128}, one{1, 256, 8, 2, 128};
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE("seed " + std::to_string(seed) + (bf16 ? ", bf16 products" : ", fp32 products"));
    Problem p(all, DType::kF32);
    p.fill(all, seed);
    cpu::attention_fwd(p.q, p.k, p.v, p.o, p.lse, Tensor(), bf16);
    cpu::attention_bwd(p.dout, p.q, p.k, p.v, p.o, p.lse, p.dq, p.dk, p.dv, Tensor(), bf16);
    for (int64_t b = 0; b < all.B; ++b) {
      Problem s(one, DType::kF32);
      for (auto [from, to] : {std::pair{&p.q, &s.q}, {&p.k, &s.k}, {&p.v, &s.v}, {&p.dout, &s.dout}})
        test::copy_tensor(from->t.slice(b, b + 1), *to);
      cpu::attention_fwd(s.q, s.k, s.v, s.o, s.lse, Tensor(), bf16);
      cpu::attention_bwd(s.dout, s.q, s.k, s.v, s.o, s.lse, s.dq, s.dk, s.dv, Tensor(), bf16);
      EXPECT_TRUE(test::bitwise_equal(p.dq.t.slice(b, b + 1), s.dq)) << "sequence " << b;
      EXPECT_TRUE(test::bitwise_equal(p.dk.t.slice(b, b + 1), s.dk)) << "sequence " << b;
      EXPECT_TRUE(test::bitwise_equal(p.dv.t.slice(b, b + 1), s.dv)) << "sequence " << b;
    }
  }
}

TEST_P(Attention, RejectsBadArguments) {
  const Shape s{1, 8, 4, 2, 8};
  Problem p64(s, DType::kF64);
  try {
    test::fast().attention_fwd(p64.q, p64.k, p64.v, p64.o, p64.lse, Tensor(), false);
    ADD_FAILURE() << "attention accepted f64";
  } catch (const Error& e) {
    EXPECT_TRUE(test::says(e.what(), {"cpu backend does not support f64"},
                           {"attention_fwd: dtype f64 not supported on cuda"}));
  }
  EXPECT_THROW(test::fast().attention_bwd(p64.dout, p64.q, p64.k, p64.v, p64.o, p64.lse, p64.dq,
                                         p64.dk, p64.dv, Tensor(), false),
               Error);
  Problem p(s, DType::kF32);
  Problem g3({1, 8, 4, 3, 8}, DType::kF32);  // H not a multiple of G
  EXPECT_THROW(test::fast().attention_fwd(p.q, g3.k, g3.v, p.o, p.lse, Tensor(), false), Error);
  EXPECT_THROW(ref::attention_fwd(p.q, g3.k, g3.v, p.o, p.lse, Tensor(), false), Error);
  OwnedTensor short_lse(DType::kF32, {1, 4, 7});
  EXPECT_THROW(test::fast().attention_fwd(p.q, p.k, p.v, p.o, short_lse, Tensor(), false), Error);
  EXPECT_THROW(ref::attention_fwd(p.q, p.k, p.v, p.o, short_lse, Tensor(), false), Error);
  EXPECT_THROW(test::fast().attention_fwd(p.q, p.k, p.v, p64.o, p.lse, Tensor(), false), Error);  // dtype mismatch
  EXPECT_THROW(test::fast().attention_bwd(p.dout, p.q, p.k, p.v, p.o, p.lse, p.dq, p.dq, p.dv, Tensor(), false),
               Error);
  // doc_start: (B,S) i32 with 0 <= doc_start[b,s] <= s.
  OwnedTensor bad_doc(DType::kI32, {1, 8});
  for (int s = 0; s < 8; ++s) bad_doc.as<int32_t>()[s] = s == 5 ? 6 : 0;
  for (bool use_fast : {true, false}) {
    try {
      if (use_fast) test::fast().attention_fwd(p.q, p.k, p.v, p.o, p.lse, bad_doc, false);
      else ref::attention_fwd(p.q, p.k, p.v, p.o, p.lse, bad_doc, false);
      ADD_FAILURE() << "doc_start after its position accepted";
    } catch (const Error& e) {
      // cuda checks doc_start on the device: b * S + s is the index of its error.
      EXPECT_TRUE(test::says(e.what(), use_fast ? test::fast_device().name() : "ref", {"doc_start[0,5] = 6"},
                             {"attention_fwd: invalid value 6 at index 5"}));
    }
  }
  OwnedTensor short_doc(DType::kI32, {1, 7});
  EXPECT_THROW(test::fast().attention_fwd(p.q, p.k, p.v, p.o, p.lse, short_doc, false), Error);
  EXPECT_THROW(ref::attention_bwd(p.dout, p.q, p.k, p.v, p.o, p.lse, p.dq, p.dk, p.dv, short_doc, false), Error);
}

// ------------------------------------------------------------------ intra-document masking
// Boundaries cover: a document starting mid-tile, one starting exactly on a tile edge (64, 128),
// a one-token document, and a long last document so whole key tiles are skipped (S = 300).
const std::vector<std::vector<int64_t>> kDocs = {{0, 5, 6, 64, 100, 101, 128, 190}, {0, 37, 130}};

TEST(AttentionDocMaskRef, EqualsEachDocumentAsItsOwnSequence) {
  // The masked attention of a packed row equals plain causal attention of each document alone.
  const Shape s{2, 150, 4, 2, 8, 2.0};
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(s, DType::kF64);
  p.fill(s, seed);
  OwnedTensor doc = doc_starts(s.B, s.S, kDocs);  // starts past S are ignored
  run<Ref>(p, doc);
  for (int64_t b = 0; b < s.B; ++b) {
    std::vector<int64_t> bounds;
    for (int64_t x : kDocs[static_cast<size_t>(b)])
      if (x < s.S) bounds.push_back(x);
    bounds.push_back(s.S);
    for (size_t d = 0; d + 1 < bounds.size(); ++d) {
      const int64_t a = bounds[d], n = bounds[d + 1] - a;
      Shape one{1, n, s.H, s.G, s.hd};
      Problem q(one, DType::kF64);
      auto copy_rows = [&](const Tensor& src, const Tensor& dst, int64_t width) {
        for (int64_t i = 0; i < n * width; ++i) test::set(dst, i, test::get(src, (b * s.S + a) * width + i));
      };
      copy_rows(p.q, q.q, s.H * s.hd);
      copy_rows(p.k, q.k, s.G * s.hd);
      copy_rows(p.v, q.v, s.G * s.hd);
      copy_rows(p.dout, q.dout, s.H * s.hd);
      run<Ref>(q);
      double worst = 0;
      auto cmp = [&](const Tensor& whole, const Tensor& part, int64_t width) {
        for (int64_t i = 0; i < n * width; ++i)
          worst = std::max(worst, std::abs(test::get(whole, (b * s.S + a) * width + i) - test::get(part, i)));
      };
      cmp(p.o, q.o, s.H * s.hd);
      cmp(p.dq, q.dq, s.H * s.hd);
      cmp(p.dk, q.dk, s.G * s.hd);  // keys of other documents get no gradient from this one
      cmp(p.dv, q.dv, s.G * s.hd);
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t i = 0; i < n; ++i)
          worst = std::max(worst, std::abs(test::get(p.lse, (b * s.H + h) * s.S + a + i) - test::get(q.lse, h * n + i)));
      EXPECT_LE(worst, 1e-12) << "row " << b << " document at " << a;
    }
  }
}

TEST(AttentionDocMaskRef, BackwardMatchesFiniteDifferences) {
  const Shape s{2, 13, 4, 2, 6, 2.0};
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(s, DType::kF64);
  p.fill(s, seed);
  OwnedTensor doc = doc_starts(s.B, s.S, {{0, 4, 5, 9}, {0, 7}});
  run<Ref>(p, doc);
  const double h = 1e-3;
  for (auto [x, g, what] : {std::tuple{&p.q, &p.dq, "dq"}, std::tuple{&p.k, &p.dk, "dk"},
                            std::tuple{&p.v, &p.dv, "dv"}}) {
    OwnedTensor fd = clone(*g);
    for (int64_t i = 0; i < x->t.numel(); ++i) {
      const double x0 = test::get(*x, i);
      auto at = [&](double dx) {
        test::set(*x, i, x0 + dx);
        return loss(p, p.dout, doc);
      };
      const double d1 = at(h) - at(-h), d2 = at(2 * h) - at(-2 * h);
      test::set(*x, i, x0);
      test::set(fd, i, (8 * d1 - d2) / (12 * h));
    }
    EXPECT_LE(rel_error(*g, fd), 1e-9) << what;
  }
}

// A test-name part for a shape: B2_S150_H4_G2_hd8.
std::string doc_shape_param_name(const Shape& s) {
  return "B" + std::to_string(s.B) + "_S" + std::to_string(s.S) + "_H" + std::to_string(s.H) +
         "_G" + std::to_string(s.G) + "_hd" + std::to_string(s.hd);
}

const Shape kDocShapes[] = {Shape{2, 150, 4, 2, 8}, Shape{2, 300, 4, 2, 32, 2.0}, Shape{2, 200, 8, 1, 64, 3.0},
                            Shape{2, 70, 4, 4, 12}, Shape{2, 40, 3, 1, 3}};

MOE_BACKEND_SUITE_WITH(AttentionDocShapes, Shape, ::testing::ValuesIn(kDocShapes), doc_shape_param_name);

TEST_P(AttentionDocShapes, MatchesF64Reference) {
  const Shape s = param();
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(s));
  Problem ref64(s, DType::kF64);
  ref64.fill(s, seed);
  ref64.poison_outputs();
  Problem fast32 = ref64.converted(s, DType::kF32);
  std::vector<std::vector<int64_t>> docs;
  for (int64_t b = 0; b < s.B; ++b) {
    std::vector<int64_t> row;
    for (int64_t x : kDocs[static_cast<size_t>(b % 2)])
      if (x < s.S) row.push_back(x);
    docs.push_back(row);
  }
  OwnedTensor doc = doc_starts(s.B, s.S, docs);
  run<Ref>(ref64, doc);
  run<Fast>(fast32, doc);
  const double grow = std::max(1.0, s.amp * s.amp / 9.0);
  EXPECT_LE(rel_error(fast32.o, ref64.o), kTolO * grow);
  EXPECT_LE(rel_error(fast32.lse, ref64.lse), kTolLse * grow);
  EXPECT_LE(rel_error(fast32.dq, ref64.dq), kTolGrad * grow);
  EXPECT_LE(rel_error(fast32.dk, ref64.dk), kTolGrad * grow);
  EXPECT_LE(rel_error(fast32.dv, ref64.dv), kTolGrad * grow);
}

MOE_BACKEND_SUITE(AttentionDocMask);

TEST_P(AttentionDocMask, OneDocumentIsBitwisePlainCausalAndThreadCountFree) {
  const uint64_t seed = test::test_seed();
  const Shape s{2, 200, 4, 2, 16};
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(s, DType::kF32);
  p.fill(s, seed);
  Problem plain = p.converted(s, DType::kF32), one_doc = p.converted(s, DType::kF32);
  run<Fast>(plain);
  run<Fast>(one_doc, doc_starts(s.B, s.S, {{0}, {0}}));
  EXPECT_TRUE(test::bitwise_equal(plain.o, one_doc.o));
  EXPECT_TRUE(test::bitwise_equal(plain.lse, one_doc.lse));
  EXPECT_TRUE(test::bitwise_equal(plain.dq, one_doc.dq));
  EXPECT_TRUE(test::bitwise_equal(plain.dk, one_doc.dk));
  EXPECT_TRUE(test::bitwise_equal(plain.dv, one_doc.dv));
  const int saved = omp_get_max_threads();
  OwnedTensor doc = doc_starts(s.B, s.S, kDocs);
  Problem a = p.converted(s, DType::kF32), b = p.converted(s, DType::kF32);
  cpu::set_num_threads(1);  // cpu::, not omp_: it reaches a backend's own thread too (strict)
  run<Fast>(a, doc);
  cpu::set_num_threads(2);
  run<Fast>(b, doc);
  cpu::set_num_threads(saved);
  EXPECT_TRUE(test::bitwise_equal(a.o, b.o));
  EXPECT_TRUE(test::bitwise_equal(a.dq, b.dq));
  EXPECT_TRUE(test::bitwise_equal(a.dk, b.dk));
  EXPECT_TRUE(test::bitwise_equal(a.dv, b.dv));
}

// The cpu backward keeps its dk/dv pass's score-gradient tiles for its dq pass, for as many
// (batch, kv head) pairs per round as MOE_CPU_ATTENTION_STORE_MB holds (kernels/cpu_memory.h),
// and recomputes them where it holds none. Here 4 pairs of 2 heads x 10 tile pairs x 16 KiB
// (320 KiB each): 0.4 MiB runs 4 rounds, 0.7 MiB 2, the default 1, 0 recomputes. Rounds change no
// bit; the recomputing dq pass (scores as k . (c q) instead of q . (c k)) differs from the stored
// one by rounding only: dk, dv bitwise, every path's dq within the f64 reference's bounds. With
// bf16 products the tiles are kept as bf16 pair rows (half the bytes, in the same slots): the
// same, against the reference on bf16-rounded operands at the bf16 bound. Other backends ignore
// the variable: every comparison then holds trivially.
MOE_BACKEND_SUITE(AttentionBackwardStore);

TEST_P(AttentionBackwardStore, RoundsAreBitwiseAndRecomputingMatchesTheReference) {
  const uint64_t seed = test::test_seed();
  // hd 16, and whole 16-row tiles at hd 64 (AMX tiles where the CPU has them): 4 tiles each.
  for (const Shape& s : {Shape{2, 200, 4, 2, 16}, Shape{2, 208, 4, 2, 64}})
  for (const bool bf16 : {false, true})
    for (const bool docs : {false, true}) {
      SCOPED_TRACE("seed " + std::to_string(seed) + " " + name(s) + (bf16 ? " bf16 products, " : " fp32 products, ") +
                   (docs ? "documents" : "causal"));
      Problem p(s, DType::kF64);
      p.fill(s, seed);
      const OwnedTensor doc = doc_starts(s.B, s.S, kDocs);
      const Tensor doc_t = docs ? static_cast<const Tensor&>(doc) : Tensor();
      Problem ref64 = bf16 ? rounded_to_bf16(p, s) : p.converted(s, DType::kF64);
      run<Ref>(ref64, doc_t);
      std::vector<Problem> runs;
      for (const char* mb : {"", "0.4", "0.7", "0"}) {
        if (*mb) ::setenv("MOE_CPU_ATTENTION_STORE_MB", mb, 1);
        else ::unsetenv("MOE_CPU_ATTENTION_STORE_MB");
        runs.push_back(p.converted(s, DType::kF32));
        run<Fast>(runs.back(), doc_t, bf16);
        EXPECT_LE(rel_error(runs.back().dq, ref64.dq), bf16 ? kTolGradBf16 : kTolGrad) << "store " << mb;
      }
      ::unsetenv("MOE_CPU_ATTENTION_STORE_MB");
      for (size_t i = 1; i < runs.size(); ++i) {
        EXPECT_TRUE(test::bitwise_equal(runs[i].dk, runs[0].dk)) << i;
        EXPECT_TRUE(test::bitwise_equal(runs[i].dv, runs[0].dv)) << i;
        if (i < 3) {
          EXPECT_TRUE(test::bitwise_equal(runs[i].dq, runs[0].dq)) << i;
        }
      }
    }
}

}  // namespace
}  // namespace moe
