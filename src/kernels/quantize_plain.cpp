// The quantizers of the types ggml writes with its reference functions alone (no
// search, and an importance matrix changes nothing): MXFP4 and NVFP4 (each block's
// scale from its absolute maximum, then per value the nearest E2M1 value, the
// first on ties), Q1_0 (the mean |x| and a sign bit per weight), Q2_0 (the
// absolute maximum d and round(x / d) in -1..2) and the ternary TQ1_0 / TQ2_0 (d
// the absolute maximum, trits round(x / d) + 1). Byte-identical to ggml's
// quantize_row_<type>_ref (quantize_impl.h).

// As in quantize_search.cpp: ggml's products and differences are not fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/half.h"
#include "kernels/quant_blocks.h"
#include "kernels/quantize_impl.h"

namespace loom::quant {
namespace {

// The index into kMxfp4Values of the value whose multiple of d is nearest x
// (ggml's best_index_mxfp4: a linear search, the first index on ties).
uint8_t nearest_fp4(float x, float d) {
  int best = 0;
  float best_err = std::fabs(static_cast<float>(kMxfp4Values[0]) * d - x);
  for (int i = 1; i < 16; ++i) {
    const float err = std::fabs(static_cast<float>(kMxfp4Values[i]) * d - x);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

float abs_max(const float* x, int n) {
  float amax = 0.0f;
  for (int j = 0; j < n; ++j)
    if (amax < std::fabs(x[j])) amax = std::fabs(x[j]);
  return amax;
}

// ggml_fp32_to_ue4m3: x > 0 to the unsigned E4M3 byte (bias 7) by its float bits, the
// mantissa rounded half up on bit 19, subnormals by rounding x * 2^9, clamped to 0x7e (448).
uint8_t fp32_to_ue4m3(float x) {
  if (!(x > 0.0f)) return 0;
  if (x > 448.0f) x = 448.0f;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  int exp = static_cast<int>((bits >> 23) & 0xff) - 127 + 7;
  if (exp <= 0) {
    int man = static_cast<int>(x * 512.0f + 0.5f);
    if (man > 7) man = 7;
    return man < 1 ? 0 : static_cast<uint8_t>(man);
  }
  if (exp >= 15) return 0x7e;
  int man = static_cast<int>((bits >> 20) & 7) + static_cast<int>((bits >> 19) & 1);
  if (man > 7) {
    man = 0;
    if (++exp >= 15) return 0x7e;
  }
  return static_cast<uint8_t>(exp << 3 | man);
}

}  // namespace

void quantize_row_mxfp4(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / 32; ++i, x += 32, out += sizeof(BlockMXFP4)) {
    const float amax = abs_max(x, 32);
    // ggml: floorf(log2f(amax)) - 2 + 127, through log2f as ggml does (its rounding
    // just below a power of two included).
    // The float to an int, then its low byte, as x86 converts ggml's (uint8_t) cast.
    const auto e =
        static_cast<uint8_t>(amax > 0.0f ? static_cast<int>(std::floor(std::log2(amax)) - 2 + 127) : 0);
    const float d = bf16_to_fp32(mxfp4_scale_bf16(e));
    BlockMXFP4 b;
    b.e = e;
    for (int j = 0; j < 16; ++j)
      b.qs[j] = static_cast<uint8_t>(nearest_fp4(x[j], d) | nearest_fp4(x[j + 16], d) << 4);
    std::memcpy(out, &b, sizeof b);
  }
}

void quantize_row_nvfp4(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / QK_NVFP4; ++i, out += sizeof(BlockNVFP4)) {
    BlockNVFP4 b;
    for (int s = 0; s < 4; ++s, x += QK_NVFP4_SUB) {
      b.d[s] = fp32_to_ue4m3(abs_max(x, QK_NVFP4_SUB) / 6.0f);
      const float d = fp16_to_fp32(nvfp4_scale_f16(b.d[s]));
      for (int j = 0; j < 8; ++j)
        b.qs[8 * s + j] = static_cast<uint8_t>(nearest_fp4(x[j], d) | nearest_fp4(x[j + 8], d) << 4);
    }
    std::memcpy(out, &b, sizeof b);
  }
}

void quantize_row_q1_0(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / QK1_0; ++i, x += QK1_0, out += sizeof(BlockQ1_0)) {
    float sum_abs = 0.0f;
    for (int j = 0; j < QK1_0; ++j) sum_abs += std::fabs(x[j]);
    BlockQ1_0 b{};
    b.d = fp32_to_fp16(sum_abs / QK1_0);
    for (int j = 0; j < QK1_0; ++j)
      if (x[j] >= 0.0f) b.qs[j / 8] = static_cast<uint8_t>(b.qs[j / 8] | 1 << (j % 8));
    std::memcpy(out, &b, sizeof b);
  }
}

void quantize_row_q2_0(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / QK2_0; ++i, x += QK2_0, out += sizeof(BlockQ2_0)) {
    const float d = abs_max(x, QK2_0);
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    BlockQ2_0 b{};
    b.d = fp32_to_fp16(d);
    for (int j = 0; j < QK2_0; ++j) {
      const int q =
          std::clamp(static_cast<int>(std::round(x[j] * id)) + 1, 0, 3);  // roundf: half away from 0
      b.qs[j / 4] = static_cast<uint8_t>(b.qs[j / 4] | q << (2 * (j % 4)));
    }
    std::memcpy(out, &b, sizeof b);
  }
}

namespace {
// A trit of x: round(x / d) + 1 in 0..2 (lroundf: half away from zero).
int trit(float x, float id) { return static_cast<int>(std::lround(x * id)) + 1; }

// A ternary superblock's scale: d = its absolute maximum, stored as f16; the
// inverse the trits round with (0 for an all-zero block, as ggml's d != 0 test).
float ternary_scale(const float* x, uint16_t& d_f16) {
  const float d = abs_max(x, QK_K);
  d_f16 = fp32_to_fp16(d);
  return d != 0.0f ? 1.0f / d : 0.0f;
}
// n trits as one base-3 number scaled to a byte, rounding up (ggml's TQ1_0 packing:
// the byte times 3 lifts each trit in turn into the top; ternary_trits reads it).
uint8_t trits_to_byte(const int* t, int n) {
  uint8_t q = 0;
  for (int i = 0; i < n; ++i) q = static_cast<uint8_t>(q * 3 + t[i]);
  return static_cast<uint8_t>((q * 256 + 242) / 243);
}
}  // namespace

void quantize_row_tq1_0(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / QK_K; ++i, out += sizeof(BlockTQ1_0)) {
    BlockTQ1_0 b{};
    const float id = ternary_scale(x, b.d);
    int t[5];
    for (int m = 0; m < 32; ++m) {  // 5 trits a byte over the first 160 values, strided by 32
      for (int k = 0; k < 5; ++k) t[k] = trit(x[m + 32 * k], id);
      b.qs[m] = trits_to_byte(t, 5);
    }
    x += 160;
    for (int m = 0; m < 16; ++m) {  // the next 80, strided by 16
      for (int k = 0; k < 5; ++k) t[k] = trit(x[m + 16 * k], id);
      b.qs[32 + m] = trits_to_byte(t, 5);
    }
    x += 80;
    for (int j = 0; j < 4; ++j) {  // the last 16: 4 trits a byte, strided by 4, the first lifted once more
      for (int k = 0; k < 4; ++k) t[k] = trit(x[j + 4 * k], id);
      t[4] = 0;
      b.qh[j] = trits_to_byte(t, 5);
    }
    x += 16;
    std::memcpy(out, &b, sizeof b);
  }
}

void quantize_row_tq2_0(const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / QK_K; ++i, out += sizeof(BlockTQ2_0)) {
    BlockTQ2_0 b{};
    const float id = ternary_scale(x, b.d);
    for (int j = 0; j < QK_K / 4; j += 32, x += 128)  // 4 trits a byte, 2 bits each, strided by 32
      for (int m = 0; m < 32; ++m) {
        int q = 0;
        for (int k = 0; k < 4; ++k) q += (trit(x[m + 32 * k], id) & 3) << (2 * k);
        b.qs[j + m] = static_cast<uint8_t>(q);
      }
    std::memcpy(out, &b, sizeof b);
  }
}

}  // namespace loom::quant
