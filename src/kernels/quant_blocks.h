// Block layouts of the GGUF (ggml) quantized formats, byte-compatible with
// files written by llama.cpp. Sizes are checked by static_asserts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace loom {

constexpr int QK4_0 = 32;
constexpr int QK4_1 = 32;
constexpr int QK5_0 = 32;
constexpr int QK5_1 = 32;
constexpr int QK8_0 = 32;
constexpr int QK8_1 = 32;
constexpr int QK_K = 256;
constexpr int K_SCALE_SIZE = 12;

// x = (q - 8) * d; qs[j] low nibble is element j, high nibble element j + 16.
struct BlockQ4_0 { uint16_t d; uint8_t qs[QK4_0 / 2]; };
// x = q * d + m
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[QK4_1 / 2]; };
// 5th bit of element j in bit j of qh; x = (q - 16) * d
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; };
struct BlockQ5_1 { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK8_0]; };
// Activation format for q4_1/q5_1 dot products: s = d * sum(qs).
struct BlockQ8_1 { uint16_t d; uint16_t s; int8_t qs[QK8_1]; };

struct BlockQ2_K { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d; uint16_t dmin; };
struct BlockQ3_K { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
struct BlockQ5_K { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
// Activation format for k-quant dot products; bsums are sums of 16 qs each.
struct BlockQ8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };

// IQ4_NL: x = d * kIq4Values[q], 4-bit indices into a fixed non-linear codebook,
// nibbles ordered as q4_0's (low nibble of qs[j] = element j, high = j + 16).
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[16];
};
// IQ4_XS: 8 sub-blocks of 32, sub-block j x = d * (ls_j - 32) * kIq4Values[q],
// ls_j 6 bits (low 4 in nibble j % 2 of scales_l[j / 2], high 2 in bits 2j..2j+1
// of scales_h); qs[16j .. 16j + 15] hold sub-block j as an IQ4_NL block's qs.
struct BlockIQ4_XS {
  uint16_t d;
  uint16_t scales_h;
  uint8_t scales_l[QK_K / 64];
  uint8_t qs[QK_K / 2];
};
// ggml's kvalues_iq4nl.
inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);
static_assert(sizeof(BlockIQ4_NL) == 18);
static_assert(sizeof(BlockIQ4_XS) == 136);

// Format helpers for scalar code in cpu/ and ref/. Internal linkage: files built
// with AVX-512 flags include this header too, and must not share code with others.
namespace {

// Element or block i of an array at any alignment (file data and fuzz inputs are
// not always aligned to the block struct).
template <typename T>
inline T load_unaligned(const void* src, int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const uint8_t*>(src) + static_cast<size_t>(i) * sizeof(T), sizeof(T));
  return v;
}

// Q3_K: signed 6-bit scale (offset 32) of sub-block g (16 elements), packed in 12
// bytes: low nibbles in bytes 0..7 (g < 8 low nibble, g >= 8 high nibble of byte
// g-8), high 2 bits in bytes 8..11.
inline int q3_k_scale(const uint8_t* scales, int g) {
  const int lo = g < 8 ? (scales[g] & 0x0f) : (scales[g - 8] >> 4);
  const int hi = (scales[8 + g % 4] >> (2 * (g / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

// Q4_K/Q5_K: 6-bit scale and min of group g (32 elements), packed in 12 bytes.
inline void k4_scale_min(const uint8_t* q, int g, int& sc, int& m) {
  if (g < 4) {
    sc = q[g] & 63;
    m = q[g + 4] & 63;
  } else {
    sc = (q[g + 4] & 0x0f) | ((q[g - 4] >> 6) << 4);
    m = (q[g + 4] >> 4) | ((q[g] >> 6) << 4);
  }
}

// IQ4_XS: the signed scale ls_j - 32 (-32..31) of sub-block j (32 elements).
inline int iq4_xs_scale(const BlockIQ4_XS& b, int j) {
  const int lo = (b.scales_l[j / 2] >> (4 * (j % 2))) & 0x0f;
  const int hi = (b.scales_h >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

}  // namespace

}  // namespace loom
