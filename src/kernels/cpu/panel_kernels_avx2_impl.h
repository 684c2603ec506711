// AVX2 panel kernels (the x86-64-v3 baseline): a 16-row panel is two ymm halves
// of 8 rows. Integer block dots use vpmaddubsw/vpmaddwd (sums that provably fit
// in int16), then the same per-lane f32 sequence as the AVX-512 kernels, so both
// paths give bit-identical results. Included by two files: with LOOM_AVX2_VNNI
// 1 (panel_kernels_avx2_vnni.cpp, built with -mavxvnni) the block dots take
// AVX-VNNI's vpdpbusd instead, and the scaled ones multiply by their scales with
// add_scaled instead of vpmaddwd or vpmulld: the same exact int32 sums in fewer
// instructions. Their shared helpers: panel_kernels_avx2_common.h.
#pragma once  // (one inclusion per file)

#ifndef LOOM_AVX2_VNNI
#error "define LOOM_AVX2_VNNI (0 or 1) before including panel_kernels_avx2_impl.h"
#endif

#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/mxcsr.h"
#include "kernels/cpu/nf4.h"
#include "kernels/cpu/panel.h"
#include "kernels/cpu/panel_kernels.h"
#include "kernels/cpu/panel_kernels_avx2_common.h"
#include "kernels/quant_blocks.h"

namespace loom::cpu {
namespace {

// ---- 32-element block types ----

template <DType kT>
struct Block32 : Block32Layout<kT> {
  using L = Block32Layout<kT>;
  // q1_0: operand o of half h as q4_0's codes 8 +- 1 from its 32 bits (bit j: byte j).
  static __m256i bit_operand(const uint8_t* pb, int h, int o) {
    uint32_t bits;
    std::memcpy(&bits, pb + L::kQuants + 8 * o + 4 * h, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    // -1 where the bit is clear, 0 where set: 9 - 2 or 9.
    const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), _mm256_setzero_si256());
    return _mm256_sub_epi8(_mm256_set1_epi8(9), _mm256_and_si256(clear, _mm256_set1_epi8(2)));
  }
  static void unpack(const uint8_t* pb, int h, __m256i (&ops)[8]) {
    if constexpr (L::kBits == 8) {
      for (int o = 0; o < 8; ++o) ops[o] = load256(pb + L::kQuants + 64 * o + 32 * h);
    } else if constexpr (L::kBits == 1) {
      for (int o = 0; o < 8; ++o) ops[o] = bit_operand(pb, h, o);
    } else {
      // iq4_nl signed (the sign trick), mxfp4 as unsigned codes.
      if constexpr (L::kCodebook)
        return unpack_iq4(pb + L::kQuants, h, ops, L::codebook(), L::kSigned ? 0 : L::kCodeBias);
      unpack_nibbles(pb + L::kQuants, h, ops);
      if constexpr (L::kBits == 5) add_bit4(pb + L::kBit4, h, ops);
    }
  }
};

// kUnpacked (the 4- and 5-bit types): panels whose blocks were unpacked once per
// call (panel_kernels.h) to the block's scales (32 bytes; 64 with mins) and the 8
// operands of 16 rows x 4 values, 64 bytes each, half h at byte 32h. Batches ran
// q5_0/q5_1 26-27% and q4_0/q4_1 3-5% faster so (AMD Zen 4, LOOM_CPU=avx2).
// iq4_nl unpacks to its signed codebook values: a q8_0 panel block's layout, run
// as q8_0's (the sign trick); mxfp4 to its codes v + 12, run as q5's.
template <DType kT, bool kUnpacked = false>
struct Q32Impl {
  using Q = Block32<kT>;
  // q8_0 tiles take 5 tokens (its operand load and |w| then serve one token
  // more; 15 ymm registers, no spill): AMD Zen 2, SmolLM2 Q8_0 pp512 615-627 ->
  // 627-641 t/s. The 4- and 5-bit tiles keep 4.
  // With AVX-VNNI 6 tokens (no int16 parts to keep, one sum per token): Intel
  // Emerald Rapids under LOOM_CPU=avx2-vnni, T = 512, 1536 x 576, against 4 (5
  // for q8_0): q4_0 0.88x the time, q5_0 0.86, q4_1 0.93, q8_0 / iq4_nl 0.99;
  // 8 ran q8_0 and iq4_nl 1.05-1.1x slower.
  static constexpr int kP1 = kMaxDecodePanelsQuant, kPB = 1, kCB = kVnni ? 6 : Q::kSigned ? 5 : 4;
  static constexpr bool kDecodePanelsChosen = true;  // KernelArgs::decode_panels
  static constexpr bool kTokensOuter = true;
  static constexpr size_t kHeader = Q::kUnpackedScaleBytes;  // (where an unpacked block's operands start)
  using S = std::conditional_t<kUnpacked, UnpackedScales<Q>, Q>;  // the scales' fields in this form
  static constexpr size_t kBlock = kUnpacked ? Q::kUnpackedPB : Q::kPB;
  using Unpacked = std::conditional_t<kUnpacked || Q::kBits == 8 || Q::kBits == 1, void, Q32Impl<kT, true>>;
  static_assert(!Q::kSigned || kHeader == Q::kQuants);  // signed operands at the same offset either way
  // Operand o of a signed type's half h: q8_0's words, iq4_nl's unpacked values,
  // or iq4_nl's packed nibbles looked up one operand at a time.
  static __m256i signed_operand(const uint8_t* pb, int h, int o) {
    if constexpr (Q::kCodebook && !kUnpacked) {
      return iq4_operand(pb + Q::kQuants, h, o);  // (iq4_nl: the signed codebook type)
    } else {
      return load256(pb + Q::kQuants + 64 * o + 32 * h);
    }
  }
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K / 32) * kBlock; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* src = pan + b * Q::kPB;
      uint8_t* dst = out + b * kBlock;
      Q::unpack_scales(src, dst);
      for (int h = 0; h < 2; ++h) {
        __m256i ops[8];
        Q::unpack(src, h, ops);
        for (int o = 0; o < 8; ++o)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kHeader + 64 * o + 32 * h), ops[o]);
      }
    }
  }
  static void unpack(const uint8_t* pb, int h, __m256i (&ops)[8]) {
    if constexpr (kUnpacked)
      for (int o = 0; o < 8; ++o) ops[o] = load256(pb + kHeader + 64 * o + 32 * h);
    else
      Q::unpack(pb, h, ops);
  }
  // Block dots of one 8-row half for C tokens, operand-major: each operand is
  // loaded once, then every token's product taken (int32 sums, exact in any order).
  template <int C>
  static void block_dots(const uint8_t* pb, int h, const ActQ8x32* const (&x)[C], __m256i (&tot)[C]) {
    for (int c = 0; c < C; ++c) tot[c] = _mm256_setzero_si256();
    if constexpr (Q::kSigned) {
#pragma GCC unroll 8
      for (int o = 0; o < 8; ++o) {
        const __m256i w = signed_operand(pb, h, o), aw = _mm256_sign_epi8(w, w);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          tot[c] = dot_add(tot[c], aw, _mm256_sign_epi8(bcast32(x[c]->qs + 4 * o), w));
          keep_in_register(tot[c]);
        }
      }
    } else {
      __m256i ops[8];
      if constexpr (!kUnpacked) unpack(pb, h, ops);
      const int8_t* xq[C];
      for (int c = 0; c < C; ++c) xq[c] = x[c]->qs;
      const auto operand = [&](int o) {
        return kUnpacked ? load256(pb + kHeader + 64 * o + 32 * h) : ops[o];
      };
      if constexpr (kVnni) {
#pragma GCC unroll 8
        for (int o = 0; o < 8; ++o) {
          const __m256i w = operand(o);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            tot[c] = dot_add(tot[c], w, bcast32(xq[c] + 4 * o));
            keep_in_register(tot[c]);
          }
        }
        return;
      }
      const __m256i ones = _mm256_set1_epi16(1);
      constexpr int kRun = Q::kCodeBits == 4 ? 8 : 4;  // int16 runs (see idot)
      group_dots<kRun>(operand, xq, {ones, ones}, tot);
    }
  }
  // Row half h's scales (8 rows) in a block: d, or (kTwoScales) the high 16 elements' d.
  static __m256 half_scales(const uint8_t* pb, int h) {
    return load_scales8<S>(pb + 8 * S::kScaleRowBytes * h);
  }
  static __m256 half_hi_scales(const uint8_t* pb, int h) {
    return load_scales8<S>(pb + S::kHiScale + 8 * S::kScaleRowBytes * h);
  }
  // nvfp4 (kTwoScales): the block dots of each half of the 32 elements apart,
  // tot[0] over operands 0..3, tot[1] over 4..7, operand-major as block_dots.
  // Without AVX-VNNI a half's 4 operands sum in int16 (codes <= 24: 4 x 2 x 24 x 127
  // < 2^15), as idot's runs.
  template <int C>
  static void block_dots_halves(const uint8_t* pb, int h, const ActQ8x32* const (&x)[C],
                                __m256i (&tot)[2][C]) {
    __m256i ops[8];
    if constexpr (!kUnpacked) unpack(pb, h, ops);
    const auto operand = [&](int o) { return kUnpacked ? load256(pb + kHeader + 64 * o + 32 * h) : ops[o]; };
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      __m256i part[C];
#pragma GCC unroll 4
      for (int o = 4 * q; o < 4 * q + 4; ++o) {
        const __m256i w = operand(o);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m256i xb = bcast32(x[c]->qs + 4 * o);
          if constexpr (kVnni) {
            part[c] = dot_add(o == 4 * q ? _mm256_setzero_si256() : part[c], w, xb);
          } else {
            const __m256i m = _mm256_maddubs_epi16(w, xb);
            part[c] = o == 4 * q ? m : _mm256_add_epi16(part[c], m);
          }
          keep_in_register(part[c]);
        }
      }
      for (int c = 0; c < C; ++c) tot[q][c] = kVnni ? part[c] : madd1(part[c]);
    }
  }
  // acc += (each half's dot + its aux) times its scale d0 or d1 and the token's d (nvfp4).
  static __m256 add_halves(__m256 acc, __m256i lo, __m256i hi, __m256 d0, __m256 d1, const ActQ8x32* x) {
    const __m256 dx = _mm256_set1_ps(x->d);
    lo = _mm256_add_epi32(lo, _mm256_set1_epi32(nvfp4_aux_lo(x->aux)));
    hi = _mm256_add_epi32(hi, _mm256_set1_epi32(nvfp4_aux_hi(x->aux)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(d0, dx), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(d1, dx), acc);
  }
  // Batch tiles: one 8-row half at a time over the whole K, so C sums, C
  // accumulators and one operand are live. The block-major order below kept 8
  // operands (16 with q8_0's absolute values) and both halves' sums, and spilled
  // from AVX2's 16 registers. The f32 sequence per lane is the same.
  template <int P, int C>
  static void run_batch(const TileArgs& ta) {
    const int64_t nb = ta.K / 32;
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        __m256 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* pb = ta.pan + p * ta.pstride + b * kBlock;
          const ActQ8x32* x[C];
          for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const ActQ8x32*>(ta.act + c * ta.astride) + b;
          const __m256 dw = half_scales(pb, h);
          if constexpr (Q::kTwoScales) {
            __m256i halves[2][C];
            block_dots_halves<C>(pb, h, x, halves);
            const __m256 d1 = half_hi_scales(pb, h);
            for (int c = 0; c < C; ++c) acc[c] = add_halves(acc[c], halves[0][c], halves[1][c], dw, d1, x[c]);
            continue;
          }
          __m256i tot[C];
          block_dots<C>(pb, h, x, tot);
          for (int c = 0; c < C; ++c) {
            __m256i i = tot[c];
            if constexpr (!Q::kMin && !Q::kSigned) i = _mm256_add_epi32(i, _mm256_set1_epi32(x[c]->aux));
            acc[c] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dw, _mm256_set1_ps(x[c]->d)), acc[c]);
            if constexpr (Q::kMin) {
              float s;
              std::memcpy(&s, &x[c]->aux, 4);
              acc[c] = _mm256_fmadd_ps(load_f16x8(pb + 32 + 16 * h), _mm256_set1_ps(s), acc[c]);
            }
          }
        }
        for (int c = 0; c < C; ++c)
          store_rows(ta.y + c * ta.ldy + p * 16 + h * 8, acc[c], ta.nv - p * 16 - h * 8);
      }
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    if constexpr (C > 1)
      run_batch<P, C>(ta);
    else
      run_decode<P>(ta);
  }
  // Decode tiles (one token): block-major, both halves per block.
  template <int P>
  static void run_decode(const TileArgs& ta) {
    constexpr int C = 1;
    __m256 acc[P][2][C];
    zero_tile(acc);
    const int64_t nb = ta.K / 32;
    for (int64_t b = 0; b < nb; ++b) {
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + b * kBlock;
        if constexpr (!kUnpacked) prefetch_ahead<kAhead, Q::kPB>(pb);
        for (int h = 0; h < 2; ++h) {
          const __m256 dw = half_scales(pb, h);
          __m256 mw = _mm256_setzero_ps();
          if constexpr (Q::kMin) mw = load_f16x8(pb + 32 + 16 * h);
          if constexpr (Q::kTwoScales) mw = half_hi_scales(pb, h);  // the high half's d
          __m256i ops[8];
          unpack(pb, h, ops);
          __m256i absw[8];
          if constexpr (Q::kSigned)
            for (int o = 0; o < 8; ++o) absw[o] = _mm256_sign_epi8(ops[o], ops[o]);
          for (int c = 0; c < C; ++c) {
            const auto* x = reinterpret_cast<const ActQ8x32*>(ta.act + c * ta.astride) + b;
            if constexpr (Q::kTwoScales) {
              acc[p][h][c] = add_halves(acc[p][h][c], idot<Q::kCodeBits, 0, 4>(ops, x->qs),
                                        idot<Q::kCodeBits, 4, 8>(ops, x->qs), dw, mw, x);
              continue;
            }
            __m256i i;
            if constexpr (Q::kSigned)
              i = idot_s8(absw, ops, x->qs);
            else
              i = idot<Q::kCodeBits, 0, 8>(ops, x->qs);
            if constexpr (!Q::kMin && !Q::kSigned) i = _mm256_add_epi32(i, _mm256_set1_epi32(x->aux));
            const __m256 f = _mm256_cvtepi32_ps(i);
            acc[p][h][c] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(x->d)), acc[p][h][c]);
            if constexpr (Q::kMin) {
              float s;
              std::memcpy(&s, &x->aux, 4);
              acc[p][h][c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s), acc[p][h][c]);
            }
          }
        }
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// Decode prefetch of a 256-superblock panel block (header bytes, then 8 groups of
// `group` bytes): the header with group 0, then each group as it is reached. One
// burst of 40-50 hints per superblock overflowed the miss buffers (measured on
// AMD Zen 4: q4_k decode from DRAM 12.7 GB/s with it, against 28 for q4_0's
// per-block hints).
inline void prefetch_group(const uint8_t* pb, int g, size_t header, size_t group) {
  if (g == 0)
    for (size_t o = 0; o < header; o += 64) __builtin_prefetch(pb + kAhead + o, 0, 3);
  for (size_t o = 0; o < group; o += 64) __builtin_prefetch(pb + header + g * group + kAhead + o, 0, 3);
}

// What an Unpacked subtracts from each operand byte (kOperandBias; 0 if none).
template <class Unpacked>
constexpr int operand_bias() {
  if constexpr (requires { Unpacked::kOperandBias; })
    return Unpacked::kOperandBias;
  else
    return 0;
}

// Unpacked panels (panel_kernels.h) have the AVX-512 kernels' layout: each
// superblock's header as packed, then per group of 32 the 8 operands, 64 bytes
// each (16 rows x 4 values), half h at byte 32h, less operand_bias<Unpacked>().
template <class Packed, class Unpacked, size_t kHeader>
void unpack_superblocks(const uint8_t* pan, int64_t K, uint8_t* out) {
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* src = pan + sb * Packed::kPBB;
    uint8_t* dst = out + sb * Unpacked::kPBB;
    std::memcpy(dst, src, kHeader);
    for (int g = 0; g < 8; ++g)
      for (int h = 0; h < 2; ++h) {
        __m256i ops[8];
        Packed::unpack(src + kHeader + g * Packed::kGroup, h, ops);
        if constexpr (operand_bias<Unpacked>() != 0)
          for (int o = 0; o < 8; ++o)
            ops[o] = _mm256_sub_epi8(ops[o], _mm256_set1_epi8(operand_bias<Unpacked>()));
        for (int o = 0; o < 8; ++o)
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(dst + kHeader + g * kUnpackedGroup + 64 * o + 32 * h), ops[o]);
      }
  }
}

inline void load_unpacked(const uint8_t* gp, int h, __m256i (&ops)[8]) {
  for (int o = 0; o < 8; ++o) ops[o] = load256(gp + 64 * o + 32 * h);
}

// The act rows of a batch tile's C tokens at superblock sb, and zeroed sums.
template <int C>
inline void start_superblock(const TileArgs& ta, int64_t sb, const ActQ8K* (&x)[C], __m256i (&isc)[C]) {
  for (int c = 0; c < C; ++c) {
    x[c] = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
    isc[c] = _mm256_setzero_si256();
  }
}

// ---- q4_k / q5_k ----

// q5_k batches run on unpacked panels (whole bytes, panel_kernels.h): with the
// operand-major tiles they ran 1.1-1.25x the packed ones (AMD Zen 4 under
// LOOM_CPU=avx2, T = 512), where q4_k's nibbles, one shift and mask per operand
// next to 4 tokens' vpmaddubsw, measured the same either way and stay packed.
template <DType kT, bool kUnpacked = false>
struct Q45KImpl {
  static constexpr bool kFive = kT == DType::q5_k;
  static constexpr int kP1 = kMaxDecodePanelsQuant, kPB = 1, kCB = 4;
  static constexpr bool kDecodePanelsChosen = true;  // KernelArgs::decode_panels
  static constexpr bool kTokensOuter = true;
  static constexpr size_t kGroup = kUnpacked ? kUnpackedGroup : kFive ? 320 : 256;
  static constexpr size_t kPBB = 320 + 8 * kGroup;
  static_assert(kUnpacked || kPBB == (kFive ? 2880 : 2368));
  using Unpacked = std::conditional_t<kUnpacked || !kFive, void, Q45KImpl<kT, true>>;
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K / 256) * kPBB; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    unpack_superblocks<Q45KImpl<kT, false>, Q45KImpl, 320>(pan, K, out);
  }
  static void unpack(const uint8_t* gp, int h, __m256i (&ops)[8]) {
    if constexpr (kUnpacked) {
      load_unpacked(gp, h, ops);
    } else {
      unpack_nibbles(gp, h, ops);
      if constexpr (kFive) add_bit4(gp + 256, h, ops);
    }
  }
  // Operand o of group gp's half h (unpack_nibbles, add_bit4), one at a time.
  static __m256i operand(const uint8_t* gp, int h, int o) {
    if constexpr (kUnpacked) return load256(gp + 64 * o + 32 * h);
    const __m256i m = _mm256_set1_epi8(0x0f), w = load256(gp + 64 * (o % 4) + 32 * h);
    __m256i op = _mm256_and_si256(o < 4 ? w : _mm256_srli_epi32(w, 4), m);
    if constexpr (kFive)
      op = _mm256_or_si256(
          op, _mm256_and_si256(shift_bits(load256(gp + 256 + 32 * h), 4 - o), _mm256_set1_epi8(0x10)));
    return op;
  }
  // Batch tiles, one half over the whole K, operand-major (see Q32Impl::run_batch);
  // vpmaddwd by the group's scales (scales_x2) replaces vpmaddwd by ones and vpmulld.
  template <int P, int C>
  static void run_batch(const TileArgs& ta) {
    constexpr int kRun = kFive ? 4 : 8;
    const int64_t nsb = ta.K / 256;
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        __m256 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb) {
          const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
          const ActQ8K* x[C];
          __m256i isc[C];
          start_superblock(ta, sb, x, isc);
          for (int g = 0; g < 8; ++g) {
            const __m256i sc = scales_x2(pb + 64 + 16 * g + 8 * h);
            const uint8_t* gp = pb + 320 + g * kGroup;
            const int8_t* xq[C];
            for (int c = 0; c < C; ++c) xq[c] = x[c]->qs + 32 * g;
            group_dots<kRun, C, false, 8>([&](int o) { return operand(gp, h, o); }, xq, {sc, sc}, isc);
          }
          const HalfScales<4> hs(pb, h, 192);
          for (int c = 0; c < C; ++c) acc[c] = hs.update(acc[c], isc[c], x[c]->d, x[c]->s32);
        }
        for (int c = 0; c < C; ++c)
          store_rows(ta.y + c * ta.ldy + p * 16 + h * 8, acc[c], ta.nv - p * 16 - h * 8);
      }
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    if constexpr (C > 1)
      run_batch<P, C>(ta);
    else
      run_decode<P>(ta);
  }
  // Decode tiles (one token): block-major, both halves per block.
  template <int P>
  static void run_decode(const TileArgs& ta) {
    constexpr int C = 1;
    __m256 acc[P][2][C];
    zero_tile(acc);
    const int64_t nsb = ta.K / 256;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
        // Both halves in one pass over the superblock's bytes.
        __m256i isc[2][C];
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < C; ++c) isc[h][c] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          prefetch_group(pb, g, 320, kGroup);
          for (int h = 0; h < 2; ++h) {
            const uint8_t* sc = pb + 64 + 16 * g + 8 * h;  // (u6 scales)
            __m256i ops[8];
            unpack(pb + 320 + g * kGroup, h, ops);
            for (int c = 0; c < C; ++c) {
              const auto* x = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
              const __m256i d = idot < kFive ? 5 : 4, 0, 8 > (ops, x->qs + 32 * g);
              isc[h][c] = add_scaled_rows(isc[h][c], d, sc);
            }
          }
        }
        for (int h = 0; h < 2; ++h) {
          const HalfScales<4> hs(pb, h, 192);
          for (int c = 0; c < C; ++c) {
            const auto* x = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
            acc[p][h][c] = hs.update(acc[p][h][c], isc[h][c], x->d, x->s32);
          }
        }
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// ---- q6_k, q3_k, q2_k ----

inline void unpack_crumbs(const uint8_t* p, int h, __m256i (&ops)[8]) {
  const __m256i m = _mm256_set1_epi8(0x03);
  for (int j = 0; j < 2; ++j) {
    const __m256i w = load256(p + 64 * j + 32 * h);
    for (int s = 0; s < 4; ++s) ops[4 * j + s] = _mm256_and_si256(_mm256_srli_epi32(w, 2 * s), m);
  }
}

inline void add_bit2(const uint8_t* p, int h, __m256i (&ops)[8]) {
  const __m256i w = load256(p + 32 * h), m = _mm256_set1_epi8(0x04);
  for (int o = 0; o < 8; ++o) ops[o] = _mm256_or_si256(ops[o], _mm256_and_si256(shift_bits(w, 2 - o), m));
}

// The weight sums of an unpacked superblock at pb whose tiles read ActKind::q8k_u8
// rows (the +128 they add, subtracted once per superblock), per 8-row half at
// pb + at: 128 x the sum over the 16 sub-blocks of scale x the sum of the
// sub-block's 16 signed values (|.| < 2^28). Group g's operands start at
// pb + quants + g * group; scale_at(pb, g, s, h) points at the 8 i8 scales of
// sub-block 2g + s (operands 4s .. 4s + 3).
template <class ScaleAt>
inline void store_u8_weight_sums(uint8_t* pb, size_t quants, size_t group, size_t at, ScaleAt scale_at) {
  const __m256i ones = _mm256_set1_epi8(1);
  for (int h = 0; h < 2; ++h) {
    __m256i sums = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g)
      for (int s = 0; s < 2; ++s) {
        __m256i v = _mm256_setzero_si256();
        for (int o = 4 * s; o < 4 * s + 4; ++o)
          v = _mm256_add_epi32(
              v, madd1(_mm256_maddubs_epi16(ones, load256(pb + quants + g * group + 64 * o + 32 * h))));
        __m128i sv;
        std::memcpy(&sv, scale_at(pb, g, s, h), 8);
        sums = _mm256_add_epi32(sums, _mm256_mullo_epi32(v, _mm256_cvtepi8_epi32(sv)));
      }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + at + 32 * h), _mm256_slli_epi32(sums, 7));
  }
}

template <DType kKind, bool kUnpacked = false>
struct K16Impl {
  static constexpr int kP1 = kMaxDecodePanelsQuant, kPB = 1, kCB = 4;
  static constexpr bool kDecodePanelsChosen = true;  // KernelArgs::decode_panels
  static constexpr bool kTokensOuter = true;
  static constexpr bool kMin = kKind == DType::q2_k;
  // tq2_0 panels (TQ1_0, TQ2_0; panel.h): q2_k's crumbs without scales or mins;
  // sum t x less the act sum (ternary_sum), then one float step.
  static constexpr bool kTernary = kKind == DType::tq2_0;
  static constexpr int kMinPairs = kMin ? 8 : 0;              // HalfScales' mins
  static constexpr int kBits = kKind == DType::q6_k ? 6 : 4;  // q3's 3-bit and q2's 2-bit sums fit like 4-bit
  static constexpr size_t kScales = kMin ? 64 : 32;
  static constexpr size_t kGroups = kMin ? 576 : kTernary ? 32 : 288;
  static constexpr size_t kGroup = kUnpacked              ? kUnpackedGroup
                                   : kKind == DType::q6_k ? 384
                                   : kKind == DType::q3_k ? 192
                                                          : 128;
  // Unpacked q6_k and q3_k panels hold the signed values (-32..31, -4..3) and
  // read act rows offset by +128 (ActKind::q8k_u8; vpmaddubsw(x + 128, w): pair
  // sums within 2 * 255 * 32, so q6_k's runs of 2 still fit int16, q3_k's of 4).
  // What the +128 adds, 128 x the sum over sub-blocks of scale x (sum of the
  // sub-block's values), depends on the weights alone: each superblock keeps it
  // per row (kWeightSums, 16 int32 after the groups) and a token subtracts it
  // once per superblock, where the unsigned values (0..63, 0..7) needed a
  // vpmaddwd per group and token for their offset (-32, -4). vpmaddubsw and
  // vpmaddwd share one pipe on an AMD Zen 2: per group and token q6_k takes 12
  // of them instead of 13, q3_k 10 instead of 11.
  static constexpr bool kU8Acts = kUnpacked && (kKind == DType::q6_k || kKind == DType::q3_k);
  static constexpr int kOperandBias = !kU8Acts ? 0 : kKind == DType::q6_k ? 32 : 4;
  static constexpr size_t kWeightSums = kGroups + 8 * kGroup;
  static constexpr size_t kPBB = kWeightSums + (kU8Acts ? 64 : 0);
  static_assert(kUnpacked || kPBB == (kKind == DType::q6_k   ? 3360
                                      : kKind == DType::q3_k ? 1824
                                      : kTernary             ? 1056
                                                             : 1600));
  // The 8 rows' sub-block scales of a group (scales_x2), or ones for tq2_0's sums.
  static __m256i group_scales(const uint8_t* sp) {
    if constexpr (kTernary) return _mm256_set1_epi16(1);
    return scales_x2(sp);
  }
  // tq2_0: sum t x - sum x = sum (t - 1) x, exact in int32.
  static __m256i ternary_sum(__m256i isc, const ActQ8K* x) {
    return _mm256_sub_epi32(isc, _mm256_set1_epi32(act_sum(*x)));
  }
  using Unpacked = K16Impl<kKind, true>;
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K / 256) * kPBB; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    unpack_superblocks<K16Impl<kKind, false>, K16Impl, kGroups>(pan, K, out);
    if constexpr (kU8Acts)
      for (int64_t sb = 0; sb < K / 256; ++sb) store_weight_sums(out + sb * kPBB);
  }
  // kWeightSums of an unpacked superblock (store_u8_weight_sums).
  static void store_weight_sums(uint8_t* pb) {
    store_u8_weight_sums(pb, kGroups, kGroup, kWeightSums, [](const uint8_t* b, int g, int s, int h) {
      return b + kScales + 32 * g + 16 * s + 8 * h;
    });
  }
  static void unpack(const uint8_t* gp, int h, __m256i (&ops)[8]) {
    if constexpr (kUnpacked) {
      load_unpacked(gp, h, ops);
    } else if constexpr (kKind == DType::q6_k) {
      unpack_nibbles(gp, h, ops);
      add_bits45(gp + 256, h, ops);
    } else {
      unpack_crumbs(gp, h, ops);
      if constexpr (kKind == DType::q3_k) add_bit2(gp + 128, h, ops);
    }
  }
  static int32_t offset(const ActQ8K* x, int j) {
    if constexpr (kKind == DType::q6_k) return x->b16[j];
    if constexpr (kKind == DType::q3_k) return x->b16[j] >> 3;  // -4 * xsum, exact
    return 0;
  }
  // offset(x, j) = -(s16[j] << kOffsetShift): q6_k's -32 and q3_k's -4 per value.
  static constexpr int kOffsetShift = kKind == DType::q6_k ? 5 : kKind == DType::q3_k ? 2 : -1;
  // Batch tiles, one half over the whole K, operand-major (see Q32Impl::run_batch).
  // vpmaddwd by each sub-block's scales (scales_x2) replaces vpmaddwd by ones and
  // vpmulld, and one vpmaddwd per group gives both sub-blocks' offsets times their
  // scales: the same int32 sums.
  template <int P, int C>
  static void run_batch(const TileArgs& ta) {
    constexpr int kRun = kBits == 6 ? 2 : 4;  // (q8k_u8: see kU8Acts)
    const int64_t nsb = ta.K / 256;
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        __m256 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb) {
          const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
          const ActQ8K* x[C];
          __m256i isc[C];
          start_superblock(ta, sb, x, isc);
          for (int g = 0; g < 8; ++g) {
            const uint8_t* sp = pb + kScales + 32 * g + 8 * h;
            const __m256i sc[2] = {group_scales(sp), group_scales(sp + 16)};
            const uint8_t* gp = pb + kGroups + g * kGroup;
            __m256i ops[8];
            if constexpr (!kUnpacked) unpack(gp, h, ops);
            const int8_t* xq[C];
            for (int c = 0; c < C; ++c) xq[c] = x[c]->qs + 32 * g;
            group_dots<kRun, C, kU8Acts>(
                [&](int o) { return kUnpacked ? load256(gp + 64 * o + 32 * h) : ops[o]; }, xq, sc, isc);
            if constexpr (kOffsetShift >= 0 && !kU8Acts) {
              __m128i s0, s1;
              std::memcpy(&s0, sp, 8);
              std::memcpy(&s1, sp + 16, 8);
              const __m256i pair =
                  _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));  // (sc 2g, sc 2g+1) per row
              for (int c = 0; c < C; ++c)
                isc[c] = _mm256_sub_epi32(
                    isc[c],
                    _mm256_slli_epi32(_mm256_madd_epi16(pair, bcast32(x[c]->s16 + 2 * g)), kOffsetShift));
            }
          }
          if constexpr (kU8Acts) {
            const __m256i ws = load256(pb + kWeightSums + 32 * h);
            for (int c = 0; c < C; ++c) isc[c] = _mm256_sub_epi32(isc[c], ws);
          }
          const HalfScales<kMinPairs> hs(pb, h, 320);
          if constexpr (kTernary)
            for (int c = 0; c < C; ++c) isc[c] = ternary_sum(isc[c], x[c]);
          for (int c = 0; c < C; ++c) acc[c] = hs.update(acc[c], isc[c], x[c]->d, x[c]->s16);
        }
        for (int c = 0; c < C; ++c)
          store_rows(ta.y + c * ta.ldy + p * 16 + h * 8, acc[c], ta.nv - p * 16 - h * 8);
      }
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    if constexpr (C > 1 || kU8Acts)  // (a batch's last tile may have one token)
      run_batch<P, C>(ta);
    else
      run_decode<P>(ta);
  }
  // Decode tiles (one token): block-major, both halves per block.
  template <int P>
  static void run_decode(const TileArgs& ta) {
    constexpr int C = 1;
    __m256 acc[P][2][C];
    zero_tile(acc);
    const int64_t nsb = ta.K / 256;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
        __m256i isc[2][C];
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < C; ++c) isc[h][c] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          if constexpr (!kUnpacked) prefetch_group(pb, g, kGroups, kGroup);
          for (int h = 0; h < 2; ++h) {
            __m256i ops[8];
            unpack(pb + kGroups + g * kGroup, h, ops);
            if constexpr (kTernary) {  // (no scales)
              for (int c = 0; c < C; ++c) {
                const int8_t* xq =
                    (reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb)->qs + 32 * g;
                isc[h][c] = _mm256_add_epi32(
                    isc[h][c], _mm256_add_epi32(idot<kBits, 0, 4>(ops, xq), idot<kBits, 4, 8>(ops, xq)));
              }
              continue;
            }
            const uint8_t* sc0 = pb + kScales + 32 * g + 8 * h;  // sub-block 2g's, then 2g + 1's at + 16
            for (int c = 0; c < C; ++c) {
              const auto* x = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
              const __m256i d0 = _mm256_add_epi32(idot<kBits, 0, 4>(ops, x->qs + 32 * g),
                                                  _mm256_set1_epi32(offset(x, 2 * g)));
              const __m256i d1 = _mm256_add_epi32(idot<kBits, 4, 8>(ops, x->qs + 32 * g),
                                                  _mm256_set1_epi32(offset(x, 2 * g + 1)));
              // (|d| < 2^18: 16 values of 63 x 127 and q6_k's offset -32 x 16 x 127)
              isc[h][c] = add_scaled_rows(add_scaled_rows(isc[h][c], d0, sc0), d1, sc0 + 16);
            }
          }
        }
        for (int h = 0; h < 2; ++h) {
          const HalfScales<kMinPairs> hs(pb, h, 320);
          for (int c = 0; c < C; ++c) {
            const auto* x = reinterpret_cast<const ActQ8K*>(ta.act + c * ta.astride) + sb;
            if constexpr (kTernary) isc[h][c] = ternary_sum(isc[h][c], x);
            acc[p][h][c] = hs.update(acc[p][h][c], isc[h][c], x->d, x->s16);
          }
        }
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// ---- iq4_xs and the grid types: signed values, 8 groups of 32 with i8 scales ----

// Grid types (iq2_xxs .. iq3_s, panel.h IqGridPanel), half h of a group: the 8
// rows' grid indices of entry e (index bytes and high-bit row masks).
template <DType kT>
inline __m256i iq_grid_index(const uint8_t* gp, int h, int e) {
  constexpr IqGridPanel L = iq_grid_panel(kT);
  __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp + 16 * e + 8 * h)));
  const __m256i row_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int p = 0; p < L.hi_planes; ++p) {
    const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(gp[L.hi + 2 * (p * L.entries + e) + h]), row_bit);
    idx = _mm256_or_si256(idx,
                          _mm256_and_si256(_mm256_cmpeq_epi32(bits, row_bit), _mm256_set1_epi32(256 << p)));
  }
  return idx;
}

// The magnitudes mag of operand o of half h with their signs: sign bit b of the
// half's 32 (row b / 4, weight b % 4) negates byte b.
template <DType kT>
inline __m256i iq_grid_signed(const uint8_t* gp, int h, int o, __m256i mag) {
  constexpr IqGridPanel L = iq_grid_panel(kT);
  uint32_t sign;
  std::memcpy(&sign, gp + L.signs + 8 * o + 4 * h, 4);
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(sign)),
                          _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                           2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i byte_bit = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(spread, byte_bit), byte_bit);
  return _mm256_sub_epi8(_mm256_xor_si256(mag, neg), neg);
}

// The 8-byte grid entries of 8 rows (indices idx) by two vpgatherdq: their low
// dwords in row order (lo) and their high dwords (hi).
inline void gather_entries(const long long* table, __m256i idx, __m256i& lo, __m256i& hi) {
  const __m256 q0 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm256_castsi256_si128(idx), 8));
  const __m256 q1 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm256_extracti128_si256(idx, 1), 8));
  // shuffle_ps: rows (0, 1, 4, 5 | 2, 3, 6, 7); vpermq puts them in order.
  lo = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(q0, q1, 0x88)), 0xd8);
  hi = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(q0, q1, 0xdd)), 0xd8);
}

// Operand o of half h alone: the 8 rows' signed grid values, entries by vpgatherdd.
template <DType kT>
inline __m256i iq_grid_operand(const uint8_t* gp, int h, int o) {
  constexpr IqGridPanel L = iq_grid_panel(kT);
  const auto* grid = static_cast<const uint8_t*>(iq_grid_table(kT));
  const int e = L.entries == 8 ? o : o / 2;
  const __m256i idx = iq_grid_index<kT>(gp, h, e);
  __m256i mag;
  if constexpr (L.entries == 8)
    mag = _mm256_i32gather_epi32(reinterpret_cast<const int*>(grid), idx, 4);
  else
    mag = _mm256_i32gather_epi32(reinterpret_cast<const int*>(grid + 4 * (o % 2)), idx, 8);
  return iq_grid_signed<kT>(gp, h, o, mag);
}

// All 8 operands of half h. iq2 fetches each entry's 8 bytes whole (two
// vpgatherdq of 4 rows, then its low and high dwords to operands 2e and 2e + 1):
// half the elements of two vpgatherdd.
template <DType kT>
inline void unpack_iq_grid(const uint8_t* gp, int h, __m256i (&ops)[8]) {
  constexpr IqGridPanel L = iq_grid_panel(kT);
  if constexpr (L.entries == 8) {
    for (int o = 0; o < 8; ++o) ops[o] = iq_grid_operand<kT>(gp, h, o);
  } else {
    const auto* grid = static_cast<const long long*>(iq_grid_table(kT));
    for (int e = 0; e < 4; ++e) {
      __m256i lo, hi;
      gather_entries(grid, iq_grid_index<kT>(gp, h, e), lo, hi);
      ops[2 * e] = iq_grid_signed<kT>(gp, h, 2 * e, lo);
      ops[2 * e + 1] = iq_grid_signed<kT>(gp, h, 2 * e + 1, hi);
    }
  }
}

// IQ1 (iq1_s, iq1_m; panel.h IqGridPanel), half h of a group: entry e's 8 rows'
// grid indices, and a dword of ones per row whose delta is negative.
inline __m256i iq1_index(const uint8_t* gp, int h, int e, __m256i& neg) {
  constexpr IqGridPanel L = iq_grid_panel(DType::iq1_s);
  const __m256i lo =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp + 16 * e + 8 * h)));
  const __m256i nib = _mm256_and_si256(
      _mm256_srli_epi32(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp + L.hi + 8 * e))), 4 * h),
      _mm256_set1_epi32(15));
  const __m256i eight = _mm256_set1_epi32(8);
  neg = _mm256_cmpeq_epi32(_mm256_and_si256(nib, eight), eight);
  return _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(7)), 8));
}

// v (8g + 1 per byte, kIq1Values) less 2 in the rows of neg: the values 8g +- 1.
inline __m256i iq1_shifted(__m256i v, __m256i neg) {
  return _mm256_sub_epi8(v, _mm256_and_si256(neg, _mm256_set1_epi8(2)));
}

// Operand o of half h alone (entry o / 2's low or high dwords, by vpgatherdd).
inline __m256i iq1_operand(const uint8_t* gp, int h, int o) {
  __m256i neg;
  const __m256i idx = iq1_index(gp, h, o / 2, neg);
  const auto* table = reinterpret_cast<const int*>(kIq1Values.entry) + o % 2;
  return iq1_shifted(_mm256_i32gather_epi32(table, idx, 8), neg);
}

// All 8 operands of half h: each entry's 8 bytes whole, as unpack_iq_grid's iq2.
inline void unpack_iq1(const uint8_t* gp, int h, __m256i (&ops)[8]) {
  const auto* table = reinterpret_cast<const long long*>(kIq1Values.entry);
  for (int e = 0; e < 4; ++e) {
    __m256i neg, lo, hi;
    gather_entries(table, iq1_index(gp, h, e, neg), lo, hi);
    ops[2 * e] = iq1_shifted(lo, neg);
    ops[2 * e + 1] = iq1_shifted(hi, neg);
  }
}

// Operands are the signed values (iq4_xs: codebook values, |v| <= 127; the grid
// types: grid values with their signs, |v| <= 62; unpacked panels hold them as
// they are), dotted with the signed act values by the sign trick: a vpmaddubsw
// pair sum reaches 2 * 127 * 127, so each goes to vpmaddwd by its group's (or
// sub-block's) scales (scales_x2) alone. Per lane the f32 sequence is K16Impl's
// of the AVX-512 kernels: acc = fma(float(I), d * (d_x * f), acc).
template <DType kKind, bool kUnpacked = false>
struct SignedK16Impl {
  static constexpr bool kGrid = is_iq_grid(kKind);
  static constexpr int kP1 = kMaxDecodePanelsQuant, kPB = 1, kCB = 4;
  static constexpr bool kDecodePanelsChosen = true;  // KernelArgs::decode_panels
  static constexpr bool kTokensOuter = true;
  // Scales per 32 (i8[8][16]) or, iq2_xs / iq2_s, per 16 (i8[16][16]).
  static constexpr bool kPer16 = kGrid && iq_grid_traits(kKind).scale_group == 16;
  static constexpr float kDFactor = kGrid ? iq_grid_traits(kKind).factor : 1.0f;
  static constexpr size_t kScales = 32, kHeader = kGrid ? iq_grid_panel(kKind).header : 160;
  static constexpr size_t kGroup = kUnpacked ? kUnpackedGroup : kGrid ? iq_grid_panel(kKind).group : 256;
  // Unpacked grid panels read act rows offset by +128 (ActKind::q8k_u8, as K16Impl's
  // q6_k and q3_k): vpmaddubsw(x + 128, w) takes the place of the sign trick's vpsignb
  // + vpmaddubsw. Its pair sums reach 2 * 255 * max|w|: iq3_s's (15) and IQ1's (9) in runs of 4
  // operands still fit int16, iq3_xxs's (62) and iq2's (43) go to vpmaddwd one by one.
  // What the +128 adds depends on the weights alone (kWeightSums: per superblock and
  // row, 128 x the sum over sub-blocks of scale x the sum of its values), subtracted
  // once per superblock. iq4_xs (|v| <= 127) keeps the sign trick.
  static constexpr bool kU8Acts = kUnpacked && kGrid;
  static constexpr int u8_run() {
    if constexpr (kGrid) return 4 * 2 * 255 * iq_weight_max<kKind>() <= 32767 ? 4 : 1;
    return 1;
  }
  static constexpr int kU8Run = u8_run();
  static constexpr size_t kWeightSums = kHeader + 8 * kGroup;
  static constexpr size_t kPBB = kWeightSums + (kU8Acts ? 64 : 0);
  static_assert(kUnpacked || kGrid || kPBB == 2208);
  using Unpacked = SignedK16Impl<kKind, true>;
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K / 256) * kPBB; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    unpack_superblocks<SignedK16Impl<kKind, false>, SignedK16Impl, kHeader>(pan, K, out);
    if constexpr (kU8Acts)
      for (int64_t sb = 0; sb < K / 256; ++sb) store_weight_sums(out + sb * kPBB);
  }
  // kWeightSums of an unpacked superblock (store_u8_weight_sums; per 32, the same scale twice).
  static void store_weight_sums(uint8_t* pb) {
    store_u8_weight_sums(pb, kHeader, kGroup, kWeightSums,
                         [](const uint8_t* b, int g, int s, int h) { return scales(b, g, s, h); });
  }
  static __m256i operand(const uint8_t* gp, int h, int o) {
    if constexpr (kUnpacked) return load256(gp + 64 * o + 32 * h);
    if constexpr (is_iq1(kKind)) return iq1_operand(gp, h, o);
    if constexpr (kGrid) return iq_grid_operand<kKind>(gp, h, o);
    return iq4_operand(gp, h, o);
  }
  static void unpack(const uint8_t* gp, int h, __m256i (&ops)[8]) {
    if constexpr (kUnpacked)
      load_unpacked(gp, h, ops);
    else if constexpr (is_iq1(kKind))
      unpack_iq1(gp, h, ops);
    else if constexpr (kGrid)
      unpack_iq_grid<kKind>(gp, h, ops);
    else
      unpack_iq4(gp, h, ops);
  }
  // Half h's scales of group g (per 16: sub-block 2g + s) at pb.
  static const uint8_t* scales(const uint8_t* pb, int g, int s, int h) {
    return pb + kScales + (kPer16 ? 32 * g + 16 * s : 16 * g) + 8 * h;
  }
  // Batch tiles, one half over the whole K, operand-major (see Q32Impl::run_batch).
  template <int P, int C>
  static void run_batch(const TileArgs& ta) {
    const int64_t nsb = ta.K / 256;
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        __m256 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; ++sb) {
          const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
          const ActQ8K* x[C];
          __m256i isc[C];
          start_superblock(ta, sb, x, isc);
          for (int g = 0; g < 8; ++g) {
            const __m256i sc[2] = {scales_x2(scales(pb, g, 0, h)), scales_x2(scales(pb, g, 1, h))};
            const uint8_t* gp = pb + kHeader + g * kGroup;
            if constexpr (kU8Acts) {
              const int8_t* xq[C];
              for (int c = 0; c < C; ++c) xq[c] = x[c]->qs + 32 * g;
              group_dots<kU8Run, C, true, kPer16 ? 4 : 8>(
                  [&](int o) { return load256(gp + 64 * o + 32 * h); }, xq, sc, isc);
              continue;
            }
#if LOOM_AVX2_VNNI
            // Each scale unit (16 values, or 32 with one scale per 32) by vpdpbusd,
            // then scaled once (add_scaled; a unit's dot is under 2^20).
            constexpr int kUnit = kPer16 ? 4 : 8;
            const __m256i sw[2] = {scale_words(sc[0]), scale_words(sc[1])};
            __m256i d[C];
#endif
#pragma GCC unroll 8
            for (int o = 0; o < 8; ++o) {
              const __m256i w = operand(gp, h, o), aw = _mm256_sign_epi8(w, w);
#pragma GCC unroll 8
              for (int c = 0; c < C; ++c) {
                const __m256i xs = _mm256_sign_epi8(bcast32(x[c]->qs + 32 * g + 4 * o), w);
#if LOOM_AVX2_VNNI
                unit_dot<kUnit>(o, aw, xs, sw, d[c], isc[c]);
#else
                isc[c] = _mm256_add_epi32(isc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), sc[o / 4]));
#endif
                keep_in_register(isc[c]);
              }
            }
          }
          if constexpr (kU8Acts) {
            const __m256i ws = load256(pb + kWeightSums + 32 * h);
            for (int c = 0; c < C; ++c) isc[c] = _mm256_sub_epi32(isc[c], ws);
          }
          const HalfScales<0> hs(pb, h, 0);
          for (int c = 0; c < C; ++c) acc[c] = hs.update(acc[c], isc[c], x[c]->d * kDFactor, nullptr);
        }
        for (int c = 0; c < C; ++c)
          store_rows(ta.y + c * ta.ldy + p * 16 + h * 8, acc[c], ta.nv - p * 16 - h * 8);
      }
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    if constexpr (C > 1 || kU8Acts)  // (a batch's last tile may have one token)
      run_batch<P, C>(ta);
    else
      run_decode<P>(ta);
  }
  // Decode tiles (one token): block-major, both halves per block.
  template <int P>
  static void run_decode(const TileArgs& ta) {
    constexpr int C = 1;
    __m256 acc[P][2][C];
    zero_tile(acc);
    const int64_t nsb = ta.K / 256;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + sb * kPBB;
        const auto* x = reinterpret_cast<const ActQ8K*>(ta.act) + sb;
        __m256i isc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int g = 0; g < 8; ++g) {
          if constexpr (!kUnpacked) prefetch_group(pb, g, kHeader, kGroup);
          for (int h = 0; h < 2; ++h) {
            __m256i ops[8], absw[8];
            unpack(pb + kHeader + g * kGroup, h, ops);
            for (int o = 0; o < 8; ++o) absw[o] = _mm256_sign_epi8(ops[o], ops[o]);
            for (int s = 0; s < (kPer16 ? 2 : 1); ++s) {
              const int8_t* xq = x->qs + 32 * g;
              const __m256i dot =
                  kPer16 ? idot_s8_range(absw, ops, xq, 4 * s, 4 * s + 4) : idot_s8(absw, ops, xq);
              isc[h] = add_scaled_rows(isc[h], dot, scales(pb, g, s, h));  // (|dot| < 2^20: 32 of 128 x 127)
            }
          }
        }
        for (int h = 0; h < 2; ++h) {
          const HalfScales<0> hs(pb, h, 0);
          acc[p][h][0] = hs.update(acc[p][h][0], isc[h], x->d * kDFactor, nullptr);
        }
      }
    }
    store_tile<P, C>(ta, acc);
  }
};
// The signed-value types take the K16 family's place in the dtype switch (fenced:
// this clang-format mangles requires-clauses).
// clang-format off
template <DType kKind, bool kUnpacked>
  requires(kKind == DType::iq4_xs || is_iq_grid(kKind))
struct K16Impl<kKind, kUnpacked> : SignedK16Impl<kKind, kUnpacked> {};
// clang-format on

// Zeroed sums and the f32 act rows of a float-activation tile.
template <int P, int C>
inline void start_float_tile(const TileArgs& ta, __m256 (&acc)[P][2][C], const float* (&x)[C]) {
  zero_tile(acc);
  for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const float*>(ta.act + c * ta.astride);
}

// ---- bf16 panels (pair rows): vdpbf16ps emulated exactly (see the AVX-512
// file): per pair, the odd product then the even one, under DAZ + FTZ; act rows
// are the bf16-rounded values as floats (ActKind::bf16f32). ----

// acc[h][c] += odd[h] * x[c][2j + 1], then += even[h] * x[c][2j]: one pair of a
// bf16 tile, the odd product first as vdpbf16ps; each of a token's two
// broadcasts serves both halves before the next is loaded.
template <int C>
inline void pair_fmas(__m256 (&acc)[2][C], const __m256 (&odd)[2], const __m256 (&even)[2],
                      const float* const (&x)[C], int64_t j) {
  for (int c = 0; c < C; ++c) {
    const __m256 xo = _mm256_set1_ps(x[c][2 * j + 1]);
    for (int h = 0; h < 2; ++h) acc[h][c] = _mm256_fmadd_ps(odd[h], xo, acc[h][c]);
    const __m256 xe = _mm256_set1_ps(x[c][2 * j]);
    for (int h = 0; h < 2; ++h) acc[h][c] = _mm256_fmadd_ps(even[h], xe, acc[h][c]);
  }
}

// Each sum is a chain of two dependent FMAs per pair, so a tile needs 10 sums
// (2 FMAs per cycle x 5 cycles of latency) to keep the FMAs busy: with 8 an AMD
// Zen 2 ran 1.6 FMAs per cycle. 10 sums, 4 weight halves and one broadcast at a
// time fill 15 of the 16 ymm registers, so the AND mask of the odd halves is
// reloaded from memory each pair (as vpand's memory operand): hoisted into the
// 16th register it made GCC spill a sum. Two shifts instead ran as fast on the
// Zen 2 but take the FMA ports on Intel cores, where vpand need not. Zen 2, one
// core, T = 512: 61-65 -> 70-74 GFLOP/s.
struct Bf16WidenedImpl;

struct Bf16EmuImpl {
  static constexpr int kP1 = 2, kPB = 1, kCB = 5;
  static constexpr bool kTokensOuter = true;
  using Unpacked = std::conditional_t<LOOM_AVX2_VNNI, Bf16WidenedImpl, void>;
  template <int P, int C>
  static void run(const TileArgs& ta) {
    __m256 acc[P][2][C];
    const float* x[C];
    start_float_tile(ta, acc, x);
    alignas(32) static constexpr uint32_t kHiMask[8] = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                                        0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};
    const int64_t pairs = bf16_pair_count(ta.K);
    for (int64_t j = 0; j < pairs; ++j) {
      if constexpr (C == 1)
        for (int p = 0; p < P; ++p) prefetch_ahead<kAhead, 64>(ta.pan + p * ta.pstride + j * 64);
      const uint32_t* hi_mask = kHiMask;
      asm("" : "+r"(hi_mask));  // reloaded per pair: see above
      // Both halves unpacked first, then the pair's FMAs.
      for (int p = 0; p < P; ++p) {
        __m256 odd[2], even[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i w = load256(ta.pan + p * ta.pstride + j * 64 + 32 * h);
          odd[h] = _mm256_castsi256_ps(
              _mm256_and_si256(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(hi_mask))));
          even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        }
        pair_fmas(acc[p], odd, even, x, j);
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// Batches of the AVX-VNNI build (as its f16 ones, FloatImpl): the pair rows
// widened to f32 once per call, per pair the odd elements' 16 rows then the
// even ones' (128 bytes), so the tile's FMAs take them without the AND and
// the shift: the same FMAs on the same values in the same order (and under
// the same DAZ + FTZ), the same bits. Emerald Rapids, LOOM_CPU=avx2-vnni:
// see bench/README.md ("AVX2 with AVX-VNNI").
struct Bf16WidenedImpl {
  static constexpr int kP1 = 2, kPB = 1, kCB = 5;
  static constexpr bool kTokensOuter = true;
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(bf16_pair_count(K)) * 128; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t j = 0; j < bf16_pair_count(K); ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = load256(pan + j * 64 + 32 * h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 128 + 32 * h), _mm256_and_si256(w, hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 128 + 64 + 32 * h),
                            _mm256_slli_epi32(w, 16));
      }
  }
  template <int P, int C>
  static void run(const TileArgs& ta) {
    __m256 acc[P][2][C];
    const float* x[C];
    start_float_tile(ta, acc, x);
    const int64_t pairs = bf16_pair_count(ta.K);
    for (int64_t j = 0; j < pairs; ++j)
      for (int p = 0; p < P; ++p) {
        const auto* w = reinterpret_cast<const float*>(ta.pan + p * ta.pstride + j * 128);
        __m256 odd[2], even[2];
        for (int h = 0; h < 2; ++h) {
          odd[h] = _mm256_loadu_ps(w + 8 * h);
          even[h] = _mm256_loadu_ps(w + 16 + 8 * h);
        }
        pair_fmas(acc[p], odd, even, x, j);
      }
    store_tile<P, C>(ta, acc);
  }
};

// ---- f32 / f16 ----

// f16 batches: the plain AVX2 build keeps their packed panels (widened to f32
// once per call, the AVX-512 kernels' way, they ran 0.91-0.93x on an AMD Zen 2,
// this loop being bound by its two load ports). The AVX-VNNI build widens them
// (F16WidenedImpl): AVX-VNNI without AVX-512 means Intel's cores since Alder
// Lake, with three load ports, where vcvtph2ps takes an FMA port's slot; an
// Emerald Rapids under LOOM_CPU=avx2-vnni ran the T = 512 tiles at 78-82
// GFLOP/s per core widened, 70-77 packed.
// Five tokens per batch tile (10 sums, 2 weights, 1 broadcast: 13 of the 16 ymm
// registers): with six, GCC kept one sum on the stack, and each k then waited on
// a store-to-load round trip plus the FMA. An AMD Zen 4 hid that; a Zen 2 ran
// the f16 T = 512 tiles at 37 GFLOP/s per core with six and 67-77 with five.
struct F16WidenedImpl;

template <DType kKind>
struct FloatImpl {
  static constexpr int kP1 = 2, kPB = 1, kCB = 5;
  static constexpr bool kTokensOuter = true;
  static constexpr size_t kStep = kKind == DType::f32 ? 64 : 32;
  using Unpacked = std::conditional_t<LOOM_AVX2_VNNI && kKind == DType::f16, F16WidenedImpl, void>;
  static __m256 load(const uint8_t* p, int h) {
    if constexpr (kKind == DType::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * h);
    return load_f16x8(p + 16 * h);
  }
  // Out of line: inlined into walk_tiles, whose loop variables stay live across
  // the tile, GCC kept one of the five act pointers on the stack and reloaded it
  // every column (Zen 5, LOOM_CPU=avx2, the 1B-shape F16 file's pp512: 225-231 ->
  // 235-236 t/s). The bf16 tile above is faster inlined.
  template <int P, int C>
  [[gnu::noinline]] static void run(const TileArgs& ta) {
    __m256 acc[P][2][C];
    const float* x[C];
    start_float_tile(ta, acc, x);
    for (int64_t k = 0; k < ta.K; ++k) {
      if constexpr (C == 1)
        if ((k * kStep) % 64 == 0)
          for (int p = 0; p < P; ++p) prefetch_ahead<kAhead, 64>(ta.pan + p * ta.pstride + k * kStep);
      // Both halves' weights first, then one broadcast per token for both: the
      // broadcasts are loads, and the load ports (not the FMAs) bound this loop.
      for (int p = 0; p < P; ++p) {
        const __m256 w0 = load(ta.pan + p * ta.pstride + k * kStep, 0);
        const __m256 w1 = load(ta.pan + p * ta.pstride + k * kStep, 1);
        for (int c = 0; c < C; ++c) {
          const __m256 xc = _mm256_set1_ps(x[c][k]);
          acc[p][0][c] = _mm256_fmadd_ps(w0, xc, acc[p][0][c]);
          acc[p][1][c] = _mm256_fmadd_ps(w1, xc, acc[p][1][c]);
        }
      }
    }
    store_tile<P, C>(ta, acc);
  }
};

// The f32 tiles on the f16 panels widened (exact): the same FMAs on the same
// values in the same order, so the same bits as the packed tiles.
struct F16WidenedImpl : FloatImpl<DType::f32> {
  static size_t panel_bytes(int64_t K) { return static_cast<size_t>(K) * 64; }
  static void unpack_panel(const uint8_t* pan, int64_t K, uint8_t* out) {
    for (int64_t k = 0; k < K; ++k)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(reinterpret_cast<float*>(out + 64 * k + 32 * h), load_f16x8(pan + 32 * k + 16 * h));
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

// q6_k, q3_k and the grid types: the unpacked kernel takes q8k_u8 rows (K16Impl::kU8Acts,
// SignedK16Impl::kU8Acts), the packed one q8k.
template <DType kT>
[[gnu::noinline]] void u8_family_kernel(const KernelArgs& a) {
  const bool unpacked = a.tmp != nullptr && runs_unpacked<K16Impl<kT>>(a.K, a.T, a.tmp_bytes);
  LOOM_ASSERT(!a.q8k_u8 || unpacked);  // (matmul decides as avx2_u8_acts)
  if (a.q8k_u8 || !unpacked) return drive_tiles<K16Impl<kT>>(a);
  KernelArgs packed = a;
  packed.tmp = nullptr;
  packed.tmp_bytes = 0;
  drive_tiles<K16Impl<kT>>(packed);
}

// Out of line: inlined into panel_kernel_avx2 beside the other families, the bf16
// tile had GCC keep 6 of its 10 sums on the stack (Zen 2, T = 512: 89 -> 63-69
// GFLOP/s; see Bf16EmuImpl).
[[gnu::noinline]] void bf16_emu_kernel(const KernelArgs& a) {
  const DenormalsAreZero daz;
  drive_tiles<Bf16EmuImpl>(a);
}

}  // namespace

#if LOOM_AVX2_VNNI
UnpackedPanels unpacked_panels_avx2_vnni(DType type, int64_t K) {
#else
UnpackedPanels unpacked_panels_avx2(DType type, int64_t K) {
#endif
  if (type == DType::bf16) return unpacked_panels_for<Bf16EmuImpl>(K);  // bf16_emu_kernel's
  return unpacked_panels_of<Q32Packed, Q45KPacked, K16Packed, FloatImpl>(type, K);
}

// Runs f.template operator()<kT>() for the kT of kTs equal to type; returns whether one was.
template <DType... kTs, class F>
static bool visit_one_of(DType type, F&& f) {
  return ((type == kTs && (f.template operator()<kTs>(), true)) || ...);
}

// visit_one_of over the q8k_u8 family (q6_k, q3_k, the grid types).
template <class F>
static bool visit_u8_family(DType type, F&& f) {
  return visit_one_of<DType::q6_k, DType::q3_k, DType::iq2_xxs, DType::iq2_xs, DType::iq2_s, DType::iq3_xxs,
                      DType::iq3_s, DType::iq1_s, DType::iq1_m>(type, f);
}

#if LOOM_AVX2_VNNI
void panel_kernel_avx2_vnni(DType type, const KernelArgs& a) {
#else
bool avx2_u8_acts(DType type, int64_t K, int64_t T, size_t tmp_bytes) {
  bool u8 = false;
  visit_u8_family(type, [&]<DType kT>() { u8 = runs_unpacked<K16Impl<kT>>(K, T, tmp_bytes); });
  return u8;
}

void panel_kernel_avx2(DType type, const KernelArgs& a) {
#endif
  if (visit_u8_family(type, [&]<DType kT>() { u8_family_kernel<kT>(a); })) return;
  if (type == DType::nf4) return nf4_panel_kernel_avx2(a);
  if (type == DType::i8_ch) return i8ch_panel_kernel_avx2(a);
  if (type == DType::bf16) return bf16_emu_kernel(a);
  run_panel_kernel<Q32Packed, Q45KPacked, K16Packed, FloatImpl>(type, a);
}

}  // namespace loom::cpu
