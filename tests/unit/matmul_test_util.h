// Test helpers for the matmul kernels: random weights of every type and a
// scalar model of the kernels' exact arithmetic (integer block dots, then the
// documented per-block f32 sequence), written independently of the packers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "kernels/quant_blocks.h"
#include "kernels/ref/dequant_ref.h"

namespace loom::testing {

inline std::vector<float> random_floats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

inline void put_f16(uint8_t* p, float v) {
  const uint16_t h = fp32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

// N rows of K columns of `type`. Types with a reference quantizer quantize
// normal(0, 1) data; k-quants get random bits with sane f16 scales.
inline std::vector<uint8_t> random_weights(DType type, int64_t N, int64_t K, uint32_t seed) {
  const size_t row_bytes = dtype_row_bytes(type, K);
  std::vector<uint8_t> w(row_bytes * static_cast<size_t>(N));
  std::mt19937 rng(seed);
  if (quantize_ref_supported(type)) {
    for (int64_t r = 0; r < N; ++r) {
      auto x = random_floats(K, seed * 7919u + static_cast<uint32_t>(r));
      // Rows of different magnitude, and a few exact zeros.
      for (auto& v : x) v *= 0.05f * static_cast<float>(1 + r % 5);
      if (r % 3 == 1) x[static_cast<size_t>(r % K)] = 0.0f;
      quantize_row_ref(type, x.data(), w.data() + static_cast<size_t>(r) * row_bytes, K);
    }
    return w;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.02f);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  const size_t bb = dtype_traits(type).block_bytes;
  for (size_t off = 0; off < w.size(); off += bb) {
    uint8_t* blk = w.data() + off;
    switch (type) {
      case DType::q2_k:
        put_f16(blk + 80, scale(rng));
        put_f16(blk + 82, scale(rng));
        break;
      case DType::q3_k:
        put_f16(blk + 108, scale(rng));
        break;
      case DType::q4_k:
      case DType::q5_k:
        put_f16(blk, scale(rng));
        put_f16(blk + 2, scale(rng));
        break;
      case DType::q6_k:
        put_f16(blk + 208, scale(rng));
        break;
      case DType::iq4_nl:
      case DType::iq4_xs:
        put_f16(blk, scale(rng) * (type == DType::iq4_nl ? 0.1f : 0.01f));  // values up to 127 (x 32)
        break;
      case DType::iq2_xxs:
      case DType::iq2_xs:
      case DType::iq2_s:
      case DType::iq3_xxs:
      case DType::iq3_s:
      case DType::iq1_s:
        put_f16(blk, scale(rng));  // values up to 62 x scale 31 x f
        break;
      case DType::iq1_m:
        set_iq1_m_d(blk, fp32_to_fp16(scale(rng)));
        break;
      case DType::tq1_0:
      case DType::tq2_0:
        put_f16(blk + bb - 2, scale(rng));
        break;
      case DType::q1_0:
      case DType::q2_0:
        put_f16(blk, scale(rng));
        break;
      case DType::mxfp4:  // 2^(e - 128) from 2^-13 to 2^-6
        blk[0] = static_cast<uint8_t>(115 + byte(rng) % 8);
        break;
      case DType::nvfp4:  // UE4M3 scales 2^-9 .. 2^-6 and, one in eight, any byte (0x7f reads 0)
        for (int s = 0; s < 4; ++s)
          blk[s] = byte(rng) % 8 == 0 ? blk[s] : static_cast<uint8_t>(16 + byte(rng) % 32);
        break;
      default:
        break;
    }
  }
  return w;
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// vcvtneps2bf16's rounding, written from its definition (independent of
// kernels/cpu/bf16_gemm.h): to nearest even; f32 subnormals become signed zeros.
inline float bf16_model_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0) return std::signbit(x) ? -0.0f : 0.0f;
  if (std::isnan(x)) return x;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// The kernels' result for one output: row `w` (GGUF bytes) times activations x.
inline float model_dot(DType type, const uint8_t* w, const float* x, int64_t K) {
  float acc = 0.0f;
  if (is_ternary(type)) {  // per superblock the integer sum (t - 1) x_q, then one fma with d * d_x
    std::vector<BlockQ8_K> xq(static_cast<size_t>(K / QK_K));
    quantize_row_q8_k_ref(x, xq.data(), K);
    const size_t bb = dtype_traits(type).block_bytes;
    for (int64_t sb = 0; sb < K / QK_K; ++sb) {
      const BlockQ8_K& a = xq[static_cast<size_t>(sb)];
      uint8_t trit[QK_K];
      ternary_trits(type, w + sb * bb, trit);
      int64_t I = 0;
      for (int e = 0; e < QK_K; ++e) I += (static_cast<int64_t>(trit[e]) - 1) * a.qs[e];
      acc = std::fma(static_cast<float>(I), f16(w + (sb + 1) * bb - 2) * a.d, acc);
    }
    return acc;
  }
  if (type == DType::nvfp4) {  // per 16 the integer dot, then one fma with d_16 * d_x (low 16 first)
    std::vector<BlockQ8_0> xq(static_cast<size_t>(K / 32));
    quantize_row_q8_0_ref(x, xq.data(), K);
    for (int64_t b = 0; b < K / 32; ++b) {
      const BlockQ8_0& a = xq[static_cast<size_t>(b)];
      const uint8_t* blk = w + (b / 2) * sizeof(BlockNVFP4);
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * static_cast<int>(b % 2) + half;  // the NVFP4 sub-block
        int64_t dot = 0;
        for (int j = 0; j < 16; ++j) {
          const uint8_t q = blk[4 + 8 * s + j % 8];
          dot += static_cast<int64_t>(kMxfp4Values[j < 8 ? q & 15 : q >> 4]) * a.qs[16 * half + j];
        }
        const float dw = fp16_to_fp32(nvfp4_scale_f16(blk[s]));
        acc = std::fma(static_cast<float>(dot), dw * fp16_to_fp32(a.d), acc);
      }
    }
    return acc;
  }
  if (is_low_bit(type) || type == DType::mxfp4) {  // per 32 the integer dot, then one fma with d * d_x
    std::vector<BlockQ8_0> xq(static_cast<size_t>(K / 32));
    quantize_row_q8_0_ref(x, xq.data(), K);
    const int64_t bs = dtype_block_size(type);
    const size_t bb = dtype_traits(type).block_bytes;
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = w + (b * 32 / bs) * bb;
      int v[32];
      float dw;
      if (type == DType::mxfp4) {
        for (int j = 0; j < 16; ++j) {
          v[j] = kMxfp4Values[blk[1 + j] & 15];
          v[j + 16] = kMxfp4Values[blk[1 + j] >> 4];
        }
        dw = bf16_to_fp32(mxfp4_scale_bf16(blk[0]));
      } else {
        uint8_t code[QK1_0];
        low_bit_codes(type, blk, code);
        for (int j = 0; j < 32; ++j) v[j] = code[(b * 32) % bs + j] - 8;
        dw = f16(blk);
      }
      const BlockQ8_0& a = xq[static_cast<size_t>(b)];
      int64_t dot = 0;
      for (int j = 0; j < 32; ++j) dot += static_cast<int64_t>(v[j]) * a.qs[j];
      acc = std::fma(static_cast<float>(dot), dw * fp16_to_fp32(a.d), acc);
    }
    return acc;
  }
  switch (type) {
    case DType::q4_0:
    case DType::q4_1:
    case DType::q5_0:
    case DType::q5_1:
    case DType::q8_0:
    case DType::iq4_nl: {
      const bool q81 = type == DType::q4_1 || type == DType::q5_1;
      std::vector<uint8_t> xq(static_cast<size_t>(K / 32) * (q81 ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0)));
      if (q81)
        quantize_row_q8_1_ref(x, xq.data(), K);
      else
        quantize_row_q8_0_ref(x, xq.data(), K);
      const size_t bb = dtype_traits(type).block_bytes;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* wb = w + b * bb;
        int v[32];
        float dw = f16(wb), mw = 0.0f;
        if (type == DType::q4_0 || type == DType::q4_1) {
          const uint8_t* qs = wb + (type == DType::q4_0 ? 2 : 4);
          const int off = type == DType::q4_0 ? 8 : 0;
          for (int j = 0; j < 16; ++j) {
            v[j] = (qs[j] & 15) - off;
            v[j + 16] = (qs[j] >> 4) - off;
          }
          if (type == DType::q4_1) mw = f16(wb + 2);
        } else if (type == DType::q5_0 || type == DType::q5_1) {
          const int hoff = type == DType::q5_0 ? 2 : 4;
          uint32_t qh;
          std::memcpy(&qh, wb + hoff, 4);
          const uint8_t* qs = wb + hoff + 4;
          const int off = type == DType::q5_0 ? 16 : 0;
          for (int j = 0; j < 16; ++j) {
            v[j] = ((qs[j] & 15) | static_cast<int>(((qh >> j) & 1) << 4)) - off;
            v[j + 16] = ((qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4)) - off;
          }
          if (type == DType::q5_1) mw = f16(wb + 2);
        } else if (type == DType::iq4_nl) {
          for (int j = 0; j < 16; ++j) {
            v[j] = kIq4Values[wb[2 + j] & 15];
            v[j + 16] = kIq4Values[wb[2 + j] >> 4];
          }
        } else {
          for (int j = 0; j < 32; ++j) v[j] = static_cast<int8_t>(wb[2 + j]);
        }
        const uint8_t* xb = xq.data() + b * (q81 ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0));
        const float dx = f16(xb);
        const auto* xs = reinterpret_cast<const int8_t*>(xb + (q81 ? 4 : 2));
        int64_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += static_cast<int64_t>(v[j]) * xs[j];
        const float s = dw * dx;
        acc = std::fma(static_cast<float>(dot), s, acc);
        if (q81) acc = std::fma(mw, f16(xb + 2), acc);
      }
      return acc;
    }
    case DType::q2_k:
    case DType::q3_k:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k:
    case DType::iq4_xs:
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq1_s:
    case DType::iq1_m: {
      std::vector<BlockQ8_K> xq(static_cast<size_t>(K / QK_K));
      quantize_row_q8_k_ref(x, xq.data(), K);
      const size_t bb = dtype_traits(type).block_bytes;
      for (int64_t sb = 0; sb < K / QK_K; ++sb) {
        const uint8_t* wb = w + sb * bb;
        const BlockQ8_K& a = xq[static_cast<size_t>(sb)];
        if (is_iq_grid(type)) {
          // Written from the format (quant_blocks.h): I = sum over sub-blocks of
          // (2s + 1) x the dot of the signed grid values, scaled by d * (d_x * f).
          const IqGridSuperblock b = decode_iq_grid(type, wb);
          int64_t I = 0;
          for (int j = 0; j < 16; ++j) {
            int64_t s = 0;
            for (int e = 16 * j; e < 16 * j + 16; ++e)
              s += static_cast<int64_t>(iq_grid_weight(type, b, e)) * a.qs[e];
            I += s * b.scale[j];
          }
          acc = std::fma(static_cast<float>(I), fp16_to_fp32(b.d) * (a.d * iq_grid_traits(type).factor), acc);
          continue;
        }
        if (type == DType::q2_k) {
          BlockQ2_K b;
          std::memcpy(&b, wb, sizeof b);
          int64_t I1 = 0, I2 = 0;
          for (int j = 0; j < 16; ++j) {
            int64_t s = 0, xs = 0;
            for (int e = 16 * j; e < 16 * j + 16; ++e) {
              const int h = e / 128, q = (e / 32) % 4, l = e % 32;
              s += static_cast<int64_t>((b.qs[32 * h + l] >> (2 * q)) & 3) * a.qs[e];
              xs += a.qs[e];
            }
            I1 += s * (b.scales[j] & 15);
            I2 += xs * (b.scales[j] >> 4);
          }
          acc = std::fma(static_cast<float>(I1), fp16_to_fp32(b.d) * a.d, acc);
          acc = std::fma(-static_cast<float>(I2), fp16_to_fp32(b.dmin) * a.d, acc);
        } else if (type == DType::q3_k) {
          BlockQ3_K b;
          std::memcpy(&b, wb, sizeof b);
          int64_t I = 0;
          for (int j = 0; j < 16; ++j) {
            const int lo = j < 8 ? (b.scales[j] & 15) : (b.scales[j - 8] >> 4);
            const int hi = (b.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
            const int sc = (lo | (hi << 4)) - 32;
            int64_t s = 0;
            for (int e = 16 * j; e < 16 * j + 16; ++e) {
              const int h = e / 128, q = (e / 32) % 4, l = e % 32;
              const int low = (b.qs[32 * h + l] >> (2 * q)) & 3;
              const int v = low - (((b.hmask[l] >> (e / 32)) & 1) ? 0 : 4);
              s += static_cast<int64_t>(v) * a.qs[e];
            }
            I += s * sc;
          }
          acc = std::fma(static_cast<float>(I), fp16_to_fp32(b.d) * a.d, acc);
        } else if (type == DType::iq4_xs) {
          BlockIQ4_XS b;
          std::memcpy(&b, wb, sizeof b);
          int64_t I = 0;
          for (int j = 0; j < 8; ++j) {
            int64_t s = 0;
            for (int l = 0; l < 16; ++l) {
              s += static_cast<int64_t>(kIq4Values[b.qs[16 * j + l] & 15]) * a.qs[32 * j + l];
              s += static_cast<int64_t>(kIq4Values[b.qs[16 * j + l] >> 4]) * a.qs[32 * j + 16 + l];
            }
            I += s * iq4_xs_scale(b, j);
          }
          acc = std::fma(static_cast<float>(I), fp16_to_fp32(b.d) * a.d, acc);
        } else if (type == DType::q6_k) {
          BlockQ6_K b;
          std::memcpy(&b, wb, sizeof b);
          int64_t I = 0;
          for (int j = 0; j < 16; ++j) {
            int64_t s = 0;
            for (int e = 16 * j; e < 16 * j + 16; ++e) {
              const int h = e / 128, q = (e / 32) % 4, l = e % 32;
              const int lo = (b.ql[64 * h + 32 * (q % 2) + l] >> (4 * (q / 2))) & 15;
              const int hi = (b.qh[32 * h + l] >> (2 * q)) & 3;
              s += static_cast<int64_t>((lo | (hi << 4)) - 32) * a.qs[e];
            }
            I += s * b.scales[j];
          }
          acc = std::fma(static_cast<float>(I), fp16_to_fp32(b.d) * a.d, acc);
        } else {
          const bool five = type == DType::q5_k;
          const uint8_t* scales = wb + 4;
          const uint8_t* qh = wb + 16;
          const uint8_t* qs = wb + (five ? 48 : 16);
          int64_t I1 = 0, I2 = 0;
          for (int g = 0; g < 8; ++g) {
            int sc, m;
            k4_scale_min(scales, g, sc, m);
            int64_t s = 0, xs = 0;
            for (int l = 0; l < 32; ++l) {
              int q = (qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 15;
              if (five) q |= ((qh[l] >> g) & 1) << 4;
              s += static_cast<int64_t>(q) * a.qs[32 * g + l];
              xs += a.qs[32 * g + l];
            }
            I1 += s * sc;
            I2 += xs * m;
          }
          const float d = f16(wb), dmin = f16(wb + 2);
          acc = std::fma(static_cast<float>(I1), d * a.d, acc);
          acc = std::fma(-static_cast<float>(I2), dmin * a.d, acc);
        }
      }
      return acc;
    }
    case DType::bf16: {
      // Activations rounded to bf16 (to nearest even, f32 subnormals to zero); per
      // pair the odd product, then the even one (vdpbf16ps; the products are exact,
      // so each step is one fma). Denormal flushing is not modelled: no test data
      // comes near 1e-38.
      std::vector<float> wf(static_cast<size_t>(K + 1), 0.0f), xr(static_cast<size_t>(K + 1), 0.0f);
      dequantize_row_ref(type, w, wf.data(), K);
      for (int64_t k = 0; k < K; ++k) xr[static_cast<size_t>(k)] = bf16_model_round(x[k]);
      for (int64_t k = 0; k < K; k += 2) {
        const auto i = static_cast<size_t>(k);
        acc = std::fma(wf[i + 1], xr[i + 1], acc);
        acc = std::fma(wf[i], xr[i], acc);
      }
      return acc;
    }
    default: {
      std::vector<float> wf(static_cast<size_t>(K));
      dequantize_row_ref(type, w, wf.data(), K);
      for (int64_t k = 0; k < K; ++k) acc = std::fma(wf[static_cast<size_t>(k)], x[k], acc);
      return acc;
    }
  }
}

// Bound on |kernel - exact| where exact = sum_k w_k x_k in double: the activation
// rounding sum_k |w_k| |x_k - xq_k| (xq: the reference-quantized x), the q8_1
// 's' rounding |m| |s - d*sum(qs)|, and f32 accumulation (K+8 roundings of at
// most sum |w_k x_k| + the rounding term).
inline double matmul_tolerance(DType type, const uint8_t* w, const float* x, int64_t K) {
  std::vector<float> wf(static_cast<size_t>(K)), xq(static_cast<size_t>(K));
  dequantize_row_ref(type, w, wf.data(), K);
  double act_err = 0.0, mag = 0.0, s_err = 0.0;
  switch (type) {
    case DType::q4_0:
    case DType::q5_0:
    case DType::q8_0:
    case DType::iq4_nl:
    case DType::q1_0:
    case DType::q2_0:
    case DType::mxfp4:
    case DType::nvfp4: {
      std::vector<BlockQ8_0> b(static_cast<size_t>(K / 32));
      quantize_row_q8_0_ref(x, b.data(), K);
      dequantize_row_ref(DType::q8_0, b.data(), xq.data(), K);
      break;
    }
    case DType::q4_1:
    case DType::q5_1: {
      std::vector<BlockQ8_1> b(static_cast<size_t>(K / 32));
      quantize_row_q8_1_ref(x, b.data(), K);
      dequantize_row_ref(DType::q8_1, b.data(), xq.data(), K);
      const size_t bb = dtype_traits(type).block_bytes;
      for (int64_t i = 0; i < K / 32; ++i) {
        const auto& blk = b[static_cast<size_t>(i)];
        double sum = 0.0;
        for (int j = 0; j < 32; ++j) sum += xq[static_cast<size_t>(32 * i + j)];
        s_err += std::fabs(f16(w + i * bb + 2)) * std::fabs(fp16_to_fp32(blk.s) - sum);
      }
      break;
    }
    case DType::q2_k:
    case DType::q3_k:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k:
    case DType::iq4_xs:
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq1_s:
    case DType::iq1_m:
    case DType::tq1_0:
    case DType::tq2_0: {
      std::vector<BlockQ8_K> b(static_cast<size_t>(K / QK_K));
      quantize_row_q8_k_ref(x, b.data(), K);
      dequantize_row_ref(DType::q8_k, b.data(), xq.data(), K);
      break;
    }
    case DType::bf16:
      for (int64_t k = 0; k < K; ++k) xq[static_cast<size_t>(k)] = bf16_model_round(x[k]);
      break;
    default:
      xq.assign(x, x + K);
      break;
  }
  for (int64_t k = 0; k < K; ++k) {
    const auto i = static_cast<size_t>(k);
    act_err += std::fabs(static_cast<double>(wf[i])) * std::fabs(static_cast<double>(x[k]) - xq[i]);
    mag += std::fabs(static_cast<double>(wf[i]) * xq[i]);
  }
  return act_err + s_err + static_cast<double>(K + 8) * 0x1p-23 * (mag + act_err + s_err) + 1e-30;
}

}  // namespace loom::testing
