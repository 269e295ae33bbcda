// GradWrites: which gradients a step has written (model/grad_writes.h). The model-level property
// (a step never reads the last step's gradients) is ModelGradient.AStepNeverReadsTheLastStepsGradients.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/test_util.h"
#include "model/grad_writes.h"

namespace moe {
namespace {

// The message of what f throws, or "" when it does not throw.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

struct Fixture {
  Config c;
  std::unique_ptr<Backend> ops = make_backend("cpu");
  ParamLayout layout{c.model};
  OwnedTensor flat{DType::kF32, {layout.total()}};
  Tensor grad(const std::string& name) { return param_view(layout.find(name), flat.t); }
  bool all(const Tensor& t, float v) {
    for (int64_t i = 0; i < t.numel(); ++i)
      if (t.as<float>()[i] != v && !(std::isnan(v) && std::isnan(t.as<float>()[i]))) return false;
    return true;
  }
};

TEST(GradWrites, FirstWriteOverwritesLaterWritesAddAndEachStepStartsOver) {
  Fixture f;
  std::fill(f.flat.as<float>(), f.flat.as<float>() + f.flat.t.numel(), std::nanf(""));
  GradWrites writes(f.layout, f.flat.t, *f.ops);
  EXPECT_TRUE(f.all(f.flat.t, 0.0f)) << "the buffer is zero-filled once, padding included";
  const Tensor wq = f.grad("layers.0.wq");
  EXPECT_FALSE(writes.accumulate(wq));
  EXPECT_TRUE(writes.accumulate(wq));
  EXPECT_TRUE(writes.accumulate(wq.view({wq.numel()})));  // any view of the whole entry
  writes.start_step();
  EXPECT_FALSE(writes.accumulate(wq));
}

TEST(GradWrites, PrepareZeroesOnlyAtTheFirstWrite) {
  Fixture f;
  GradWrites writes(f.layout, f.flat.t, *f.ops);
  const Tensor norm = f.grad("layers.0.attn_norm");
  f.ops->fill(norm, 5.0);
  writes.prepare(norm);
  EXPECT_TRUE(f.all(norm, 0.0f));
  f.ops->fill(norm, 5.0);
  writes.prepare(norm);  // written this step already: left to add to
  EXPECT_TRUE(f.all(norm, 5.0f));
}

TEST(GradWrites, ZeroUnwrittenZeroesOneLayersUnwrittenGradientsOrAll) {
  Fixture f;
  GradWrites writes(f.layout, f.flat.t, *f.ops);
  for (const ParamInfo& info : f.layout.entries()) f.ops->fill(param_view(info, f.flat.t), 3.0);
  const Tensor wq0 = f.grad("layers.0.wq"), wk0 = f.grad("layers.0.wk"), wq1 = f.grad("layers.1.wq");
  writes.accumulate(wq0);
  writes.zero_unwritten(0);
  EXPECT_TRUE(f.all(wq0, 3.0f)) << "written: kept";
  EXPECT_TRUE(f.all(wk0, 0.0f)) << "layer 0, unwritten: zeroed";
  EXPECT_TRUE(f.all(wq1, 3.0f)) << "another layer: untouched";
  EXPECT_TRUE(writes.accumulate(wk0)) << "a zeroed gradient counts as written";
  writes.zero_unwritten(GradWrites::kEvery);
  EXPECT_TRUE(f.all(wq1, 0.0f));
  EXPECT_TRUE(f.all(f.grad("embed"), 0.0f));
}

TEST(GradWrites, APartOfAGradientIsRefusedNamingItsParameter) {
  Fixture f;
  GradWrites writes(f.layout, f.flat.t, *f.ops);
  const Tensor wq = f.grad("layers.0.wq");
  const std::string inside = error_of([&] { writes.accumulate(wq.slice(1, 2)); });
  EXPECT_NE(inside.find("inside 'layers.0.wq'"), std::string::npos) << inside;
  const std::string start = error_of([&] { writes.prepare(wq.view({wq.numel()}).slice(0, 3)); });
  EXPECT_NE(start.find("'layers.0.wq') is not a whole parameter's gradient"), std::string::npos) << start;
}

}  // namespace
}  // namespace moe
