// Reference (de)quantization vs gguf-py: fixtures written by
// scripts/fixtures/make_quant_fixtures.py must match bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/half.h"
#include "kernels/quant_blocks.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

struct QuantFixture {
  DType type = DType::f32;
  int64_t rows = 0, cols = 0;
  std::vector<float> src;      // empty when the fixture has no source floats
  std::vector<uint8_t> bytes;  // rows * row_bytes
  std::vector<float> deq;      // empty when the fixture has no dequantized floats
  size_t row_bytes() const { return dtype_row_bytes(type, cols); }
};

QuantFixture load_fixture(const std::string& name) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/quant/" + name;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("missing fixture " + path + " (run scripts/fixtures/make_quant_fixtures.py)");
  char magic[4];
  uint32_t hdr[5];
  in.read(magic, 4);
  in.read(reinterpret_cast<char*>(hdr), sizeof(hdr));
  if (!in || std::memcmp(magic, "LQFX", 4) != 0 || hdr[0] != 1) throw std::runtime_error("bad fixture " + path);
  QuantFixture f;
  const auto traits = dtype_traits_of_id(hdr[1]);
  if (!traits) throw std::runtime_error("fixture type unknown to loom: " + path);
  f.type = traits->type;
  f.rows = hdr[2];
  f.cols = hdr[3];
  const size_t n = static_cast<size_t>(f.rows * f.cols);
  auto read_floats = [&](std::vector<float>& v) {
    v.resize(n);
    in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  };
  if (hdr[4] & 1) read_floats(f.src);
  f.bytes.resize(f.row_bytes() * static_cast<size_t>(f.rows));
  in.read(reinterpret_cast<char*>(f.bytes.data()), static_cast<std::streamsize>(f.bytes.size()));
  if (hdr[4] & 2) read_floats(f.deq);
  if (!in || in.peek() != EOF) throw std::runtime_error("fixture size mismatch: " + path);
  return f;
}

// Bit-identical, except that any NaN matches any NaN (NaN payloads after
// fp16 conversion differ between F16C, NumPy and the scalar code).
::testing::AssertionResult same_float(float expected, float actual) {
  if (std::isnan(expected) && std::isnan(actual)) return ::testing::AssertionSuccess();
  if (float_to_bits(expected) == float_to_bits(actual)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << expected << " (0x" << std::hex << float_to_bits(expected)
                                       << ") got " << actual << " (0x" << float_to_bits(actual) << ")";
}

void expect_dequant_matches(const QuantFixture& f, const std::string& label) {
  ASSERT_EQ(f.deq.size(), static_cast<size_t>(f.rows * f.cols));
  std::vector<float> out(static_cast<size_t>(f.cols));
  for (int64_t r = 0; r < f.rows; ++r) {
    dequantize_row_ref(f.type, f.bytes.data() + r * f.row_bytes(), out.data(), f.cols);
    int bad = 0;
    for (int64_t c = 0; c < f.cols && bad < 5; ++c) {
      const auto ok = same_float(f.deq[static_cast<size_t>(r * f.cols + c)], out[static_cast<size_t>(c)]);
      if (!ok) ++bad;
      EXPECT_TRUE(ok) << label << " row " << r << " col " << c;
    }
  }
}

class RawFixture : public ::testing::TestWithParam<const char*> {};

TEST_P(RawFixture, DequantizeMatchesGgufPy) {
  const QuantFixture f = load_fixture(std::string(GetParam()) + "_raw.bin");
  EXPECT_EQ(dtype_name(f.type), std::string(GetParam()));
  expect_dequant_matches(f, GetParam());
}

TEST_P(RawFixture, SourceAlignmentDoesNotMatter) {
  const QuantFixture f = load_fixture(std::string(GetParam()) + "_raw.bin");
  const int64_t n = f.rows * f.cols;  // rows are contiguous, so the whole buffer is one long row
  std::vector<float> aligned(static_cast<size_t>(n)), shifted(static_cast<size_t>(n));
  dequantize_row_ref(f.type, f.bytes.data(), aligned.data(), n);
  std::vector<uint8_t> odd(f.bytes.size() + 1);
  std::memcpy(odd.data() + 1, f.bytes.data(), f.bytes.size());
  dequantize_row_ref(f.type, odd.data() + 1, shifted.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(same_float(aligned[static_cast<size_t>(i)], shifted[static_cast<size_t>(i)])) << i;
}

INSTANTIATE_TEST_SUITE_P(AllTypes, RawFixture,
                         ::testing::Values("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                                           "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
                                           "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
                                           "tq1_0", "tq2_0", "mxfp4", "nvfp4"),
                         [](const auto& info) { return std::string(info.param); });

class QuantizedFixture : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizedFixture, DequantizeMatchesGgufPy) {
  const QuantFixture f = load_fixture(std::string(GetParam()) + "_quant.bin");
  expect_dequant_matches(f, GetParam());
}

TEST_P(QuantizedFixture, QuantizeMatchesGgufPy) {
  const QuantFixture f = load_fixture(std::string(GetParam()) + "_quant.bin");
  ASSERT_EQ(f.src.size(), static_cast<size_t>(f.rows * f.cols));
  std::vector<uint8_t> out(f.row_bytes());
  for (int64_t r = 0; r < f.rows; ++r) {
    quantize_row_ref(f.type, f.src.data() + r * f.cols, out.data(), f.cols);
    const uint8_t* want = f.bytes.data() + r * f.row_bytes();
    for (size_t b = 0; b < out.size(); ++b) {
      ASSERT_EQ(static_cast<int>(want[b]), static_cast<int>(out[b]))
          << GetParam() << " row " << r << " byte " << b << " (block " << b / dtype_traits(f.type).block_bytes << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(GgufPyQuantizers, QuantizedFixture,
                         ::testing::Values("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"),
                         [](const auto& info) { return std::string(info.param); });

void expect_bytes_equal(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got, size_t block_bytes) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_EQ(static_cast<int>(want[i]), static_cast<int>(got[i])) << "byte " << i << " (block " << i / block_bytes << ")";
}

// NVFP4's UE4M3 scale of every byte against ggml's ggml_ue4m3_to_fp32, written
// again from its definition (exponent bias 7, 3 mantissa bits, subnormals at
// exponent 0, 0 and 0x7f read 0, bit 7 ignored otherwise, then halved): the f16
// that the dequantizer and the matmul panels keep is that value exactly.
TEST(Nvfp4, ScaleOfEveryByteIsGgmlsExactly) {
  for (int x = 0; x < 256; ++x) {
    const int e = (x >> 3) & 15, m = x & 7;
    double want = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
    if (x == 0 || x == 0x7f) want = 0.0;
    want *= 0.5;
    EXPECT_EQ(static_cast<double>(fp16_to_fp32(nvfp4_scale_f16(static_cast<uint8_t>(x)))), want)
        << "byte " << x;
  }
  EXPECT_EQ(fp16_to_fp32(nvfp4_scale_f16(0xff)), 240.0f);
  EXPECT_EQ(fp16_to_fp32(nvfp4_scale_f16(0x01)), std::ldexp(1.0f, -10));
}

TEST(ActivationQuant, Q8_0MatchesGgufPy) {
  const QuantFixture f = load_fixture("q8_0_quant.bin");
  std::vector<uint8_t> out(f.bytes.size());
  quantize_row_q8_0_ref(f.src.data(), out.data(), f.rows * f.cols);
  expect_bytes_equal(f.bytes, out, sizeof(BlockQ8_0));
}

TEST(ActivationQuant, Q8_1MatchesGgmlAlgorithm) {
  const QuantFixture f = load_fixture("act_q8_1.bin");
  ASSERT_EQ(f.type, DType::q8_1);
  std::vector<uint8_t> out(f.bytes.size());
  quantize_row_q8_1_ref(f.src.data(), out.data(), f.rows * f.cols);
  expect_bytes_equal(f.bytes, out, sizeof(BlockQ8_1));
  // s is fp16(d * sum(qs)), computed from the fp32 d.
  for (size_t i = 0; i < out.size() / sizeof(BlockQ8_1); ++i) {
    BlockQ8_1 b;
    std::memcpy(&b, out.data() + i * sizeof(b), sizeof(b));
    int sum = 0;
    for (int8_t q : b.qs) sum += q;
    EXPECT_NEAR(fp16_to_fp32(b.s), sum * fp16_to_fp32(b.d), std::fabs(sum * fp16_to_fp32(b.d)) * 2e-3 + 1e-6);
  }
}

TEST(ActivationQuant, Q8_KMatchesGgmlAlgorithm) {
  const QuantFixture f = load_fixture("act_q8_k.bin");
  ASSERT_EQ(f.type, DType::q8_k);
  std::vector<uint8_t> out(f.bytes.size());
  quantize_row_q8_k_ref(f.src.data(), out.data(), f.rows * f.cols);
  expect_bytes_equal(f.bytes, out, sizeof(BlockQ8_K));
}

// ggml rounds q8_0/q8_1 with roundf and q8_K with nearest-even: pin both down
// on exact ties (amax = 127 makes the scale exactly 1).
TEST(ActivationQuant, TieRounding) {
  float x[QK_K] = {};
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 3.5f;
  BlockQ8_0 b0;
  quantize_row_q8_0_ref(x, &b0, QK8_0);
  EXPECT_EQ(fp16_to_fp32(b0.d), 1.0f);
  EXPECT_EQ(b0.qs[1], 3);
  EXPECT_EQ(b0.qs[2], -3);
  EXPECT_EQ(b0.qs[3], 4);
  BlockQ8_1 b1;
  quantize_row_q8_1_ref(x, &b1, QK8_1);
  EXPECT_EQ(b1.qs[1], 3);
  EXPECT_EQ(fp16_to_fp32(b1.s), 127.0f + 3 - 3 + 4);

  x[0] = -127.0f;  // q8_K scales by -127/max: max = -127 gives exactly 1
  BlockQ8_K bk;
  quantize_row_q8_k_ref(x, &bk, QK_K);
  EXPECT_EQ(bk.d, 1.0f);
  EXPECT_EQ(bk.qs[0], -127);
  EXPECT_EQ(bk.qs[1], 2);
  EXPECT_EQ(bk.qs[2], -2);
  EXPECT_EQ(bk.qs[3], 4);
  EXPECT_EQ(bk.bsums[0], -127 + 2 - 2 + 4);
  for (int g = 1; g < QK_K / 16; ++g) EXPECT_EQ(bk.bsums[g], 0);
}

TEST(ActivationQuant, Q8_KZeroBlockIsAllZero) {
  std::vector<float> x(QK_K * 2, 0.0f);
  x[QK_K + 3] = 1.0f;
  std::vector<BlockQ8_K> b(2);
  std::memset(b.data(), 0x5a, b.size() * sizeof(BlockQ8_K));  // garbage to be overwritten
  quantize_row_q8_k_ref(x.data(), b.data(), QK_K * 2);
  EXPECT_EQ(b[0].d, 0.0f);
  for (int j = 0; j < QK_K; ++j) ASSERT_EQ(b[0].qs[j], 0);
  for (int g = 0; g < QK_K / 16; ++g) ASSERT_EQ(b[0].bsums[g], 0);
  // The largest-magnitude value maps to -127 (ggml scales by -127/max).
  EXPECT_EQ(b[1].qs[3], -127);
  EXPECT_EQ(b[1].bsums[0], -127);
  EXPECT_EQ(b[1].d, -1.0f / 127.0f);
}

// Random rows of awkward length: dequant(quant(x)) stays within the format's
// rounding step, and non-finite input never crashes.
TEST(QuantizeRef, RoundTripErrorBounded) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const DType types[] = {DType::q4_0, DType::q4_1, DType::q5_0, DType::q5_1, DType::q8_0, DType::q8_1, DType::q8_k};
  for (DType t : types) {
    const int64_t bs = dtype_block_size(t);
    const int64_t n = bs * (t == DType::q8_k ? 3 : 37);
    std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
    for (auto& v : x) v = dist(rng) * 3.0f;
    std::vector<uint8_t> q(dtype_row_bytes(t, n));
    quantize_row_ref(t, x.data(), q.data(), n);
    dequantize_row_ref(t, q.data(), y.data(), n);
    const int levels = t == DType::q4_0 || t == DType::q4_1 ? 15 : t == DType::q5_0 || t == DType::q5_1 ? 31 : 254;
    for (int64_t b = 0; b < n / bs; ++b) {
      float lo = x[static_cast<size_t>(b * bs)], hi = lo;
      for (int64_t j = 0; j < bs; ++j) {
        lo = std::min(lo, x[static_cast<size_t>(b * bs + j)]);
        hi = std::max(hi, x[static_cast<size_t>(b * bs + j)]);
      }
      // Symmetric formats span 2*amax with `levels` steps; one step covers the clipped top value.
      const float span = (t == DType::q4_1 || t == DType::q5_1) ? hi - lo : 2 * std::max(-lo, hi);
      const float step = span / static_cast<float>(levels);
      for (int64_t j = 0; j < bs; ++j) {
        const auto k = static_cast<size_t>(b * bs + j);
        ASSERT_LE(std::fabs(x[k] - y[k]), step * 1.01f + 1e-3f * std::fabs(x[k])) << dtype_name(t) << " elem " << k;
      }
    }
  }
}

TEST(QuantizeRef, NonFiniteInputDoesNotCrash) {
  std::vector<float> x(QK_K, 1.0f);
  x[5] = NAN;
  x[9] = INFINITY;
  x[11] = -INFINITY;
  std::vector<uint8_t> q(dtype_row_bytes(DType::q8_k, QK_K));
  std::vector<float> y(QK_K);
  for (DType t : {DType::q4_0, DType::q4_1, DType::q5_0, DType::q5_1, DType::q8_0, DType::q8_1, DType::q8_k}) {
    quantize_row_ref(t, x.data(), q.data(), QK_K);
    dequantize_row_ref(t, q.data(), y.data(), QK_K);
  }
}

TEST(QuantizeRef, KQuantsAreUnsupported) {
  std::vector<float> x(QK_K, 1.0f);
  std::vector<uint8_t> q(dtype_row_bytes(DType::q4_k, QK_K));
  EXPECT_FALSE(quantize_ref_supported(DType::q4_k));
  try {
    quantize_row_ref(DType::q4_k, x.data(), q.data(), QK_K);
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::unsupported);
    EXPECT_NE(std::string(e.what()).find("q4_k"), std::string::npos) << e.what();
  }
}

TEST(DequantizeRef, IntegerAndF64Types) {
  const int8_t i8[3] = {-128, 0, 127};
  const int16_t i16[3] = {-32768, 1, 32767};
  const int32_t i32[3] = {-5, 16777217, 7};
  const int64_t i64[3] = {-1, 0, int64_t{1} << 40};
  const double f64[3] = {0.1, -1e300, 2.5};
  float y[3];
  dequantize_row_ref(DType::i8, i8, y, 3);
  EXPECT_EQ(y[0], -128.0f);
  EXPECT_EQ(y[2], 127.0f);
  dequantize_row_ref(DType::i16, i16, y, 3);
  EXPECT_EQ(y[0], -32768.0f);
  dequantize_row_ref(DType::i32, i32, y, 3);
  EXPECT_EQ(y[1], 16777216.0f);  // nearest float
  dequantize_row_ref(DType::i64, i64, y, 3);
  EXPECT_EQ(y[2], 1099511627776.0f);
  dequantize_row_ref(DType::f64, f64, y, 3);
  EXPECT_EQ(y[0], 0.1f);
  EXPECT_TRUE(std::isinf(y[1]));
}

}  // namespace
}  // namespace loom
