// Packs GGUF weight rows into the 16-row panels the matmul kernels read
// (layouts in panel.h). Runs once per weight for PackedWeight, or per call for
// matmul on a plain Tensor.
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/nf4.h"
#include "kernels/cpu/panel.h"
#include "kernels/quant_blocks.h"

namespace loom::cpu {
static_assert(iq_grid_panel(DType::iq2_xxs).header + 8 * iq_grid_panel(DType::iq2_xxs).group == 1184);
static_assert(iq_grid_panel(DType::iq2_xs).header + 8 * iq_grid_panel(DType::iq2_xs).group == 1376);
static_assert(iq_grid_panel(DType::iq2_s).header + 8 * iq_grid_panel(DType::iq2_s).group == 1440);
static_assert(iq_grid_panel(DType::iq3_xxs).header + 8 * iq_grid_panel(DType::iq3_xxs).group == 1696);
static_assert(iq_grid_panel(DType::iq3_s).header + 8 * iq_grid_panel(DType::iq3_s).group == 1824);
static_assert(iq_grid_panel(DType::iq1_s).header + 8 * iq_grid_panel(DType::iq1_s).group == 928);
static_assert(iq_grid_panel(DType::iq1_m).header + 8 * iq_grid_panel(DType::iq1_m).group == 1056);
namespace {

constexpr int R = kPanelRows;

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// Writes a nibble group: v[0..31] are the 4-bit values (low 4 bits used) of a
// group's 32 elements; row r's words land at dst + o*64 + r*4.
void put_nibble_group(const uint8_t* v, int r, uint8_t* dst) {
  for (int o = 0; o < 4; ++o) {
    uint32_t w = 0;
    for (int i = 0; i < 4; ++i)
      w |= static_cast<uint32_t>((v[4 * o + i] & 0x0f) | ((v[16 + 4 * o + i] & 0x0f) << 4)) << (8 * i);
    store_u32(dst + o * 64 + r * 4, w);
  }
}

// 5th-bit word: bit o of byte i = bit 4 of v[4o+i].
void put_bit4_word(const uint8_t* v, int r, uint8_t* dst) {
  uint32_t w = 0;
  for (int o = 0; o < 8; ++o)
    for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>((v[4 * o + i] >> 4) & 1) << (8 * i + o);
  store_u32(dst + r * 4, w);
}

// Two 2-bit words: word h, bits 2s..2s+1 of byte i = bits 4..5 of v[4(4h+s)+i].
void put_bit45_words(const uint8_t* v, int r, uint8_t* dst) {
  for (int h = 0; h < 2; ++h) {
    uint32_t w = 0;
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 4; ++i)
        w |= static_cast<uint32_t>((v[4 * (4 * h + s) + i] >> 4) & 3) << (8 * i + 2 * s);
    store_u32(dst + h * 64 + r * 4, w);
  }
}

// Two 2-bit words of the low 2 bits: word h, bits 2s..2s+1 of byte i = bits
// 0..1 of v[4(4h+s)+i] (q2_k, q3_k).
void put_bit01_words(const uint8_t* v, int r, uint8_t* dst) {
  for (int h = 0; h < 2; ++h) {
    uint32_t w = 0;
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>(v[4 * (4 * h + s) + i] & 3) << (8 * i + 2 * s);
    store_u32(dst + h * 64 + r * 4, w);
  }
}

// Bit 2 word (q3_k): bit o of byte i = bit 2 of v[4o+i].
void put_bit2_word(const uint8_t* v, int r, uint8_t* dst) {
  uint32_t w = 0;
  for (int o = 0; o < 8; ++o)
    for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>((v[4 * o + i] >> 2) & 1) << (8 * i + o);
  store_u32(dst + r * 4, w);
}

// 5-bit values of a q5_0/q5_1 block.
void q5_values(const uint8_t* qs, const uint8_t* qh_bytes, uint8_t* v) {
  const uint32_t qh = load_u32(qh_bytes);
  for (int j = 0; j < 16; ++j) {
    v[j] = static_cast<uint8_t>((qs[j] & 0x0f) | (((qh >> j) & 1) << 4));
    v[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
}

inline void put_bit16(uint8_t* p, int bit, bool on) {
  uint16_t w = load_u16(p);
  w = static_cast<uint16_t>((w & ~(1u << bit)) | (static_cast<unsigned>(on) << bit));
  store_u16(p, w);
}
inline void put_bit64(uint8_t* p, int bit, bool on) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  w = (w & ~(uint64_t{1} << bit)) | (static_cast<uint64_t>(on) << bit);
  std::memcpy(p, &w, 8);
}

// Row r of a grid type's superblock (panel.h: IqGridPanel). Bits are set and
// cleared one row at a time: a full panel's bytes are not zeroed first.
void pack_iq_grid(DType type, const uint8_t* blk, int r, uint8_t* pb) {
  const IqGridSuperblock b = decode_iq_grid(type, blk);
  const IqGridPanel L = iq_grid_panel(type);
  const bool per16 = iq_grid_traits(type).scale_group == 16;
  store_u16(pb + 2 * r, b.d);
  for (int j = 0; j < (per16 ? 16 : 8); ++j) pb[32 + 16 * j + r] = b.scale[per16 ? j : 2 * j];
  for (int g = 0; g < 8; ++g) {
    uint8_t* gp = pb + L.header + g * L.group;
    if (is_iq1(type)) {
      for (int e = 0; e < 4; ++e) {
        const unsigned idx = b.index[4 * g + e], neg = (b.delta_neg >> (4 * g + e)) & 1;
        gp[16 * e + r] = static_cast<uint8_t>(idx & 0xff);
        const unsigned nib = (idx >> 8) | (neg << 3), shift = 4 * (r / 8);
        uint8_t& byte = gp[L.hi + 8 * e + r % 8];
        byte = static_cast<uint8_t>((byte & ~(0xfu << shift)) | (nib << shift));
      }
      continue;
    }
    for (int e = 0; e < L.entries; ++e) {
      const unsigned idx = b.index[L.entries * g + e];
      gp[16 * e + r] = static_cast<uint8_t>(idx & 0xff);
      for (int h = 0; h < L.hi_planes; ++h)
        put_bit16(gp + L.hi + 2 * (h * L.entries + e), r, (idx >> (8 + h)) & 1);
    }
    for (int o = 0; o < 8; ++o)
      for (int i = 0; i < 4; ++i) {
        const int w = 32 * g + 4 * o + i;
        put_bit64(gp + L.signs + 8 * o, 4 * r + i, (b.sign[w / 8] >> (w % 8)) & 1);
      }
  }
}

void pack_block(DType type, const uint8_t* blk, int r, uint8_t* pb) {
  uint8_t v[32];
  if (is_iq_grid(type)) return pack_iq_grid(type, blk, r, pb);
  if (is_ternary(type)) {  // tq2_0 panels: d, then the trits as q2_k's crumb words
    uint8_t trit[QK_K];
    ternary_trits(type, blk, trit);
    std::memcpy(pb + 2 * r, blk + dtype_traits(type).block_bytes - 2, 2);
    for (int g = 0; g < 8; ++g) put_bit01_words(trit + 32 * g, r, pb + 32 + g * 128);
    return;
  }
  if (type == DType::q1_0) {  // q1_0 panel blocks, one per 32: the block's d, then each operand's bits
    const size_t group_bytes = panel_block_bytes(DType::q1_0) / (QK1_0 / 32);
    for (int g = 0; g < QK1_0 / 32; ++g) {
      uint8_t* gb = pb + g * group_bytes;
      std::memcpy(gb + 2 * r, blk, 2);
      for (int o = 0; o < 8; ++o)
        for (int i = 0; i < 4; ++i) {
          const int e = 32 * g + 4 * o + i;
          put_bit64(gb + 32 + 8 * o, 4 * r + i, (blk[2 + e / 8] >> (e % 8)) & 1);
        }
    }
    return;
  }
  if (type == DType::q2_0) {  // two q4_0 blocks with the block's d, packed as q4_0's
    uint8_t code[QK2_0];
    low_bit_codes(type, blk, code);
    for (int g = 0; g < QK2_0 / 32; ++g) {
      BlockQ4_0 q;
      std::memcpy(&q.d, blk, 2);
      for (int j = 0; j < 16; ++j)
        q.qs[j] = static_cast<uint8_t>(code[32 * g + j] | code[32 * g + j + 16] << 4);
      pack_block(DType::q4_0, reinterpret_cast<const uint8_t*>(&q), r,
                 pb + g * panel_block_bytes(DType::q4_0));
    }
    return;
  }
  if (type == DType::nvfp4) {  // per 32: the two sub-blocks' scale codes, then the nibble group
    BlockNVFP4 b;
    std::memcpy(&b, blk, sizeof b);
    for (int g = 0; g < QK_NVFP4 / 32; ++g) {
      uint8_t* gb = pb + g * panel_block_bytes(DType::nvfp4) / (QK_NVFP4 / 32);
      gb[r] = nvfp4_scale_code(b.d[2 * g]);
      gb[16 + r] = nvfp4_scale_code(b.d[2 * g + 1]);
      for (int e = 0; e < 32; ++e) {  // sub-block 2g + e / 16, its element j = e % 16
        const int s = 2 * g + e / 16, j = e % 16;
        v[e] = static_cast<uint8_t>(j < 8 ? b.qs[8 * s + j] & 0x0f : b.qs[8 * s + j - 8] >> 4);
      }
      put_nibble_group(v, r, gb + 32);
    }
    return;
  }
  switch (type) {
    case DType::mxfp4: {  // iq4_nl's layout with the scale as bf16 (2^(e - 128), exact)
      BlockMXFP4 b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, mxfp4_scale_bf16(b.e));
      for (int o = 0; o < 4; ++o) store_u32(pb + 32 + o * 64 + r * 4, load_u32(b.qs + 4 * o));
      return;
    }
    case DType::q4_0:
    case DType::iq4_nl: {  // the same bytes: f16 d, then 16 bytes of nibbles (iq4_nl's codebook indices)
      static_assert(sizeof(BlockQ4_0) == sizeof(BlockIQ4_NL));
      BlockQ4_0 b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      for (int o = 0; o < 4; ++o) store_u32(pb + 32 + o * 64 + r * 4, load_u32(b.qs + 4 * o));
      return;
    }
    case DType::iq4_xs: {
      BlockIQ4_XS b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      for (int g = 0; g < 8; ++g) {
        pb[32 + g * 16 + r] = static_cast<uint8_t>(static_cast<int8_t>(iq4_xs_scale(b, g)));
        // Sub-block g's qs are an iq4_nl block's: byte j = elements j, j + 16.
        uint8_t* gp = pb + 160 + g * 256;
        for (int o = 0; o < 4; ++o) store_u32(gp + o * 64 + r * 4, load_u32(b.qs + 16 * g + 4 * o));
      }
      return;
    }
    case DType::q4_1: {
      BlockQ4_1 b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      store_u16(pb + 32 + 2 * r, b.m);
      for (int o = 0; o < 4; ++o) store_u32(pb + 64 + o * 64 + r * 4, load_u32(b.qs + 4 * o));
      return;
    }
    case DType::q5_0: {
      BlockQ5_0 b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      q5_values(b.qs, b.qh, v);
      put_bit4_word(v, r, pb + 32);
      put_nibble_group(v, r, pb + 96);
      return;
    }
    case DType::q5_1: {
      BlockQ5_1 b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      store_u16(pb + 32 + 2 * r, b.m);
      q5_values(b.qs, b.qh, v);
      put_bit4_word(v, r, pb + 64);
      put_nibble_group(v, r, pb + 128);
      return;
    }
    case DType::q8_0: {
      BlockQ8_0 b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      for (int o = 0; o < 8; ++o) std::memcpy(pb + 32 + o * 64 + r * 4, b.qs + 4 * o, 4);
      return;
    }
    case DType::q4_k:
    case DType::q5_k: {
      const bool five = type == DType::q5_k;
      BlockQ5_K b5{};
      BlockQ4_K b4{};
      const uint8_t *scales, *qs;
      uint16_t d, dmin;
      if (five) {
        std::memcpy(&b5, blk, sizeof b5);
        scales = b5.scales;
        qs = b5.qs;
        d = b5.d;
        dmin = b5.dmin;
      } else {
        std::memcpy(&b4, blk, sizeof b4);
        scales = b4.scales;
        qs = b4.qs;
        d = b4.d;
        dmin = b4.dmin;
      }
      store_u16(pb + 2 * r, d);
      store_u16(pb + 32 + 2 * r, dmin);
      const size_t group_bytes = five ? 320 : 256;
      for (int g = 0; g < 8; ++g) {
        int sc, m;
        k4_scale_min(scales, g, sc, m);
        pb[64 + g * 16 + r] = static_cast<uint8_t>(sc);
        pb[192 + (g / 2) * 32 + r * 2 + (g % 2)] = static_cast<uint8_t>(m);
        // element 32g + j: nibble (g % 2) of qs[32*(g/2) + j]
        for (int j = 0; j < 32; ++j) {
          v[j] = static_cast<uint8_t>((qs[32 * (g / 2) + j] >> (4 * (g % 2))) & 0x0f);
          if (five) v[j] = static_cast<uint8_t>(v[j] | (((b5.qh[j] >> g) & 1) << 4));
        }
        uint8_t* gp = pb + 320 + g * group_bytes;
        put_nibble_group(v, r, gp);
        if (five) put_bit4_word(v, r, gp + 256);
      }
      return;
    }
    case DType::q6_k: {
      BlockQ6_K b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      for (int j = 0; j < 16; ++j) pb[32 + j * 16 + r] = static_cast<uint8_t>(b.scales[j]);
      for (int g = 0; g < 8; ++g) {
        for (int j = 0; j < 32; ++j) {
          const int e = 32 * g + j, h = e / 128, s = (e / 32) % 4, l = e % 32;
          const int lo = (b.ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0f;
          const int hi = (b.qh[32 * h + l] >> (2 * s)) & 3;
          v[j] = static_cast<uint8_t>(lo | (hi << 4));
        }
        uint8_t* gp = pb + 288 + g * 384;
        put_nibble_group(v, r, gp);
        put_bit45_words(v, r, gp + 256);
      }
      return;
    }
    case DType::q2_k: {
      BlockQ2_K b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      store_u16(pb + 32 + 2 * r, b.dmin);
      for (int j = 0; j < 16; ++j) {
        pb[64 + j * 16 + r] = static_cast<uint8_t>(b.scales[j] & 0x0f);
        pb[320 + (j / 2) * 32 + r * 2 + (j % 2)] = static_cast<uint8_t>(b.scales[j] >> 4);
      }
      for (int g = 0; g < 8; ++g) {
        for (int j = 0; j < 32; ++j) {
          const int e = 32 * g + j, h = e / 128, s = (e / 32) % 4, l = e % 32;
          v[j] = static_cast<uint8_t>((b.qs[32 * h + l] >> (2 * s)) & 3);
        }
        put_bit01_words(v, r, pb + 576 + g * 128);
      }
      return;
    }
    case DType::q3_k: {
      BlockQ3_K b;
      std::memcpy(&b, blk, sizeof b);
      store_u16(pb + 2 * r, b.d);
      for (int j = 0; j < 16; ++j)
        pb[32 + j * 16 + r] = static_cast<uint8_t>(static_cast<int8_t>(q3_k_scale(b.scales, j)));
      for (int g = 0; g < 8; ++g) {
        // u = q3 + 4 in 0..7: low 2 bits from qs, bit 2 = the hmask bit.
        for (int j = 0; j < 32; ++j) {
          const int e = 32 * g + j, h = e / 128, s = (e / 32) % 4, l = e % 32;
          const int low = (b.qs[32 * h + l] >> (2 * s)) & 3;
          const int high = (b.hmask[l] >> (e / 32)) & 1;
          v[j] = static_cast<uint8_t>(low | (high << 2));
        }
        uint8_t* gp = pb + 288 + g * 192;
        put_bit01_words(v, r, gp);
        put_bit2_word(v, r, gp + 128);
      }
      return;
    }
    default:
      break;
  }
  LOOM_ASSERT(false && "pack_block: unhandled dtype");
}

}  // namespace

size_t panel_block_bytes(DType type) {
  switch (type) {
    case DType::f32:
      return 64;
    case DType::f16:
      return 32;
    case DType::bf16:
      return 64;  // per pair of columns
    case DType::q4_0:
      return 288;
    case DType::q4_1:
      return 320;
    case DType::q5_0:
      return 352;
    case DType::q5_1:
      return 384;
    case DType::q8_0:
      return 544;
    case DType::iq4_nl:
    case DType::mxfp4:
      return 288;
    case DType::nvfp4:  // per 64: two panel blocks of 288 bytes
      return 2 * 288;
    case DType::q1_0:  // per 128: four q1_0 panel blocks of 96 bytes
      return 4 * 96;
    case DType::q2_0:  // as q4_0 panel blocks (matmul_panel_type)
      return 2 * 288;
    case DType::iq4_xs:
      return 2208;
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq1_s:
    case DType::iq1_m:
      return iq_grid_panel(type).header + 8 * iq_grid_panel(type).group;
    case DType::q4_k:
      return 2368;
    case DType::q5_k:
      return 2880;
    case DType::q6_k:
      return 3360;
    case DType::q2_k:
      return 1600;
    case DType::tq1_0:
    case DType::tq2_0:
      return 1056;
    case DType::q3_k:
      return 1824;
    case DType::nf4:
      return kNf4PanelBlockBytes;
    case DType::i8_ch:
      return 16;  // per column, plus the panel header (panel_bytes)
    default:
      break;
  }
  LOOM_ASSERT(false && "panel_block_bytes: unsupported dtype");
  return 0;
}

int64_t panel_block_elems(DType type) { return type == DType::bf16 ? 2 : dtype_block_size(type); }

size_t panel_bytes(DType type, int64_t K) {
  if (type == DType::i8_ch) return i8ch_panel_bytes(K);
  if (type == DType::bf16) return static_cast<size_t>(bf16_pair_count(K)) * panel_block_bytes(type);
  return static_cast<size_t>(K / panel_block_elems(type)) * panel_block_bytes(type);
}

void pack_panel(DType type, const uint8_t* const* rows, int nrows, int64_t K, uint8_t* dst) {
  LOOM_ASSERT(nrows >= 0 && nrows <= R);
  const size_t pbytes = panel_bytes(type, K);
  if (nrows < R) std::memset(dst, 0, pbytes);
  switch (type) {
    case DType::f32:
      for (int r = 0; r < nrows; ++r)
        for (int64_t k = 0; k < K; ++k) std::memcpy(dst + k * 64 + r * 4, rows[r] + k * 4, 4);
      return;
    case DType::f16:
      for (int r = 0; r < nrows; ++r)
        for (int64_t k = 0; k < K; ++k) std::memcpy(dst + k * 32 + r * 2, rows[r] + k * 2, 2);
      return;
    case DType::bf16:
      if (K % 2 != 0 && nrows == R) std::memset(dst, 0, pbytes);  // the padding column
      for (int r = 0; r < nrows; ++r)
        for (int64_t k = 0; k < K; ++k) std::memcpy(dst + (k / 2) * 64 + r * 4 + (k % 2) * 2, rows[r] + k * 2, 2);
      return;
    case DType::nf4:
      for (int r = 0; r < nrows; ++r) pack_nf4_row(rows[r], r, K, dst);
      return;
    case DType::i8_ch:
      pack_i8ch_panel(rows, nrows, K, dst);
      return;
    default:
      break;
  }
  const int64_t nb = K / panel_block_elems(type);
  const size_t bb = dtype_traits(type).block_bytes, pbb = panel_block_bytes(type);
  for (int r = 0; r < nrows; ++r)
    for (int64_t b = 0; b < nb; ++b) pack_block(type, rows[r] + b * bb, r, dst + b * pbb);
}

}  // namespace loom::cpu
