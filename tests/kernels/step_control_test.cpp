// step_control and the update ops it gates, through every backend: the decisions equal the host
// code they replace (GradSync::grad_norm, total_loss, torch's clip rule, the LR table), and the
// gated ops are bitwise their ungated forms -- or change nothing when the step is non-finite.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/backends.h"
#include "common/test_util.h"
#include "kernels/step_control.h"
#include "parallel/grad_sync.h"
#include "train/trainer.h"

namespace moe {
namespace {

using test::clone;
using test::get;
using test::random_tensor;
using test::set;

MOE_BACKEND_SUITE(StepControlOps);

OwnedTensor control_with(double updates, double nonfinite) {
  OwnedTensor c(DType::kF64, {kCtlSize});
  test::poison(c);
  set(c, kCtlUpdates, updates);
  set(c, kCtlNonfinite, nonfinite);
  return c;
}

TEST_P(StepControlOps, DecisionsEqualTheHostFormulas) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  const int64_t M = 3, P = 37;
  OwnedTensor lr_table(DType::kF64, {12});
  for (int64_t n = 0; n < 12; ++n) set(lr_table, n, 1e-3 * static_cast<double>(n) + 1e-5);
  LossConfig loss;
  loss.lm_z_coef = 1e-4;
  loss.lbl_coef = 0.01;
  loss.router_z_coef = 1e-3;
  uint64_t salt = 0;
  for (double max_norm : {0.0, 1e-3, 1e6})
    for (double updates : {0.0, 4.0, 30.0})  // 30: past the table's end (its last entry)
      for (int poison : {0, 1, 2, 3}) {     // 1: NaN loss term, 2: Inf gradient, 3: flag already set
        SCOPED_TRACE("max_norm " + std::to_string(max_norm) + " updates " + std::to_string(updates) + " poison " +
                     std::to_string(poison));
        OwnedTensor values = random_tensor(DType::kF64, {2 + 2 * M}, ++salt, 0.0, 3.0);
        OwnedTensor sumsq = random_tensor(DType::kF64, {P}, ++salt, 0.0, 2.0);
        if (poison == 1) set(values, 2 + M, std::nan(""));
        if (poison == 2) set(sumsq, 5, std::numeric_limits<double>::infinity());
        OwnedTensor control = control_with(updates, poison == 3 ? 1.0 : 0.0);
        test::fast().step_control(values, sumsq, loss.lm_z_coef, loss.lbl_coef, loss.router_z_coef, max_norm, lr_table,
                                  control);
        // The host code the op replaces.
        StepResult r;
        r.ce = get(values, 0);
        r.lm_z = get(values, 1);
        for (int64_t m = 0; m < M; ++m) r.lbl.push_back(get(values, 2 + m));
        for (int64_t m = 0; m < M; ++m) r.router_z.push_back(get(values, 2 + M + m));
        const double total = total_loss(loss, r);
        const double norm = GradSync::grad_norm(test::to_vector(sumsq));
        const bool finite = std::isfinite(total) && std::isfinite(norm) && poison != 3;
        const double coef = max_norm / (norm + 1e-6);
        const bool clipped = max_norm > 0 && coef < 1.0;
        const int64_t n = static_cast<int64_t>(updates) + 1;
        if (std::isfinite(norm)) {
          EXPECT_EQ(get(control, kCtlGradNorm), norm);
        } else {
          EXPECT_FALSE(std::isfinite(get(control, kCtlGradNorm)));
        }
        if (std::isfinite(total)) {
          EXPECT_EQ(get(control, kCtlLoss), total);
        } else {
          EXPECT_TRUE(std::isnan(get(control, kCtlLoss)));
        }
        EXPECT_EQ(get(control, kCtlNonfinite), finite ? 0.0 : 1.0);
        EXPECT_EQ(get(control, kCtlClipped), clipped ? 1.0 : 0.0);
        EXPECT_EQ(get(control, kCtlClipCoef), clipped ? coef : 1.0);
        EXPECT_EQ(get(control, kCtlLr), get(lr_table, std::min<int64_t>(n, 11)));
        EXPECT_EQ(get(control, kCtlUpdates), finite ? static_cast<double>(n) : updates);
      }
}

// A control tensor as step_control leaves it: finite or not, clipped by coef or not.
OwnedTensor decided(bool finite, bool clipped, double coef, double lr, double updates) {
  OwnedTensor c = control_with(updates, finite ? 0.0 : 1.0);
  set(c, kCtlClipped, clipped ? 1.0 : 0.0);
  set(c, kCtlClipCoef, clipped ? coef : 1.0);
  set(c, kCtlLr, lr);
  return c;
}

TEST_P(StepControlOps, GatedUpdatesAreTheUngatedOpsOrNothing) {
  SCOPED_TRACE("seed " + std::to_string(test::test_seed()));
  uint64_t salt = 100;
  // f64 where the backend has it (cuda has f64 scale only: tests/kernels/expected_skips.txt).
  const auto takes = [](DType dt) {
    for (OpId op : {OpId::scale, OpId::adamw_by_control, OpId::adamw})
      if (!test::fast_device().supports(op, dt)) return false;
    return true;
  };
  for (DType dt : {DType::kF32, DType::kF64})
    for (bool finite : {true, false})
      for (bool clipped : {true, false}) {
        if (!takes(dt)) continue;
        SCOPED_TRACE(std::string(dtype_name(dt)) + (finite ? " finite" : " nonfinite") + (clipped ? " clipped" : ""));
        const OwnedTensor control = decided(finite, clipped, 0.3125, 2e-3, 7);
        // adamw_by_control vs scale(grad, clip coefficient) then adamw(lr, step), and its bf16 copy vs
        // convert of the result (777 elements: the 16-wide blocks and a tail). The gradient itself
        // is left as it was.
        const OwnedTensor p0 = random_tensor(dt, {777}, ++salt), gr = random_tensor(dt, {777}, ++salt);
        const OwnedTensor m0 = random_tensor(dt, {777}, ++salt, -0.1, 0.1), v0 = random_tensor(dt, {777}, ++salt, 0.0, 0.1);
        for (bool with_copy : {false, true}) {
          SCOPED_TRACE(with_copy ? "with the bf16 copy" : "no copy");
          OwnedTensor pa = clone(p0), ma = clone(m0), va = clone(v0), pb = clone(p0), mb = clone(m0), vb = clone(v0);
          OwnedTensor ga = clone(gr), gb = clone(gr), copy(DType::kBF16, {777}), want(DType::kBF16, {777});
          test::fill_uniform(copy, test::test_seed(), ++salt, -1, 1);  // untouched when not finite
          test::fast().convert(copy, want);
          test::fast().adamw_by_control(pa, ga, ma, va, control, 0.9, 0.95, 1e-8, 0.1, with_copy ? copy.t : Tensor());
          if (finite && clipped) test::fast().scale(gb, 0.3125);
          if (finite) test::fast().adamw(pb, gb, mb, vb, 2e-3, 0.9, 0.95, 1e-8, 0.1, 7);
          EXPECT_TRUE(test::bitwise_equal(pa, pb) && test::bitwise_equal(ma, mb) && test::bitwise_equal(va, vb));
          EXPECT_TRUE(test::bitwise_equal(ga, gr));
          if (with_copy && finite) test::fast().convert(pb, want);
          if (with_copy) {
            EXPECT_TRUE(test::bitwise_equal(copy, want));
          }
        }
      }
  // router_bias_update_by_control vs router_bias_update
  for (bool finite : {true, false}) {
    OwnedTensor counts(DType::kI32, {8});
    test::fill_ids(counts, test::test_seed(), 7, 50);
    const OwnedTensor b0 = random_tensor(DType::kF32, {8}, 9);
    OwnedTensor ba = clone(b0), bb = clone(b0);
    test::fast().router_bias_update_by_control(counts, 1e-3, ba, decided(finite, false, 1, 1e-3, 1));
    if (finite) test::fast().router_bias_update(counts, 1e-3, bb);
    EXPECT_TRUE(test::bitwise_equal(ba, bb)) << (finite ? "finite" : "nonfinite");
  }
}

TEST_P(StepControlOps, RefusesAControlOfTheWrongShape) {
  OwnedTensor x(DType::kF32, {4}), bad(DType::kF64, {3});
  EXPECT_NE(test::error_of([&] { test::fast().adamw_by_control(x, x, x, x, bad, 0.9, 0.95, 1e-8, 0.1, Tensor()); })
                .find("adamw_by_control control"),
            std::string::npos);
}

}  // namespace
}  // namespace moe
