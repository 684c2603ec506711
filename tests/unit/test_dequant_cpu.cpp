// The production dequantizer (kernels/cpu/dequant.h) against the scalar
// reference on every DType: random block bytes (any scale, NaN and inf ones
// included), unaligned sources and destinations, several row lengths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "kernels/cpu/dequant.h"
#include "kernels/quant_blocks.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

// Bit-identical, except that any NaN matches any NaN (F16C quiets signalling
// NaNs, the scalar conversion keeps them).
bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || float_to_bits(a) == float_to_bits(b);
}

const DType kAllTypes[] = {
    DType::f32,    DType::f16,     DType::bf16,   DType::f64,   DType::i8,      DType::i16,   DType::i32,
    DType::i64,    DType::q4_0,    DType::q4_1,   DType::q5_0,  DType::q5_1,    DType::q8_0,  DType::q8_1,
    DType::q2_k,   DType::q3_k,    DType::q4_k,   DType::q5_k,  DType::q6_k,    DType::q8_k,  DType::iq4_nl,
    DType::iq4_xs, DType::iq2_xxs, DType::iq2_xs, DType::iq2_s, DType::iq3_xxs, DType::iq3_s, DType::iq1_s,
    DType::iq1_m,  DType::tq1_0,   DType::tq2_0,  DType::q1_0,  DType::q2_0,    DType::mxfp4, DType::nvfp4};

// Random bytes; with `sane`, f16 scales small and finite (so the products are
// ordinary numbers, where a wrong order of operations would show).
std::vector<uint8_t> random_row(DType type, int64_t n, uint32_t seed, bool sane) {
  std::vector<uint8_t> w(dtype_row_bytes(type, n));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  if (!sane) return w;
  if (type == DType::f16 || type == DType::bf16 || type == DType::f32 || type == DType::f64)
    return w;  // whole bit patterns: NaNs compare as NaNs
  // Positions of the f16 scales in each block.
  std::vector<size_t> at;
  switch (type) {
    case DType::q4_0:
    case DType::q5_0:
    case DType::q8_0:
    case DType::iq4_nl:
    case DType::iq4_xs:
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq1_s:
    case DType::q1_0:
    case DType::q2_0:
      at = {0};
      break;
    case DType::mxfp4:  // random exponents: 2^-128 .. 2^127, subnormal scales among them
    case DType::nvfp4:  // random UE4M3 scales: every byte is one (0 .. 240, 0x7f reads 0)
      return w;
    case DType::iq1_m: {  // d in the top nibbles of the scales (set_iq1_m_d)
      std::uniform_real_distribution<float> scale(-0.1f, 0.1f);
      for (size_t off = 0; off < w.size(); off += 56) set_iq1_m_d(w.data() + off, fp32_to_fp16(scale(rng)));
      return w;
    }
    case DType::q4_1: case DType::q5_1: case DType::q8_1: at = {0, 2}; break;
    case DType::q2_k: at = {80, 82}; break;
    case DType::q3_k: at = {108}; break;
    case DType::q4_k: case DType::q5_k: at = {0, 2}; break;
    case DType::q6_k: at = {208}; break;
    case DType::tq1_0:
      at = {52};
      break;
    case DType::tq2_0:
      at = {64};
      break;
    default: return w;
  }
  std::uniform_real_distribution<float> scale(-0.1f, 0.1f);
  const size_t bb = dtype_traits(type).block_bytes;
  for (size_t off = 0; off < w.size(); off += bb)
    for (size_t a : at) {
      const uint16_t h = fp32_to_fp16(scale(rng));
      std::memcpy(w.data() + off + a, &h, 2);
    }
  return w;
}

void expect_same(DType type, const uint8_t* src, int64_t n, const std::string& label) {
  std::vector<float> ref(static_cast<size_t>(n)), out(static_cast<size_t>(n) + 1);
  dequantize_row_ref(type, src, ref.data(), n);
  float* dst = out.data() + 1;  // unaligned destination
  dequantize_row(type, src, dst, n);
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 5; ++i)
    if (!same_float(ref[static_cast<size_t>(i)], dst[i])) {
      ++bad;
      ADD_FAILURE() << label << " element " << i << ": ref " << ref[static_cast<size_t>(i)] << " (0x" << std::hex
                    << float_to_bits(ref[static_cast<size_t>(i)]) << ") cpu " << dst[i] << " (0x"
                    << float_to_bits(dst[i]) << ")" << std::dec;
    }
}

TEST(DequantCpu, MatchesReferenceOnEveryType) {
  for (DType type : kAllTypes) {
    const int64_t bs = dtype_block_size(type);
    for (int64_t blocks : {1, 2, 3, 7}) {
      const int64_t n = bs * (bs == 1 ? 37 * blocks : blocks);  // plain types: tails past the vector width
      for (bool sane : {true, false}) {
        const auto w = random_row(type, n, static_cast<uint32_t>(n * 31 + sane), sane);
        std::vector<uint8_t> odd(w.size() + 1);
        std::memcpy(odd.data() + 1, w.data(), w.size());
        const std::string label = std::string(dtype_name(type)) + " n=" + std::to_string(n) + (sane ? "" : " raw");
        expect_same(type, w.data(), n, label);
        expect_same(type, odd.data() + 1, n, label + " unaligned");
      }
    }
  }
}

// Every f16 and bf16 bit pattern (subnormals, infinities, NaNs) converts as the
// scalar reference does.
TEST(DequantCpu, EveryHalfBitPattern) {
  for (DType type : {DType::f16, DType::bf16}) {
    std::vector<uint16_t> all(65536);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
    expect_same(type, reinterpret_cast<const uint8_t*>(all.data()), 65536, dtype_name(type));
  }
}

TEST(DequantCpu, ZeroLengthWritesNothing) {
  const uint8_t src[1] = {0};
  float y = 1.5f;
  for (DType type : kAllTypes) {
    dequantize_row(type, src, &y, 0);
    EXPECT_EQ(y, 1.5f) << dtype_name(type);
  }
}

}  // namespace
}  // namespace loom
