// AVX-512 (F/BW/VL/VNNI) panel kernels: one zmm lane per weight row, integer
// block dots with vpdpbusd (u8 weights x s8 activations), f32 accumulation in a
// fixed per-lane order shared with the AVX2 kernels (see kernels/cpu/matmul.h).
// The body of two files: panel_kernels_avx512.cpp, and panel_kernels_avx512_vbmi.cpp
// (built with AVX512-VBMI too), whose grid types look their codes up with byte
// permutes (__AVX512VBMI__ below). Everything here is local to the including file.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (and, in the VBMI byte
// permutes, -Wuninitialized) on their own _mm512_undefined_* helpers (a known
// false positive).
#pragma once
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <array>
#include <cstring>
#include <iterator>
#include <type_traits>

#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/mxcsr.h"
#include "kernels/cpu/nf4.h"
#include "kernels/cpu/panel.h"
#include "kernels/cpu/panel_kernels.h"
#include "kernels/quant_blocks.h"

namespace loom::cpu {
namespace {

// Decode prefetch distance of this kernel family (panel_kernels.h).
constexpr size_t kAhead = kPrefetchBytesAvx512;

inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m512 load_f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_rows(float* y, __m512 v, int64_t nv) {
  if (nv >= 16)
    _mm512_storeu_ps(y, v);
  else if (nv > 0)
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << nv) - 1), v);
}

template <int P, int C>
inline void store_tile(const TileArgs& ta, __m512 (&acc)[P][C]) {
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < P; ++p) store_rows(ta.y + c * ta.ldy + p * 16, acc[p][c], ta.nv - p * 16);
}

template <int P, int C>
inline void zero_tile(__m512 (&acc)[P][C]) {
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < C; ++c) acc[p][c] = _mm512_setzero_ps();
}

// The float sums of a tile in memory (L1) rather than registers: the k-quant
// batch tiles update them once per superblock, and their registers go to the
// integer sums of 8 tokens next to the unpacked weights and the 8 dot products.
template <int P, int C>
struct MemAcc {
  alignas(64) float v[P][C][16];
  MemAcc() {
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < C; ++c) _mm512_store_ps(v[p][c], _mm512_setzero_ps());
  }
  __m512 get(int p, int c) const { return _mm512_load_ps(v[p][c]); }
  void set(int p, int c, __m512 a) { _mm512_store_ps(v[p][c], a); }
  void store(const TileArgs& ta) const {
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < P; ++p) store_rows(ta.y + c * ta.ldy + p * 16, get(p, c), ta.nv - p * 16);
  }
};

// imm8 for vpternlogd computing A | (B & C).
constexpr int kOrAnd = 0xF8;

// ops[o] (o < 8) = u8 values of elements 4o..4o+3 of a nibble group, 16 rows.
inline void unpack_nibbles(const uint8_t* p, __m512i (&ops)[8]) {
  const __m512i m = _mm512_set1_epi8(0x0f);
  for (int o = 0; o < 4; ++o) {
    const __m512i w = load512(p + 64 * o);
    ops[o] = _mm512_and_si512(w, m);
    ops[o + 4] = _mm512_and_si512(_mm512_srli_epi32(w, 4), m);
  }
}

// iq4_nl / iq4_xs / mxfp4: the nibbles of ops (codebook indices) become their
// values + bias as u8 (vpshufb on the codebook; the offset leaves the act rows' sums).
inline void lookup_iq4_u8(__m512i (&ops)[8], const int8_t* codebook = kIq4Values, int bias = 128) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook)), _mm_set1_epi8(static_cast<char>(bias))));
  for (int o = 0; o < 8; ++o) ops[o] = _mm512_shuffle_epi8(table, ops[o]);
}

// The 16 rows' scales of a 32-element panel block: f16, bf16 (kBf16Scale), or
// an f16's bits >> 7 in a byte (kU8Scale).
template <class L>
inline __m512 load_scales16(const uint8_t* p) {
  if constexpr (L::kU8Scale)
    return _mm512_cvtph_ps(
        _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7));
  else if constexpr (L::kBf16Scale)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  else
    return load_f16x16(p);
}

// Grid types (iq2_xxs .. iq3_s, panel.h IqGridPanel). Each grid entry's values
// take 3 (iq2) or 8 (iq3) levels, so an entry is a 16-bit code of level numbers:
// iq3 one per nibble (4 values), iq2 one per 2 bits (8 values, two per nibble).
// The codes of 32 entries are looked up at once from registers (vpermt2w: 64
// codes per table pair, then a blend per index bit above 6), their nibbles
// spread to bytes and mapped to levels by vpshufb. vpgatherdd on the grid itself
// took ~20 cycles per 16 lanes on an AMD Zen 4 (decode 2.5-6 GB/s, 2.1x slower
// than this); gathers are slow on Intel cores too since the GDS microcode fix.
template <DType kT>
struct GridCodes {
  static constexpr bool kIq3 = kT == DType::iq3_xxs || kT == DType::iq3_s;
  static constexpr int kBits = kIq3 ? 4 : 2, kValues = kIq3 ? 4 : 8;
  static constexpr int kSize = static_cast<int>(std::size(iq_grid<kT>()));
  static constexpr uint64_t entry(int i) { return iq_grid<kT>()[i]; }
  static constexpr IqGridLevels kLevelSet = iq_grid_levels<kT>();
  static_assert(kLevelSet.n == (kIq3 ? 8 : 3));
  static constexpr const uint8_t* kLevels = kLevelSet.v;
  struct Table {
    alignas(64) uint16_t code[kSize];
  };
  static constexpr Table make() {
    Table t{};
    for (int i = 0; i < kSize; ++i)
      for (int j = 0; j < kValues; ++j) {
        const auto v = static_cast<uint8_t>(entry(i) >> (8 * j));
        int level = 0;
        while (kLevels[level] != v) ++level;  // (every grid value is a level)
        t.code[i] |= static_cast<uint16_t>(level << (kBits * j));
      }
    return t;
  }
  static constexpr Table kTable = make();
  // vpshufb tables: a nibble's level (iq3), or the level of its low / high 2 bits (iq2).
  struct Shuffle {
    alignas(16) uint8_t t[16];
  };
  static constexpr Shuffle make_shuffle(int which) {
    Shuffle s{};
    for (int n = 0; n < 16; ++n) {
      const int level = kIq3 ? n : which == 0 ? (n & 3) : (n >> 2);
      s.t[n] = level < (kIq3 ? 8 : 3) ? kLevels[level] : 0;
    }
    return s;
  }
  static constexpr Shuffle kShuffle[2] = {make_shuffle(0), make_shuffle(1)};
  static __m512i table(int which) {
    return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kShuffle[which].t)));
  }
};

// Codes of the 32 entries whose indices are the words of idx.
template <DType kT>
inline __m512i lookup_codes(__m512i idx) {
  using G = GridCodes<kT>;
  constexpr int kPairs = G::kSize / 64;
  const auto* table = reinterpret_cast<const __m512i*>(G::kTable.code);
  __m512i r[kPairs];
  for (int p = 0; p < kPairs; ++p)
    r[p] = _mm512_permutex2var_epi16(_mm512_load_si512(table + 2 * p), idx,
                                     _mm512_load_si512(table + 2 * p + 1));
  int n = kPairs;
  for (int bit = 6; n > 1; ++bit, n /= 2) {
    const __mmask32 k = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(static_cast<short>(1 << bit)));
    for (int i = 0; i < n / 2; ++i) r[i] = _mm512_mask_mov_epi16(r[2 * i], k, r[2 * i + 1]);
  }
  return r[0];
}

// ops[o] = 128 + v, or 128 - v where the group's sign mask of operand o has a bit.
template <DType kT>
inline void apply_grid_signs(const uint8_t* gp, __m512i (&ops)[8]) {
  constexpr IqGridPanel L = iq_grid_panel(kT);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int o = 0; o < 8; ++o) {
    uint64_t sign;
    std::memcpy(&sign, gp + L.signs + 8 * o, 8);
    ops[o] = _mm512_mask_sub_epi8(_mm512_or_si512(ops[o], bias), _cvtu64_mask64(sign), bias, ops[o]);
  }
}

#if defined(__AVX512VBMI__)
// With VBMI (panel_kernels_avx512_vbmi.cpp) the codes come from two byte tables,
// lo = code bits 0..7 (iq3: the levels of values 0 and 1, a nibble each; iq2: of
// values 0..3, 2 bits each), hi = bits 8..15: vpermi2b looks up 64 entries per
// table pair (128 entries), a blend per index bit above 6. One byte permute then
// gathers two entries' codes per qword and vpmultishiftqb cuts them into the
// bytes of their operands. About half the instructions of the word tables' path
// below, which Cascade Lake (VNNI without VBMI) keeps.
template <DType kT>
struct GridCodeBytes {
  using G = GridCodes<kT>;
  static_assert(G::kSize % 128 == 0);
  static constexpr int kPairs = G::kSize / 128;  // 2, 4 or 8 table pairs per byte
  struct Table {
    alignas(64) uint8_t b[2][G::kSize];
  };
  static constexpr Table make() {
    Table t{};
    for (int i = 0; i < G::kSize; ++i) {
      t.b[0][i] = static_cast<uint8_t>(G::kTable.code[i]);
      t.b[1][i] = static_cast<uint8_t>(G::kTable.code[i] >> 8);
    }
    return t;
  }
  static constexpr Table kTable = make();
  // The pair permutes: entries (2s, 2s + 1) of 4 (a, b), rows 2j and 2j + 1 in
  // qword j. iq3 (an entry per operand): a's rows each as lo, hi, then b's, so
  // nibble n of the qword's low (high) half is value n % 4 of row 2j + n / 4 of a
  // (b). iq2 (an entry per operand pair): a's lo of both rows, a's hi of both
  // rows, then b's, so crumb n of each 16 bits is a value of one operand.
  // Byte 16e + r of the lo bytes is entry e, row r; the hi bytes' are 64 on.
  struct Pairs {
    alignas(64) uint8_t v[2][64];
  };
  static constexpr Pairs make_pairs() {
    Pairs t{};
    for (int s = 0; s < 2; ++s)
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 2; ++e)
          for (int r = 0; r < 2; ++r)
            for (int hi = 0; hi < 2; ++hi)
              t.v[s][8 * j + 4 * e + (G::kIq3 ? 2 * r + hi : 2 * hi + r)] =
                  static_cast<uint8_t>(64 * hi + 16 * (2 * s + e) + 2 * j + r);
    return t;
  }
  static constexpr Pairs kPairBytes = make_pairs();
};

// Code bytes (which: 0 lo, 1 hi) of the 64 entries whose index bits 0..7 are
// idx's bytes, bits 8 and 9 in k8 and k9.
template <DType kT>
inline __m512i lookup_code_bytes(int which, __m512i idx, __mmask64 k8, __mmask64 k9) {
  constexpr int kPairs = GridCodeBytes<kT>::kPairs;
  const auto* t = reinterpret_cast<const __m512i*>(GridCodeBytes<kT>::kTable.b[which]);
  __m512i r[kPairs];
  for (int p = 0; p < kPairs; ++p)
    r[p] = _mm512_permutex2var_epi8(_mm512_load_si512(t + 2 * p), idx, _mm512_load_si512(t + 2 * p + 1));
  const __mmask64 k[3] = {_mm512_movepi8_mask(idx), k8, k9};
  for (int n = kPairs, bit = 0; n > 1; n /= 2, ++bit)
    for (int i = 0; i < n / 2; ++i) r[i] = _mm512_mask_mov_epi8(r[2 * i], k[bit], r[2 * i + 1]);
  return r[0];
}

// The level numbers of a group's values (iq3: a nibble per byte, bit 7 clear as
// vpshufb wants; iq2: a crumb in bits 0..1 of each byte, the rest garbage),
// operand by operand as unpack_iq_grid lays them out.
template <DType kT>
inline void grid_levels_vbmi(const uint8_t* gp, __m512i (&ops)[8]) {
  using B = GridCodeBytes<kT>;
  constexpr IqGridPanel L = iq_grid_panel(kT);
  const auto* pairs = reinterpret_cast<const __m512i*>(B::kPairBytes.v);
  const __m512i pair[2] = {_mm512_load_si512(pairs), _mm512_load_si512(pairs + 1)};
  // vpmultishiftqb controls: bit offsets of the fields of each operand's bytes.
  constexpr uint64_t kStep = B::G::kIq3 ? 4 : 2;
  constexpr auto cut = [](uint64_t first) {
    uint64_t c = 0;
    for (int n = 0; n < 8; ++n) c |= (first + kStep * static_cast<uint64_t>(n)) << (8 * n);
    return static_cast<long long>(c);
  };
  for (int h = 0; h < L.entries / 4; ++h) {  // entries 4h .. 4h + 3: 64 indices
    const __m512i idx = load512(gp + 64 * h);
    uint64_t plane[2] = {0, 0};
    for (int p = 0; p < L.hi_planes; ++p) std::memcpy(&plane[p], gp + L.hi + 2 * (p * L.entries + 4 * h), 8);
    const __mmask64 k8 = _cvtu64_mask64(plane[0]), k9 = _cvtu64_mask64(plane[1]);
    const __m512i lo = lookup_code_bytes<kT>(0, idx, k8, k9), hi = lookup_code_bytes<kT>(1, idx, k8, k9);
    for (int s = 0; s < 2; ++s) {
      const __m512i q = _mm512_permutex2var_epi8(lo, pair[s], hi);
      if constexpr (B::G::kIq3) {
        ops[4 * h + 2 * s] = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(cut(0)), q);
        ops[4 * h + 2 * s + 1] = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(cut(32)), q);
      } else {
        for (int o = 0; o < 4; ++o)
          ops[4 * s + o] = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(cut(16 * o)), q);
      }
    }
  }
}
#endif

// ops[o] = 128 + the signed grid values of a group of 32 (16 rows), negated where
// the operand's sign mask has a bit (128 - v under a byte mask).
template <DType kT>
inline void unpack_iq_grid(const uint8_t* gp, __m512i (&ops)[8]) {
  using G = GridCodes<kT>;
#if defined(__AVX512VBMI__)
  grid_levels_vbmi<kT>(gp, ops);
  if constexpr (G::kIq3) {
    const __m512i levels = G::table(0);
    for (int o = 0; o < 8; ++o) ops[o] = _mm512_shuffle_epi8(levels, ops[o]);
  } else {  // vpermb reads bits 0..5: a 64-byte table of each crumb's level
    alignas(64) static constexpr auto kCrumbLevels = [] {
      std::array<uint8_t, 64> t{};
      for (int n = 0; n < 64; ++n) t[n] = (n & 3) < 3 ? G::kLevels[n & 3] : 0;
      return t;
    }();
    const __m512i levels = _mm512_load_si512(kCrumbLevels.data());
    for (int o = 0; o < 8; ++o) ops[o] = _mm512_permutexvar_epi8(ops[o], levels);
  }
  return apply_grid_signs<kT>(gp, ops);
#else
  constexpr IqGridPanel L = iq_grid_panel(kT);
  const __m512i nib = _mm512_set1_epi16(0x0f0f);
  for (int e = 0; e < L.entries; e += 2) {  // entries e and e + 1: 32 words
    __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 16 * e)));
    for (int h = 0; h < L.hi_planes; ++h) {
      uint32_t bits;
      std::memcpy(&bits, gp + L.hi + 2 * (h * L.entries + e), 4);
      // (bit 8 + h is clear: the add sets it)
      idx = _mm512_mask_add_epi16(idx, _cvtu32_mask32(bits), idx,
                                  _mm512_set1_epi16(static_cast<short>(256 << h)));
    }
    // Rows 4q..4q+3 of entry e, then of entry e + 1, per 128-bit lane: the
    // in-lane byte unpacks below then give whole operands in row order.
    idx = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), idx);
    const __m512i codes = lookup_codes<kT>(idx);
    const __m512i lo = _mm512_and_si512(codes, nib), hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nib);
    // dword r of a: entry e, row r, its 4 nibbles in order (b: entry e + 1).
    const __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
    if constexpr (G::kIq3) {  // an entry (4 values, a nibble each) per operand
      const __m512i levels = G::table(0);
      ops[e] = _mm512_shuffle_epi8(levels, a);
      ops[e + 1] = _mm512_shuffle_epi8(levels, b);
    } else {  // an entry (8 values, two per nibble) per operand pair
      const __m512i first = G::table(0), second = G::table(1);
      const __m512i even = _mm512_setr_epi32(0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      const __m512i* src[2] = {&a, &b};
      for (int s = 0; s < 2; ++s) {
        const __m512i x0 = _mm512_shuffle_epi8(first, *src[s]), x1 = _mm512_shuffle_epi8(second, *src[s]);
        // qwords: a row's 8 values; u rows 4q, 4q + 1 and v rows 4q + 2, 4q + 3 of lane q.
        const __m512i u = _mm512_unpacklo_epi8(x0, x1), v = _mm512_unpackhi_epi8(x0, x1);
        ops[2 * e + 2 * s] = _mm512_permutex2var_epi32(u, even, v);
        ops[2 * e + 2 * s + 1] = _mm512_permutex2var_epi32(u, odd, v);
      }
    }
  }
  apply_grid_signs<kT>(gp, ops);
#endif
}

// IQ1 (iq1_s, iq1_m; panel.h IqGridPanel): ops[o] = 128 + the integer values 8g +- 1
// of a group of 32 (16 rows). Each entry's 8 bytes (kIq1Values: 8g + 1) come whole
// from vpgatherdq, 8 rows a gather, less 2 in the rows whose delta is negative;
// entry e's low and high dwords are operands 2e and 2e + 1. IQ1's 2048 entries
// (16 KiB) are too many for the register tables of the other grid types.
inline void unpack_iq1(const uint8_t* gp, __m512i (&ops)[8]) {
  constexpr IqGridPanel L = iq_grid_panel(DType::iq1_s);
  const auto* table = reinterpret_cast<const long long*>(kIq1Values.entry);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i two = _mm512_set1_epi8(2), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int e = 0; e < 4; ++e) {
    const __m256i nibs =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp + L.hi + 8 * e)));
    __m512i half[2];
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
      const __m256i lo =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp + 16 * e + 8 * h)));
      const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi32(nibs, 4) : nibs, _mm256_set1_epi32(15));
      const __m256i idx =
          _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(7)), 8));
      const __mmask8 neg = _mm256_test_epi32_mask(nib, _mm256_set1_epi32(8));
      const __m512i q = _mm512_i32gather_epi64(idx, table, 8);
      half[h] = _mm512_mask_mov_epi64(q, neg, _mm512_sub_epi8(q, two));
    }
    ops[2 * e] = _mm512_xor_si512(_mm512_permutex2var_epi32(half[0], even, half[1]), bias);
    ops[2 * e + 1] = _mm512_xor_si512(_mm512_permutex2var_epi32(half[0], odd, half[1]), bias);
  }
}

// Adds bit 4 from a 5th-bit word (bit o of byte i belongs to operand o).
inline void add_bit4(const uint8_t* p, __m512i (&ops)[8]) {
  const __m512i h = load512(p), m = _mm512_set1_epi8(0x10);
  ops[0] = _mm512_ternarylogic_epi32(ops[0], _mm512_slli_epi32(h, 4), m, kOrAnd);
  ops[1] = _mm512_ternarylogic_epi32(ops[1], _mm512_slli_epi32(h, 3), m, kOrAnd);
  ops[2] = _mm512_ternarylogic_epi32(ops[2], _mm512_slli_epi32(h, 2), m, kOrAnd);
  ops[3] = _mm512_ternarylogic_epi32(ops[3], _mm512_slli_epi32(h, 1), m, kOrAnd);
  ops[4] = _mm512_ternarylogic_epi32(ops[4], h, m, kOrAnd);
  ops[5] = _mm512_ternarylogic_epi32(ops[5], _mm512_srli_epi32(h, 1), m, kOrAnd);
  ops[6] = _mm512_ternarylogic_epi32(ops[6], _mm512_srli_epi32(h, 2), m, kOrAnd);
  ops[7] = _mm512_ternarylogic_epi32(ops[7], _mm512_srli_epi32(h, 3), m, kOrAnd);
}

// Adds bits 4..5 from the two 2-bit words (q6_k).
inline void add_bits45(const uint8_t* p, __m512i (&ops)[8]) {
  const __m512i m = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m512i w = load512(p + 64 * h);
    ops[4 * h + 0] = _mm512_ternarylogic_epi32(ops[4 * h + 0], _mm512_slli_epi32(w, 4), m, kOrAnd);
    ops[4 * h + 1] = _mm512_ternarylogic_epi32(ops[4 * h + 1], _mm512_slli_epi32(w, 2), m, kOrAnd);
    ops[4 * h + 2] = _mm512_ternarylogic_epi32(ops[4 * h + 2], w, m, kOrAnd);
    ops[4 * h + 3] = _mm512_ternarylogic_epi32(ops[4 * h + 3], _mm512_srli_epi32(w, 2), m, kOrAnd);
  }
}

// acc += w . (x's 4 bytes in every lane): vpdpbusd with x as an embedded
// broadcast ({1to16}), one instruction. Written in asm because GCC and clang
// compile the intrinsics' form (_mm512_set1_epi32 of the 4 bytes) to a separate
// vpbroadcastd load, which on an Intel Emerald Rapids takes an ALU slot: 16
// independent chains ran 1.3-1.7 vpdpbusd per cycle so and 1.9 embedded, and
// the 8-token batch tiles of q4_k, q5_k and q8_0 10-24% faster (T = 512).
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(w), "m"(*reinterpret_cast<const std::array<int8_t, 4>*>(x)));
  return acc;
}

// sum over operands o in [O0, O1) of ops[o] . x[4o..4o+3], starting from `init`.
// kChains = 2 splits the dependency chain for latency when a tile has few
// independent outputs (integer adds are exact, so the order is free).
template <int O0, int O1, int kChains = 2>
inline __m512i idot(__m512i init, const __m512i (&ops)[8], const int8_t* x) {
  if constexpr (kChains == 1) {
    __m512i a = init;
    for (int o = O0; o < O1; ++o) a = _mm512_dpbusd_epi32(a, ops[o], bcast32(x + 4 * o));
    return a;
  } else {
    __m512i a0 = init, a1 = _mm512_setzero_si512();
    for (int o = O0; o < O1; o += 2) {
      a0 = _mm512_dpbusd_epi32(a0, ops[o], bcast32(x + 4 * o));
      a1 = _mm512_dpbusd_epi32(a1, ops[o + 1], bcast32(x + 4 * (o + 1)));
    }
    return _mm512_add_epi32(a0, a1);
  }
}

// Tiles of 4 or more outputs have enough independent chains to hide vpdpbusd's
// latency; fewer (decode) split each chain in two.
template <int P, int C>
constexpr int kChainsFor = P* C >= 4 ? 1 : 2;

// d[c] += sum over o in [O0, O1) of ops[o] . x[c][4o..4o+3] for the C tokens of
// a batch tile, token-interleaved: the C vpdpbusd of one operand are independent
// and sit next to each other, where one token after the other (idot) makes
// chains of 4-8 dependent vpdpbusd for the scheduler to overlap. With the
// token-outer tile order (panel_kernels.h) and 8-token tiles this ran q4_0,
// q4_k, q5_k and q8_0 T = 512 tiles 7-18% faster on an AMD Zen 4 than the
// per-token order (the k-quants then with 16-token tiles); a stand-alone loop of the
// q6_k group ran 1.3-1.7 G vpdpbusd/s per core per token, 2.4-2.7 interleaved.
// Integer sums are exact, so the order changes no result. Each token's 4 values
// are vpdpbusd's embedded-broadcast memory operand (dpbusd_bcast).
template <int O0, int O1, int C>
inline void idot_tokens(__m512i (&d)[C], const __m512i (&ops)[8], const int8_t* const (&x)[C]) {
#pragma GCC unroll 8
  for (int o = O0; o < O1; ++o)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) d[c] = dpbusd_bcast(d[c], ops[o], x[c] + 4 * o);
}

// The dots of a tile's C tokens: a decode tile (one token) splits its chain as
// kChainsFor says, a batch tile interleaves its tokens.
template <int O0, int O1, int P, int C>
inline void idot_tile(__m512i (&d)[C], const __m512i (&ops)[8], const int8_t* const (&x)[C]) {
  if constexpr (C == 1)
    d[0] = idot<O0, O1, kChainsFor<P, C>>(d[0], ops, x[0]);
  else
    idot_tokens<O0, O1>(d, ops, x);
}

// isc + d * sc per lane, exactly, without vpmulld (2 uops on Intel's port 0;
// with its add it cost the k-quant tiles about three vpdpbusd slots on an Emerald
// Rapids): with |d| < 2^23 (a group's or sub-block's dot: under 2^21) and sc an
// int8 (or a u8 below 128), d * sc = (d & 0xff) * sc + (d >> 8) * (sc * 256)
// with all four factors int16, so one vpshufb splits d into the words
// (d & 0xff, d >> 8) and one vpdpwssd multiplies them by the words (sc, sc * 256)
// of scale_words(sc) and adds. q6_k's batch tiles ran 9-11% faster so, q4_k's 5-7%.
// pack_words: per lane the int16 words (lo, hi) of two int32 vectors, vpdpwssd's pairs.
inline __m512i pack_words(__m512i lo, __m512i hi) {
  return _mm512_ternarylogic_epi32(_mm512_slli_epi32(hi, 16), lo, _mm512_set1_epi32(0xffff), kOrAnd);
}
inline __m512i scale_words(__m512i sc) { return pack_words(sc, _mm512_slli_epi32(sc, 8)); }
inline __m512i add_scaled(__m512i isc, __m512i d, __m512i sw) {
  const __m512i bytes_0_1_2 =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, -128, 1, 2, 4, -128, 5, 6, 8, -128, 9, 10, 12, -128, 13, 14));
  return _mm512_dpwssd_epi32(isc, _mm512_shuffle_epi8(d, bytes_0_1_2), sw);
}

// ---- 32-element block types: q4_0, q4_1, q5_0, q5_1, q8_0 ----

template <DType kT>
struct Block32 : Block32Layout<kT> {
  using L = Block32Layout<kT>;
  static void unpack(const uint8_t* pb, __m512i (&ops)[8]) {
    if constexpr (L::kBits == 8) {
      // s8 weights + 128 as u8; the act's aux (-128 * sum x) removes the offset.
      const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int o = 0; o < 8; ++o) ops[o] = _mm512_xor_si512(load512(pb + L::kQuants + 64 * o), bias);
    } else if constexpr (L::kBits == 1) {
      // q1_0: q4_0's codes, 8 + 1 where the operand's bit is set, 8 - 1 where clear.
      const __m512i minus = _mm512_set1_epi8(7), plus = _mm512_set1_epi8(9);
      for (int o = 0; o < 8; ++o) {
        uint64_t bits;
        std::memcpy(&bits, pb + L::kQuants + 8 * o, 8);
        ops[o] = _mm512_mask_blend_epi8(_cvtu64_mask64(bits), minus, plus);
      }
    } else {
      unpack_nibbles(pb + L::kQuants, ops);
      if constexpr (L::kBits == 5) add_bit4(pb + L::kBit4, ops);
      if constexpr (L::kCodebook) lookup_iq4_u8(ops, L::codebook(), L::kCodeBias);
    }
  }
};

// kUnpacked (q5_0, q5_1, iq4_nl): panels whose blocks were unpacked once per call
// (panel_kernels.h) to the block's scales (32 bytes; 64 with mins) and the 8
// operands, 64 bytes each: their batches ran 5-8% faster on an AMD Zen 4, q4_0
// and q4_1 (cheap nibbles) 1-2%, within the noise, so those stay packed; iq4_nl
// (a vpshufb per operand) 1.4% in 3 of 3 rounds (Matmul/iq4_nl/T512_1536x576/t1
// 2735-2744 against 2770-2788 us packed).
template <DType kT, bool kUnpacked = false>
struct Q32Impl {
  using Q = Block32<kT>;
  static constexpr int kP1 = kMaxDecodePanelsQuant, kPB = 1, kCB = 8;
  static constexpr bool kDecodePanelsChosen = true;  // KernelArgs::decode_panels
  static constexpr bool kTokensOuter = true;
  static constexpr size_t kHeader = Q::kUnpackedScaleBytes;  // (where an unpacked block's operands start)
  using S = std::conditional_t<kUnpacked, UnpackedScales<Q>, Q>;  // the scales' fields in this form
  static constexpr size_t kBlock = kUnpacked ? Q::kUnpackedPB : Q::kPB;
  using Unpacked = std::conditional_t<kUnpacked || !(Q::kBits == 5 || Q::kCodebook), void, Q32Impl<kT, true>>;
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K / 32) * kBlock; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* src = pan + b * Q::kPB;
      uint8_t* dst = out + b * kBlock;
      Q::unpack_scales(src, dst);
      __m512i ops[8];
      Q::unpack(src, ops);
      for (int o = 0; o < 8; ++o) _mm512_storeu_si512(dst + kHeader + 64 * o, ops[o]);
    }
  }
  static void unpack(const uint8_t* pb, __m512i (&ops)[8]) {
    if constexpr (kUnpacked)
      for (int o = 0; o < 8; ++o) ops[o] = load512(pb + kHeader + 64 * o);
    else
      Q::unpack(pb, ops);
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    __m512 acc[P][C];
    zero_tile(acc);
    const int64_t nb = ta.K / 32;
    for (int64_t b = 0; b < nb; ++b) {
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + b * kBlock;
        if constexpr (C == 1 && !kUnpacked) prefetch_ahead<kAhead, Q::kPB>(pb);
        const __m512 dw = load_scales16<S>(pb);
        __m512 mw = _mm512_setzero_ps();
        if constexpr (Q::kMin) mw = load_f16x16(pb + 32);
        if constexpr (Q::kTwoScales) mw = load_scales16<S>(pb + S::kHiScale);  // the high half's d
        __m512i ops[8];
        unpack(pb, ops);
        const ActQ8x32* xs[C];
        const int8_t* xq[C];
        __m512i dots[C];
        for (int c = 0; c < C; ++c) {
          xs[c] = reinterpret_cast<const ActQ8x32*>(ta.act + c * ta.astride) + b;
          xq[c] = xs[c]->qs;
        }
        if constexpr (Q::kTwoScales) {  // each half's dot and scale (Block32Layout)
          __m512i hi[C];
          for (int c = 0; c < C; ++c) {
            dots[c] = _mm512_set1_epi32(nvfp4_aux_lo(xs[c]->aux));
            hi[c] = _mm512_set1_epi32(nvfp4_aux_hi(xs[c]->aux));
          }
          idot_tile<0, 4, P>(dots, ops, xq);
          idot_tile<4, 8, P>(hi, ops, xq);
          for (int c = 0; c < C; ++c) {
            const __m512 dx = _mm512_set1_ps(xs[c]->d);
            acc[p][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[c]), _mm512_mul_ps(dw, dx), acc[p][c]);
            acc[p][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[c]), _mm512_mul_ps(mw, dx), acc[p][c]);
          }
          continue;
        }
        for (int c = 0; c < C; ++c)
          dots[c] = Q::kMin ? _mm512_setzero_si512() : _mm512_set1_epi32(xs[c]->aux);
        idot_tile<0, 8, P>(dots, ops, xq);
        for (int c = 0; c < C; ++c) {
          const ActQ8x32* x = xs[c];
          const __m512 f = _mm512_cvtepi32_ps(dots[c]);
          acc[p][c] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(x->d)), acc[p][c]);
          if constexpr (Q::kMin) {
            float s;
            std::memcpy(&s, &x->aux, 4);
            acc[p][c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(s), acc[p][c]);
          }
        }
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// ---- q4_k / q5_k: 8 groups of 32 with u8 scales and mins ----

// The whole-byte copy of a panel (kUnpacked): each superblock's header as
// packed, then per group of 32 the 8 operands, 64 bytes each (kUnpackedGroup).
template <class Packed, class Unpacked, size_t kHeader>
void unpack_superblocks(const uint8_t* pan, int64_t K, uint8_t* out) {
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* src = pan + sb * Packed::kPBB;
    uint8_t* dst = out + sb * Unpacked::kPBB;
    std::memcpy(dst, src, kHeader);
    for (int g = 0; g < 8; ++g) {
      __m512i ops[8];
      Packed::unpack(src + kHeader + g * Packed::kGroup, ops);
      for (int o = 0; o < 8; ++o) _mm512_storeu_si512(dst + kHeader + g * kUnpackedGroup + 64 * o, ops[o]);
    }
  }
}

template <DType kT, bool kUnpacked = false>
struct Q45KImpl {
  static constexpr bool kFive = kT == DType::q5_k;
  static constexpr int kP1 = kMaxDecodePanelsQuant, kPB = 1, kCB = 8;
  static constexpr bool kDecodePanelsChosen = true;  // KernelArgs::decode_panels
  static constexpr bool kTokensOuter = true;
  static constexpr size_t kPackedGroup = kFive ? 320 : 256;
  static constexpr size_t kGroup = kUnpacked ? kUnpackedGroup : kPackedGroup;
  static constexpr size_t kPBB = 320 + 8 * kGroup;
  static_assert(kUnpacked || kPBB == (kFive ? 2880 : 2368));
  using Unpacked = Q45KImpl<kT, true>;
  static void unpack(const uint8_t* gp, __m512i (&ops)[8]) {
    if constexpr (kUnpacked) {
      for (int o = 0; o < 8; ++o) ops[o] = load512(gp + 64 * o);
    } else {
      unpack_nibbles(gp, ops);
      if constexpr (kFive) add_bit4(gp + 256, ops);
    }
  }
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K / 256) * kPBB; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    unpack_superblocks<Q45KImpl<kT, false>, Q45KImpl, 320>(pan, K, out);
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    MemAcc<P, C> acc;
    const int64_t nsb = ta.K / 256;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      __m512i isc[P][C];
      for (int p = 0; p < P; ++p)
        for (int c = 0; c < C; ++c) isc[p][c] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        for (int p = 0; p < P; ++p) {
          const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
          if constexpr (C == 1 && !kUnpacked) {
            if (g == 0) prefetch_ahead<kAhead, 320>(pb);
            prefetch_ahead<kAhead, kGroup>(pb + 320 + g * kGroup);
          }
          const __m512i sc =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + 64 + 16 * g)));
          __m512i ops[8];
          unpack(pb + 320 + g * kGroup, ops);
          const int8_t* xq[C];
          __m512i dots[C];
          for (int c = 0; c < C; ++c) {
            xq[c] = (reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb)->qs + 32 * g;
            dots[c] = _mm512_setzero_si512();
          }
          idot_tile<0, 8, P>(dots, ops, xq);
          const __m512i sw = scale_words(sc);
          for (int c = 0; c < C; ++c) isc[p][c] = add_scaled(isc[p][c], dots[c], sw);
        }
      }
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
        const __m512 dw = load_f16x16(pb), dm = load_f16x16(pb + 32);
        __m512i mins[4];
        for (int q = 0; q < 4; ++q)
          mins[q] =
              _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 192 + 32 * q)));
        for (int c = 0; c < C; ++c) {
          const auto* x = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
          __m512i im = _mm512_setzero_si512();
          for (int q = 0; q < 4; ++q) im = _mm512_dpwssd_epi32(im, mins[q], bcast32(x->s32 + 2 * q));
          const __m512 xd = _mm512_set1_ps(x->d);
          __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isc[p][c]), _mm512_mul_ps(dw, xd), acc.get(p, c));
          acc.set(p, c, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(dm, xd), a));
        }
      }
    }
    acc.store(ta);
  }
};

// ---- q6_k, q3_k, q2_k: 16 sub-blocks of 16 with 8-bit scales ----

// Low 2 bits from the two 2-bit words (q2_k, q3_k).
inline void unpack_crumbs(const uint8_t* p, __m512i (&ops)[8]) {
  const __m512i m = _mm512_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    const __m512i w = load512(p + 64 * h);
    ops[4 * h + 0] = _mm512_and_si512(w, m);
    ops[4 * h + 1] = _mm512_and_si512(_mm512_srli_epi32(w, 2), m);
    ops[4 * h + 2] = _mm512_and_si512(_mm512_srli_epi32(w, 4), m);
    ops[4 * h + 3] = _mm512_and_si512(_mm512_srli_epi32(w, 6), m);
  }
}

// Adds bit 2 from the bit-2 word (q3_k; bit o of byte i belongs to operand o).
inline void add_bit2(const uint8_t* p, __m512i (&ops)[8]) {
  const __m512i h = load512(p), m = _mm512_set1_epi8(0x04);
  ops[0] = _mm512_ternarylogic_epi32(ops[0], _mm512_slli_epi32(h, 2), m, kOrAnd);
  ops[1] = _mm512_ternarylogic_epi32(ops[1], _mm512_slli_epi32(h, 1), m, kOrAnd);
  ops[2] = _mm512_ternarylogic_epi32(ops[2], h, m, kOrAnd);
  ops[3] = _mm512_ternarylogic_epi32(ops[3], _mm512_srli_epi32(h, 1), m, kOrAnd);
  ops[4] = _mm512_ternarylogic_epi32(ops[4], _mm512_srli_epi32(h, 2), m, kOrAnd);
  ops[5] = _mm512_ternarylogic_epi32(ops[5], _mm512_srli_epi32(h, 3), m, kOrAnd);
  ops[6] = _mm512_ternarylogic_epi32(ops[6], _mm512_srli_epi32(h, 4), m, kOrAnd);
  ops[7] = _mm512_ternarylogic_epi32(ops[7], _mm512_srli_epi32(h, 5), m, kOrAnd);
}

// Per 256: I = sum_j sc_j * (sum_{16} u x + offset_j) with u = q (q2_k), q + 4
// (q3_k, offset -4 * xsum_j), the 6-bit value (q6_k, offset -32 * xsum_j) or
// the codebook value + 128 (iq4_xs, offset -128 * xsum_j; one scale per 32);
// acc = fma(float(I), d * d_x, acc); q2_k then acc -= float(sum_j m_j xsum_j) * dmin * d_x.
// kUnpacked: the panel's whole-byte copy (unpack_superblocks; the header is the
// kGroups bytes before the quants).
template <DType kKind, bool kUnpacked = false>
struct K16Impl {
  static constexpr int kP1 = kMaxDecodePanelsQuant, kPB = 1, kCB = 8;
  static constexpr bool kDecodePanelsChosen = true;  // KernelArgs::decode_panels
  static constexpr bool kTokensOuter = true;
  static constexpr bool kMin = kKind == DType::q2_k;
  // tq2_0 panels (TQ1_0, TQ2_0; panel.h): q2_k's crumbs without scales or mins.
  // Per superblock sum t x less the act sum, sum (t - 1) x in int32, then one
  // float step, as ggml's TQ dot.
  static constexpr bool kTernary = kKind == DType::tq2_0;
  static constexpr bool kIq4 = kKind == DType::iq4_xs;
  static constexpr bool kGrid = is_iq_grid(kKind);  // iq2_xxs .. iq3_s
  // One scale per 32 (i8[8][16]) for iq4_xs and the grid types but iq2_xs / iq2_s,
  // whose values are signed and offset by +128 like iq4_xs's.
  static constexpr bool kPer32 = kIq4 || (kGrid && iq_grid_traits(kKind).scale_group == 32);
  static constexpr size_t kScales = kMin ? 64 : 32;
  static constexpr size_t kScaleGroup = kPer32 ? 16 : 32;  // scale bytes per group of 32
  static constexpr size_t kGroups = kMin       ? 576
                                    : kTernary ? 32
                                    : kIq4     ? 160
                                    : kGrid    ? iq_grid_panel(kKind).header
                                               : 288;
  static constexpr size_t kPackedGroup = kKind == DType::q6_k   ? 384
                                         : kKind == DType::q3_k ? 192
                                         : kIq4                 ? 256
                                         : kGrid                ? iq_grid_panel(kKind).group
                                                                : 128;
  // The grid types' power of two f (quant_blocks.h), applied to the act scale (exact).
  static constexpr float kDFactor = kGrid ? iq_grid_traits(kKind).factor : 1.0f;
  static constexpr size_t kGroup = kUnpacked ? kUnpackedGroup : kPackedGroup;
  static constexpr size_t kPBB = kGroups + 8 * kGroup;
  static_assert(kUnpacked || kGrid ||
                kPBB == (kKind == DType::q6_k   ? 3360
                         : kKind == DType::q3_k ? 1824
                         : kIq4                 ? 2208
                         : kTernary             ? 1056
                                                : 1600));
  using Unpacked = K16Impl<kKind, true>;
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K / 256) * kPBB; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    unpack_superblocks<K16Impl<kKind, false>, K16Impl, kGroups>(pan, K, out);
  }
  static void unpack(const uint8_t* gp, __m512i (&ops)[8]) {
    if constexpr (kUnpacked) {
      for (int o = 0; o < 8; ++o) ops[o] = load512(gp + 64 * o);
    } else if constexpr (kKind == DType::q6_k) {
      unpack_nibbles(gp, ops);
      add_bits45(gp + 256, ops);
    } else if constexpr (kIq4) {
      unpack_nibbles(gp, ops);
      lookup_iq4_u8(ops);
    } else if constexpr (is_iq1(kKind)) {
      unpack_iq1(gp, ops);
    } else if constexpr (kGrid) {
      unpack_iq_grid<kKind>(gp, ops);
    } else {
      unpack_crumbs(gp, ops);
      if constexpr (kKind == DType::q3_k) add_bit2(gp + 128, ops);
    }
  }
  // The offset per unit of act sum, -2^kOffsetShift (-1: none; offset() below).
  static constexpr int kOffsetShift = kKind == DType::q6_k   ? 5
                                      : kKind == DType::q3_k ? 2
                                      : (kGrid || kIq4)      ? 7
                                                             : -1;
  // Batch tiles start every sub-block's chain at zero and add the offsets once
  // per superblock (add_offsets): the same int32 sum, exactly. The broadcast
  // that started each chain (a computed scalar for the kPer32 types) cost the
  // batch tiles of iq4_xs and iq3_s 14-16% on an Intel Emerald Rapids (against
  // the embedded broadcasts alone; q6_k 0.97-1.03x). Decode tiles keep them in
  // the chain (offset()).
  template <int C>
  static constexpr bool kLateOffsets = C > 1 && kOffsetShift >= 0;
  // A scale unit's 16 i8 scales (one per row), widened to int32.
  static __m512i scales16(const uint8_t* sp) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
  }
  static __m512i offset(const ActQ8K* x, int j) {
    if constexpr (kKind == DType::q6_k) return _mm512_set1_epi32(x->b16[j]);
    if constexpr (kKind == DType::q3_k) return _mm512_set1_epi32(x->b16[j] >> 3);  // -4 * xsum, exact
    if constexpr (kGrid) return _mm512_set1_epi32(-128 * x->s16[j]);               // iq2_xs, iq2_s
    return _mm512_setzero_si512();
  }
  // isc[c] -= 2^kOffsetShift * sum_u sc_u * xsum_u over the superblock's scale
  // units (16 of 16 values, or 8 of 32 with kPer32): vpdpwssd of the units' scale
  // pairs (the panel's i8 widened to i16) with the act's pair sums (s16 or s32).
  template <int C>
  static void add_offsets(const uint8_t* pb, const ActQ8K* const (&xs)[C], __m512i (&isc)[C]) {
    constexpr int kPairs = kPer32 ? 4 : 8;
    __m512i pairs[kPairs];
    for (int q = 0; q < kPairs; ++q) {
      const uint8_t* sp = pb + kScales + 32 * q;
      pairs[q] = pack_words(scales16(sp), scales16(sp + 16));
    }
    for (int c = 0; c < C; ++c) {
      const int16_t* sums = kPer32 ? xs[c]->s32 : xs[c]->s16;
      __m512i im = _mm512_setzero_si512();
      for (int q = 0; q < kPairs; ++q) im = _mm512_dpwssd_epi32(im, pairs[q], bcast32(sums + 2 * q));
      isc[c] = _mm512_sub_epi32(isc[c], _mm512_slli_epi32(im, kOffsetShift));
    }
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    MemAcc<P, C> acc;
    const int64_t nsb = ta.K / 256;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      __m512i isc[P][C];
      for (int p = 0; p < P; ++p)
        for (int c = 0; c < C; ++c) isc[p][c] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        for (int p = 0; p < P; ++p) {
          const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
          if constexpr (C == 1 && !kUnpacked) {
            if (g == 0) prefetch_ahead<kAhead, kGroups>(pb);
            prefetch_ahead<kAhead, kGroup>(pb + kGroups + g * kGroup);
          }
          __m512i ops[8];
          unpack(pb + kGroups + g * kGroup, ops);
          const ActQ8K* xs[C];
          const int8_t* xq[C];
          for (int c = 0; c < C; ++c) {
            xs[c] = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
            xq[c] = xs[c]->qs + 32 * g;
          }
          if constexpr (kTernary) {  // (no scales)
            idot_tile<0, 8, P>(isc[p], ops, xq);
            continue;
          }
          const uint8_t* sp = pb + kScales + kScaleGroup * g;
          const __m512i sw0 = scale_words(scales16(sp));
          // The two sub-blocks' scaled sums in turn (wrapping int32 adds: any order gives the same sums);
          // one scale for both (kPer32), in one chain (decode: from both offsets, -128 * the act sum).
          __m512i dots[C];
          if constexpr (kPer32) {
            for (int c = 0; c < C; ++c)
              dots[c] = kLateOffsets<C> ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * xs[c]->s32[g]);
            idot_tile<0, 8, P>(dots, ops, xq);
            for (int c = 0; c < C; ++c) isc[p][c] = add_scaled(isc[p][c], dots[c], sw0);
            continue;
          }
          for (int c = 0; c < C; ++c)
            dots[c] = kLateOffsets<C> ? _mm512_setzero_si512() : offset(xs[c], 2 * g);
          idot_tile<0, 4, P>(dots, ops, xq);
          for (int c = 0; c < C; ++c) isc[p][c] = add_scaled(isc[p][c], dots[c], sw0);
          const __m512i sw1 = scale_words(scales16(sp + 16));
          for (int c = 0; c < C; ++c)
            dots[c] = kLateOffsets<C> ? _mm512_setzero_si512() : offset(xs[c], 2 * g + 1);
          idot_tile<4, 8, P>(dots, ops, xq);
          for (int c = 0; c < C; ++c) isc[p][c] = add_scaled(isc[p][c], dots[c], sw1);
        }
      }
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
        if constexpr (kLateOffsets<C>) {
          const ActQ8K* xs[C];
          for (int c = 0; c < C; ++c) xs[c] = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
          add_offsets(pb, xs, isc[p]);
        }
        const __m512 dw = load_f16x16(pb);
        __m512 dm = _mm512_setzero_ps();
        __m512i mins[8];
        if constexpr (kMin) {
          dm = load_f16x16(pb + 32);
          for (int q = 0; q < 8; ++q)
            mins[q] =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 320 + 32 * q)));
        }
        for (int c = 0; c < C; ++c) {
          const auto* x = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
          const __m512 xd = _mm512_set1_ps(x->d * kDFactor);
          if constexpr (kTernary)  // sum t x - sum x
            isc[p][c] = _mm512_sub_epi32(isc[p][c], _mm512_set1_epi32(act_sum(*x)));
          __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isc[p][c]), _mm512_mul_ps(dw, xd), acc.get(p, c));
          if constexpr (kMin) {
            __m512i im = _mm512_setzero_si512();
            for (int q = 0; q < 8; ++q) im = _mm512_dpwssd_epi32(im, mins[q], bcast32(x->s16 + 2 * q));
            a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(dm, xd), a);
          }
          acc.set(p, c, a);
        }
      }
    }
    acc.store(ta);
  }
};

// Zeroed sums and the f32 act rows of a float-activation tile.
template <int P, int C>
inline void start_float_tile(const TileArgs& ta, __m512 (&acc)[P][C], const float* (&x)[C]) {
  zero_tile(acc);
  for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const float*>(ta.act + c * ta.astride);
}

// ---- bf16 panels (pair rows) with bf16 activations ----
// Per lane and pair j: acc += w[2j+1] x[2j+1], then acc += w[2j] x[2j], each an
// exact product added with one rounding, denormals as zero: what vdpbf16ps does
// (Intel's definition; measured bit-equal on AMD Zen 4), and what the emulating
// kernels do with two FMAs under MXCSR DAZ + FTZ (Bf16Emu; kernels/cpu/mxcsr.h).

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// AVX512-BF16: act rows are bf16 pairs (ActKind::bf16pairs).
struct Bf16DotImpl {
  static constexpr int kP1 = 4, kPB = 4, kCB = 6;
  template <int P, int C>
  static void run(const TileArgs& ta) {
    __m512 acc[P][C];
    zero_tile(acc);
    const int64_t pairs = bf16_pair_count(ta.K);
    for (int64_t j = 0; j < pairs; ++j) {
      if constexpr (C == 1)
        for (int p = 0; p < P; ++p) prefetch_ahead<kAhead, 64>(ta.pan + p * ta.pstride + j * 64);
      __m512i w[P];
      for (int p = 0; p < P; ++p) w[p] = load512(ta.pan + p * ta.pstride + j * 64);
      for (int c = 0; c < C; ++c) {
        const __m512bh x = as_bh(bcast32(ta.act + c * ta.astride + 4 * j));
        for (int p = 0; p < P; ++p) acc[p][c] = _mm512_dpbf16_ps(acc[p][c], as_bh(w[p]), x);
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// AVX-512 without BF16: act rows are the bf16 values as floats (ActKind::bf16f32);
// the caller sets DAZ + FTZ. Its batches keep the packed pairs: split once per
// call into f32 (as f16 is widened below) they ran 0.99-1.02x, the two FMAs per
// pair and not the split bounding the loop.
struct Bf16EmuImpl {
  static constexpr int kP1 = 4, kPB = 2, kCB = 6;
  template <int P, int C>
  static void run(const TileArgs& ta) {
    __m512 acc[P][C];
    const float* x[C];
    start_float_tile(ta, acc, x);
    const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    const int64_t pairs = bf16_pair_count(ta.K);
    for (int64_t j = 0; j < pairs; ++j) {
      if constexpr (C == 1)
        for (int p = 0; p < P; ++p) prefetch_ahead<kAhead, 64>(ta.pan + p * ta.pstride + j * 64);
      __m512 odd[P], even[P];
      for (int p = 0; p < P; ++p) {
        const __m512i w = load512(ta.pan + p * ta.pstride + j * 64);
        odd[p] = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
        even[p] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      }
      for (int c = 0; c < C; ++c) {
        const __m512 xo = _mm512_set1_ps(x[c][2 * j + 1]), xe = _mm512_set1_ps(x[c][2 * j]);
        for (int p = 0; p < P; ++p) {
          acc[p][c] = _mm512_fmadd_ps(odd[p], xo, acc[p][c]);
          acc[p][c] = _mm512_fmadd_ps(even[p], xe, acc[p][c]);
        }
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// ---- f32 / f16 panels with f32 activations ----

struct F16WidenedImpl;

// Batch tiles of 3 panels x 8 tokens (24 sums): f16 (widened) ran 4-8% faster on
// an AMD Zen 4 than with 2 x 8, at 92% of its FMA peak; f32 alike (1.02x).
template <DType kKind>
struct FloatImpl {
  static constexpr int kP1 = 4, kPB = 3, kCB = 8;
  static constexpr size_t kStep = kKind == DType::f32 ? 64 : 32;
  using Unpacked = std::conditional_t<kKind == DType::f16, F16WidenedImpl, void>;
  static __m512 load(const uint8_t* p) {
    if constexpr (kKind == DType::f32) return _mm512_loadu_ps(p);
    return load_f16x16(p);
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    __m512 acc[P][C];
    const float* x[C];
    start_float_tile(ta, acc, x);
    for (int64_t k = 0; k < ta.K; ++k) {
      if constexpr (C == 1)
        if ((k * kStep) % 64 == 0)
          for (int p = 0; p < P; ++p) prefetch_ahead<kAhead, 64>(ta.pan + p * ta.pstride + k * kStep);
      // All panels' weights first, then one broadcast per token for all of them:
      // the broadcasts are loads, and the load ports bound this loop.
      __m512 w[P];
      for (int p = 0; p < P; ++p) w[p] = load(ta.pan + p * ta.pstride + k * kStep);
      for (int c = 0; c < C; ++c) {
        const __m512 xc = _mm512_set1_ps(x[c][k]);
        for (int p = 0; p < P; ++p) acc[p][c] = _mm512_fmadd_ps(w[p], xc, acc[p][c]);
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// f16 batches run on their panels widened to f32 once per call (exact), which
// spares every tile one vcvtph2ps per panel and column: the f32 tiles' FMAs on
// the same values, in the same order.
struct F16WidenedImpl : FloatImpl<DType::f32> {
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K) * 64; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    for (int64_t k = 0; k < K; ++k)
      _mm512_storeu_ps(reinterpret_cast<float*>(out + 64 * k), load_f16x16(pan + 32 * k));
  }
};

// The packed families under one template parameter each, as panel_kernels.h's
// dispatch takes them: clang (no P0522 by default) does not match a template
// with a defaulted second parameter to `template <DType> class`.
template <DType kT>
using Q32Packed = Q32Impl<kT>;
template <DType kT>
using Q45KPacked = Q45KImpl<kT>;
template <DType kKind>
using K16Packed = K16Impl<kKind>;

}  // namespace
}  // namespace loom::cpu
