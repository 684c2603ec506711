// AVX2 dequantization. Each block type is decoded into its quants, 32 at a
// time as int8 in element order, then converted and scaled with the reference's
// float operations in the reference's order (every product that a sum follows
// is exact in f32, so an FMA could not change it either).
#include "kernels/cpu/dequant.h"

#include <immintrin.h>

#include <cstddef>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/nf4.h"
#include "kernels/quant_blocks.h"

namespace loom {
namespace {

template <typename T>
void dequant_plain(const void* src, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(load_unaligned<T>(src, i));
}

inline __m256 bcast_f16(uint16_t h) { return _mm256_set1_ps(_cvtsh_ss(h)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

enum class Op { mul, mul_add, mul_sub };

// y[j] = float(q[j]) * s (op b) for the 32 int8 quants q, s0 / b0 for elements
// 0..15 and s1 / b1 for 16..31.
template <Op kOp>
inline void emit32(float* y, __m256i q, __m256 s0, __m256 s1, __m256 b0 = __m256{}, __m256 b1 = __m256{}) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; ++j) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[j])), j < 2 ? s0 : s1);
    if constexpr (kOp == Op::mul_add) v = _mm256_add_ps(v, j < 2 ? b0 : b1);
    if constexpr (kOp == Op::mul_sub) v = _mm256_sub_ps(v, j < 2 ? b0 : b1);
    _mm256_storeu_ps(y + 8 * j, v);
  }
}

// Elements j and j + 16 of a 32-block: low and high nibble of qs[j].
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// Byte j = 0x10 where bit j of the 32-bit qh is set (q5's 5th bits).
inline __m256i bit4_bytes(const uint8_t* qh) {
  uint32_t x;
  std::memcpy(&x, qh, 4);
  const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// (v >> shift) & mask in every byte (shift < 8).
inline __m256i bits_at(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

// Block i of a 32-element type, read in place: a copy to the stack would stall
// the vector loads that follow (store forwarding), tripling the time.
template <typename Block>
const uint8_t* block_at(const void* src, int64_t i) {
  return static_cast<const uint8_t*>(src) + static_cast<size_t>(i) * sizeof(Block);
}
#define LOOM_FIELD(Block, p, field) ((p) + offsetof(Block, field))

template <typename Block>
__m256 scale_of(const uint8_t* p) {
  return bcast_f16(load_unaligned<uint16_t>(LOOM_FIELD(Block, p, d), 0));
}

void dequant_q4_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK4_0) {
    const uint8_t* p = block_at<BlockQ4_0>(src, i);
    const __m256 d = scale_of<BlockQ4_0>(p);
    emit32<Op::mul>(y, _mm256_sub_epi8(nibbles32(LOOM_FIELD(BlockQ4_0, p, qs)), _mm256_set1_epi8(8)), d, d);
  }
}

void dequant_q4_1(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK4_1) {
    const uint8_t* p = block_at<BlockQ4_1>(src, i);
    const __m256 d = scale_of<BlockQ4_1>(p), m = bcast_f16(load_unaligned<uint16_t>(LOOM_FIELD(BlockQ4_1, p, m), 0));
    emit32<Op::mul_add>(y, nibbles32(LOOM_FIELD(BlockQ4_1, p, qs)), d, d, m, m);
  }
}

void dequant_q5_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK5_0) {
    const uint8_t* p = block_at<BlockQ5_0>(src, i);
    const __m256 d = scale_of<BlockQ5_0>(p);
    const __m256i q =
        _mm256_or_si256(nibbles32(LOOM_FIELD(BlockQ5_0, p, qs)), bit4_bytes(LOOM_FIELD(BlockQ5_0, p, qh)));
    emit32<Op::mul>(y, _mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, d);
  }
}

void dequant_q5_1(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK5_1) {
    const uint8_t* p = block_at<BlockQ5_1>(src, i);
    const __m256 d = scale_of<BlockQ5_1>(p), m = bcast_f16(load_unaligned<uint16_t>(LOOM_FIELD(BlockQ5_1, p, m), 0));
    const __m256i q =
        _mm256_or_si256(nibbles32(LOOM_FIELD(BlockQ5_1, p, qs)), bit4_bytes(LOOM_FIELD(BlockQ5_1, p, qh)));
    emit32<Op::mul_add>(y, q, d, d, m, m);
  }
}

template <typename Block>
void dequant_q8_32(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const uint8_t* p = block_at<Block>(src, i);
    const __m256 d = scale_of<Block>(p);
    emit32<Op::mul>(y, load32(LOOM_FIELD(Block, p, qs)), d, d);
  }
}

// IQ4_NL / IQ4_XS: the 32 nibbles of qs looked up in the codebook (vpshufb).
inline __m256i iq4_values32(const uint8_t* qs) {
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
  return _mm256_shuffle_epi8(table, nibbles32(qs));
}

void dequant_iq4_nl(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const uint8_t* p = block_at<BlockIQ4_NL>(src, i);
    const __m256 d = scale_of<BlockIQ4_NL>(p);
    emit32<Op::mul>(y, iq4_values32(LOOM_FIELD(BlockIQ4_NL, p, qs)), d, d);
  }
}

// MXFP4: the same lookup in ggml's doubled E2M1 values, times 2^(e - 128).
void dequant_mxfp4(const void* src, float* y, int64_t nb) {
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const uint8_t* p = block_at<BlockMXFP4>(src, i);
    const __m256 d = _mm256_set1_ps(bf16_to_fp32(mxfp4_scale_bf16(p[0])));
    emit32<Op::mul>(y, _mm256_shuffle_epi8(table, nibbles32(LOOM_FIELD(BlockMXFP4, p, qs))), d, d);
  }
}
#undef LOOM_FIELD

// NVFP4: per sub-block of 16 the 8 bytes' low nibbles (elements 0..7) then high
// ones (8..15) looked up in the same values, times the sub-block's scale.
void dequant_nvfp4(const void* src, float* y, int64_t nb) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_unaligned<BlockNVFP4>(src, i);
    for (int s = 0; s < 4; ++s, y += QK_NVFP4_SUB) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * s));
      const __m128i codes =
          _mm_unpacklo_epi64(_mm_and_si128(q, low4), _mm_and_si128(_mm_srli_epi16(q, 4), low4));
      const __m128i v = _mm_shuffle_epi8(table, codes);
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(nvfp4_scale_f16(b.d[s])));
      _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d));
      _mm256_storeu_ps(y + 8,
                       _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), d));
    }
  }
}

void dequant_iq4_xs(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_unaligned<BlockIQ4_XS>(src, i);
    const float d = _cvtsh_ss(b.d);
    for (int j = 0; j < QK_K / 32; ++j, y += 32) {
      const __m256 dl = _mm256_set1_ps(d * static_cast<float>(iq4_xs_scale(b, j)));
      emit32<Op::mul>(y, iq4_values32(b.qs + 16 * j), dl, dl);
    }
  }
}

void dequant_q8_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ8_K>(src, i);
    const __m256 d = _mm256_set1_ps(b.d);
    for (int g = 0; g < 8; ++g) emit32<Op::mul>(y + 32 * g, load32(reinterpret_cast<const uint8_t*>(b.qs) + 32 * g), d, d);
  }
}

// Q2_K: 32 elements at 32k (k = 4h + s) are bits 2s..2s+1 of qs[32h + l];
// scales[j] = 4-bit scale | 4-bit min << 4 of the 16 elements at 16j.
void dequant_q2_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ2_K>(src, i);
    const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
    for (int k = 0; k < 8; ++k) {
      const __m256i q = bits_at(load32(b.qs + 32 * (k / 4)), 2 * (k % 4), 3);
      const uint8_t s0 = b.scales[2 * k], s1 = b.scales[2 * k + 1];
      emit32<Op::mul_sub>(y + 32 * k, q, _mm256_set1_ps(d * static_cast<float>(s0 & 0x0f)),
                          _mm256_set1_ps(d * static_cast<float>(s1 & 0x0f)),
                          _mm256_set1_ps(dmin * static_cast<float>(s0 >> 4)),
                          _mm256_set1_ps(dmin * static_cast<float>(s1 >> 4)));
    }
  }
}

// Q3_K: as Q2_K's 2-bit quants, minus 4 where bit k of hmask[l] is clear.
void dequant_q3_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ3_K>(src, i);
    const float d = _cvtsh_ss(b.d);
    const __m256i hmask = load32(b.hmask);
    for (int k = 0; k < 8; ++k) {
      const __m256i low = bits_at(load32(b.qs + 32 * (k / 4)), 2 * (k % 4), 3);
      const __m256i high4 = _mm256_slli_epi16(bits_at(hmask, k, 1), 2);  // 4 where the bit is set
      const __m256i q = _mm256_sub_epi8(_mm256_add_epi8(low, high4), _mm256_set1_epi8(4));
      emit32<Op::mul>(y + 32 * k, q, _mm256_set1_ps(d * static_cast<float>(q3_k_scale(b.scales, 2 * k))),
                      _mm256_set1_ps(d * static_cast<float>(q3_k_scale(b.scales, 2 * k + 1))));
    }
  }
}

// Q4_K / Q5_K: group g (32 elements) is nibble g % 2 of qs[32 (g / 2) + l], plus
// bit g of qh[l] as bit 4 for Q5_K.
template <typename Block, bool kFive>
void dequant_q45_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<Block>(src, i);
    const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k4_scale_min(b.scales, g, sc, m);
      __m256i q = bits_at(load32(b.qs + 32 * (g / 2)), 4 * (g % 2), 0x0f);
      if constexpr (kFive) q = _mm256_or_si256(q, _mm256_slli_epi16(bits_at(load32(b.qh), g, 1), 4));
      const __m256 d1 = _mm256_set1_ps(d * static_cast<float>(sc)), m1 = _mm256_set1_ps(dmin * static_cast<float>(m));
      emit32<Op::mul_sub>(y + 32 * g, q, d1, d1, m1, m1);
    }
  }
}

// Q6_K: 32 elements at 32k (k = 4h + s): low nibble from ql[64h + 32(s % 2) + l]
// (high nibble when s >= 2), top 2 bits are bits 2s..2s+1 of qh[32h + l].
void dequant_q6_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ6_K>(src, i);
    const float d = _cvtsh_ss(b.d);
    for (int k = 0; k < 8; ++k) {
      const int h = k / 4, s = k % 4;
      const __m256i lo = bits_at(load32(b.ql + 64 * h + 32 * (s % 2)), 4 * (s / 2), 0x0f);
      const __m256i hi = _mm256_slli_epi16(bits_at(load32(b.qh + 32 * h), 2 * s, 3), 4);
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
      emit32<Op::mul>(y + 32 * k, q, _mm256_set1_ps(d * static_cast<float>(b.scales[2 * k])),
                      _mm256_set1_ps(d * static_cast<float>(b.scales[2 * k + 1])));
    }
  }
}

void dequant_f16(const void* src, float* y, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
  for (; i < n; ++i) y[i] = _cvtsh_ss(load_unaligned<uint16_t>(src, i));
}

void dequant_bf16(const void* src, float* y, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
    _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) y[i] = bf16_to_fp32(load_unaligned<uint16_t>(src, i));
}

}  // namespace

void dequantize_row(DType type, const void* src, float* dst, int64_t n) {
  const int64_t bs = dtype_block_size(type);
  LOOM_ASSERT(n >= 0 && n % bs == 0);
  const int64_t nb = n / bs;
  switch (type) {
    case DType::f32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case DType::f16: dequant_f16(src, dst, n); return;
    case DType::bf16: dequant_bf16(src, dst, n); return;
    case DType::f64: dequant_plain<double>(src, dst, n); return;
    case DType::i8: dequant_plain<int8_t>(src, dst, n); return;
    case DType::i16: dequant_plain<int16_t>(src, dst, n); return;
    case DType::i32: dequant_plain<int32_t>(src, dst, n); return;
    case DType::i64: dequant_plain<int64_t>(src, dst, n); return;
    case DType::q4_0: dequant_q4_0(src, dst, nb); return;
    case DType::q4_1: dequant_q4_1(src, dst, nb); return;
    case DType::q5_0: dequant_q5_0(src, dst, nb); return;
    case DType::q5_1: dequant_q5_1(src, dst, nb); return;
    case DType::q8_0: dequant_q8_32<BlockQ8_0>(src, dst, nb); return;
    case DType::q8_1: dequant_q8_32<BlockQ8_1>(src, dst, nb); return;
    case DType::q2_k: dequant_q2_k(src, dst, nb); return;
    case DType::q3_k: dequant_q3_k(src, dst, nb); return;
    case DType::q4_k: dequant_q45_k<BlockQ4_K, false>(src, dst, nb); return;
    case DType::q5_k: dequant_q45_k<BlockQ5_K, true>(src, dst, nb); return;
    case DType::q6_k: dequant_q6_k(src, dst, nb); return;
    case DType::q8_k: dequant_q8_k(src, dst, nb); return;
    case DType::iq4_nl:
      dequant_iq4_nl(src, dst, nb);
      return;
    case DType::iq4_xs:
      dequant_iq4_xs(src, dst, nb);
      return;
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq1_s:
    case DType::iq1_m:
      dequantize_iq_grid(type, src, dst, nb);
      return;
    case DType::tq1_0:
    case DType::tq2_0:
      dequantize_ternary(type, src, dst, nb);
      return;
    case DType::q1_0:
    case DType::q2_0:
      dequantize_low_bit(type, src, dst, nb);
      return;
    case DType::mxfp4:
      dequant_mxfp4(src, dst, nb);
      return;
    case DType::nvfp4:
      dequant_nvfp4(src, dst, nb);
      return;
    case DType::nf4: cpu::dequantize_row_nf4(src, dst, n); return;
    case DType::i8_ch: cpu::dequantize_row_i8ch(src, dst, n); return;
  }
  LOOM_ASSERT(false && "dequantize_row: unhandled dtype");
}

void dequantize_row_cols(DType type, const void* row, int64_t c0, float* dst, int64_t n) {
  LOOM_ASSERT(c0 >= 0 && c0 % dtype_block_size(type) == 0);
  if (type == DType::i8_ch) return cpu::dequantize_i8ch_cols(row, c0, dst, n);
  LOOM_ASSERT(dtype_row_header_bytes(type) == 0);
  dequantize_row(type, static_cast<const uint8_t*>(row) + dtype_row_bytes(type, c0), dst, n);
}

}  // namespace loom
