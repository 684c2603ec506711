// Weight quantization (kernels/quantize.h) against ggml's own quantizers:
// ggml_quantize_chunk's bytes for fixed inputs, with and without importance
// vectors, written by scripts/fixtures/make_ggml_quant_fixtures.sh, must match
// byte for byte. LOOM_GGML_QUANT_FIXTURES points the comparison at another
// (e.g. larger, one-off) set written by the same script.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "expect_error.h"
#include "kernels/quantize.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

const char* const kTypes[] = {"f32",   "f16",     "bf16",  "q4_0",    "q4_1",   "q5_0",  "q5_1",   "q8_0",
                              "q2_k",  "q3_k",    "q4_k",  "q5_k",    "q6_k",   "iq4_nl", "iq4_xs", "mxfp4",
                              "nvfp4", "q1_0",    "q2_0",  "tq1_0",   "tq2_0",  "iq3_xxs", "iq3_s", "iq2_xxs",
                              "iq2_xs", "iq2_s", "iq1_s", "iq1_m"};
const char* const kModes[] = {"plain", "imatrix", "imatrix_zeros"};

std::string fixture_dir() {
  if (const char* dir = std::getenv("LOOM_GGML_QUANT_FIXTURES")) return dir;
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/ggml_quants";
}

template <typename T>
void read_exact(std::ifstream& in, T* p, size_t count, const std::string& path) {
  in.read(reinterpret_cast<char*>(p), static_cast<std::streamsize>(count * sizeof(T)));
  if (!in) throw std::runtime_error("truncated fixture " + path);
}

struct Inputs {
  int64_t rows = 0, cols = 0;
  std::vector<float> src;                      // rows * cols
  std::vector<std::vector<float>> importance;  // each cols long
};

const Inputs& inputs() {
  static const Inputs in = [] {
    const std::string path = fixture_dir() + "/inputs.bin";
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("missing " + path + " (scripts/fixtures/make_ggml_quant_fixtures.sh)");
    char magic[4];
    uint32_t version, n_importance;
    Inputs r;
    read_exact(f, magic, 4, path);
    read_exact(f, &version, 1, path);
    read_exact(f, &r.rows, 1, path);
    read_exact(f, &r.cols, 1, path);
    read_exact(f, &n_importance, 1, path);
    if (std::memcmp(magic, "LGQI", 4) != 0 || version != 1) throw std::runtime_error("bad fixture " + path);
    r.src.resize(static_cast<size_t>(r.rows * r.cols));
    read_exact(f, r.src.data(), r.src.size(), path);
    r.importance.assign(n_importance, std::vector<float>(static_cast<size_t>(r.cols)));
    for (auto& v : r.importance) read_exact(f, v.data(), v.size(), path);
    return r;
  }();
  return in;
}

struct Expected {
  DType type = DType::f32;
  uint32_t mode = 0;  // 0: no importance; k: inputs().importance[k - 1]
  std::vector<uint8_t> bytes;
};

// The fixture <type>.<mode>.bin, or nullopt when the script wrote none (types that ignore importance).
std::optional<Expected> load_expected(const std::string& type, const std::string& mode) {
  const std::string path = fixture_dir() + "/" + type + "." + mode + ".bin";
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  char magic[4];
  uint32_t version, type_id;
  int64_t rows, cols;
  uint64_t nbytes;
  Expected e;
  read_exact(f, magic, 4, path);
  read_exact(f, &version, 1, path);
  read_exact(f, &type_id, 1, path);
  read_exact(f, &e.mode, 1, path);
  read_exact(f, &rows, 1, path);
  read_exact(f, &cols, 1, path);
  read_exact(f, &nbytes, 1, path);
  if (std::memcmp(magic, "LGQO", 4) != 0 || version != 1) throw std::runtime_error("bad fixture " + path);
  const auto traits = dtype_traits_of_id(type_id);
  if (!traits || rows != inputs().rows || cols != inputs().cols)
    throw std::runtime_error("fixture mismatch " + path);
  e.type = traits->type;
  e.bytes.resize(nbytes);
  read_exact(f, e.bytes.data(), nbytes, path);
  if (f.peek() != EOF) throw std::runtime_error("trailing bytes in " + path);
  return e;
}

std::string hex(const uint8_t* p, size_t n) {
  std::ostringstream s;
  for (size_t i = 0; i < n; ++i) s << (i ? " " : "") << std::hex << (p[i] >> 4) << (p[i] & 15);
  return s.str();
}

// Byte equality; on failure names the first differing block and shows both.
::testing::AssertionResult same_blocks(DType type, int64_t cols, const std::vector<uint8_t>& want,
                                       const std::vector<uint8_t>& got) {
  if (want.size() != got.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  const size_t bb = dtype_traits(type).block_bytes;
  const size_t row_bytes = dtype_row_bytes(type, cols);
  size_t n_bad = 0, first = want.size();
  for (size_t i = 0; i < want.size(); i += bb) {
    if (std::memcmp(want.data() + i, got.data() + i, bb) != 0) {
      if (first == want.size()) first = i;
      ++n_bad;
    }
  }
  if (n_bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << n_bad << " of " << want.size() / bb << " blocks differ; first: row " << first / row_bytes
         << " block " << (first % row_bytes) / bb << "\n  ggml: " << hex(want.data() + first, bb)
         << "\n  loom: " << hex(got.data() + first, bb);
}

std::vector<uint8_t> quantize(ThreadPool& pool, DType type, const float* src, int64_t rows, int64_t cols,
                              const float* importance) {
  std::vector<uint8_t> out(dtype_row_bytes(type, cols) * static_cast<size_t>(rows), 0xCD);
  quantize_rows(pool, type, src, out.data(), rows, cols, importance);
  return out;
}

class QuantizeGgml : public ::testing::TestWithParam<const char*> {};

// The plain fixture of a type; for f32, which ggml_quantize_chunk copies, the input rows.
Expected load_plain(const std::string& type) {
  if (type == "f32") {
    const auto& src = inputs().src;
    Expected e;
    e.bytes.resize(src.size() * sizeof(float));
    std::memcpy(e.bytes.data(), src.data(), e.bytes.size());
    return e;
  }
  const auto plain = load_expected(type, "plain");
  if (!plain) throw std::runtime_error("missing fixture " + type + ".plain.bin");
  return *plain;
}

// Every mode of the type: the fixture of that mode, or for types that ignore
// the importance (q8_0, f16, bf16, f32), the plain fixture. Types that need an
// importance vector (iq2_xxs, iq2_xs, iq1_s) have no plain fixture and refuse rows
// without one.
TEST_P(QuantizeGgml, MatchesGgmlQuantizeChunk) {
  const Inputs& in = inputs();
  ThreadPool pool(2);
  if (quantize_requires_importance(*dtype_from_name(GetParam()))) {
    EXPECT_FALSE(load_expected(GetParam(), "plain"));
    for (uint32_t mode = 1; mode < 3; ++mode) {
      const auto want = load_expected(GetParam(), kModes[mode]);
      ASSERT_TRUE(want) << "missing fixture " << GetParam() << "." << kModes[mode] << ".bin";
      const auto got =
          quantize(pool, want->type, in.src.data(), in.rows, in.cols, in.importance[mode - 1].data());
      EXPECT_TRUE(same_blocks(want->type, in.cols, want->bytes, got)) << GetParam() << " " << kModes[mode];
    }
    std::vector<uint8_t> out(dtype_row_bytes(*dtype_from_name(GetParam()), in.cols));
    test_util::expect_error(
        [&] { quantize_rows(pool, *dtype_from_name(GetParam()), in.src.data(), out.data(), 1, in.cols, nullptr); },
        ErrorKind::invalid_input, {GetParam(), "importance"});
    return;
  }
  const Expected plain = load_plain(GetParam());
  ASSERT_EQ(dtype_name(plain.type), std::string(GetParam()));
  for (uint32_t mode = 0; mode < 3; ++mode) {
    const auto fixture = load_expected(GetParam(), kModes[mode]);
    const Expected& want = fixture ? *fixture : plain;
    ASSERT_EQ(want.mode, fixture ? mode : 0u);
    const float* importance = mode == 0 ? nullptr : in.importance[mode - 1].data();
    const auto got = quantize(pool, want.type, in.src.data(), in.rows, in.cols, importance);
    EXPECT_TRUE(same_blocks(want.type, in.cols, want.bytes, got)) << GetParam() << " " << kModes[mode];
  }
}

INSTANTIATE_TEST_SUITE_P(Quantize, QuantizeGgml, ::testing::ValuesIn(kTypes),
                         [](const auto& info) { return std::string(info.param); });

// Random rows of several magnitudes and a log-normal importance vector.
struct RandomMatrix {
  int64_t rows, cols;
  std::vector<float> x, importance;
  RandomMatrix(int64_t r, int64_t c, uint32_t seed) : rows(r), cols(c) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    x.resize(static_cast<size_t>(r * c));
    for (int64_t i = 0; i < r; ++i) {
      const float scale = std::pow(10.0f, static_cast<float>(i % 5) - 3.0f);
      for (int64_t j = 0; j < c; ++j) x[static_cast<size_t>(i * c + j)] = scale * normal(rng);
    }
    importance.resize(static_cast<size_t>(c));
    for (auto& w : importance) w = 0.1f * std::exp(1.5f * normal(rng));
  }
};

TEST(QuantizeRows, ResultDoesNotDependOnThreadCount) {
  const RandomMatrix m(37, 768, 5);
  ThreadPool one(1), three(3);
  for (const char* name : kTypes) {
    const DType type = *dtype_from_name(name);
    for (const float* importance : {static_cast<const float*>(nullptr), m.importance.data()}) {
      if (importance == nullptr && quantize_requires_importance(type)) continue;
      const auto a = quantize(one, type, m.x.data(), m.rows, m.cols, importance);
      const auto b = quantize(three, type, m.x.data(), m.rows, m.cols, importance);
      EXPECT_TRUE(same_blocks(type, m.cols, a, b)) << name << (importance ? " with importance" : "");
    }
  }
}

// Root mean square of (dequantized - x) over that of x, optionally weighted.
double relative_rms_error(DType type, const std::vector<uint8_t>& q, const RandomMatrix& m, bool weighted) {
  std::vector<float> y(static_cast<size_t>(m.cols));
  const size_t row_bytes = dtype_row_bytes(type, m.cols);
  double err = 0, ref = 0;
  for (int64_t r = 0; r < m.rows; ++r) {
    dequantize_row_ref(type, q.data() + static_cast<size_t>(r) * row_bytes, y.data(), m.cols);
    const float* x = m.x.data() + r * m.cols;
    double e = 0, s = 0;
    for (int64_t j = 0; j < m.cols; ++j) {
      const double w = weighted ? m.importance[static_cast<size_t>(j)] : 1.0;
      e += w * (y[static_cast<size_t>(j)] - x[j]) * (y[static_cast<size_t>(j)] - x[j]);
      s += w * x[j] * x[j];
    }
    err += e / s;  // each row relative to its own magnitude
    ref += 1;
  }
  return std::sqrt(err / ref);
}

// A sanity bound per type (about 1.4x what the formats give on these Gaussian
// rows: q4_k 0.072, q2_k 0.30, q6_k 0.018, iq4_nl 0.076, iq4_xs 0.078, iq3_xxs 0.21, iq3_s 0.17,
// iq2_s 0.26; iq2_xxs and iq2_xs need importance), and the importance-weighted search
// must lower the importance-weighted error (q4_k: 0.072 -> 0.058).
TEST(QuantizeRows, DequantizedErrorIsSmall) {
  const struct {
    const char* type;
    double max_rel_rms;
  } bounds[] = {
      {"f32", 0.0},   {"f16", 4e-4},   {"bf16", 2.5e-3}, {"q4_0", 0.12},   {"q4_1", 0.11},
      {"q5_0", 0.06}, {"q5_1", 0.055}, {"q8_0", 0.008},  {"q2_k", 0.40},   {"q3_k", 0.21},
      {"q4_k", 0.10}, {"q5_k", 0.05},  {"q6_k", 0.026},  {"iq4_nl", 0.11}, {"iq4_xs", 0.11},
      {"iq3_xxs", 0.30}, {"iq3_s", 0.24}, {"iq2_s", 0.37},
  };
  const RandomMatrix m(40, 1024, 11);
  ThreadPool pool(2);
  for (const auto& b : bounds) {
    const DType type = *dtype_from_name(b.type);
    const auto plain = quantize(pool, type, m.x.data(), m.rows, m.cols, nullptr);
    EXPECT_LE(relative_rms_error(type, plain, m, false), b.max_rel_rms) << b.type;
    if (!dtype_is_quantized(type) || type == DType::q8_0) continue;
    const auto weighted = quantize(pool, type, m.x.data(), m.rows, m.cols, m.importance.data());
    EXPECT_LE(relative_rms_error(type, weighted, m, false), 1.5 * b.max_rel_rms)
        << b.type << " with importance";
    EXPECT_LT(relative_rms_error(type, weighted, m, true), relative_rms_error(type, plain, m, true))
        << b.type << ": the importance did not lower the weighted error";
  }
}

TEST(QuantizeRows, RejectsUnsupportedTypesAndBadRowLengths) {
  ThreadPool pool(1);
  std::vector<float> x(1024, 1.0f);
  std::vector<uint8_t> out(8192);
  for (DType t : {DType::q8_1, DType::q8_k, DType::nf4, DType::i8, DType::f64}) {
    EXPECT_FALSE(quantize_supported(t)) << dtype_name(t);
    test_util::expect_error([&] { quantize_rows(pool, t, x.data(), out.data(), 1, 256, nullptr); },
                            ErrorKind::unsupported, {dtype_name(t)});
  }
  for (const char* name : kTypes) EXPECT_TRUE(quantize_supported(*dtype_from_name(name))) << name;
  for (auto [type, n] : {std::pair{DType::q4_k, int64_t{100}},
                         {DType::q4_k, int64_t{128}},
                         {DType::q4_0, int64_t{48}},
                         {DType::q8_0, int64_t{0}},
                         {DType::f16, int64_t{-2}}}) {
    test_util::expect_error([&] { quantize_rows(pool, type, x.data(), out.data(), 1, n, nullptr); },
                            ErrorKind::invalid_input, {dtype_name(type), std::to_string(n)});
  }
  test_util::expect_error([&] { quantize_rows(pool, DType::q4_0, x.data(), out.data(), -1, 32, nullptr); },
                          ErrorKind::invalid_input, {"-1"});
}

// The grid searches need numbers (ggml stops on a NaN with "point not on grid"):
// a non-finite weight or importance is refused by name, never a crash.
TEST(QuantizeRows, GridTypesRefuseNonFiniteValues) {
  ThreadPool pool(2);
  std::vector<float> x(2 * 256, 0.5f), importance(256, 1.0f);
  std::vector<uint8_t> out(2 * 256 * 4);
  x[256 + 7] = std::nanf("");
  for (DType t : {DType::iq1_s, DType::iq1_m, DType::iq2_xxs, DType::iq2_xs, DType::iq2_s, DType::iq3_xxs,
                  DType::iq3_s})
    test_util::expect_error([&] { quantize_rows(pool, t, x.data(), out.data(), 2, 256, importance.data()); },
                            ErrorKind::invalid_input, {dtype_name(t), "row 1", "nan", "column 7"});
  x[256 + 7] = INFINITY;
  test_util::expect_error([&] { quantize_rows(pool, DType::iq3_s, x.data(), out.data(), 2, 256, nullptr); },
                          ErrorKind::invalid_input, {"row 1", "inf"});
  x[256 + 7] = 0.5f;
  importance[9] = -1;
  test_util::expect_error([&] { quantize_rows(pool, DType::iq2_s, x.data(), out.data(), 2, 256, importance.data()); },
                          ErrorKind::invalid_input, {"importance", "column 9"});
  importance[9] = 1;
  quantize_rows(pool, DType::iq2_s, x.data(), out.data(), 2, 256, importance.data());  // finite: fine
}

TEST(QuantizeRows, NoRowsWritesNothing) {
  ThreadPool pool(2);
  uint8_t out[4] = {1, 2, 3, 4};
  quantize_rows(pool, DType::q4_k, nullptr, out, 0, 256, nullptr);
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(out[3], 4);
}

}  // namespace
}  // namespace loom
