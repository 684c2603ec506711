// Block layouts of the GGUF (ggml) quantized formats, byte-compatible with
// files written by llama.cpp. Sizes are checked by static_asserts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "core/half.h"
#include "kernels/iq_grids.h"

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
// The grid types (IQ2_XXS .. IQ3_S): 256 weights in entries of 8 (IQ2) or 4
// (IQ3) consecutive weights whose magnitudes come from a grid codebook
// (kernels/iq_grids.h), each weight with its own sign, each sub-block of 32
// (IQ2_XS, IQ2_S: 16) with a 4-bit scale s. ggml's x = d * (0.5 + s) * 0.25 * v
// (IQ3_XXS: * 0.5; IQ3_S: d * (1 + 2s) * v) is d * f * (2s + 1) * v with f =
// 1/8, 1/4, 1 (decode_iq_grid below). Signs: IQ2_XXS, IQ2_XS and IQ3_XXS keep 7
// per 8 weights, the 8th making the count of negatives even (iq_ksigns).
// IQ2_XXS: per 32, u32 aux0 = 4 grid indices, u32 aux1 = 4 x 7 sign bits | s << 28.
struct BlockIQ2_XXS {
  uint16_t d;
  uint16_t qs[QK_K / 8];
};
// IQ2_XS: per 8 weights u16 = 9-bit grid index | 7 sign bits << 9; scale nibbles per 16.
struct BlockIQ2_XS {
  uint16_t d;
  uint16_t qs[QK_K / 8];
  uint8_t scales[QK_K / 32];
};
// IQ2_S: per 8 weights the low 8 index bits (qs[0..31]) and 8 sign bits (qs[32..63]);
// qh[j] bits 2l..2l+1 = index bits 8..9 of entry l of sub-block j; scale nibbles per 16.
struct BlockIQ2_S {
  uint16_t d;
  uint8_t qs[QK_K / 4];
  uint8_t qh[QK_K / 32];
  uint8_t scales[QK_K / 32];
};
// IQ3_XXS: a grid index per 4 weights, then per 32 a u32 of 4 x 7 sign bits | s << 28.
struct BlockIQ3_XXS {
  uint16_t d;
  uint8_t qs[3 * QK_K / 8];
};
// IQ3_S: 8-bit grid index per 4 weights, bit 8 in qh (bit l of qh[j]: entry 8j + l),
// a sign bit per weight, scale nibbles per 32 (sub-block j: nibble j % 2 of scales[j / 2]).
struct BlockIQ3_S {
  uint16_t d;
  uint8_t qs[QK_K / 4];
  uint8_t qh[QK_K / 32];
  uint8_t signs[QK_K / 8];
  uint8_t scales[QK_K / 64];
};
// IQ1_S and IQ1_M: 256 weights in entries of 8 whose values g (-1, 0, 1) come
// from an 11-bit index into kIq1sGrid, with no signs but a shift delta = +-1/8 per
// 32 (IQ1_S) or per entry (IQ1_M): ggml's x = d * (2s + 1) * (g + delta) is
// d * f * (2s + 1) * (8g +- 1) with f = 1/8, integer values in {-9, -7, -1, 1, 7, 9}.
// IQ1_S: qs = the low 8 index bits per entry; per 32 a u16 qh = the high 3 bits of
// entry l at bits 3l..3l+2, the 3-bit scale s at bits 12..14, delta's sign at bit 15.
struct BlockIQ1_S {
  uint16_t d;
  uint8_t qs[QK_K / 8];
  uint16_t qh[QK_K / 32];
};
// IQ1_M: qs as IQ1_S's; a nibble per entry (entry e: nibble e % 2 of qh[e / 2]) =
// the high 3 index bits | delta's sign << 3; a 3-bit scale per 16 (scale j: bits
// 3(j % 4).. of the u16 j / 4 of scales), and the f16 d in the top nibbles of the
// four u16 (bits 12..15 of u16 i = bits 4i..4i+3 of d).
struct BlockIQ1_M {
  uint8_t qs[QK_K / 8];
  uint8_t qh[QK_K / 16];
  uint8_t scales[QK_K / 32];
};

// ggml's kvalues_iq4nl.
inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

// TQ1_0 and TQ2_0 (ternary, for models trained with weights in {-1, 0, 1}, such
// as TriLM): x = d * (t - 1), t in {0, 1, 2}. TQ2_0 keeps t in 2 bits, in q2_k's
// order (qs[32c + m] bits 2s..2s+1: element 128c + 32s + m); TQ1_0 five trits
// per byte of qs (t_n = (u8(q * 3^n) * 3) >> 8: qs[m] element 32n + m for m < 32,
// qs[32 + m] element 160 + 16n + m) and four per byte of qh (element 240 + 4n + m).
struct BlockTQ1_0 {
  uint8_t qs[48];
  uint8_t qh[4];
  uint16_t d;
};
struct BlockTQ2_0 {
  uint8_t qs[QK_K / 4];
  uint16_t d;
};

// Q1_0 and Q2_0 (llama-quantize's 1.125 and 2.25 bits-per-weight types): one f16
// d per 128 (Q1_0) or 64 (Q2_0) elements. Q1_0: bit j % 8 of qs[j / 8], x = d if
// set, -d if clear. Q2_0: bits 2(j % 4)..+1 of qs[j / 4], x = (q - 1) d, q in 0..3.
struct BlockQ1_0 {
  uint16_t d;
  uint8_t qs[16];
};
struct BlockQ2_0 {
  uint16_t d;
  uint8_t qs[16];
};
constexpr int QK1_0 = 128;
constexpr int QK2_0 = 64;
// MXFP4 (OCP microscaling FP4): 32 E2M1 values with one E8M0 exponent e. ggml
// keeps the E2M1 values doubled (kMxfp4Values) and halves the scale: x =
// 2^(e - 128) * kMxfp4Values[q], nibbles in q4_0's order.
struct BlockMXFP4 {
  uint8_t e;
  uint8_t qs[16];
};
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// ggml's E8M0 "half" scale 2^(e - 128) as bf16 bits (exact for every e: 2^-128
// and 2^-127 are bf16 subnormals; e = 255, NaN in the OCP format, reads as 2^127
// as in ggml).
constexpr uint16_t mxfp4_scale_bf16(uint8_t e) {
  return e < 2 ? static_cast<uint16_t>(0x0020u << e) : static_cast<uint16_t>((e - 1u) << 7);
}
// NVFP4 (NVIDIA's FP4): 64 E2M1 values in 4 sub-blocks of 16, each with an
// unsigned E4M3 scale (bias 7, no sign; ggml reads 0x7f, E4M3's NaN, as 0 and
// halves the scale as for MXFP4). Sub-block s: byte qs[8s + j] holds element j
// in its low nibble and element j + 8 in its high one.
struct BlockNVFP4 {
  uint8_t d[4];
  uint8_t qs[32];
};
constexpr int QK_NVFP4 = 64;
constexpr int QK_NVFP4_SUB = 16;
// ggml's UE4M3 "half" scale as f16 bits, exact for every byte: (8 + m) 2^(e - 11)
// for e = 1..15, m 2^-10 for e = 0 (bit 7 ignored, as in ggml; 0x7f reads 0).
// Every value has at most 4 significant bits between 2^-10 and 240: an f16
// normal (exponent e + 7 in f16's bias of 15, mantissa m << 7).
constexpr uint16_t nvfp4_scale_f16(uint8_t x) {
  if (x == 0x7f) return 0;
  const unsigned e = (x >> 3) & 15u, m = x & 7u;
  if (e != 0) return static_cast<uint16_t>((e + 7u) << 10 | m << 7);
  if (m == 0) return 0;
  // m 2^-10: m = 2^k (1 + f): exponent k - 10 + 15, the bits below the leading one.
  const unsigned k = m >= 4 ? 2u : m >= 2 ? 1u : 0u;
  return static_cast<uint16_t>((k + 5u) << 10 | ((m << (10 - k)) & 0x3ffu));
}
// The same f16 in one byte: its bits >> 7 (no sign, and the 7 low mantissa bits
// of every such f16 are zero: at most 3 mantissa bits below the leading one),
// for the matmul panels; the kernels shift the byte back left by 7.
constexpr uint8_t nvfp4_scale_code(uint8_t x) { return static_cast<uint8_t>(nvfp4_scale_f16(x) >> 7); }
constexpr bool nvfp4_scale_codes_exact() {
  for (int x = 0; x < 256; ++x)
    if ((nvfp4_scale_f16(static_cast<uint8_t>(x)) & 0x807f) != 0 ||
        nvfp4_scale_f16(static_cast<uint8_t>(x)) >> 7 > 255)
      return false;
  return true;
}
static_assert(nvfp4_scale_codes_exact());
static_assert(sizeof(BlockQ1_0) == 18 && sizeof(BlockQ2_0) == 18 && sizeof(BlockMXFP4) == 17 &&
              sizeof(BlockNVFP4) == 36);

static_assert(sizeof(BlockTQ1_0) == 54);
static_assert(sizeof(BlockTQ2_0) == 66);
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockIQ1_S) == 50);
static_assert(sizeof(BlockIQ1_M) == 56);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);
static_assert(sizeof(BlockIQ4_NL) == 18);
static_assert(sizeof(BlockIQ4_XS) == 136);
static_assert(sizeof(BlockIQ2_XXS) == 66);
static_assert(sizeof(BlockIQ2_XS) == 74);
static_assert(sizeof(BlockIQ2_S) == 82);
static_assert(sizeof(BlockIQ3_XXS) == 98);
static_assert(sizeof(BlockIQ3_S) == 110);

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

// The grid types' constants: weights per grid entry, weights per scale, f.
struct IqGridTraits {
  int per_entry;
  int scale_group;
  float factor;
};
constexpr bool is_iq1(DType t) { return t == DType::iq1_s || t == DType::iq1_m; }
constexpr bool is_iq_grid(DType t) {
  return t == DType::iq2_xxs || t == DType::iq2_xs || t == DType::iq2_s || t == DType::iq3_xxs ||
         t == DType::iq3_s || is_iq1(t);
}
constexpr IqGridTraits iq_grid_traits(DType t) {
  switch (t) {
    case DType::iq2_xxs:
      return {8, 32, 0.125f};
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq1_m:
      return {8, 16, 0.125f};
    case DType::iq1_s:
      return {8, 32, 0.125f};
    case DType::iq3_xxs:
      return {4, 32, 0.25f};
    default:  // iq3_s
      return {4, 32, 1.0f};
  }
}

// A grid superblock decoded: x_i = d * factor * scale[i / 16] * (sign bit i ? -1 : 1)
// * byte (i % per_entry) of the grid entry index[i / per_entry]; IQ1: no signs,
// x_i = d * factor * scale[i / 16] * (8 * that byte + (delta_neg bit i / 8 ? -1 : 1)).
struct IqGridSuperblock {
  uint16_t d;          // f16
  uint16_t index[64];  // (IQ1, IQ2: the first 32)
  uint8_t sign[32];    // bit j of byte i: weight 8i + j
  uint8_t scale[16];   // 2s + 1 of weights 16j .. 16j + 15
  uint32_t delta_neg;  // IQ1: bit e = entry e's shift is -1/8
};

// The 8 signs of 7 stored sign bits: the 8th makes the number of negatives even.
inline uint8_t iq_ksigns(uint32_t bits7) {
  const uint32_t b = bits7 & 0x7f;
  return static_cast<uint8_t>(b | ((__builtin_popcount(b) & 1) << 7));
}

// The grid of a grid type (for gathers: entries of 8 bytes for IQ2, 4 for IQ3).
constexpr const void* iq_grid_table(DType t) {
  switch (t) {
    case DType::iq2_xxs:
      return kIq2xxsGrid;
    case DType::iq2_xs:
      return kIq2xsGrid;
    case DType::iq2_s:
      return kIq2sGrid;
    case DType::iq3_xxs:
      return kIq3xxsGrid;
    case DType::iq1_s:
    case DType::iq1_m:
      return kIq1sGrid;
    default:  // iq3_s
      return kIq3sGrid;
  }
}

// The grid of a grid type as its constexpr array (compile-time tables and bounds).
template <DType kT>
constexpr const auto& iq_grid() {
  static_assert(is_iq_grid(kT));
  if constexpr (kT == DType::iq2_xxs) return kIq2xxsGrid;
  if constexpr (kT == DType::iq2_xs) return kIq2xsGrid;
  if constexpr (kT == DType::iq2_s) return kIq2sGrid;
  if constexpr (kT == DType::iq3_xxs) return kIq3xxsGrid;
  if constexpr (kT == DType::iq3_s) return kIq3sGrid;
  if constexpr (is_iq1(kT)) return kIq1sGrid;
}

// The magnitudes a grid's entries take, ascending, found in the grid itself:
// iq3_s 1, 3, .., 15; iq3_xxs 4, 12, .., 52, 62; iq2 8, 25, 43.
struct IqGridLevels {
  uint8_t v[9];  // (room for a ninth, which the assert below refuses)
  int n;
  constexpr int max() const { return v[n - 1]; }
};
template <DType kT>
constexpr IqGridLevels iq_grid_levels() {
  static_assert(!is_iq1(kT));  // (IQ1's bytes are signed: iq_weight_max)
  IqGridLevels l{};
  for (const auto entry : iq_grid<kT>())
    for (size_t j = 0; j < sizeof(entry); ++j) {
      const auto v = static_cast<uint8_t>(entry >> (8 * j));
      int at = 0;
      while (at < l.n && l.v[at] < v) ++at;
      if (at < l.n && l.v[at] == v) continue;
      for (int k = l.n; k > at; --k) l.v[k] = l.v[k - 1];
      l.v[at] = v;
      ++l.n;
    }
  return l;
}

// The largest |v| of a grid type's integer weights (v of d * f * scale * v).
template <DType kT>
constexpr int iq_weight_max() {
  if constexpr (is_iq1(kT))
    return 9;
  else
    return iq_grid_levels<kT>().max();
}

// IQ1's grid with the shift folded in: each byte 8g + 1 (int8), so an entry's
// integer values are these, less 2 where its delta is negative.
struct Iq1Values {
  alignas(64) uint64_t entry[2048];
};
constexpr Iq1Values make_iq1_values() {
  Iq1Values t{};
  for (int i = 0; i < 2048; ++i)
    for (int j = 0; j < 8; ++j) {
      const auto g = static_cast<int8_t>(static_cast<uint8_t>(kIq1sGrid[i] >> (8 * j)));
      t.entry[i] |= static_cast<uint64_t>(static_cast<uint8_t>(8 * g + 1)) << (8 * j);
    }
  return t;
}
inline constexpr Iq1Values kIq1Values = make_iq1_values();

// Magnitude of weight j of grid entry `index` (an entry's values are its bytes
// in memory order: iq_grids.h; IQ1: the byte of g, -1 as 255).
inline int iq_grid_value(DType t, uint32_t index, int j) {
  const auto* grid = static_cast<const uint8_t*>(iq_grid_table(t));
  return grid[static_cast<size_t>(index) * iq_grid_traits(t).per_entry + j];
}

inline uint32_t load_u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IQ1_M's f16 d is the top nibbles of its four u16 scales (bits 4i..4i+3 in u16 i).
inline void set_iq1_m_d(uint8_t* blk, uint16_t d) {
  for (int i = 0; i < 4; ++i)
    blk[49 + 2 * i] = static_cast<uint8_t>((blk[49 + 2 * i] & 0x0f) | (((d >> (4 * i)) & 15) << 4));
}

inline IqGridSuperblock decode_iq1_m(const uint8_t* blk) {
  IqGridSuperblock o{};
  uint16_t sc[4];
  std::memcpy(sc, blk + 48, 8);
  o.d = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                              (sc[3] & 0xf000));
  for (int e = 0; e < 32; ++e) {
    const unsigned nib = (blk[32 + e / 2] >> (4 * (e % 2))) & 15;
    o.index[e] = static_cast<uint16_t>(blk[e] | ((nib & 7) << 8));
    o.delta_neg |= static_cast<uint32_t>(nib >> 3) << e;
  }
  for (int j = 0; j < 16; ++j) o.scale[j] = static_cast<uint8_t>(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1);
  return o;
}

// Decodes one superblock of a grid type (blk at any alignment).
inline IqGridSuperblock decode_iq_grid(DType t, const uint8_t* blk) {
  IqGridSuperblock o{};
  if (t == DType::iq1_m) return decode_iq1_m(blk);
  std::memcpy(&o.d, blk, 2);
  const uint8_t* q = blk + 2;
  switch (t) {
    case DType::iq1_s:
      for (int j = 0; j < 8; ++j) {
        const uint32_t qh = q[32 + 2 * j] | (static_cast<uint32_t>(q[33 + 2 * j]) << 8);
        for (int l = 0; l < 4; ++l)
          o.index[4 * j + l] = static_cast<uint16_t>(q[4 * j + l] | (((qh >> (3 * l)) & 7) << 8));
        o.delta_neg |= ((qh >> 15) & 1) * (0xfu << (4 * j));
        o.scale[2 * j] = o.scale[2 * j + 1] = static_cast<uint8_t>(2 * ((qh >> 12) & 7) + 1);
      }
      break;
    case DType::iq2_xxs:
      for (int j = 0; j < 8; ++j) {
        const uint32_t idx = load_u32_at(q + 8 * j), aux = load_u32_at(q + 8 * j + 4);
        for (int l = 0; l < 4; ++l) {
          o.index[4 * j + l] = static_cast<uint16_t>((idx >> (8 * l)) & 0xff);
          o.sign[4 * j + l] = iq_ksigns(aux >> (7 * l));
        }
        o.scale[2 * j] = o.scale[2 * j + 1] = static_cast<uint8_t>(2 * (aux >> 28) + 1);
      }
      break;
    case DType::iq2_xs:
      for (int e = 0; e < 32; ++e) {
        const uint32_t v = q[2 * e] | (static_cast<uint32_t>(q[2 * e + 1]) << 8);
        o.index[e] = static_cast<uint16_t>(v & 511);
        o.sign[e] = iq_ksigns(v >> 9);
      }
      for (int j = 0; j < 16; ++j)
        o.scale[j] = static_cast<uint8_t>(2 * ((q[64 + j / 2] >> (4 * (j % 2))) & 15) + 1);
      break;
    case DType::iq2_s:
      for (int e = 0; e < 32; ++e) {
        o.index[e] = static_cast<uint16_t>(q[e] | (((q[64 + e / 4] >> (2 * (e % 4))) & 3) << 8));
        o.sign[e] = q[32 + e];
      }
      for (int j = 0; j < 16; ++j)
        o.scale[j] = static_cast<uint8_t>(2 * ((q[72 + j / 2] >> (4 * (j % 2))) & 15) + 1);
      break;
    case DType::iq3_xxs:
      for (int e = 0; e < 64; ++e) o.index[e] = q[e];
      for (int j = 0; j < 8; ++j) {
        const uint32_t aux = load_u32_at(q + 64 + 4 * j);
        for (int l = 0; l < 4; ++l) o.sign[4 * j + l] = iq_ksigns(aux >> (7 * l));
        o.scale[2 * j] = o.scale[2 * j + 1] = static_cast<uint8_t>(2 * (aux >> 28) + 1);
      }
      break;
    default:  // iq3_s
      for (int e = 0; e < 64; ++e)
        o.index[e] = static_cast<uint16_t>(q[e] | (((q[64 + e / 8] >> (e % 8)) & 1) << 8));
      std::memcpy(o.sign, q + 72, 32);
      for (int j = 0; j < 8; ++j)
        o.scale[2 * j] = o.scale[2 * j + 1] =
            static_cast<uint8_t>(2 * ((q[104 + j / 2] >> (4 * (j % 2))) & 15) + 1);
      break;
  }
  return o;
}

// Signed integer value (sign * magnitude) of weight i of a decoded superblock.
inline int iq_grid_weight(DType t, const IqGridSuperblock& b, int i) {
  if (is_iq1(t)) {
    const int g = static_cast<int8_t>(static_cast<uint8_t>(iq_grid_value(t, b.index[i / 8], i % 8)));
    return 8 * g + (((b.delta_neg >> (i / 8)) & 1) ? -1 : 1);
  }
  const int per = iq_grid_traits(t).per_entry;
  const int v = iq_grid_value(t, b.index[i / per], i % per);
  return ((b.sign[i / 8] >> (i % 8)) & 1) ? -v : v;
}

// Dequantizes nb superblocks of a grid type: d * factor * scale * signed value,
// every product exact in f32 (at most 11 + 5 + 6 significant bits), so in any
// order the floats of ggml and gguf-py. Scalar: these types are read by the
// matmul kernels from their panels; this serves embeddings and checks.
inline void dequantize_iq_grid(DType t, const void* src, float* y, int64_t nb) {
  const size_t bb = dtype_traits(t).block_bytes;
  const float f = iq_grid_traits(t).factor;
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const IqGridSuperblock b =
        decode_iq_grid(t, static_cast<const uint8_t*>(src) + static_cast<size_t>(i) * bb);
    const float d = fp16_to_fp32(b.d) * f;
    for (int w = 0; w < QK_K; ++w)
      y[w] = d * static_cast<float>(b.scale[w / 16]) * static_cast<float>(iq_grid_weight(t, b, w));
  }
}

// Q1_0 and Q2_0 are q4_0 with the same d and codes c = x / d + 8 (Q1_0 9 or 7,
// Q2_0 q + 7): the matmul packs Q2_0 as q4_0 panels (cpu/panel.h), exactly.
constexpr bool is_low_bit(DType t) { return t == DType::q1_0 || t == DType::q2_0; }

// The q4_0 codes of a Q1_0 (128) or Q2_0 (64) block's elements, in order.
inline void low_bit_codes(DType t, const uint8_t* blk, uint8_t* code) {
  const uint8_t* qs = blk + 2;
  if (t == DType::q1_0) {
    for (int e = 0; e < QK1_0; ++e) code[e] = ((qs[e / 8] >> (e % 8)) & 1) ? 9 : 7;
  } else {
    for (int e = 0; e < QK2_0; ++e) code[e] = static_cast<uint8_t>(((qs[e / 4] >> (2 * (e % 4))) & 3) + 7);
  }
}

// Dequantizes nb Q1_0 / Q2_0 blocks as ggml does: +-d, (q - 1) d.
inline void dequantize_low_bit(DType t, const void* src, float* y, int64_t nb) {
  const int n = t == DType::q1_0 ? QK1_0 : QK2_0;
  for (int64_t i = 0; i < nb; ++i, y += n) {
    const auto* blk = static_cast<const uint8_t*>(src) + static_cast<size_t>(i) * dtype_traits(t).block_bytes;
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    const float d = fp16_to_fp32(dh);
    uint8_t code[QK1_0];
    low_bit_codes(t, blk, code);
    for (int e = 0; e < n; ++e) y[e] = static_cast<float>(static_cast<int>(code[e]) - 8) * d;
  }
}

// Dequantizes nb MXFP4 blocks as ggml does.
inline void dequantize_mxfp4(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto b = load_unaligned<BlockMXFP4>(src, i);
    const float d = bf16_to_fp32(mxfp4_scale_bf16(b.e));
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(kMxfp4Values[b.qs[j] & 0x0f]);
      y[j + 16] = d * static_cast<float>(kMxfp4Values[b.qs[j] >> 4]);
    }
  }
}

// Dequantizes nb NVFP4 blocks as ggml does.
inline void dequantize_nvfp4(const void* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_unaligned<BlockNVFP4>(src, i);
    for (int s = 0; s < 4; ++s, y += QK_NVFP4_SUB) {
      const float d = fp16_to_fp32(nvfp4_scale_f16(b.d[s]));
      for (int j = 0; j < 8; ++j) {
        y[j] = d * static_cast<float>(kMxfp4Values[b.qs[8 * s + j] & 0x0f]);
        y[j + 8] = d * static_cast<float>(kMxfp4Values[b.qs[8 * s + j] >> 4]);
      }
    }
  }
}

constexpr bool is_ternary(DType t) { return t == DType::tq1_0 || t == DType::tq2_0; }

// The trits t of a TQ1_0 or TQ2_0 block, element by element.
inline void ternary_trits(DType t, const uint8_t* blk, uint8_t (&trit)[QK_K]) {
  if (t == DType::tq2_0) {
    for (int e = 0; e < QK_K; ++e) trit[e] = (blk[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
    return;
  }
  constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
  const auto trit_of = [&](uint8_t q, int n) {
    return static_cast<uint8_t>((static_cast<uint8_t>(q * kPow3[n]) * 3) >> 8);
  };
  for (int e = 0; e < 160; ++e) trit[e] = trit_of(blk[e % 32], e / 32);
  for (int e = 160; e < 240; ++e) trit[e] = trit_of(blk[32 + (e - 160) % 16], (e - 160) / 16);
  for (int e = 240; e < QK_K; ++e) trit[e] = trit_of(blk[48 + (e - 240) % 4], (e - 240) / 4);
}

// Dequantizes nb ternary blocks as ggml does: d * (t - 1).
inline void dequantize_ternary(DType t, const void* src, float* y, int64_t nb) {
  const size_t bb = dtype_traits(t).block_bytes;
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    const auto* blk = static_cast<const uint8_t*>(src) + static_cast<size_t>(i) * bb;
    uint16_t dh;
    std::memcpy(&dh, blk + bb - 2, 2);
    const float d = fp16_to_fp32(dh);
    uint8_t trit[QK_K];
    ternary_trits(t, blk, trit);
    for (int e = 0; e < QK_K; ++e) y[e] = static_cast<float>(static_cast<int>(trit[e]) - 1) * d;
  }
}
}  // namespace

}  // namespace loom
