// Internal layouts shared by the matmul driver, the weight packers and the
// AVX2 / AVX-512 panel kernels (see kernels/cpu/matmul.h for the design).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/dtype.h"

// Forward declarations only: this header is also included by files built with
// AVX-512 flags, which must not instantiate inline code shared with other files.
namespace loom {
class ThreadPool;
struct CpuFeatures;
class PackedWeight;
class MatmulScratch;
struct Tensor;
struct MatmulOut;
}  // namespace loom

namespace loom::cpu {

// A panel is kPanelRows consecutive rows of W, interleaved so that vector lane r
// holds row r. Each panel is a sequence of "panel blocks", one per weight block
// (32 or 256 elements; one element for f32/f16/bf16).
constexpr int kPanelRows = 16;

// Quantized panels are built from groups of 32 elements per row. A group's quants
// come as 32-bit words per row, a word = 4 consecutive elements:
//  * nibble group (q4_0/q4_1/q5_*/q4_k/q5_k/q6_k): 4 words per row; byte i of word o
//    holds element 4o+i in its low nibble and element 16+4o+i in its high nibble;
//  * 5th-bit word (q5_*): bit o of byte i = bit 4 of element 4o+i;
//  * two 2-bit words (q6_k): word h, bits 2s..2s+1 of byte i = bits 4..5 of element
//    4(4h+s)+i;
//  * q8_0: 8 words per row, word o = elements 4o..4o+3.
// Each array of words is stored row-interleaved: word o of rows 0..15 = 64 bytes.
// Hence "operand" o of a group (elements 4o..4o+3 of all 16 rows) is one vector.
//
// Panel block byte layouts (offsets in bytes; f16 scales as uint16[16]):
//  q4_0 (288):  d @0, nibbles @32
//  q4_1 (320):  d @0, m @32, nibbles @64
//  q5_0 (352):  d @0, 5th-bit word @32, nibbles @96
//  q5_1 (384):  d @0, m @32, 5th-bit word @64, nibbles @128
//  q8_0 (544):  d @0, words @32
//  iq4_nl (288): d @0, nibbles @32 (codebook indices, kIq4Values)
//  mxfp4 (288): as iq4_nl, d as bf16 (2^(e - 128)), indices into kMxfp4Values
//  nvfp4 (288, per 32): the scale of elements 0..15 @0, of 16..31 @16, a byte
//               per row (each NVFP4 sub-block's UE4M3 scale as an exact f16,
//               nvfp4_scale_f16, stored as its bits >> 7: nvfp4_scale_code),
//               nibbles @32: indices into kMxfp4Values; two panel blocks per
//               NVFP4 block of 64 (4.5 bits per weight, as the file)
//  q1_0 (96, per 32): d @0 (each Q1_0 block's d in its four), then per operand o
//               a u64 of the weights' bits @32 + 8o (bit 4r + i: weight 4o + i of
//               row r set: +d, clear: -d; the kernels' q4_0 codes 9, 7): 1.5 bits
//               per weight
//  (Q2_0 weights pack as q4_0 panel blocks: matmul_panel_type)
//  q4_k (2368): d @0, dmin @32, scale u8[8][16] @64, min pairs u8[4][16][2] @192,
//               8 nibble groups @320 (256 bytes each)
//  q5_k (2880): as q4_k, groups @320 of 320 bytes: nibbles then 5th-bit word
//  q6_k (3360): d @0, scale i8[16][16] @32, 8 groups @288 of 384 bytes: nibbles
//               then the two 2-bit words
//  tq2_0 (1056; TQ1_0 and TQ2_0 weights): d @0, then 8 groups of 32 as q2_k's
//               two 2-bit words of the trits t (x = d (t - 1))
//  q2_k (1600): d @0, dmin @32, scale u8[16][16] @64, min pairs u8[8][16][2] @320,
//               8 groups @576 of 128 bytes: the two 2-bit words of q (0..3)
//  q3_k (1824): d @0, scale i8[16][16] @32, 8 groups @288 of 192 bytes: the two
//               2-bit words, then the bit-2 word, of u = q + 4 (0..7)
//  iq4_xs (2208): d @0, scale i8[8][16] @32 (ls - 32 of each group of 32),
//               8 nibble groups @160 (256 bytes each) of codebook indices
//  iq2_xxs (1184), iq2_xs (1376), iq2_s (1440), iq3_xxs (1696), iq3_s (1824):
//               d @0, scale i8 @32 (2s + 1: [8][16] per 32, or iq2_xs / iq2_s
//               [16][16] per 16), then 8 groups of 32 (IqGridPanel below): per
//               grid entry of the group (8 for iq3, 4 for iq2) the 16 rows' low
//               index bytes, then the high index bits as u16 row masks (iq3_s
//               and iq2_xs bit 8, iq2_s bits 8 and 9, plane-major), then per
//               operand o a u64 of signs (bit 4r + i: weight 4o + i of row r)
//  iq1_s (928), iq1_m (1056): d @0, scale i8 @32 (2s + 1: iq1_s [8][16] per 32,
//               iq1_m [16][16] per 16), then 8 groups of 32 of 96 bytes: per entry
//               e the 16 rows' low index bytes @16e, then per entry 8 bytes @64 + 8e
//               of nibbles (byte j: row j's low nibble, row j + 8's high) = the high
//               3 index bits | the negative-delta bit << 3
//  f32 / f16: element k of rows 0..15 contiguous (64 / 32 bytes)
//  bf16 (64 per pair of columns): pair row j = rows 0..15 as 32-bit words, word r
//               = element 2j (low half) and 2j + 1 (high half) of row r: the
//               operand order of vdpbf16ps; an odd K gets a zero column
//  nf4 (576, per 64): f32 absmax[16] @0, 32 code-pair slots of 16 bytes @64
//               (kernels/cpu/nf4.h)
//  i8_ch (no blocks): one 192-byte header per panel (scales, zero points,
//               offset corrections), then 4-column words of 64 bytes
//               (kernels/cpu/i8ch.h)
// (2-bit words: word h, bits 2s..2s+1 of byte i = bits 0..1 of element 4(4h+s)+i;
//  bit-2 word: bit o of byte i = bit 2 of element 4o+i.)
// Byte layout of a grid type's superblock in a panel (see above).
struct IqGridPanel {
  int entries;    // grid entries per group of 32 weights
  int hi_planes;  // index bits above 8
  size_t header;  // d and scales
  size_t hi;      // in a group: the high-bit planes (IQ1: the nibbles)
  size_t signs;   // in a group: the sign masks (IQ1: none)
  size_t group;   // bytes per group
};
constexpr IqGridPanel iq_grid_panel(DType t) {
  if (t == DType::iq1_s || t == DType::iq1_m) return {4, 3, t == DType::iq1_m ? 288u : 160u, 64, 96, 96};
  const bool iq3 = t == DType::iq3_xxs || t == DType::iq3_s;
  const int entries = iq3 ? 8 : 4;
  const int planes = t == DType::iq2_s ? 2 : (t == DType::iq2_xs || t == DType::iq3_s) ? 1 : 0;
  const size_t header = (t == DType::iq2_xs || t == DType::iq2_s) ? 288 : 160;
  const size_t hi = static_cast<size_t>(16 * entries), signs = hi + static_cast<size_t>(2 * entries * planes);
  return {entries, planes, header, hi, signs, signs + 64};
}
// The type of a weight's panels, which its kernels take: TQ1_0 and TQ2_0 both
// pack as "tq2_0" panels (above: d and the 2-bit trits, 2.06 bits per weight),
// whose kernels are q2_k's without scales or mins: sum t x less the superblock's
// act sum in int32, sum (t - 1) x, then one float step, as ggml's TQ dot.
// Q2_0 packs as q4_0 panels (codes q + 7; each 32 with its block's d): the
// same values, at 4.5 bits per weight instead of 2.25 (llama.cpp has no SIMD
// kernel for Q2_0: loom's q4_0 ones run 7-75x its speed). Q1_0 has panels of
// its own (above: its bits as byte masks, 1.5 bits per weight).
// Every other type as itself.
constexpr DType matmul_panel_type(DType t) {
  if (t == DType::q2_0) return DType::q4_0;
  return t == DType::tq1_0 || t == DType::tq2_0 ? DType::tq2_0 : t;
}
size_t panel_block_bytes(DType type);
int64_t panel_block_elems(DType type);  // 32, 256, 2 (bf16 column pairs) or 1

// Bytes of one panel of K columns.
size_t panel_bytes(DType type, int64_t K);
namespace {  // local to each file (see the note at the top)
// Pair rows of a bf16 panel (and pairs of a bf16 act row) for K columns.
inline int64_t bf16_pair_count(int64_t K) { return (K + 1) / 2; }
}  // namespace

// Packs `nrows` (<= 16) GGUF rows of K columns into one panel; missing rows
// become zeros.
void pack_panel(DType type, const uint8_t* const* rows, int nrows, int64_t K, uint8_t* dst);

// ---- Activations (one "act row" per token, built once per matmul call) ----

// For q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, mxfp4, nvfp4, q1_0 weights: q8_0 / q8_1
// blocks with float scale. aux: q4_0 / q1_0 -8*sum(qs), q5_0 -16*sum(qs), mxfp4
// -12*sum(qs), q8_0 / iq4_nl -128*sum(qs) (integer offset terms, int32), q4_1/q5_1
// the q8_1 's' field (fp16-rounded d*sum) as float bits, nvfp4 -12 times each
// half's sum as two int16 (nvfp4_act_aux; |12 * 16 * 127| < 2^15).
struct ActQ8x32 {
  int8_t qs[32];
  float d;
  int32_t aux;
};
static_assert(sizeof(ActQ8x32) == 40);
// nvfp4's aux: elements 0..15's offset in the low int16, 16..31's in the high.
constexpr int32_t nvfp4_act_aux(int lo, int hi) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) | static_cast<uint32_t>(hi)
                                                                                     << 16);
}
constexpr int32_t nvfp4_aux_lo(int32_t aux) { return static_cast<int16_t>(aux & 0xffff); }
constexpr int32_t nvfp4_aux_hi(int32_t aux) { return aux >> 16; }
static_assert(nvfp4_aux_lo(nvfp4_act_aux(-24384, 24384)) == -24384 &&
              nvfp4_aux_hi(nvfp4_act_aux(-24384, 24384)) == 24384 &&
              nvfp4_aux_hi(nvfp4_act_aux(5, -7)) == -7);

// For k-quant and iq4_xs weights: a q8_K block plus per-group sums. s16[j] = sum of the 16
// qs of sub-block j (q8_K's bsums), b16[j] = -32 * s16[j] (q6_k's offset; q3_k
// uses b16 / 8), s32[g] = sum of the 32 qs of group g (q4_k/q5_k).
struct ActQ8K {
  int8_t qs[256];
  int32_t b16[16];
  int16_t s16[16];
  int16_t s32[8];
  float d;
  int32_t pad[3];
};
static_assert(sizeof(ActQ8K) == 384);
// The sum of a block's 256 qs (the tq2_0 kernels' sum t x - sum x = sum (t - 1) x).
inline int32_t act_sum(const ActQ8K& x) {
  int32_t total = 0;
  for (int g = 0; g < 8; ++g) total += x.s32[g];
  return total;
}

// i8row (i8_ch weights): the whole row quantized to int8 with one scale
// (kernels/cpu/i8ch.h).
// bf16 weights take activations rounded to bf16 (round_to_bf16 of
// kernels/cpu/bf16_gemm.h, as llama.cpp and PyTorch's bf16 do), K padded to even
// with a zero, in one of two encodings with the same values: bf16pairs (the
// vdpbf16ps operand: pair j = 32-bit word j) or bf16f32 (the rounded values as
// floats, for the kernels that emulate vdpbf16ps with f32 FMAs).
// q8k_u8: q8k with every qs byte offset by +128 (read as uint8), for the AVX2
// q6_k and q3_k batch kernels (vpmaddubsw takes the activations as its unsigned operand).
enum class ActKind { q8x32, q8k, q8k_u8, i8row, bf16pairs, bf16f32, f32 };
// `bf16_pairs`: whether the kernel that will read the rows multiplies bf16 pairs
// natively (bf16_native(isa)); only bf16 weights care.
ActKind act_kind(DType type, bool bf16_pairs);
// Bytes of one token's act row for K columns (f32: K floats).
size_t act_row_bytes(ActKind kind, int64_t K);
// Quantizes (or rounds) one token row for weights of `type` (not for f32-activation types).
void quantize_act_row(ActKind kind, DType type, const float* x, int64_t K, uint8_t* dst);

// One quantized block of 32 (bit-identical to quantize_row_q8_0_ref): writes qs,
// returns the unrounded scale d (callers round it to fp16 as the format needs).
float quantize_block_q8_32(const float* x, int8_t* qs);
// One q8_K block: writes qs and bsums, returns d.
float quantize_block_q8_k(const float* x, int8_t* qs, int16_t* bsums);

// ---- Kernels ----

struct KernelArgs {
  const uint8_t* panels = nullptr;  // panel 0
  size_t panel_stride = 0;          // bytes between panels
  int64_t n_panels = 0;
  int64_t K = 0;
  const uint8_t* act = nullptr;  // token 0's act row (f32 x for float panels)
  size_t act_stride = 0;         // bytes between tokens' act rows
  int64_t T = 0;
  float* y = nullptr;  // y[t*ldy + 16*p + r] for panel p, token t, row r
  int64_t ldy = 0;
  int64_t n_valid = 0;  // rows beyond this (counted from panel 0) are not stored
  void* tmp = nullptr;  // per-thread scratch (AMX: K*16 bytes; else a batch's unpacked panels)
  size_t tmp_bytes = 0;     // its size
  bool bf16_pairs = false;  // bf16 weights: act rows are ActKind::bf16pairs (else bf16f32)
  bool q8k_u8 = false;      // act rows are ActKind::q8k_u8 (AVX2 q6_k/q3_k batches: avx2_u8_acts)
  bool vbmi = false;        // AVX-512 kernels may use AVX512-VBMI (has_vbmi_kernel types)
  // Panels a decode (T == 1) tile of the integer-dot kernels reads side by side,
  // 1 or kMaxDecodePanelsQuant (decode_panels_quant); the float kernels keep their own.
  int decode_panels = 1;
};

// The integer-dot kernels' decode tiles read at most this many panels at once.
constexpr int kMaxDecodePanelsQuant = 2;

// Panels per decode tile of the integer-dot (quantized) kernels on a CPU with
// features `f` (after LOOM_CPU's masks): how many weight streams each thread
// reads from DRAM at once. Same results either way (each output keeps its own
// sums; Matmul.DecodePanelsGiveTheSameBits).
//
// One on AMD: with 4 panels per tile (4 streams ~19 KiB apart per thread) a Zen 4
// read q4_k/q6_k at 18-27 GB/s against 27-34 with one (2 threads, bench
// Matmul/<type>/matvec_dram) and a 1B-shape Q4_K_M decoded 37 -> 58 tokens/s
// with one; the AVX2 kernels from two panels to one there, 36 -> 50 (bench/README.md,
// "one stream per thread"); a Zen 2 chose the AVX2 kernels' prefetch distance with one.
// Two on Intel's cores since Golden Cove, told apart by instructions no AMD core
// has (up to Zen 5): AVX512-FP16 (Sapphire Rapids and later servers) or AVX-VNNI
// without AVX-512 (Alder Lake and later clients; the same AVX2 + AVX-VNNI
// kernels take the longer prefetch distance, panel_kernels.h). On an Emerald Rapids
// (2 threads) one stream per thread left the decode of a 1B-shape model (484 MiB
// of weights) at 21-23 GB/s where f32 weights, several panels a tile, read
// 33-39; two panels, the builds in turn over 5 rounds, tg64 medians: Q4_0
// 43.1 -> 49.0 t/s, Q4_K_M 41.8 -> 47.8, Q6_K 33.9 -> 38.9, Q8_0 30.0 -> 32.3,
// SmolLM2 (in cache) unchanged or faster; under LOOM_CPU=avx2-vnni Q4_0 1.14x,
// Q6_K 1.06x, Q4_K_M 1.0x. Other CPUs keep the one stream measured on theirs.
int decode_panels_quant(const CpuFeatures& f);

using PanelKernel = void (*)(DType type, const KernelArgs& a);
void panel_kernel_avx2(DType type, const KernelArgs& a);
// The same kernels with AVX-VNNI's vpdpbusd in the 32-element types' block dots
// (same results); for CPUs with AVX-VNNI (usable_cpu_features().avxvnni).
void panel_kernel_avx2_vnni(DType type, const KernelArgs& a);
void panel_kernel_avx512(DType type, const KernelArgs& a);
// The types whose AVX-512 kernels have an AVX512-VBMI form (panel_kernel_avx512
// runs it where KernelArgs::vbmi): the iq2 and iq3 grids, whose codes come from
// byte tables (vpermi2b) rather than word tables. Same results as without.
constexpr bool has_vbmi_kernel(DType type) {
  return type == DType::iq2_xxs || type == DType::iq2_xs || type == DType::iq2_s || type == DType::iq3_xxs ||
         type == DType::iq3_s;
}
void panel_kernel_avx512_vbmi(DType type, const KernelArgs& a);
// Panels a batch tile group walks (panel_kernels.h): about this many bytes, so a
// group stays in L2 (1-2 MiB per core on the x86 classes targeted) while every
// token tile passes over it.
constexpr int64_t kTileGroupBytes = int64_t{256} << 10;
// The kernels of most quantized types (and AVX-512 f16) unpack or widen the
// panels of a batch (T > 1) into a.tmp once per call, instead of once per token
// tile, when a.tmp_bytes holds a tile's panels unpacked: their bytes each (0: the
// type's kernel reads packed panels only) and how many a batch tile takes.
struct UnpackedPanels {
  size_t panel_bytes = 0;
  int tile_panels = 0;
};
UnpackedPanels unpacked_panels_avx2(DType type, int64_t K);
UnpackedPanels unpacked_panels_avx2_vnni(DType type, int64_t K);
UnpackedPanels unpacked_panels_avx512(DType type, int64_t K);
// Whether the AVX2 kernel's batch of `type` with unpacked panels (tmp_bytes of
// scratch for T > 1 tokens) reads ActKind::q8k_u8 act rows (then KernelArgs::q8k_u8):
// the unpacked q6_k and q3_k kernels do, and without them run on the packed panels.
bool avx2_u8_acts(DType type, int64_t K, int64_t T, size_t tmp_bytes);
// Scratch for a group of unpacked panels: about kTileGroupBytes, at least a tile's.
inline size_t unpack_scratch_bytes(const UnpackedPanels& u) {
  const size_t group = static_cast<size_t>(kTileGroupBytes) / u.panel_bytes * u.panel_bytes;
  const size_t tile = static_cast<size_t>(u.tile_panels) * u.panel_bytes;
  return group >= tile ? group : tile;
}

// matmul with an explicit kernel set (tests and benchmarks run both paths on one
// machine; the public matmul picks by use_avx512_kernels()). avx512 needs
// cpu_features().has_avx512_kernels().
// amx: AVX-512 plus AMX-INT8 tiles for batches of 32-element block types.
enum class Isa { avx2, avx512, amx };
// Whether the kernels of `isa` multiply bf16 pairs with vdpbf16ps on this CPU
// (AVX512-BF16, not masked by LOOM_CPU, and not slower than two FMAs: bf16_dot.h);
// else they emulate it exactly with f32 FMAs (the odd product, then the even one,
// denormals as zero).
bool bf16_native(Isa isa);
void matmul_isa(Isa isa, ThreadPool& pool, const PackedWeight& W, const float* x, int64_t ldx, float* y,
                int64_t ldy, int64_t T, MatmulScratch& scratch);
void matmul_isa(Isa isa, ThreadPool& pool, const Tensor& W, const float* x, int64_t ldx, float* y,
                int64_t ldy, int64_t T, MatmulScratch& scratch);
void matmul_multi_isa(Isa isa, ThreadPool& pool, std::span<const MatmulOut> outs, const float* x, int64_t ldx,
                      int64_t T, MatmulScratch& scratch);

// AMX: usable on this CPU and OS (requests the tile state once per process);
// types with an AMX kernel; the kernel (needs act rows padded to a multiple of 16
// tokens and a.tmp of K*16 bytes).
bool amx_available();
bool amx_supports(DType type);
void panel_kernel_amx(DType type, const KernelArgs& a);

}  // namespace loom::cpu
