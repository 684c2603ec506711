// Scalar reference (de)quantization of the GGUF block formats. Blocks are
// copied out with memcpy so that any source alignment is fine (file data and
// fuzz inputs are not always aligned to the block struct).

// The quantizers compute `x * id + 8.5f` with a rounded product (as ggml's C
// and gguf-py do); an FMA would round once and change some quants, so
// contraction is off. (Dequantization products are exact in fp32 anyway.)
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/ref/dequant_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/quant_blocks.h"
#include "kernels/ref/i8ch_ref.h"
#include "kernels/ref/nf4_ref.h"

namespace loom {
namespace {

template <typename Block>
void store_block(void* dst, int64_t i, const Block& b) {
  std::memcpy(static_cast<uint8_t*>(dst) + static_cast<size_t>(i) * sizeof(Block), &b, sizeof(Block));
}

template <typename T>
void dequant_plain(const void* src, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(load_unaligned<T>(src, i));
}

void dequant_q4_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK4_0) {
    const auto b = load_unaligned<BlockQ4_0>(src, i);
    const float d = fp16_to_fp32(b.d);
    for (int j = 0; j < QK4_0 / 2; ++j) {
      y[j] = static_cast<float>((b.qs[j] & 0x0f) - 8) * d;
      y[j + QK4_0 / 2] = static_cast<float>((b.qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK4_1) {
    const auto b = load_unaligned<BlockQ4_1>(src, i);
    const float d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
    for (int j = 0; j < QK4_1 / 2; ++j) {
      y[j] = static_cast<float>(b.qs[j] & 0x0f) * d + m;
      y[j + QK4_1 / 2] = static_cast<float>(b.qs[j] >> 4) * d + m;
    }
  }
}

// The 5th bit of element j is bit j of qh (elements 0..31 of the block).
inline int q5_high(uint32_t qh, int j) { return static_cast<int>((qh >> j) & 1u) << 4; }

void dequant_q5_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK5_0) {
    const auto b = load_unaligned<BlockQ5_0>(src, i);
    const float d = fp16_to_fp32(b.d);
    uint32_t qh;
    std::memcpy(&qh, b.qh, 4);
    for (int j = 0; j < QK5_0 / 2; ++j) {
      y[j] = static_cast<float>(((b.qs[j] & 0x0f) | q5_high(qh, j)) - 16) * d;
      y[j + 16] = static_cast<float>(((b.qs[j] >> 4) | q5_high(qh, j + 16)) - 16) * d;
    }
  }
}

void dequant_q5_1(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK5_1) {
    const auto b = load_unaligned<BlockQ5_1>(src, i);
    const float d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
    uint32_t qh;
    std::memcpy(&qh, b.qh, 4);
    for (int j = 0; j < QK5_1 / 2; ++j) {
      y[j] = static_cast<float>((b.qs[j] & 0x0f) | q5_high(qh, j)) * d + m;
      y[j + 16] = static_cast<float>((b.qs[j] >> 4) | q5_high(qh, j + 16)) * d + m;
    }
  }
}

void dequant_q8_0(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK8_0) {
    const auto b = load_unaligned<BlockQ8_0>(src, i);
    const float d = fp16_to_fp32(b.d);
    for (int j = 0; j < QK8_0; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
  }
}

void dequant_q8_1(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK8_1) {
    const auto b = load_unaligned<BlockQ8_1>(src, i);
    const float d = fp16_to_fp32(b.d);
    for (int j = 0; j < QK8_1; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
  }
}

// IQ4_NL / IQ4_XS: codebook values times the block's (sub-block's) scale; IQ4_XS
// forms d * (ls - 32) first (exact in f32), as ggml and gguf-py do.
void dequant_iq4_nl(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto b = load_unaligned<BlockIQ4_NL>(src, i);
    const float d = fp16_to_fp32(b.d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(kIq4Values[b.qs[j] & 0x0f]);
      y[j + 16] = d * static_cast<float>(kIq4Values[b.qs[j] >> 4]);
    }
  }
}

void dequant_iq4_xs(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_unaligned<BlockIQ4_XS>(src, i);
    const float d = fp16_to_fp32(b.d);
    for (int sb = 0; sb < QK_K / 32; ++sb, y += 32) {
      const float dl = d * static_cast<float>(iq4_xs_scale(b, sb));
      const uint8_t* qs = b.qs + 16 * sb;
      for (int j = 0; j < 16; ++j) {
        y[j] = dl * static_cast<float>(kIq4Values[qs[j] & 0x0f]);
        y[j + 16] = dl * static_cast<float>(kIq4Values[qs[j] >> 4]);
      }
    }
  }
}

void dequant_q8_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ8_K>(src, i);
    for (int j = 0; j < QK_K; ++j) y[j] = static_cast<float>(b.qs[j]) * b.d;
  }
}

// Q2_K: 16 groups of 16; scales[g] holds a 4-bit scale (low) and 4-bit min
// (high). Element e = 128*h + 32*s + l takes bits 2s..2s+1 of qs[32*h + l].
void dequant_q2_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ2_K>(src, i);
    const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const uint8_t sc = b.scales[e / 16];
      const float dl = d * static_cast<float>(sc & 0x0f);
      const float ml = dmin * static_cast<float>(sc >> 4);
      const int q = (b.qs[32 * h + l] >> (2 * s)) & 3;
      y[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

// Q3_K: 16 signed 6-bit scales (q3_k_scale, quant_blocks.h); a clear hmask bit
// subtracts 4 from the 2-bit quant.
void dequant_q3_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ3_K>(src, i);
    const float d = fp16_to_fp32(b.d);
    float dl[16];
    for (int g = 0; g < 16; ++g) dl[g] = d * static_cast<float>(q3_k_scale(b.scales, g));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int low = (b.qs[32 * h + l] >> (2 * s)) & 3;
      const bool high = (b.hmask[l] >> (e / 32)) & 1;
      y[e] = dl[e / 16] * static_cast<float>(low - (high ? 0 : 4));
    }
  }
}

// Q4_K/Q5_K: 8 groups of 32 with 6-bit scales and mins (k4_scale_min, quant_blocks.h).
// Element e = 64*p + 32*half + l: nibble `half` of qs[32*p + l]; Q5_K adds bit g
// of qh[l] as bit 4 of element 32*g + l.
template <typename Block, bool kFive>
void dequant_q45_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<Block>(src, i);
    const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k4_scale_min(b.scales, g, sc, m);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
      const uint8_t* qs = b.qs + 32 * (g / 2);
      const int shift = 4 * (g % 2);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[l] >> shift) & 0x0f;
        if constexpr (kFive) q |= ((b.qh[l] >> g) & 1) << 4;
        y[32 * g + l] = d1 * static_cast<float>(q) - m1;
      }
    }
  }
}

// Q6_K: element e = 128*h + 32*s + l; low nibble from ql[64*h + 32*(s%2) + l]
// (high nibble when s >= 2), top 2 bits are bits 2s..2s+1 of qh[32*h + l].
void dequant_q6_k(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto b = load_unaligned<BlockQ6_K>(src, i);
    const float d = fp16_to_fp32(b.d);
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int lo = (b.ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0f;
      const int hi = (b.qh[32 * h + l] >> (2 * s)) & 3;
      const float dl = d * static_cast<float>(b.scales[e / 16]);
      y[e] = dl * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

// C's truncating (int) cast clamped to [lo, hi]; unlike the cast, defined for
// NaN and out-of-range inputs (ggml's code leaves those undefined).
inline int trunc_clamped(float v, int lo, int hi) {
  if (!(v > static_cast<float>(lo))) return lo;
  if (!(v < static_cast<float>(hi))) return hi;
  return static_cast<int>(v);
}

// roundf (half away from zero) into int8, NaN -> 0.
inline int8_t round_to_i8(float v) {
  if (std::isnan(v)) return 0;
  return static_cast<int8_t>(std::clamp(std::round(v), -128.0f, 127.0f));
}

// ggml's nearest_int: round half to even via the 1.5*2^23 trick (exact for
// |v| < 2^22, the only range quantizers produce); out-of-range values clamp.
inline int nearest_int(float v) {
  if (std::isnan(v)) return 0;
  if (!(std::fabs(v) <= 4194303.0f)) return v > 0 ? 4194303 : -4194303;
  const float t = v + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &t, 4);
  return (bits & 0x007fffff) - 0x00400000;
}

inline float block_absmax(const float* x, int n) {
  float amax = 0.0f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
}

// Signed value with the largest magnitude (first one on ties), as ggml picks it.
inline float block_signed_max(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

inline void block_min_max(const float* x, int n, float& min, float& max) {
  min = 3.402823466e+38f;
  max = -3.402823466e+38f;
  for (int j = 0; j < n; ++j) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
}

// Packs 32 values of 4 or 5 bits: qs[j] holds element j (low nibble) and j + 16
// (high nibble); q5's qh bit j is bit 4 of element j.
template <typename Block>
void pack_quants(const int* q, Block& b) {
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
  if constexpr (requires { b.qh; }) {
    uint32_t qh = 0;
    for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>((q[j] >> 4) & 1) << j;
    std::memcpy(b.qh, &qh, 4);
  }
}

// q4_0 / q5_0 (half = 8 / 16): d = the signed largest value / -half, and
// q = trunc(x / d + half + 0.5) in [0, 2 half - 1].
template <typename Block, int kBits>
void quant_symmetric(const float* x, void* dst, int64_t nb) {
  constexpr int kHalf = 1 << (kBits - 1), kMax = (1 << kBits) - 1;
  for (int64_t i = 0; i < nb; ++i, x += 32) {
    const float d = block_signed_max(x, 32) / -static_cast<float>(kHalf);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    Block b;
    b.d = fp32_to_fp16(d);
    int q[32];
    for (int j = 0; j < 32; ++j) q[j] = trunc_clamped(x[j] * id + (static_cast<float>(kHalf) + 0.5f), 0, kMax);
    pack_quants(q, b);
    store_block(dst, i, b);
  }
}

// q4_1 / q5_1: d = (max - min) / (2^bits - 1), m = min, q = trunc((x - min) / d + 0.5).
template <typename Block, int kBits>
void quant_affine(const float* x, void* dst, int64_t nb) {
  constexpr int kMax = (1 << kBits) - 1;
  for (int64_t i = 0; i < nb; ++i, x += 32) {
    float min, max;
    block_min_max(x, 32, min, max);
    const float d = (max - min) / static_cast<float>(kMax);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    Block b;
    b.d = fp32_to_fp16(d);
    b.m = fp32_to_fp16(min);
    int q[32];
    for (int j = 0; j < 32; ++j) q[j] = trunc_clamped((x[j] - min) * id + 0.5f, 0, kMax);
    pack_quants(q, b);
    store_block(dst, i, b);
  }
}

}  // namespace

void dequantize_row_ref(DType type, const void* src, float* dst, int64_t n) {
  const int64_t bs = dtype_block_size(type);
  LOOM_ASSERT(n >= 0 && n % bs == 0);
  const int64_t nb = n / bs;
  switch (type) {
    case DType::f32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case DType::f16:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(load_unaligned<uint16_t>(src, i));
      return;
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(load_unaligned<uint16_t>(src, i));
      return;
    case DType::f64: dequant_plain<double>(src, dst, n); return;
    case DType::i8: dequant_plain<int8_t>(src, dst, n); return;
    case DType::i16: dequant_plain<int16_t>(src, dst, n); return;
    case DType::i32: dequant_plain<int32_t>(src, dst, n); return;
    case DType::i64: dequant_plain<int64_t>(src, dst, n); return;
    case DType::q4_0: dequant_q4_0(src, dst, nb); return;
    case DType::q4_1: dequant_q4_1(src, dst, nb); return;
    case DType::q5_0: dequant_q5_0(src, dst, nb); return;
    case DType::q5_1: dequant_q5_1(src, dst, nb); return;
    case DType::q8_0: dequant_q8_0(src, dst, nb); return;
    case DType::q8_1: dequant_q8_1(src, dst, nb); return;
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
      dequantize_mxfp4(src, dst, nb);
      return;
    case DType::nvfp4:
      dequantize_nvfp4(src, dst, nb);
      return;
    case DType::nf4: dequantize_row_nf4_ref(src, dst, n); return;
    case DType::i8_ch: dequantize_row_i8ch_ref(src, dst, n); return;  // src: the row's start (header)
  }
  LOOM_ASSERT(false && "dequantize_row_ref: unhandled dtype");
}

void quantize_row_q8_0_ref(const float* x, void* dst, int64_t n) {
  LOOM_ASSERT(n >= 0 && n % QK8_0 == 0);
  for (int64_t i = 0; i < n / QK8_0; ++i, x += QK8_0) {
    const float d = block_absmax(x, QK8_0) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ8_0 b;
    b.d = fp32_to_fp16(d);
    for (int j = 0; j < QK8_0; ++j) b.qs[j] = round_to_i8(x[j] * id);
    store_block(dst, i, b);
  }
}

void quantize_row_q8_1_ref(const float* x, void* dst, int64_t n) {
  LOOM_ASSERT(n >= 0 && n % QK8_1 == 0);
  for (int64_t i = 0; i < n / QK8_1; ++i, x += QK8_1) {
    const float d = block_absmax(x, QK8_1) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ8_1 b;
    b.d = fp32_to_fp16(d);
    int sum = 0;
    for (int j = 0; j < QK8_1; ++j) {
      b.qs[j] = round_to_i8(x[j] * id);
      sum += b.qs[j];
    }
    b.s = fp32_to_fp16(static_cast<float>(sum) * d);
    store_block(dst, i, b);
  }
}

void quantize_row_q8_k_ref(const float* x, void* dst, int64_t n) {
  LOOM_ASSERT(n >= 0 && n % QK_K == 0);
  for (int64_t i = 0; i < n / QK_K; ++i, x += QK_K) {
    BlockQ8_K b{};
    const float max = block_signed_max(x, QK_K);
    if (max != 0.0f) {
      const float iscale = -127.0f / max;
      for (int j = 0; j < QK_K; ++j) b.qs[j] = static_cast<int8_t>(std::clamp(nearest_int(iscale * x[j]), -128, 127));
      for (int g = 0; g < QK_K / 16; ++g) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) sum += b.qs[16 * g + l];
        b.bsums[g] = static_cast<int16_t>(sum);
      }
      b.d = 1.0f / iscale;
    }
    store_block(dst, i, b);
  }
}

bool quantize_ref_supported(DType type) {
  switch (type) {
    case DType::f32: case DType::f16: case DType::bf16:
    case DType::q4_0: case DType::q4_1: case DType::q5_0: case DType::q5_1:
    case DType::q8_0: case DType::q8_1: case DType::q8_k:
      return true;
    default:
      return false;
  }
}

void quantize_row_ref(DType type, const float* src, void* dst, int64_t n) {
  if (!quantize_ref_supported(type))
    fail(ErrorKind::unsupported, "no reference quantizer for tensor type {}", dtype_name(type));
  LOOM_ASSERT(n >= 0 && n % dtype_block_size(type) == 0);
  const int64_t nb = n / dtype_block_size(type);
  auto* out = static_cast<uint8_t*>(dst);
  switch (type) {
    case DType::f32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case DType::f16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = fp32_to_fp16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = fp32_to_bf16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case DType::q4_0: quant_symmetric<BlockQ4_0, 4>(src, dst, nb); return;
    case DType::q4_1: quant_affine<BlockQ4_1, 4>(src, dst, nb); return;
    case DType::q5_0: quant_symmetric<BlockQ5_0, 5>(src, dst, nb); return;
    case DType::q5_1: quant_affine<BlockQ5_1, 5>(src, dst, nb); return;
    case DType::q8_0: quantize_row_q8_0_ref(src, dst, n); return;
    case DType::q8_1: quantize_row_q8_1_ref(src, dst, n); return;
    case DType::q8_k: quantize_row_q8_k_ref(src, dst, n); return;
    default: break;
  }
  LOOM_ASSERT(false && "quantize_row_ref: unhandled dtype");
}

}  // namespace loom
