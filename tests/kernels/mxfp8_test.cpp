// MXFP8 quantization (core/mxfp8.h; ops mx_quantize, mx_dequantize through every backend) against
// code we did not write: tests/golden/mxfp8/quantize.safetensors, torchao 0.18's to_mx / to_dtype
// (tools/reference/make_mx_fixtures.py), ml_dtypes' decoding. Bytes and scales must be bit-exact:
// every finite code in every block position, midpoints between neighbours (ties to even), amax at
// max * 2^k and 1-2 fp32 ulps either side for every k, blocks whose scale clamps, fp32 and bf16
// subnormals, NaN / +-Inf / -0 lanes, random row- and column-wise tensors; both scale rules, both
// elements. Where torchao's eager code departs from its documented rule (the fixture lists each
// block and its reason; core/mxfp8.h) we must equal the rule and torchao must differ in exactly
// those blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/paths.h"
#include "checkpoint/safetensors.h"
#include "common/backends.h"
#include "common/test_util.h"
#include "core/mxfp8.h"
#include "kernels/math/mx_blocks.h"
#include "kernels/ref/ref_ops.h"

namespace moe {
namespace {

const std::string kFixture = std::string(::moe::test::source_dir()) + "/tests/golden/mxfp8/quantize.safetensors";

const SafetensorsFile& fixture() {
  static const SafetensorsFile f(kFixture, "MXFP8 fixture");
  return f;
}

OwnedTensor bytes_tensor(const SafetensorsFile& f, const std::string& name, DType dtype) {
  const SafetensorsEntry& e = f.entry(name);
  OwnedTensor t(dtype, {1});
  t.t.ndim = static_cast<int>(e.shape.size());
  for (size_t i = 0; i < e.shape.size(); ++i) t.t.shape[i] = e.shape[i];
  t.buffer = Buffer(std::max<size_t>(t.t.nbytes(), 1));
  t.t.data = t.buffer.data();
  const auto raw = f.bytes(name);
  EXPECT_EQ(raw.size(), t.t.nbytes()) << name;
  std::memcpy(t.t.data, raw.data(), std::min(raw.size(), t.t.nbytes()));
  return t;
}

DType input_dtype(const std::string& st) { return st == "BF16" ? DType::kBF16 : DType::kF32; }

struct Mismatch {
  int64_t count = 0;
  std::string first;
};

Mismatch compare_bytes(const Tensor& got, const Tensor& want, const char* what) {
  Mismatch m;
  const auto* g = static_cast<const uint8_t*>(got.data);
  const auto* w = static_cast<const uint8_t*>(want.data);
  for (int64_t i = 0; i < want.numel(); ++i)
    if (g[i] != w[i] && m.count++ == 0)
      m.first = std::string(what) + " [" + std::to_string(i) + "]: got " + std::to_string(g[i]) +
                ", want " + std::to_string(w[i]);
  return m;
}

// Every case of the fixture, quantized by `quantize` (the backend under test or the reference).
template <class Quantize>
void check_fixture(Quantize quantize) {
  const SafetensorsFile& f = fixture();
  int cases = 0;
  for (const auto& [name, entry] : f.entries()) {
    if (name.size() < 2 || name.substr(name.size() - 2) != ".x") continue;
    const std::string c = name.substr(0, name.size() - 2);
    const bool columnwise = f.meta(c + ".axis") == "col";
    const OwnedTensor x = bytes_tensor(f, name, input_dtype(entry.dtype));
    for (const char* elem : {"e4m3", "e5m2"})
      for (const char* rule : {"rceil", "floor"}) {
        const std::string p = c + "." + elem + "." + rule + ".";
        if (!f.contains(p + "codes")) continue;
        ++cases;
        const DType ed = std::string(elem) == "e4m3" ? DType::kE4M3 : DType::kE5M2;
        const OwnedTensor want_codes = bytes_tensor(f, p + "codes", ed);
        const OwnedTensor want_scales = bytes_tensor(f, p + "scales", DType::kE8M0);
        OwnedTensor codes = bytes_tensor(f, p + "codes", ed);  // the shapes; bytes overwritten
        OwnedTensor scales = bytes_tensor(f, p + "scales", DType::kE8M0);
        std::memset(codes.t.data, 0xAB, codes.t.nbytes());
        std::memset(scales.t.data, 0xAB, scales.t.nbytes());
        quantize(x.t, columnwise, std::string(rule) == "rceil" ? mx::ScaleRule::kRceil : mx::ScaleRule::kFloor, codes.t, scales.t);
        const Mismatch mc = compare_bytes(codes, want_codes, "codes");
        const Mismatch ms = compare_bytes(scales, want_scales, "scales");
        EXPECT_EQ(mc.count, 0) << p << mc.first;
        EXPECT_EQ(ms.count, 0) << p << ms.first;

        // torchao's own bytes differ from the expected exactly in the listed blocks.
        const OwnedTensor tc = bytes_tensor(f, p + "torchao_codes", ed);
        const OwnedTensor ts = bytes_tensor(f, p + "torchao_scales", DType::kE8M0);
        const OwnedTensor devs = bytes_tensor(f, p + "deviations", DType::kI32);
        std::vector<char> listed(static_cast<size_t>(want_scales.t.numel()), 0);
        for (int64_t i = 0; i < devs.t.numel() / 2; ++i) listed[devs.as<int32_t>()[2 * i]] = 1;
        int64_t differing = 0, unlisted = 0;
        for (int64_t b = 0; b < want_scales.t.numel(); ++b) {
          bool same = ts.bytes()[b] == want_scales.bytes()[b];
          for (int i = 0; i < mx::kBlock; ++i)
            same &= tc.bytes()[b * mx::kBlock + i] == want_codes.bytes()[b * mx::kBlock + i];
          differing += same ? 0 : 1;
          unlisted += (!same && !listed[b]) || (same && listed[b]) ? 1 : 0;
        }
        EXPECT_EQ(unlisted, 0) << p << ": torchao differs outside its listed deviations";
        EXPECT_EQ(differing, devs.t.numel() / 2) << p;
      }
  }
  // 6 element-specific inputs x 2 rules, 8 others x 2 elements x 2 rules.
  EXPECT_EQ(cases, 44) << "fixture cases";
}

MOE_BACKEND_SUITE(MxFixture);

TEST_P(MxFixture, QuantizedBytesAreTorchaosBitForBit) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_quantize, DType::kF32);
  check_fixture([](const Tensor& x, bool col, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales) {
    test::fast().mx_quantize(x, col, rule, codes, scales, Tensor{}, Tensor{});
  });
}

TEST_P(MxFixture, DequantizedValuesAreTorchaos) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_dequantize, DType::kF32);
  const SafetensorsFile& f = fixture();
  int checked = 0;
  for (const auto& [name, entry] : f.entries()) {
    const std::string suffix = ".dequantized";
    if (name.size() < suffix.size() || name.substr(name.size() - suffix.size()) != suffix) continue;
    const std::string p = name.substr(0, name.size() - suffix.size() + 1);
    const DType ed = p.find(".e4m3.") != std::string::npos ? DType::kE4M3 : DType::kE5M2;
    const OwnedTensor codes = bytes_tensor(f, p + "codes", ed);
    const OwnedTensor scales = bytes_tensor(f, p + "scales", DType::kE8M0);
    const OwnedTensor want = bytes_tensor(f, name, DType::kF32);
    OwnedTensor got(DType::kF32, {codes.t.shape[0], codes.t.shape[1]});
    test::fast().mx_dequantize(codes, scales, got, Tensor{});
    int64_t bad = 0;
    for (int64_t i = 0; i < want.t.numel(); ++i) {
      const float g = got.as<float>()[i], w = want.as<float>()[i];
      bad += (std::isnan(w) ? !std::isnan(g) : std::memcmp(&g, &w, 4) != 0) ? 1 : 0;
    }
    EXPECT_EQ(bad, 0) << name;
    ++checked;
  }
  EXPECT_GT(checked, 20);
}

TEST(MxFormat, DecodeMatchesMlDtypesForEveryCode) {
  const SafetensorsFile& f = fixture();
  for (auto [name, e] : {std::pair{"decode.e4m3", mx::Elem::kE4M3}, std::pair{"decode.e5m2", mx::Elem::kE5M2}}) {
    const OwnedTensor want = bytes_tensor(f, name, DType::kF32);
    for (int c = 0; c < 256; ++c) {
      const float w = want.as<float>()[c], g = mx::decode(static_cast<uint8_t>(c), e);
      if (std::isnan(w)) EXPECT_TRUE(std::isnan(g)) << name << " code " << c;
      else EXPECT_EQ(std::memcmp(&g, &w, 4), 0) << name << " code " << c << ": " << g << " vs " << w;
    }
  }
}

TEST(MxFormat, EncodeInvertsDecodeForEveryFiniteCode) {
  for (mx::Elem e : {mx::Elem::kE4M3, mx::Elem::kE5M2})
    for (int c = 0; c < 256; ++c) {
      const float v = mx::decode(static_cast<uint8_t>(c), e);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(mx::encode(v, e), c) << "code " << c;
    }
}

// The statistics the op reports per call: the largest finite |x|, saturated values, nonzero
// values that became zero codes, values. Under floor, amax 500 takes scale 2^0 (floor(log2 500) = 8)
// and 500 saturates to 448; under rceil it takes 2^1 and nothing saturates. 2^-12 is below half
// the smallest subnormal (2^-9) at scale 2^0 or 2^1: it underflows under both.
TEST_P(MxFixture, StatisticsCountSaturationAndUnderflow) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_quantize, DType::kF32);
  OwnedTensor x(DType::kF32, {2, 32});
  for (int i = 0; i < 64; ++i) x.as<float>()[i] = 1.0f;
  x.as<float>()[3] = 500.0f;
  x.as<float>()[4] = -std::ldexp(1.0f, -12);
  x.as<float>()[40] = NAN;  // second block: NaN, excluded from amax and from the counts but values
  x.as<float>()[41] = 0.0f;  // zero stays zero: not an underflow
  for (mx::ScaleRule rule : {mx::ScaleRule::kRceil, mx::ScaleRule::kFloor}) {
    OwnedTensor codes(DType::kE4M3, {2, 32}), scales(DType::kE8M0, {2, 1}), stats(DType::kF64, {4});
    stats.as<double>()[0] = 2.0;  // stats[0] is a running max: 500 replaces it
    test::fast().mx_quantize(x, false, rule, codes, scales, stats, Tensor{});
    const double* s = stats.as<double>();
    EXPECT_EQ(s[0], 500.0);
    EXPECT_EQ(s[1], rule == mx::ScaleRule::kFloor ? 1.0 : 0.0) << "rule " << static_cast<int>(rule);
    EXPECT_EQ(s[2], 1.0) << "rule " << static_cast<int>(rule);
    EXPECT_EQ(s[3], 64.0);
    EXPECT_EQ(scales.bytes()[0], rule == mx::ScaleRule::kFloor ? 127 : 128);
    EXPECT_EQ(scales.bytes()[1], mx::kScaleNaN);
  }
}

TEST_P(MxFixture, ColumnwiseOf3dWeightsIsEachMatrixTransposed) {
  MOE_SKIP_UNLESS_SUPPORTED(OpId::mx_quantize, DType::kF32);
  const int64_t G = 3, N = 64, C = 40;
  OwnedTensor x = test::random_tensor(DType::kF32, {G, N, C}, 7);
  OwnedTensor codes(DType::kE4M3, {G, C, N}), scales(DType::kE8M0, {G, C, N / 32});
  test::fast().mx_quantize(x, true, mx::ScaleRule::kRceil, codes, scales, Tensor{}, Tensor{});
  for (int64_t g = 0; g < G; ++g) {
    OwnedTensor xt(DType::kF32, {C, N});
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) xt.as<float>()[c * N + n] = x.as<float>()[(g * N + n) * C + c];
    OwnedTensor want(DType::kE4M3, {C, N}), want_s(DType::kE8M0, {C, N / 32});
    ref::mx_quantize(xt, false, mx::ScaleRule::kRceil, want, want_s, Tensor{}, Tensor{});
    EXPECT_EQ(std::memcmp(want.t.data, codes.bytes() + g * C * N, C * N), 0) << g;
    EXPECT_EQ(std::memcmp(want_s.t.data, scales.bytes() + g * C * N / 32, C * N / 32), 0) << g;
  }
}

TEST(MxFormat, RefQuantizesTheFixtureToo) {
  check_fixture([](const Tensor& x, bool col, mx::ScaleRule rule, const Tensor& codes, const Tensor& scales) {
    ref::mx_quantize(x, col, rule, codes, scales, Tensor{}, Tensor{});
  });
}

TEST(MxFormat, BadShapesNameTheDimension) {
  OwnedTensor x(DType::kF32, {4, 48});
  OwnedTensor codes(DType::kE4M3, {4, 48}), scales(DType::kE8M0, {4, 1});
  const std::string err = test::error_of([&] { ref::mx_quantize(x, false, mx::ScaleRule::kRceil, codes, scales, Tensor{}, Tensor{}); });
  EXPECT_NE(err.find("C = 48 is not a multiple of the 32-value MXFP8 block"), std::string::npos) << err;
  OwnedTensor wrong(DType::kBF16, {4, 48});
  const std::string err2 = test::error_of([&] { ref::mx_quantize(x, false, mx::ScaleRule::kRceil, wrong, scales, Tensor{}, Tensor{}); });
  EXPECT_NE(err2.find("expected e4m3 or e5m2"), std::string::npos) << err2;
}

}  // namespace
}  // namespace moe
