// The k-quant weight quantizers (q2_K .. q6_K) of ggml-quants.c: without
// importance ggml's quantize_row_q*_K_ref, with it quantize_row_q*_K_impl.
// Each super-block of 256 goes through the same four steps: fit a scale (and
// min) per sub-block, quantize those sub-block scales to a few bits against
// one fp16 super-scale, requantize the values with the scales as stored, pack.

// As in quantize_search.cpp: ggml's products and sums are not fused.
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

// Calls quantize(x_block, block_index, block) for every super-block of the row and stores the blocks.
template <typename Block, typename F>
void for_each_superblock(const float* x, void* dst, int64_t n, F&& quantize) {
  for (int64_t i = 0; i < n / QK_K; ++i) {
    Block b{};
    quantize(x + i * QK_K, i, b);
    store_block(dst, i, b);
  }
}

// The sum of squares of a super-block, in ggml's order (for the importance weights' sigma2).
float sum_squares(const float* x, int n) {
  float s = 0;
  for (int j = 0; j < n; ++j) s += x[j] * x[j];
  return s;
}

// Importance weights of one sub-block: qw * sqrt(sigma2 + x^2), and their sum.
float importance_weights(const float* x, const float* qw, int n, float sigma2, float* weights) {
  float sum = 0;
  for (int l = 0; l < n; ++l) weights[l] = qw[l] * std::sqrt(sigma2 + x[l] * x[l]);
  for (int l = 0; l < n; ++l) sum += weights[l];
  return sum;
}

// Codes of x against a sub-block's final scale d and offset dm: round((x + dm) / d) in [0, nmax].
void requantize_affine(const float* x, int n, float d, float dm, int nmax, uint8_t* L) {
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(std::clamp(nearest_int((x[i] + dm) / d), 0, nmax));
}

// Codes of x against a sub-block's final scale d: round(x / d) in [-nmax, nmax), offset by nmax.
void requantize_symmetric(const float* x, int n, float d, int nmax, int8_t* L) {
  for (int i = 0; i < n; ++i)
    L[i] = static_cast<int8_t>(std::clamp(nearest_int(x[i] / d), -nmax, nmax - 1) + nmax);
}

// q2_K / q3_K low bits: qs[32 h + l] holds codes 128 h + 32 s + l in bits 2s, 2s+1.
template <typename Code>
void pack_2bit(const Code* L, uint8_t* qs) {
  for (int j = 0; j < QK_K; j += 128) {
    for (int l = 0; l < 32; ++l) {
      qs[j / 4 + l] =
          static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
  }
}

// ---- q2_K: 16 sub-blocks of 16, 2-bit codes, 4-bit scale and min codes.

constexpr AffineGrid kQ2Grid{-0.5f, 0.1f, 15, true};
constexpr AffineGrid kWeightedGrid{-0.9f, 0.05f, 36, false};  // every weighted affine search

// Requantizes with the stored scales and packs (the last two steps of both q2_K paths).
void finish_q2_k(const float* x, BlockQ2_K& b, uint8_t* L) {
  const float d_all = fp16_to_fp32(b.d), dmin_all = fp16_to_fp32(b.dmin);
  for (int j = 0; j < QK_K / 16; ++j) {
    const float d = d_all * as_float(b.scales[j] & 0xF);
    if (d == 0) continue;  // keep the fit's codes
    const float dm = dmin_all * as_float(b.scales[j] >> 4);
    requantize_affine(x + 16 * j, 16, d, dm, 3, L + 16 * j);
  }
  pack_2bit(L, b.qs);
}

void quantize_block_q2_k(const float* x, BlockQ2_K& b) {
  uint8_t L[QK_K];
  float scales[QK_K / 16], mins[QK_K / 16], weights[16];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < QK_K / 16; ++j) {
    for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
    scales[j] = fit_affine(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], kQ2Grid);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  // Scales and mins to 4 bits each, the largest mapped to 15.
  if (max_scale > 0) {
    const float iscale = 15.f / max_scale;
    for (int j = 0; j < QK_K / 16; ++j) b.scales[j] = static_cast<uint8_t>(nearest_int(iscale * scales[j]));
    b.d = fp32_to_fp16(max_scale / 15.f);
  } else {
    std::fill(b.scales, b.scales + QK_K / 16, uint8_t{0});
    b.d = fp32_to_fp16(0.f);
  }
  if (max_min > 0) {
    const float iscale = 15.f / max_min;
    for (int j = 0; j < QK_K / 16; ++j)
      b.scales[j] = static_cast<uint8_t>(b.scales[j] | (nearest_int(iscale * mins[j]) << 4));
    b.dmin = fp32_to_fp16(max_min / 15.f);
  } else {
    b.dmin = fp32_to_fp16(0.f);
  }
  finish_q2_k(x, b, L);
}

void quantize_block_q2_k_weighted(const float* x, const float* qw, BlockQ2_K& b) {
  uint8_t L[QK_K], Ls[QK_K / 16], Lm[QK_K / 16];
  float scales[QK_K / 16], mins[QK_K / 16], sw[QK_K / 16], weights[16];
  const float sigma2 = sum_squares(x, QK_K) / QK_K;
  for (int j = 0; j < QK_K / 16; ++j) {
    sw[j] = importance_weights(x + 16 * j, qw + 16 * j, 16, sigma2, weights);
    scales[j] = fit_affine(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], kWeightedGrid);
  }
  // Scales and mins to 4 bits by their own weighted search (sub-block weight sums).
  const float dm = fit_positive(QK_K / 16, 15, scales, sw, Ls);
  const float mm = fit_positive(QK_K / 16, 15, mins, sw, Lm);
  b.d = fp32_to_fp16(dm);
  b.dmin = fp32_to_fp16(mm);
  for (int j = 0; j < QK_K / 16; ++j) b.scales[j] = static_cast<uint8_t>(Ls[j] | (Lm[j] << 4));
  finish_q2_k(x, b, L);
}

// ---- q3_K: 16 sub-blocks of 16, 3-bit codes (2 low bits + hmask), signed 6-bit scales.

// Scale codes (0..63, the signed scale + 32) into 12 bytes, the layout q3_k_scale reads.
void pack_q3_k_scales(const int* codes, uint8_t* scales) {
  std::memset(scales, 0, 12);
  for (int j = 0; j < QK_K / 16; ++j) {
    int l = codes[j];
    if (j < 8) {
      scales[j] = static_cast<uint8_t>(l & 0xF);
    } else {
      scales[j - 8] = static_cast<uint8_t>(scales[j - 8] | ((l & 0xF) << 4));
    }
    l >>= 4;
    scales[j % 4 + 8] = static_cast<uint8_t>(scales[j % 4 + 8] | (l << (2 * (j / 4))));
  }
}

void finish_q3_k(const float* x, BlockQ3_K& b, int8_t* L) {
  const float d_all = fp16_to_fp32(b.d);
  for (int j = 0; j < QK_K / 16; ++j) {
    const float d = d_all * as_float(q3_k_scale(b.scales, j));
    if (d == 0) continue;
    requantize_symmetric(x + 16 * j, 16, d, 4, L + 16 * j);
  }
  // Bit 2 of code j goes to bit j / 32 of hmask[j % 32].
  std::memset(b.hmask, 0, sizeof(b.hmask));
  for (int j = 0; j < QK_K; ++j) {
    if (L[j] > 3) {
      b.hmask[j % 32] = static_cast<uint8_t>(b.hmask[j % 32] | (1 << (j / 32)));
      L[j] = static_cast<int8_t>(L[j] - 4);
    }
  }
  pack_2bit(L, b.qs);
}

void quantize_block_q3_k(const float* x, BlockQ3_K& b) {
  int8_t L[QK_K];
  float scales[QK_K / 16];
  float max_scale = 0, amax = 0;  // the signed scale of largest magnitude
  for (int j = 0; j < QK_K / 16; ++j) {
    scales[j] = fit_symmetric_refined(16, 4, x + 16 * j, L + 16 * j);
    const float scale = std::fabs(scales[j]);
    if (scale > amax) {
      amax = scale;
      max_scale = scales[j];
    }
  }
  std::memset(b.scales, 0, sizeof(b.scales));
  if (max_scale != 0) {
    const float iscale = -32.f / max_scale;
    int codes[QK_K / 16];
    for (int j = 0; j < QK_K / 16; ++j) {
      const int l = static_cast<int8_t>(nearest_int(iscale * scales[j]));  // ggml keeps it in an int8_t
      codes[j] = std::clamp(l, -32, 31) + 32;
    }
    pack_q3_k_scales(codes, b.scales);
    b.d = fp32_to_fp16(1 / iscale);
  } else {
    b.d = fp32_to_fp16(0.f);
  }
  finish_q3_k(x, b, L);
}

void quantize_block_q3_k_weighted(const float* x, const float* qw, BlockQ3_K& b) {
  int8_t L[QK_K], Ls[QK_K / 16];
  float scales[QK_K / 16], sw[QK_K / 16], weights[16];
  const float sigma2 = 2 * sum_squares(x, QK_K) / QK_K;
  for (int j = 0; j < QK_K / 16; ++j) {
    sw[j] = importance_weights(x + 16 * j, qw + 16 * j, 16, sigma2, weights);
    scales[j] = fit_symmetric(16, 4, x + 16 * j, weights, L + 16 * j);
  }
  // The 16 signed scales themselves as symmetric 6-bit codes, weighted by the sub-block weight sums.
  const float d_block = fit_symmetric(QK_K / 16, 32, scales, sw, Ls);
  int codes[QK_K / 16];
  for (int j = 0; j < QK_K / 16; ++j) codes[j] = Ls[j];
  pack_q3_k_scales(codes, b.scales);
  b.d = fp32_to_fp16(d_block);
  finish_q3_k(x, b, L);
}

// ---- q4_K / q5_K: 8 sub-blocks of 32, 4- or 5-bit codes, 6-bit scales and mins.

// 6-bit scale and min codes into 12 bytes, the layout k4_scale_min reads
// (ggml's byte operations, so that out-of-range codes end up where they do there).
void pack_k4_scales(const uint8_t* ls, const uint8_t* lm, uint8_t* s) {
  for (int j = 0; j < QK_K / 32; ++j) {
    if (j < 4) {
      s[j] = ls[j];
      s[j + 4] = lm[j];
    } else {
      s[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      s[j - 4] = static_cast<uint8_t>(s[j - 4] | ((ls[j] >> 4) << 6));
      s[j] = static_cast<uint8_t>(s[j] | ((lm[j] >> 4) << 6));
    }
  }
}

template <typename Block>
void requantize_k4(const float* x, const Block& b, int nmax, uint8_t* L) {
  const float d_all = fp16_to_fp32(b.d), dmin_all = fp16_to_fp32(b.dmin);
  for (int j = 0; j < QK_K / 32; ++j) {
    int sc, m;
    k4_scale_min(b.scales, j, sc, m);
    const float d = d_all * as_float(sc);
    if (d == 0) continue;
    const float dm = dmin_all * as_float(m);
    requantize_affine(x + 32 * j, 32, d, dm, nmax, L + 32 * j);
  }
}

// Codes 64 p + l and 64 p + 32 + l share qs[32 p + l] (low, high nibble); q5_K
// puts bit 4 of code 32 g + l in bit g of qh[l].
void pack_q4_k(const uint8_t* L, BlockQ4_K& b) {
  for (int p = 0; p < QK_K / 64; ++p)
    for (int l = 0; l < 32; ++l)
      b.qs[32 * p + l] = static_cast<uint8_t>(L[64 * p + l] | (L[64 * p + l + 32] << 4));
}

void pack_q5_k(const uint8_t* L, BlockQ5_K& b) {
  std::memset(b.qh, 0, sizeof(b.qh));
  for (int p = 0; p < QK_K / 64; ++p) {
    for (int l = 0; l < 32; ++l) {
      int lo = L[64 * p + l], hi = L[64 * p + l + 32];
      if (lo > 15) {
        lo -= 16;
        b.qh[l] = static_cast<uint8_t>(b.qh[l] | (1 << (2 * p)));
      }
      if (hi > 15) {
        hi -= 16;
        b.qh[l] = static_cast<uint8_t>(b.qh[l] | (2 << (2 * p)));
      }
      b.qs[32 * p + l] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <typename Block>
void pack_k45(const uint8_t* L, Block& b) {
  if constexpr (sizeof(Block) == sizeof(BlockQ5_K)) {
    pack_q5_k(L, b);
  } else {
    pack_q4_k(L, b);
  }
}

// Without importance: each sub-block's affine fit weighted by av_x + |x|
// (av_x its RMS); scales and mins rounded to 6 bits against the largest.
template <typename Block, int kNmax>
void quantize_block_k45(const float* x, Block& b, const AffineGrid& grid) {
  uint8_t L[QK_K];
  float scales[QK_K / 32], mins[QK_K / 32], weights[32];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < QK_K / 32; ++j) {
    const float av_x = std::sqrt(sum_squares(x + 32 * j, 32) / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = fit_affine(32, kNmax, x + 32 * j, weights, L + 32 * j, &mins[j], grid);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t ls[QK_K / 32], lm[QK_K / 32];
  for (int j = 0; j < QK_K / 32; ++j) {
    ls[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
    lm[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
  }
  pack_k4_scales(ls, lm, b.scales);
  b.d = fp32_to_fp16(max_scale / 63.f);
  b.dmin = fp32_to_fp16(max_min / 63.f);
  requantize_k4(x, b, kNmax, L);
  pack_k45(L, b);
}

template <typename Block, int kNmax>
void quantize_block_k45_weighted(const float* x, const float* qw, Block& b) {
  uint8_t L[QK_K], ls[QK_K / 32], lm[QK_K / 32];
  float scales[QK_K / 32], mins[QK_K / 32], sw[QK_K / 32], weights[32];
  const float sigma2 = 2 * sum_squares(x, QK_K) / QK_K;
  for (int j = 0; j < QK_K / 32; ++j) {
    sw[j] = importance_weights(x + 32 * j, qw + 32 * j, 32, sigma2, weights);
    scales[j] = fit_affine(32, kNmax, x + 32 * j, weights, L + 32 * j, &mins[j], kWeightedGrid);
  }
  const float d_block = fit_positive(QK_K / 32, 63, scales, sw, ls);
  const float m_block = fit_positive(QK_K / 32, 63, mins, sw, lm);
  // ggml's q5_K clamps the codes here (a no-op unless a code wrapped); its q4_K does not.
  if constexpr (kNmax == 31) {
    for (int j = 0; j < QK_K / 32; ++j) {
      ls[j] = std::min<uint8_t>(63, ls[j]);
      lm[j] = std::min<uint8_t>(63, lm[j]);
    }
  }
  pack_k4_scales(ls, lm, b.scales);
  b.d = fp32_to_fp16(d_block);
  b.dmin = fp32_to_fp16(m_block);
  requantize_k4(x, b, kNmax, L);
  pack_k45(L, b);
}

// ---- q6_K: 16 sub-blocks of 16, 6-bit codes, signed 8-bit scales.

void pack_q6_k(const int8_t* L, BlockQ6_K& b) {
  for (int h = 0; h < QK_K / 128; ++h) {
    const int8_t* q = L + 128 * h;
    uint8_t* ql = b.ql + 64 * h;
    uint8_t* qh = b.qh + 32 * h;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((q[l] & 0xF) | ((q[l + 64] & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((q[l + 32] & 0xF) | ((q[l + 96] & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) |
                                   ((q[l + 96] >> 4) << 6));
    }
  }
}

// `qw` null: ggml's _ref (x^2 weights); otherwise the raw importance (q6_K's
// weighted path uses it without the sigma2 term of the other types).
void quantize_block_q6_k(const float* x, const float* qw, BlockQ6_K& b) {
  int8_t L[QK_K];
  float scales[QK_K / 16];
  float max_scale = 0, max_abs_scale = 0;
  for (int j = 0; j < QK_K / 16; ++j) {
    scales[j] = fit_symmetric(16, 32, x + 16 * j, qw ? qw + 16 * j : nullptr, L + 16 * j);
    const float abs_scale = std::fabs(scales[j]);
    if (abs_scale > max_abs_scale) {
      max_abs_scale = abs_scale;
      max_scale = scales[j];
    }
  }
  if (max_abs_scale < kGroupMaxEps) {
    b = BlockQ6_K{};  // all zero, d included
    return;
  }
  const float iscale = -128.f / max_scale;
  b.d = fp32_to_fp16(1 / iscale);
  for (int j = 0; j < QK_K / 16; ++j)
    b.scales[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[j])));
  const float d_all = fp16_to_fp32(b.d);
  for (int j = 0; j < QK_K / 16; ++j) {
    const float d = d_all * as_float(b.scales[j]);
    if (d == 0) continue;
    requantize_symmetric(x + 16 * j, 16, d, 32, L + 16 * j);
  }
  pack_q6_k(L, b);
}

}  // namespace

void quantize_row_q2_k(const float* x, void* dst, int64_t n) {
  for_each_superblock<BlockQ2_K>(x, dst, n,
                                 [](const float* xb, int64_t, BlockQ2_K& b) { quantize_block_q2_k(xb, b); });
}

void quantize_row_q3_k(const float* x, void* dst, int64_t n) {
  for_each_superblock<BlockQ3_K>(x, dst, n,
                                 [](const float* xb, int64_t, BlockQ3_K& b) { quantize_block_q3_k(xb, b); });
}

void quantize_row_q4_k(const float* x, void* dst, int64_t n) {
  for_each_superblock<BlockQ4_K>(x, dst, n, [](const float* xb, int64_t, BlockQ4_K& b) {
    quantize_block_k45<BlockQ4_K, 15>(xb, b, AffineGrid{-1.f, 0.1f, 20, false});
  });
}

void quantize_row_q5_k(const float* x, void* dst, int64_t n) {
  for_each_superblock<BlockQ5_K>(x, dst, n, [](const float* xb, int64_t, BlockQ5_K& b) {
    quantize_block_k45<BlockQ5_K, 31>(xb, b, AffineGrid{-0.5f, 0.1f, 15, false});
  });
}

void quantize_row_q6_k(const float* x, void* dst, int64_t n) {
  for_each_superblock<BlockQ6_K>(
      x, dst, n, [](const float* xb, int64_t, BlockQ6_K& b) { quantize_block_q6_k(xb, nullptr, b); });
}

void quantize_row_q2_k_weighted(const float* x, void* dst, int64_t n, const float* importance) {
  for_each_superblock<BlockQ2_K>(x, dst, n, [&](const float* xb, int64_t i, BlockQ2_K& b) {
    quantize_block_q2_k_weighted(xb, importance + i * QK_K, b);
  });
}

void quantize_row_q3_k_weighted(const float* x, void* dst, int64_t n, const float* importance) {
  for_each_superblock<BlockQ3_K>(x, dst, n, [&](const float* xb, int64_t i, BlockQ3_K& b) {
    quantize_block_q3_k_weighted(xb, importance + i * QK_K, b);
  });
}

void quantize_row_q4_k_weighted(const float* x, void* dst, int64_t n, const float* importance) {
  for_each_superblock<BlockQ4_K>(x, dst, n, [&](const float* xb, int64_t i, BlockQ4_K& b) {
    quantize_block_k45_weighted<BlockQ4_K, 15>(xb, importance + i * QK_K, b);
  });
}

void quantize_row_q5_k_weighted(const float* x, void* dst, int64_t n, const float* importance) {
  for_each_superblock<BlockQ5_K>(x, dst, n, [&](const float* xb, int64_t i, BlockQ5_K& b) {
    quantize_block_k45_weighted<BlockQ5_K, 31>(xb, importance + i * QK_K, b);
  });
}

void quantize_row_q6_k_weighted(const float* x, void* dst, int64_t n, const float* importance) {
  for_each_superblock<BlockQ6_K>(x, dst, n, [&](const float* xb, int64_t i, BlockQ6_K& b) {
    quantize_block_q6_k(xb, importance + i * QK_K, b);
  });
}

}  // namespace loom::quant
