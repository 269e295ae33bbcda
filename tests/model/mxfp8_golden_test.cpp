// The whole model in MXFP8 (experts and attention projections) against a PyTorch emulation:
// tests/golden/mxfp8/model.safetensors, written by tools/reference/make_mx_model_fixture.py
// (moe_reference.py's float64 model whose expert GEMMs and projections multiply torchao-quantized
// operands, as moecore's mode defines them). A recording backend keeps the bytes of every
// mx_quantize call, which the test names by moecore's call order and compares with the
// emulation's tensor of that name.
//
// Tolerances:
// - f64 reference path: every quantized tensor byte-equal (codes and scales). Dequantized
//   products are exact in f64 on both sides; sums differ in order only (~1e-16), which moves a
//   float32-rounded quantizer input across a rounding boundary with probability ~1e-9 per value.
//   Then losses, gradients and the ten-step trajectory at golden_test.cpp's 1e-10.
// - fp32 fast path (cpu: bf16 operands elsewhere, fp32 sums, exact products inside the bf16
//   range): the quantizers' inputs carry fp32 and bf16 rounding, so codes flip where an input sits
//   within that rounding of an E4M3 rounding midpoint: a flip fraction of order 2^-8 (bf16 inputs)
//   times the density of midpoints, bounded here at 2% of values and 1% of scales per tensor.
//   The step-0 losses within 1e-2 relative: the bf16 rounding of every unquantized GEMM operand
//   (2^-9 relative each) plus the flipped codes (one E4M3 step, 2^-3 relative, each).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/paths.h"
#include "golden_common.h"

namespace moe {
namespace {

const std::string kFixture = std::string(::moe::test::source_dir()) + "/tests/golden/mxfp8/model.safetensors";

// Forwards every call to a host backend (ref or cpu) and keeps the bytes each mx_quantize wrote.
class RecordingBackend final : public Backend {
 public:
  struct Quantized {
    std::vector<unsigned char> codes, scales;
  };
  explicit RecordingBackend(const std::string& backend) : in_(make_backend(backend)) {
    MOE_CHECK(in_->host_addressable(), "the recording backend reads host memory");
  }
  std::vector<Quantized> calls;

  const char* name() const override { return in_->name(); }
  Device device() const override { return in_->device(); }
  void* allocate(size_t bytes) override { return in_->allocate(bytes); }
  void deallocate(void* p, size_t bytes) noexcept override { in_->deallocate(p, bytes); }
  void upload(const void* host, const Tensor& dst) override { in_->upload(host, dst); }
  void download(const Tensor& src, void* host) override { in_->download(src, host); }
  void copy(const Tensor& src, const Tensor& dst) override { in_->copy(src, dst); }
  Event record() override { return in_->record(); }
  void wait(Event e) override { in_->wait(e); }
  void synchronize() override { in_->synchronize(); }
  double elapsed_seconds(Event a, Event b) override { return in_->elapsed_seconds(a, b); }
  bool supports(OpId op, DType dtype) const override { return in_->supports(op, dtype); }

#define MOE_OP(name, params, args) \
  void name params override { call(OpId::name, &Backend::name, MOE_ARGS args); }
#define MOE_ARGS(...) __VA_ARGS__
#include "kernels/op_list.inc"
#undef MOE_ARGS
#undef MOE_OP

 private:
  template <class M, class... A>
  void call(OpId id, M op, const A&... args) {
    (in_.get()->*op)(args...);
    if (id == OpId::mx_quantize) after_quantize(args...);
  }
  void after_quantize(const Tensor&, bool, mx::ScaleRule, const Tensor& codes, const Tensor& scales, const Tensor&,
                      const Tensor& row_end) {
    MOE_CHECK(row_end.empty(), "the recording backend keeps whole tensors (no expert parallelism)");
    in_->synchronize();
    auto bytes = [](const Tensor& t) {
      const auto* p = static_cast<const unsigned char*>(t.data);
      return std::vector<unsigned char>(p, p + t.nbytes());
    };
    calls.push_back({bytes(codes), bytes(scales)});
  }
  template <class... A>
  void after_quantize(const A&...) {}

  std::unique_ptr<Backend> in_;
};

// The names of moecore's mx_quantize calls, in its order, from a load (refresh_operand_weights:
// every MoE layer's expert caches, then every layer's attention caches) through one step's
// micro-batches (forward by layer: attention h, o, experts x, a; backward in reverse: experts dy,
// dgate, dup, attention dy, dq, dk, dv).
std::string join(std::initializer_list<std::string_view> parts) {
  std::string s;
  for (std::string_view p : parts) s.append(p);
  return s;
}

std::vector<std::string> call_names(const ModelConfig& c, int64_t micro_batches) {
  std::vector<std::string> n;
  auto L = [](int64_t l) { return join({"L", std::to_string(l)}); };
  for (int64_t l = 0; l < c.n_layers; ++l)
    if (c.is_moe_layer(l))
      for (const char* w : {"gate", "up", "down"})
        for (const char* o : {"q", "t"}) n.push_back(join({"q.", L(l), ".experts.", w, ".", o}));
  for (int64_t l = 0; l < c.n_layers; ++l)
    for (const char* w : {"wq", "wk", "wv", "wo"})
      for (const char* o : {"q", "t"}) n.push_back(join({"q.", L(l), ".attn.", w, ".", o}));
  for (int64_t m = 0; m < micro_batches; ++m) {
    const std::string mb = join({"q.mb", std::to_string(m), "."});
    for (int64_t l = 0; l < c.n_layers; ++l) {
      for (const char* t : {"h", "o"}) n.push_back(join({mb, L(l), ".attn.", t}));
      if (c.is_moe_layer(l))
        for (const char* t : {"x", "a"}) n.push_back(join({mb, L(l), ".experts.", t}));
    }
    for (int64_t l = c.n_layers - 1; l >= 0; --l) {
      if (c.is_moe_layer(l))
        for (const char* t : {"dy", "dgate", "dup"}) n.push_back(join({mb, L(l), ".experts.", t}));
      for (const char* t : {"dy", "dq", "dk", "dv"}) n.push_back(join({mb, L(l), ".attn.", t}));
    }
  }
  return n;
}

struct Flips {
  int64_t codes = 0, code_values = 0, scales = 0, scale_values = 0;
  std::vector<std::pair<double, double>> per_call;  // (code, scale) fractions, in call_names order
};

// Loads the fixture into a trainer on a recording `backend`, runs step 1's gradients and
// compares every quantized tensor with the emulation's.
Flips compare_quantized_step(const Golden& g, RecordingBackend& ops, Trainer& trainer, StepResult& r) {
  ops.calls.clear();
  load_initial_state(g, trainer, ops);
  OwnedTensor ids = g.file.read("ids", DType::kI32), labels = g.file.read("labels", DType::kI32);
  const TrainConfig& tc = g.config.train;
  r = trainer.compute_gradients(ids, labels);
  const std::vector<std::string> names = call_names(g.config.model, tc.batch_size / tc.micro_batch_size);
  EXPECT_EQ(ops.calls.size(), names.size()) << "mx_quantize calls";
  Flips f;
  for (size_t i = 0; i < std::min(names.size(), ops.calls.size()); ++i) {
    const auto want_codes = g.file.bytes(join({names[i], ".codes"}));
    const auto want_scales = g.file.bytes(join({names[i], ".scales"}));
    const RecordingBackend::Quantized& got = ops.calls[i];
    EXPECT_EQ(got.codes.size(), want_codes.size()) << names[i];
    EXPECT_EQ(got.scales.size(), want_scales.size()) << names[i];
    if (got.codes.size() != want_codes.size() || got.scales.size() != want_scales.size()) continue;
    int64_t codes = 0, scales = 0;
    for (size_t j = 0; j < want_codes.size(); ++j) codes += got.codes[j] != want_codes[j];
    for (size_t j = 0; j < want_scales.size(); ++j) scales += got.scales[j] != want_scales[j];
    f.codes += codes;
    f.scales += scales;
    f.code_values += static_cast<int64_t>(want_codes.size());
    f.scale_values += static_cast<int64_t>(want_scales.size());
    const double cf = static_cast<double>(codes) / static_cast<double>(want_codes.size());
    const double sf = static_cast<double>(scales) / static_cast<double>(want_scales.size());
    f.per_call.emplace_back(cf, sf);
    if (std::getenv("MOE_PRINT_FLIPS"))
      std::printf("    %-28s %6.2f%% codes %6.2f%% scales\n", names[i].c_str(), 100 * cf, 100 * sf);
  }
  return f;
}

TEST(Mxfp8Golden, FixtureIsTheMxfp8ModeWithExpertsAndAttention) {
  const Golden g(kFixture);
  EXPECT_EQ(g.config.train.precision, "mxfp8");
  EXPECT_TRUE(g.config.mxfp8.experts);
  EXPECT_TRUE(g.config.mxfp8.attention);
  EXPECT_GT(g.config.model.n_dense_layers, 0);   // dense FFNs stay unquantized
  EXPECT_GT(g.config.model.shared_hidden, 0);    // so does the shared expert
}

TEST(Mxfp8Golden, DoubleReferencePathQuantizesEveryTensorByteEqualAndMatchesTenSteps) {
  const Golden g(kFixture);
  RecordingBackend ops("ref");
  Trainer trainer(g.config, ops, DType::kF64);
  StepResult r;
  const Flips f = compare_quantized_step(g, ops, trainer, r);
  EXPECT_EQ(f.codes, 0) << "codes differ (MOE_PRINT_FLIPS=1 lists them per tensor)";
  EXPECT_EQ(f.scales, 0);
  EXPECT_GT(f.code_values, 100000);
  std::printf("  f64: %lld codes and %lld scales in %zu tensors, %lld and %lld differ\n",
              static_cast<long long>(f.code_values), static_cast<long long>(f.scale_values), ops.calls.size(),
              static_cast<long long>(f.codes), static_cast<long long>(f.scales));
  auto near = [&](double a, const std::string& name) {
    const double b = scalar(g, name);
    EXPECT_LE(std::fabs(a - b), 1e-10 * std::max(1.0, std::fabs(b))) << name << ": " << a << " vs " << b;
  };
  near(r.ce, "step0.ce");
  near(r.total, "step0.total");
  near(r.grad_norm, "step0.grad_norm");
  for (const ParamInfo& info : trainer.model().layout().entries())
    EXPECT_LT(test::rel_error(param_view(info, trainer.model().grads().flat),
                              g.file.read(join({"step0.grad.", info.name}), DType::kF64)), 1e-10)
        << "gradient of " << info.name;

  // Ten AdamW steps from the start: the caches requantized after every update.
  ops.calls.clear();
  Trainer fresh(g.config, ops, DType::kF64);
  load_initial_state(g, fresh, ops);
  OwnedTensor ids = g.file.read("ids", DType::kI32), labels = g.file.read("labels", DType::kI32);
  OwnedTensor total = g.file.read("train.total", DType::kF64);
  for (int64_t n = 0; n < g.config.train.steps; ++n) {
    const StepResult s = fresh.step(ids, labels);
    EXPECT_NEAR(s.total, total.as<double>()[n], 1e-10 * std::fabs(total.as<double>()[n])) << "step " << n + 1;
  }
  for (const ParamInfo& info : fresh.model().layout().entries())
    EXPECT_LT(test::rel_error(param_view(info, fresh.model().params().flat),
                              g.file.read(join({"final.param.", info.name}), DType::kF64)), 1e-10)
        << "final " << info.name;
}

TEST(Mxfp8Golden, Float32PathFlipsFewCodesAndStaysWithinTheBound) {
  const Golden g(kFixture);
  RecordingBackend ops("cpu");
  Trainer trainer(g.config, ops, DType::kF32);
  StepResult r;
  const Flips f = compare_quantized_step(g, ops, trainer, r);
  const TrainConfig& tc = g.config.train;
  const std::vector<std::string> names = call_names(g.config.model, tc.batch_size / tc.micro_batch_size);
  ASSERT_EQ(f.per_call.size(), names.size());
  std::printf("  fp32 (cpu): %lld of %lld codes flipped (%.2f%%), %lld of %lld scales (%.2f%%)\n",
              static_cast<long long>(f.codes), static_cast<long long>(f.code_values),
              100.0 * static_cast<double>(f.codes) / static_cast<double>(f.code_values),
              static_cast<long long>(f.scales), static_cast<long long>(f.scale_values),
              100.0 * static_cast<double>(f.scales) / static_cast<double>(f.scale_values));
  for (size_t i = 0; i < names.size(); ++i) {
    const auto [cf, sf] = f.per_call[i];
    if (names[i].rfind("q.L", 0) == 0) {
      // The caches are quantized from the fp32 masters, the fixture's f64 values rounded to fp32:
      // the same input, the same bytes.
      EXPECT_EQ(cf, 0) << names[i];
      EXPECT_EQ(sf, 0) << names[i];
    } else if (names[i].find(".L0.attn.h") != std::string::npos) {
      // The first quantization of each micro-batch reads the normed embedding rounded to bf16.
      // E4M3's rounding midpoints are bf16 values; an input within half a bf16 ulp of one rounds
      // onto it (probability bf16 ulp / E4M3 step = 2^-7 / 2^-3 = 1/16) and then to the even
      // neighbour, the other one half the time: 1/32 of the codes flip. 5% is 8 standard
      // deviations above that at this tensor's 5,120 values.
      EXPECT_LT(cf, 0.05) << names[i];
      EXPECT_LT(sf, 0.01) << names[i];
    } else {
      // Downstream of that, the differences feed every later quantization and compound (a
      // flipped code moves its value by one E4M3 step, 1/8 to 1/16): 3-50% flip here (the
      // gradients most). What would be wrong is a tensor unrelated to the emulation's.
      EXPECT_LT(cf, 0.6) << names[i];
      EXPECT_LT(sf, 0.1) << names[i];
    }
  }
  // The losses: bf16 mode's bound against fp32 (Step.Bf16StepZeroLossIsWithinOneHundredthOfFp32:
  // 1e-2) tightened tenfold; this fixture's logits are small (CE ~ ln 64), so the flipped codes
  // move its losses far less than a trained model's.
  const double ce = scalar(g, "step0.ce"), total = scalar(g, "step0.total"), gn = scalar(g, "step0.grad_norm");
  std::printf("  fp32 (cpu): ce %.7f vs %.7f (%.1e relative), total %.1e, grad norm %.5f vs %.5f (%.1e)\n", r.ce,
              ce, std::fabs(r.ce - ce) / ce, std::fabs(r.total - total) / total, r.grad_norm, gn,
              std::fabs(r.grad_norm - gn) / gn);
  EXPECT_LT(std::fabs(r.ce - ce) / ce, 1e-3);
  EXPECT_LT(std::fabs(r.total - total) / total, 1e-3);
  // The gradient norm likewise.
  EXPECT_LT(std::fabs(r.grad_norm - gn) / gn, 1e-3);
}

}  // namespace
}  // namespace moe
