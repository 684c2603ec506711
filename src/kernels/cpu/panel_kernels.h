// Tile drivers shared by the AVX2 and AVX-512 panel kernels: walk a range of
// panels x tokens in register tiles of P panels x C tokens. The per-lane
// arithmetic of a tile never depends on P or C, so the choice of tile shapes
// (and of thread split) cannot change any result. Included by files compiled
// with different ISA flags: their Impl types live in anonymous namespaces, so
// every instantiation is local to its file (no ODR mixing of ISAs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/panel.h"
#include "kernels/quant_blocks.h"

namespace loom::cpu {
namespace {  // see above: keeps each ISA's instantiations in its own file

struct TileArgs {
  const uint8_t* pan;  // first panel of the tile
  size_t pstride;
  const uint8_t* act;  // first token's act row
  size_t astride;
  int64_t K;
  float* y;  // y of (first token, first row of first panel)
  int64_t ldy;
  int64_t nv;  // valid rows counted from the first panel (may exceed 16*P)
};

template <class Impl, int P, int C>
inline void dispatch_c(int cn, const TileArgs& ta) {
  if constexpr (C >= 1) {
    if (cn == C) {
      Impl::template run<P, C>(ta);
      return;
    }
    dispatch_c<Impl, P, C - 1>(cn, ta);
  }
}

template <class Impl, int P, int C>
inline void dispatch_pc(int pn, int cn, const TileArgs& ta) {
  if constexpr (P >= 1) {
    if (pn == P) {
      dispatch_c<Impl, P, C>(cn, ta);
      return;
    }
    dispatch_pc<Impl, P - 1, C>(pn, cn, ta);
  }
}

inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// Decode (one token) streams every panel once from DRAM, and the hardware
// prefetchers alone leave the core waiting on it: measured on an AMD Zen 5 with
// 256 MiB of q4_0 weights, 30 GB/s without and 40 GB/s with these hints, as fast
// as f32 streams (bench: Matmul/<type>/matvec_dram). Each decode kernel touches
// the cache lines kAhead bytes ahead of the `kBytes` it is about to read in a
// panel. Batches reuse each panel for many tokens and need no hints.
//
// The distance is per kernel family. AVX-512 kernels: 1536 bytes (24 lines),
// measured on the Zen 5. AVX2 kernels: 768 (12 lines). On an AMD Zen 2 (AVX2
// only, 2 threads) 1536 left the decode matmuls reading 18-20 GB/s where 768
// read 22-25 (SmolLM2 Q8_0 tg128 133 -> 153 t/s; Q4_0, Q4_K_M, Q4_1, Q3_K_M,
// Q6_K, BF16 and a 1B-shape Q4_K_M / Q6_K 1.05-1.2x; F16 unchanged; 512, 1024
// and 3072 were slower than 768): hints past what the core's miss buffers track
// hold up the loads they were meant to serve. The AVX2-only class is also where
// the cores with the fewest of them are (10-12 fill buffers on Intel's Haswell
// to Skylake clients), so the shorter distance is the one for that class. The
// AVX2 kernels built for AVX-VNNI (panel_kernels_avx2_vnni.cpp) take the AVX-512
// distance: AVX-VNNI without AVX-512 means Intel's cores since Alder Lake, with
// 16 fill buffers; on an Emerald Rapids under LOOM_CPU=avx2-vnni, 2 threads,
// 1536 against 768: DRAM matvecs (q4_k, q6_k, q8_0) 0.79-0.93x the time,
// 1B-shape Q4_K_M / Q6_K tg64 1.17x / 1.14x, SmolLM2 Q8_0 tg128 1.27x.
constexpr size_t kPrefetchBytesAvx512 = 1536;
constexpr size_t kPrefetchBytesAvx2 = 768;

// Panels per decode tile. The integer-dot (quantized) families declare
// kDecodePanelsChosen and take KernelArgs::decode_panels, capped at their kP1
// (kMaxDecodePanelsQuant; panel.h's decode_panels_quant says why 1 or 2). The
// float kernels always take their kP1 (several panels: their one FMA chain per
// output would bound a single panel, f16 from L2 52 -> 29 GB/s, and their DRAM
// speed did not move with the panel count). Integer dots keep two vpdpbusd
// chains per output at one or two panels (kChainsFor), so from cache they lose little.
template <class Impl>
int decode_tile_panels(const KernelArgs& a) {
  if constexpr (requires { Impl::kDecodePanelsChosen; })
    return a.decode_panels < Impl::kP1 ? a.decode_panels : Impl::kP1;
  else
    return Impl::kP1;
}
template <size_t kAhead, size_t kBytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (size_t o = 0; o < kBytes; o += 64) __builtin_prefetch(p + kAhead + o, 0, 3);
}

// Batch tiles of the AVX-512 integer kernels walk tokens outside panels within a
// group of panels of about kTileGroupBytes (panel.h): a tile's act rows (C
// tokens, 3-24 KiB) stay in L1 for every panel of the group, and the group stays
// in L2 for every token. The panel-outer order re-read each token's act row from L2 once per
// panel, 4 bytes per vpdpbusd; on an AMD Zen 4 the token order ran T = 512
// tiles 5-29% faster (q4_0 .. q8_0, q4_k, q5_k, q6_k; Matmul/<type>/T512_*,
// same-moment pairs). The AVX2 kernels (4 or 6 tokens per tile) walk the same
// way: one core, LOOM_CPU=avx2, T = 512, 1.0-1.24x per kernel (q4_0 1.24x, q3_k
// 1.2x, q6_k/q5_k at K = 768 1.1x; floats 1.0-1.05x; the same at K = 8192, where a
// group is one unpacked panel).

// Bytes of a group of 32 values in an unpacked panel (has_unpacked below): the
// 8 operands of 16 rows x 4 values, each as one whole byte.
constexpr size_t kUnpackedGroup = 512;

template <class Impl>
constexpr bool tokens_outer() {
  if constexpr (requires { Impl::kTokensOuter; })
    return Impl::kTokensOuter;
  else
    return false;
}

// Walks a's tiles: groups of `group` panels (a multiple of the batch tile's
// panels), tokens inside a group, panels inside a token tile.
template <class Impl>
void walk_tiles(const KernelArgs& a, int64_t group) {
  const bool decode = a.T == 1;
  const int PT = decode ? decode_tile_panels<Impl>(a) : Impl::kPB;
  const int CT = decode ? 1 : Impl::kCB;
  for (int64_t p0 = 0; p0 < a.n_panels; p0 += group) {
    const int64_t p1 = min_i64(p0 + group, a.n_panels);
    for (int64_t t = 0; t < a.T; t += CT) {
      const int cn = static_cast<int>(min_i64(CT, a.T - t));
      for (int64_t p = p0; p < p1; p += PT) {
        const int pn = static_cast<int>(min_i64(PT, p1 - p));
        TileArgs ta{
            a.panels + p * a.panel_stride,    a.panel_stride, a.act + t * a.act_stride,  a.act_stride, a.K,
            a.y + t * a.ldy + p * kPanelRows, a.ldy,          a.n_valid - p * kPanelRows};
        if (decode)
          dispatch_pc<Impl, Impl::kP1, 1>(pn, 1, ta);
        else
          dispatch_pc<Impl, Impl::kPB, Impl::kCB>(pn, cn, ta);
      }
    }
  }
}

// An Impl may name a kernel for its panels unpacked to whole bytes, `Unpacked`,
// with panel_bytes(K) and unpack_panel(packed, K, out): a batch with a.tmp then
// unpacks each group of panels into it once and runs every token tile on the
// unpacked copy, where the packed kernel unpacks each panel once per tile of
// kCB tokens (the shifts and masks of the low and high bits; f16's conversion to
// f32). The copy holds the same values, so no result changes. Within a group, tiles go in the
// Impl's order (kTokensOuter or not). Scratch for fewer than one tile's kPB
// panels leaves the batch on the packed panels.
template <class Impl>
constexpr bool has_unpacked() {
  return requires { Impl::Unpacked::panel_bytes(int64_t{}); };
}

template <class Impl>
void drive_unpacked(const KernelArgs& a, size_t panel_bytes) {
  using U = typename Impl::Unpacked;
  const int64_t group = static_cast<int64_t>(a.tmp_bytes / panel_bytes) / U::kPB * U::kPB;  // >= kPB
  auto* buf = static_cast<uint8_t*>(a.tmp);
  for (int64_t p0 = 0; p0 < a.n_panels; p0 += group) {
    const int64_t pn = min_i64(group, a.n_panels - p0);
    for (int64_t i = 0; i < pn; ++i)
      U::unpack_panel(a.panels + (p0 + i) * a.panel_stride, a.K, buf + static_cast<size_t>(i) * panel_bytes);
    KernelArgs g = a;
    g.panels = buf;
    g.panel_stride = panel_bytes;
    g.n_panels = pn;
    g.y = a.y + p0 * kPanelRows;
    g.n_valid = a.n_valid - p0 * kPanelRows;
    walk_tiles<U>(g, tokens_outer<U>() ? pn : U::kPB);
  }
}

// Whether drive_tiles runs a batch of T tokens with tmp_bytes of scratch (tmp
// given) on the unpacked panels.
template <class Impl>
bool runs_unpacked(int64_t K, int64_t T, size_t tmp_bytes) {
  if constexpr (has_unpacked<Impl>())
    return T > 1 && tmp_bytes >= Impl::Unpacked::panel_bytes(K) * Impl::Unpacked::kPB;
  else
    return false;
}

// Impl provides run<P, C>(const TileArgs&), the tile sizes kP1 (panels per tile
// when T == 1), kPB and kCB (panels and tokens per tile when T > 1), and
// optionally kTokensOuter and Unpacked (above). Each tile covers the whole K,
// so the order of tiles changes no result.
template <class Impl>
void drive_tiles(const KernelArgs& a) {
  if constexpr (has_unpacked<Impl>())
    if (a.tmp != nullptr && runs_unpacked<Impl>(a.K, a.T, a.tmp_bytes))
      return drive_unpacked<Impl>(a, Impl::Unpacked::panel_bytes(a.K));
  // One tile's worth walks panels outermost.
  int64_t group = a.T == 1 ? decode_tile_panels<Impl>(a) : Impl::kPB;
  if (tokens_outer<Impl>())
    group = std::max<int64_t>(group, kTileGroupBytes / static_cast<int64_t>(a.panel_stride) / group * group);
  walk_tiles<Impl>(a, group);
}

// The dtype switch of every ISA file, given its kernel families (templates over
// the weight type): Q32 (q4_0 .. q8_0), Q45K (q4_k, q5_k), K16 (q6_k, q3_k,
// q2_k) and Flt (f32, f16); bf16 has its own kernels in each file. Returns
// fn.template operator()<Impl>() for the type's Impl (Impl = void for a type of
// none of the families).
template <template <DType> class Q32, template <DType> class Q45K, template <DType> class K16,
          template <DType> class Flt, class Fn>
decltype(auto) visit_kernel_family(DType type, Fn&& fn) {
  switch (type) {
    case DType::q4_0:
      return fn.template operator()<Q32<DType::q4_0>>();
    case DType::q4_1:
      return fn.template operator()<Q32<DType::q4_1>>();
    case DType::q5_0:
      return fn.template operator()<Q32<DType::q5_0>>();
    case DType::q5_1:
      return fn.template operator()<Q32<DType::q5_1>>();
    case DType::q8_0:
      return fn.template operator()<Q32<DType::q8_0>>();
    case DType::iq4_nl:
      return fn.template operator()<Q32<DType::iq4_nl>>();
    case DType::mxfp4:
      return fn.template operator()<Q32<DType::mxfp4>>();
    case DType::nvfp4:
      return fn.template operator()<Q32<DType::nvfp4>>();
    case DType::q1_0:
      return fn.template operator()<Q32<DType::q1_0>>();
    case DType::q4_k:
      return fn.template operator()<Q45K<DType::q4_k>>();
    case DType::q5_k:
      return fn.template operator()<Q45K<DType::q5_k>>();
    case DType::q6_k:
      return fn.template operator()<K16<DType::q6_k>>();
    case DType::q3_k:
      return fn.template operator()<K16<DType::q3_k>>();
    case DType::q2_k:
      return fn.template operator()<K16<DType::q2_k>>();
    case DType::tq2_0:  // ternary panels (matmul_panel_type)
      return fn.template operator()<K16<DType::tq2_0>>();
    case DType::iq4_xs:
      return fn.template operator()<K16<DType::iq4_xs>>();
    case DType::iq2_xxs:
      return fn.template operator()<K16<DType::iq2_xxs>>();
    case DType::iq2_xs:
      return fn.template operator()<K16<DType::iq2_xs>>();
    case DType::iq2_s:
      return fn.template operator()<K16<DType::iq2_s>>();
    case DType::iq3_xxs:
      return fn.template operator()<K16<DType::iq3_xxs>>();
    case DType::iq3_s:
      return fn.template operator()<K16<DType::iq3_s>>();
    case DType::iq1_s:
      return fn.template operator()<K16<DType::iq1_s>>();
    case DType::iq1_m:
      return fn.template operator()<K16<DType::iq1_m>>();
    case DType::f32:
      return fn.template operator()<Flt<DType::f32>>();
    case DType::f16:
      return fn.template operator()<Flt<DType::f16>>();
    default:
      return fn.template operator()<void>();
  }
}

template <template <DType> class Q32, template <DType> class Q45K, template <DType> class K16,
          template <DType> class Flt>
void run_panel_kernel(DType type, const KernelArgs& a) {
  visit_kernel_family<Q32, Q45K, K16, Flt>(type, [&]<class Impl>() {
    if constexpr (std::is_void_v<Impl>)
      __builtin_trap();  // the matmul driver only passes supported types
    else
      drive_tiles<Impl>(a);
  });
}

// The unpacked panels of Impl's batches (none: it has no unpacked form), as
// drive_tiles will ask of KernelArgs::tmp.
template <class Impl>
UnpackedPanels unpacked_panels_for(int64_t K) {
  if constexpr (has_unpacked<Impl>())
    return {Impl::Unpacked::panel_bytes(K), Impl::Unpacked::kPB};
  else
    return {};
}

// unpacked_panels_for the kernel family of `type` (none: a type of none).
template <template <DType> class Q32, template <DType> class Q45K, template <DType> class K16,
          template <DType> class Flt>
UnpackedPanels unpacked_panels_of(DType type, int64_t K) {
  return visit_kernel_family<Q32, Q45K, K16, Flt>(type, [&]<class Impl>() -> UnpackedPanels {
    if constexpr (std::is_void_v<Impl>)
      return {};
    else
      return unpacked_panels_for<Impl>(K);
  });
}

// Byte layout of a 32-element type's panel block (panel.h): f16 d @0, f16 m @32
// for the types with a min, q5's 5th-bit word, then the nibbles (q8_0: words @32).
// iq4_nl and mxfp4 are laid out as q4_0, their nibbles indices into a codebook
// (kCodebook: kIq4Values, kMxfp4Values). iq4_nl's values, like q8_0's, are
// signed bytes (kSigned), and both take the q8_0 act rows' aux (-128 * sum x)
// where a kernel multiplies them offset by +128 (kCodeBias). mxfp4's (|v| <= 12)
// run as unsigned codes v + 12 (aux -12 * sum x), on the int16 runs of 5-bit
// codes (kCodeBits: the bits the u8 codes need). mxfp4's scales are bf16 (kBf16Scale).
// nvfp4 is mxfp4's codes with a scale per 16 (kTwoScales): elements 0..15
// (operands 0..3) take the scales @0, 16..31 (operands 4..7) those @16 (kHiScale),
// each a byte per row (kU8Scale: the f16's bits >> 7, nvfp4_scale_code); each
// half's integer dot (and its half of the aux, nvfp4_act_aux) is scaled on its
// own, the low half first.
// q1_0 keeps a bit per weight (kBits 1: a u64 mask per operand, panel.h) and
// unpacks to q4_0's codes, 8 + 1 or 8 - 1, taking q4_0's act rows (aux -8 * sum x).
template <DType kT>
struct Block32Layout {
  static constexpr bool kMin = kT == DType::q4_1 || kT == DType::q5_1;
  static constexpr bool kTwoScales = kT == DType::nvfp4;
  static constexpr bool kFp4 = kT == DType::mxfp4 || kT == DType::nvfp4;  // kMxfp4Values, codes v + 12
  static constexpr bool kCodebook = kT == DType::iq4_nl || kFp4;
  static constexpr bool kBf16Scale = kT == DType::mxfp4;
  static constexpr bool kU8Scale = kT == DType::nvfp4;
  static constexpr size_t kScaleRowBytes = kU8Scale ? 1 : 2;  // a row's scale in the panel block
  static constexpr size_t kHiScale = 16 * kScaleRowBytes;     // kTwoScales: the high half's scales
  // The codebook's 16 values (kCodebook only).
  static constexpr const int8_t* codebook() { return kFp4 ? kMxfp4Values : kIq4Values; }
  static constexpr bool kSigned = kT == DType::q8_0 || kT == DType::iq4_nl;
  static constexpr int kCodeBias = kFp4 ? 12 : 128;  // u8 code = codebook value + this
  static constexpr int kBits = kT == DType::q8_0                        ? 8
                               : kT == DType::q1_0                      ? 1
                               : kT == DType::q5_0 || kT == DType::q5_1 ? 5
                                                                        : 4;
  static constexpr int kCodeBits = kBits == 1 ? 4 : kFp4 ? 5 : kBits;
  static constexpr size_t kBit4 = kMin ? 64 : 32;                   // q5's 5th-bit word
  static constexpr size_t kQuants = kBit4 + (kBits == 5 ? 64 : 0);  // nibbles / q8_0 words / q1_0 masks
  static constexpr size_t kPB = kQuants + (kBits == 8 ? 512 : kBits == 1 ? 64 : 256);
  // Unpacked (drive_unpacked): the scales as packed, then 8 whole-byte operands.
  static constexpr size_t kScaleBytes = kMin ? 64 : 32;
  // An unpacked block keeps nvfp4's scale codes widened back to f16 (d @0 and the
  // high half's @32, as q4_1's d and m), so batch tiles load plain f16 scales.
  static constexpr size_t kUnpackedScaleBytes = kMin || kU8Scale ? 64 : 32;
  static constexpr size_t kUnpackedPB = kUnpackedScaleBytes + 8 * 64;
  static void unpack_scales(const uint8_t* src, uint8_t* dst) {
    if constexpr (kU8Scale) {
      for (int i = 0; i < 32; ++i) {
        const auto h = static_cast<uint16_t>(src[i] << 7);
        std::memcpy(dst + 2 * i, &h, 2);
      }
    } else {
      std::memcpy(dst, src, kScaleBytes);
    }
  }
};
// The scale fields of an unpacked block of layout L (as L's, kU8Scale widened).
template <class L>
struct UnpackedScales {
  static constexpr bool kU8Scale = false, kBf16Scale = L::kBf16Scale;
  static constexpr size_t kScaleRowBytes = 2, kHiScale = 32;
};
static_assert(Block32Layout<DType::q4_0>::kPB == 288 && Block32Layout<DType::q4_1>::kPB == 320 &&
              Block32Layout<DType::q5_0>::kPB == 352 && Block32Layout<DType::q5_1>::kPB == 384 &&
              Block32Layout<DType::q8_0>::kPB == 544 && Block32Layout<DType::iq4_nl>::kPB == 288 &&
              Block32Layout<DType::q1_0>::kPB == 96 && Block32Layout<DType::nvfp4>::kPB == 288);

}  // namespace
}  // namespace loom::cpu
