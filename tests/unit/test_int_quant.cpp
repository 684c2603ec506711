// kernels/int_quant.h against compressed-tensors' calculate_qparams and quantize
// (fixtures from scripts/fixtures/make_int_quant_fixtures.py: int8 and int4,
// symmetric and asymmetric, per tensor / channel / group, on rows with an
// outlier, zeros, a constant and tiny values): scales, zero points and codes
// bit for bit; and the percentile and MSE ranges against direct computations.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "expect_error.h"
#include "kernels/int_quant.h"

namespace loom {
namespace {

const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/int_quant/";

template <typename T>
std::vector<T> read(std::ifstream& in, size_t n) {
  std::vector<T> v(n);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  return v;
}

TEST(IntQuant, EqualsCompressedTensorsBitForBit) {
  std::ifstream cf(kDir + "cases.json");
  const auto cases = nlohmann::json::parse(cf)["cases"];
  ASSERT_GE(cases.size(), 7u);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    IntQuantSpec spec;
    spec.bits = c["bits"];
    spec.symmetric = c["symmetric"];
    spec.group = c["group"];
    const int64_t rows = c["rows"], cols = c["cols"], np = c["params"];
    std::ifstream in(kDir + name + ".bin", std::ios::binary);
    const auto w = read<float>(in, static_cast<size_t>(rows * cols));
    const auto scale = read<float>(in, static_cast<size_t>(np));
    const auto zero = read<float>(in, static_cast<size_t>(np));
    const auto codes = read<int8_t>(in, static_cast<size_t>(rows * cols));
    ASSERT_TRUE(in) << name;
    const IntQuantParams p = choose_int_quant_params(w.data(), rows, cols, spec);
    ASSERT_EQ(static_cast<int64_t>(p.scale.size()), np) << name;
    for (int64_t i = 0; i < np; ++i) {
      if (std::isnan(zero[static_cast<size_t>(i)])) continue;  // compressed-tensors' 0/0 on an all-zero asymmetric set
      EXPECT_EQ(p.scale[static_cast<size_t>(i)], scale[static_cast<size_t>(i)]) << name << " scale " << i;
      EXPECT_EQ(p.zero[static_cast<size_t>(i)], zero[static_cast<size_t>(i)]) << name << " zero " << i;
    }
    const auto q = int_quantize(w.data(), rows, cols, spec, p);
    int64_t differ = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (!spec.symmetric && spec.group == 0 && r == 2) continue;  // the all-zero row (see above)
      for (int64_t k = 0; k < cols; ++k) differ += q[static_cast<size_t>(r * cols + k)] != codes[static_cast<size_t>(r * cols + k)];
    }
    EXPECT_EQ(differ, 0) << name;
    const auto back = int_dequantize(q.data(), rows, cols, spec, p);
    double err = 0, ref = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      err += (back[i] - w[i]) * (back[i] - w[i]);
      ref += w[i] * w[i];
    }
    // One scale for the whole tensor spends its range on the 0.9 outlier (4% error at 8 bits).
    EXPECT_LT(std::sqrt(err / ref), spec.bits == 4 ? 0.2 : spec.group < 0 ? 0.05 : 0.02) << name;
  }
}

TEST(IntQuant, PercentileAndMseRanges) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> w(4 * 512);
  for (auto& x : w) x = n(rng);
  w[7] = 40;  // one outlier in row 0
  IntQuantSpec mm;
  mm.bits = 4;
  const auto p_mm = choose_int_quant_params(w.data(), 4, 512, mm);
  EXPECT_FLOAT_EQ(p_mm.scale[0], 40.0f / 7.5f);
  IntQuantSpec pc = mm;
  pc.range = RangeMethod::percentile;
  pc.percentile = 99.0;
  const auto p_pc = choose_int_quant_params(w.data(), 4, 512, pc);
  std::vector<float> row(w.begin(), w.begin() + 512);
  std::sort(row.begin(), row.end());
  const double pos_hi = 0.99 * 511, pos_lo = 0.01 * 511;
  const float hi = static_cast<float>(row[static_cast<size_t>(pos_hi)] +
                                      (pos_hi - std::floor(pos_hi)) * (row[static_cast<size_t>(pos_hi) + 1] - row[static_cast<size_t>(pos_hi)]));
  const float lo = static_cast<float>(row[static_cast<size_t>(pos_lo)] +
                                      (pos_lo - std::floor(pos_lo)) * (row[static_cast<size_t>(pos_lo) + 1] - row[static_cast<size_t>(pos_lo)]));
  EXPECT_NEAR(p_pc.scale[0], std::max(std::fabs(lo), std::fabs(hi)) / 7.5f, 1e-6);
  IntQuantSpec ms = mm;
  ms.range = RangeMethod::mse;
  const auto p_ms = choose_int_quant_params(w.data(), 4, 512, ms);
  auto mse = [&](const IntQuantParams& p) {
    const auto q = int_quantize(w.data(), 4, 512, mm, p);
    const auto b = int_dequantize(q.data(), 4, 512, mm, p);
    double e = 0;
    for (size_t i = 0; i < w.size(); ++i) e += (b[i] - w[i]) * (b[i] - w[i]);
    return e;
  };
  EXPECT_LT(mse(p_ms), mse(p_mm));  // never worse than min-max per row, better on Gaussian rows
  EXPECT_EQ(p_ms.scale[0], p_mm.scale[0]);  // row 0: clipping the 40 would cost more than it saves
  EXPECT_LT(p_ms.scale[1], p_mm.scale[1]);  // row 1 (Gaussian): 4 bits are best spent clipped
  EXPECT_LE(mse(p_ms), mse(p_pc) * 1.0001);
}

TEST(IntQuant, BadSpecsAreRefused) {
  IntQuantSpec s;
  s.bits = 3;
  test_util::expect_error([&] { check_int_quant_spec(s, 256, "w"); }, ErrorKind::invalid_input, {"w", "3 bits"});
  s.bits = 4;
  s.group = 100;
  test_util::expect_error([&] { check_int_quant_spec(s, 256, "w"); }, ErrorKind::invalid_input, {"groups of 100"});
  test_util::expect_error([&] { range_method_from_name("max"); }, ErrorKind::invalid_input, {"'max'"});
}

}  // namespace
}  // namespace loom
