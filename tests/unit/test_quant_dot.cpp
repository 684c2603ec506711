// Activation quantizers (bit-identical to the *_ref versions) and the kernels'
// integer block dots, checked bit for bit against a scalar model.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/cpu_features.h"
#include "core/thread_pool.h"
#include "kernels/cpu/panel.h"
#include "kernels/cpu/matmul.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::model_dot;
using testing::random_floats;
using testing::random_weights;

// Inputs that stress rounding: random scales, exact .5 ties, zeros, +-inf, NaN.
std::vector<std::vector<float>> quantizer_inputs(int64_t n) {
  std::vector<std::vector<float>> cases;
  for (uint32_t seed = 0; seed < 40; ++seed) {
    auto x = random_floats(n, seed, std::pow(10.0f, static_cast<float>(seed % 9) - 4.0f));
    cases.push_back(x);
  }
  // Block maximum 127 gives scale 1 (q8_0) / -1 (q8_K): x.5 values are ties.
  std::vector<float> ties(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ties[static_cast<size_t>(i)] = (i % 32 == 0) ? 127.0f : static_cast<float>(i % 60) - 29.5f;
  cases.push_back(ties);
  for (auto& v : ties) v = -v;
  cases.push_back(ties);
  // Equal magnitudes of both signs: q8_K takes the sign of the first.
  std::vector<float> pm(static_cast<size_t>(n), 0.25f);
  for (int64_t i = 0; i < n; i += 3) pm[static_cast<size_t>(i)] = -3.0f;
  for (int64_t i = 1; i < n; i += 7) pm[static_cast<size_t>(i)] = 3.0f;
  cases.push_back(pm);
  cases.emplace_back(static_cast<size_t>(n), 0.0f);
  auto special = random_floats(n, 99);
  special[3] = std::numeric_limits<float>::quiet_NaN();
  special[40 % n] = std::numeric_limits<float>::infinity();
  cases.push_back(special);
  auto nan_only = random_floats(n, 98);
  nan_only[5] = std::numeric_limits<float>::quiet_NaN();
  cases.push_back(nan_only);
  auto denorm = random_floats(n, 97, 1e-39f);
  cases.push_back(denorm);
  return cases;
}

TEST(QuantAct, Q8_0MatchesReferenceBitForBit) {
  const int64_t n = 512;
  for (const auto& x : quantizer_inputs(n)) {
    std::vector<BlockQ8_0> ref(n / 32), fast(n / 32);
    quantize_row_q8_0_ref(x.data(), ref.data(), n);
    quantize_row_q8_0(x.data(), fast.data(), n);
    ASSERT_EQ(0, std::memcmp(ref.data(), fast.data(), sizeof(BlockQ8_0) * ref.size()));
  }
}

TEST(QuantAct, Q8_1MatchesReferenceBitForBit) {
  const int64_t n = 512;
  for (const auto& x : quantizer_inputs(n)) {
    std::vector<BlockQ8_1> ref(n / 32), fast(n / 32);
    quantize_row_q8_1_ref(x.data(), ref.data(), n);
    quantize_row_q8_1(x.data(), fast.data(), n);
    ASSERT_EQ(0, std::memcmp(ref.data(), fast.data(), sizeof(BlockQ8_1) * ref.size()));
  }
}

TEST(QuantAct, Q8_KMatchesReferenceBitForBit) {
  const int64_t n = 1024;
  for (const auto& x : quantizer_inputs(n)) {
    std::vector<BlockQ8_K> ref(n / 256), fast(n / 256);
    quantize_row_q8_k_ref(x.data(), ref.data(), n);
    quantize_row_q8_k(x.data(), fast.data(), n);
    ASSERT_EQ(0, std::memcmp(ref.data(), fast.data(), sizeof(BlockQ8_K) * ref.size()));
  }
}

TEST(QuantAct, TiesRoundAsSpecified) {
  // q8_0 rounds half away from zero, q8_K half to even.
  std::vector<float> x(256, 0.0f);
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -2.5f;
  BlockQ8_0 b0;
  quantize_row_q8_0(x.data(), &b0, 32);
  EXPECT_EQ(b0.qs[1], 3);
  EXPECT_EQ(b0.qs[2], -3);
  x[0] = -127.0f;  // iscale = 1
  BlockQ8_K bk;
  quantize_row_q8_k(x.data(), &bk, 256);
  EXPECT_EQ(bk.qs[1], 2);
  EXPECT_EQ(bk.qs[2], -2);
}

std::vector<cpu::Isa> isas() {
  std::vector<cpu::Isa> v{cpu::Isa::avx2};
  if (cpu_features().has_avx512_kernels()) v.push_back(cpu::Isa::avx512);
  if (cpu_features().has_avx512_kernels() && cpu::amx_available()) v.push_back(cpu::Isa::amx);
  return v;
}

const DType kAllTypes[] = {DType::q4_0, DType::q4_1, DType::q5_0, DType::q5_1, DType::q8_0,
                           DType::q2_k, DType::q3_k, DType::q4_k, DType::q5_k, DType::q6_k,
                           DType::f32,  DType::f16,  DType::bf16};

// One output at a time (N = 1, T = 1): the integer block dot plus the f32 sequence
// must equal the scalar model exactly, for every type and both instruction sets.
TEST(QuantDot, SingleDotMatchesScalarModelExactly) {
  ThreadPool pool(1);
  MatmulScratch scratch;
  for (DType type : kAllTypes) {
    const int64_t K = dtype_block_size(type) == 256 ? 768 : 352;
    for (uint32_t seed = 1; seed <= 6; ++seed) {
      const auto w = random_weights(type, 1, K, seed);
      const auto x = random_floats(K, 1000 + seed, seed % 2 ? 1.0f : 30.0f);
      const float expect = model_dot(type, w.data(), x.data(), K);
      const Tensor W = make_tensor(const_cast<uint8_t*>(w.data()), type, {1, K});
      for (cpu::Isa isa : isas()) {
        float y = -1.0f;
        cpu::matmul_isa(isa, pool, W, x.data(), K, &y, 1, 1, scratch);
        EXPECT_EQ(float_to_bits(expect), float_to_bits(y))
            << dtype_name(type) << " seed " << seed << " isa " << static_cast<int>(isa) << ": " << expect
            << " vs " << y;
      }
    }
  }
}

// Extreme quants: all weights at their largest magnitude against activations at
// +-127 (checks there is no int16 saturation in the AVX2 partial sums).
TEST(QuantDot, ExtremeValuesDoNotSaturate) {
  ThreadPool pool(1);
  MatmulScratch scratch;
  const int64_t K = 256;
  std::vector<float> x(K);
  for (int64_t k = 0; k < K; ++k) x[static_cast<size_t>(k)] = (k % 3 == 0) ? -1.0f : 1.0f;
  for (DType type : {DType::q4_0, DType::q4_1, DType::q5_0, DType::q5_1, DType::q8_0, DType::q2_k,
                     DType::q3_k, DType::q4_k, DType::q5_k, DType::q6_k}) {
    auto w = random_weights(type, 1, K, 5);
    const size_t bb = dtype_traits(type).block_bytes;
    for (size_t off = 0; off < w.size(); off += bb) {
      uint8_t* b = w.data() + off;
      switch (type) {
        case DType::q4_0:
          std::memset(b + 2, 0xff, 16);
          break;
        case DType::q4_1:
          std::memset(b + 4, 0xff, 16);
          break;
        case DType::q5_0:
          std::memset(b + 2, 0xff, 20);
          break;
        case DType::q5_1:
          std::memset(b + 4, 0xff, 20);
          break;
        case DType::q8_0:
          std::memset(b + 2, 0x80, 32);
          break;  // -128
        case DType::q4_k:
          std::memset(b + 4, 0xff, 140);
          break;
        case DType::q5_k:
          std::memset(b + 4, 0xff, 172);
          break;
        case DType::q6_k:
          std::memset(b, 0xff, 192);
          break;  // q = 63, scales random
        case DType::q3_k:
          std::memset(b, 0x00, 96);
          std::memset(b + 96, 0x00, 12);
          break;  // q = -4, scale -32
        case DType::q2_k:
          std::memset(b, 0xff, 80);
          break;  // q = 3, scale and min 15
        default:
          break;
      }
    }
    const float expect = model_dot(type, w.data(), x.data(), K);
    const Tensor W = make_tensor(w.data(), type, {1, K});
    for (cpu::Isa isa : isas()) {
      float y = 0.0f;
      cpu::matmul_isa(isa, pool, W, x.data(), K, &y, 1, 1, scratch);
      EXPECT_EQ(float_to_bits(expect), float_to_bits(y))
          << dtype_name(type) << " isa " << static_cast<int>(isa);
    }
  }
}

}  // namespace
}  // namespace loom
