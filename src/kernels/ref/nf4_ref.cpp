// Scalar NF4 definitions (see nf4_ref.h): the code tables of bitsandbytes, its
// 4-bit quantizer, double quantization of the absmax and the matmul order.
// Products and sums are rounded one by one, as torch computes them: no FMA
// contraction here except where written (std::fma in matmul_nf4_ref).
#pragma GCC optimize("fp-contract=off")
#include "kernels/ref/nf4_ref.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace loom {

const float kNf4Code[16] = {
    -0x1.0000000000000p+0f, -0x1.6473620000000p-1f, -0x1.0cd6600000000p-1f, -0x1.9465400000000p-2f,
    -0x1.23449a0000000p-2f, -0x1.7a6a7e0000000p-3f, -0x1.74f0e20000000p-4f, 0.0f,
    0x1.45f5fe0000000p-4f,  0x1.4995c60000000p-3f,  0x1.f809ba0000000p-3f,  0x1.5a06740000000p-2f,
    0x1.c349700000000p-2f,  0x1.200f560000000p-1f,  0x1.7227660000000p-1f,  0x1.0000000000000p+0f,
};

// Generated from bitsandbytes.functional.create_dynamic_map(signed=True).
const float kDynamicSignedMap[256] = {
    -0x1.fc66660000000p-1f, -0x1.f533340000000p-1f, -0x1.ee00000000000p-1f, -0x1.e6cccc0000000p-1f,
    -0x1.df999a0000000p-1f, -0x1.d866660000000p-1f, -0x1.d133340000000p-1f, -0x1.ca00000000000p-1f,
    -0x1.c2cccc0000000p-1f, -0x1.bb999a0000000p-1f, -0x1.b466660000000p-1f, -0x1.ad33340000000p-1f,
    -0x1.a600000000000p-1f, -0x1.9ecccc0000000p-1f, -0x1.97999a0000000p-1f, -0x1.9066660000000p-1f,
    -0x1.8933340000000p-1f, -0x1.8200000000000p-1f, -0x1.7acccc0000000p-1f, -0x1.73999a0000000p-1f,
    -0x1.6c66680000000p-1f, -0x1.6533340000000p-1f, -0x1.5e00000000000p-1f, -0x1.56cccc0000000p-1f,
    -0x1.4f999a0000000p-1f, -0x1.4866680000000p-1f, -0x1.4133340000000p-1f, -0x1.3a00000000000p-1f,
    -0x1.32cccc0000000p-1f, -0x1.2b999a0000000p-1f, -0x1.2466680000000p-1f, -0x1.1d33340000000p-1f,
    -0x1.1600000000000p-1f, -0x1.0ecccc0000000p-1f, -0x1.0799980000000p-1f, -0x1.0066660000000p-1f,
    -0x1.f266640000000p-2f, -0x1.e400000000000p-2f, -0x1.d599980000000p-2f, -0x1.c733340000000p-2f,
    -0x1.b8cccc0000000p-2f, -0x1.aa66660000000p-2f, -0x1.9c00000000000p-2f, -0x1.8d99980000000p-2f,
    -0x1.7f33340000000p-2f, -0x1.70cccc0000000p-2f, -0x1.6266660000000p-2f, -0x1.5400000000000p-2f,
    -0x1.4599980000000p-2f, -0x1.3733340000000p-2f, -0x1.28cccc0000000p-2f, -0x1.1a66680000000p-2f,
    -0x1.0c00000000000p-2f, -0x1.fb33320000000p-3f, -0x1.de66660000000p-3f, -0x1.c1999a0000000p-3f,
    -0x1.a4cccc0000000p-3f, -0x1.8800000000000p-3f, -0x1.6b33340000000p-3f, -0x1.4e66660000000p-3f,
    -0x1.31999a0000000p-3f, -0x1.14cccc0000000p-3f, -0x1.f000000000000p-4f, -0x1.b666680000000p-4f,
    -0x1.93d70a0000000p-4f, -0x1.8851ee0000000p-4f, -0x1.7cccce0000000p-4f, -0x1.7147ae0000000p-4f,
    -0x1.65c2900000000p-4f, -0x1.5a3d700000000p-4f, -0x1.4eb8540000000p-4f, -0x1.4333340000000p-4f,
    -0x1.37ae140000000p-4f, -0x1.2c28f60000000p-4f, -0x1.20a3d60000000p-4f, -0x1.151eba0000000p-4f,
    -0x1.09999a0000000p-4f, -0x1.fc28f60000000p-5f, -0x1.e51eba0000000p-5f, -0x1.ce147a0000000p-5f,
    -0x1.b70a3e0000000p-5f, -0x1.a000000000000p-5f, -0x1.88f5c20000000p-5f, -0x1.71eb860000000p-5f,
    -0x1.5ae1460000000p-5f, -0x1.43d70a0000000p-5f, -0x1.2cccce0000000p-5f, -0x1.15c2900000000p-5f,
    -0x1.fd70a40000000p-6f, -0x1.cf5c2a0000000p-6f, -0x1.a147ae0000000p-6f, -0x1.7333340000000p-6f,
    -0x1.451eba0000000p-6f, -0x1.170a3e0000000p-6f, -0x1.d1eb860000000p-7f, -0x1.75c2900000000p-7f,
    -0x1.3e76c80000000p-7f, -0x1.2c08300000000p-7f, -0x1.19999a0000000p-7f, -0x1.072b020000000p-7f,
    -0x1.e978d40000000p-8f, -0x1.c49ba60000000p-8f, -0x1.9fbe760000000p-8f, -0x1.7ae1480000000p-8f,
    -0x1.56041a0000000p-8f, -0x1.3126e80000000p-8f, -0x1.0c49ba0000000p-8f, -0x1.ced9140000000p-9f,
    -0x1.851eb80000000p-9f, -0x1.3b645a0000000p-9f, -0x1.e353f80000000p-10f, -0x1.4fdf3a0000000p-10f,
    -0x1.eecbfe0000000p-11f, -0x1.b3d07c0000000p-11f, -0x1.78d5000000000p-11f, -0x1.3dd9820000000p-11f,
    -0x1.02de020000000p-11f, -0x1.8fc5060000000p-12f, -0x1.19ce0a0000000p-12f, -0x1.47ae160000000p-13f,
    -0x1.743e960000000p-14f, -0x1.15df660000000p-14f, -0x1.6f00680000000p-15f, -0x1.64840c0000000p-16f,
    -0x1.040bfe0000000p-17f, -0x1.b435280000000p-19f, -0x1.27476e0000000p-21f, 0x0.0p+0f,
    0x1.27476e0000000p-21f, 0x1.b435280000000p-19f, 0x1.040bfe0000000p-17f, 0x1.64840c0000000p-16f,
    0x1.6f00680000000p-15f, 0x1.15df660000000p-14f, 0x1.743e960000000p-14f, 0x1.47ae160000000p-13f,
    0x1.19ce0a0000000p-12f, 0x1.8fc5060000000p-12f, 0x1.02de020000000p-11f, 0x1.3dd9820000000p-11f,
    0x1.78d5000000000p-11f, 0x1.b3d07c0000000p-11f, 0x1.eecbfe0000000p-11f, 0x1.4fdf3a0000000p-10f,
    0x1.e353f80000000p-10f, 0x1.3b645a0000000p-9f, 0x1.851eb80000000p-9f, 0x1.ced9140000000p-9f,
    0x1.0c49ba0000000p-8f, 0x1.3126e80000000p-8f, 0x1.56041a0000000p-8f, 0x1.7ae1480000000p-8f,
    0x1.9fbe760000000p-8f, 0x1.c49ba60000000p-8f, 0x1.e978d40000000p-8f, 0x1.072b020000000p-7f,
    0x1.19999a0000000p-7f, 0x1.2c08300000000p-7f, 0x1.3e76c80000000p-7f, 0x1.75c2900000000p-7f,
    0x1.d1eb860000000p-7f, 0x1.170a3e0000000p-6f, 0x1.451eba0000000p-6f, 0x1.7333340000000p-6f,
    0x1.a147ae0000000p-6f, 0x1.cf5c2a0000000p-6f, 0x1.fd70a40000000p-6f, 0x1.15c2900000000p-5f,
    0x1.2cccce0000000p-5f, 0x1.43d70a0000000p-5f, 0x1.5ae1460000000p-5f, 0x1.71eb860000000p-5f,
    0x1.88f5c20000000p-5f, 0x1.a000000000000p-5f, 0x1.b70a3e0000000p-5f, 0x1.ce147a0000000p-5f,
    0x1.e51eba0000000p-5f, 0x1.fc28f60000000p-5f, 0x1.09999a0000000p-4f, 0x1.151eba0000000p-4f,
    0x1.20a3d60000000p-4f, 0x1.2c28f60000000p-4f, 0x1.37ae140000000p-4f, 0x1.4333340000000p-4f,
    0x1.4eb8540000000p-4f, 0x1.5a3d700000000p-4f, 0x1.65c2900000000p-4f, 0x1.7147ae0000000p-4f,
    0x1.7cccce0000000p-4f, 0x1.8851ee0000000p-4f, 0x1.93d70a0000000p-4f, 0x1.b666680000000p-4f,
    0x1.f000000000000p-4f, 0x1.14cccc0000000p-3f, 0x1.31999a0000000p-3f, 0x1.4e66660000000p-3f,
    0x1.6b33340000000p-3f, 0x1.8800000000000p-3f, 0x1.a4cccc0000000p-3f, 0x1.c1999a0000000p-3f,
    0x1.de66660000000p-3f, 0x1.fb33320000000p-3f, 0x1.0c00000000000p-2f, 0x1.1a66680000000p-2f,
    0x1.28cccc0000000p-2f, 0x1.3733340000000p-2f, 0x1.4599980000000p-2f, 0x1.5400000000000p-2f,
    0x1.6266660000000p-2f, 0x1.70cccc0000000p-2f, 0x1.7f33340000000p-2f, 0x1.8d99980000000p-2f,
    0x1.9c00000000000p-2f, 0x1.aa66660000000p-2f, 0x1.b8cccc0000000p-2f, 0x1.c733340000000p-2f,
    0x1.d599980000000p-2f, 0x1.e400000000000p-2f, 0x1.f266640000000p-2f, 0x1.0066660000000p-1f,
    0x1.0799980000000p-1f, 0x1.0ecccc0000000p-1f, 0x1.1600000000000p-1f, 0x1.1d33340000000p-1f,
    0x1.2466680000000p-1f, 0x1.2b999a0000000p-1f, 0x1.32cccc0000000p-1f, 0x1.3a00000000000p-1f,
    0x1.4133340000000p-1f, 0x1.4866680000000p-1f, 0x1.4f999a0000000p-1f, 0x1.56cccc0000000p-1f,
    0x1.5e00000000000p-1f, 0x1.6533340000000p-1f, 0x1.6c66680000000p-1f, 0x1.73999a0000000p-1f,
    0x1.7acccc0000000p-1f, 0x1.8200000000000p-1f, 0x1.8933340000000p-1f, 0x1.9066660000000p-1f,
    0x1.97999a0000000p-1f, 0x1.9ecccc0000000p-1f, 0x1.a600000000000p-1f, 0x1.ad33340000000p-1f,
    0x1.b466660000000p-1f, 0x1.bb999a0000000p-1f, 0x1.c2cccc0000000p-1f, 0x1.ca00000000000p-1f,
    0x1.d133340000000p-1f, 0x1.d866660000000p-1f, 0x1.df999a0000000p-1f, 0x1.e6cccc0000000p-1f,
    0x1.ee00000000000p-1f, 0x1.f533340000000p-1f, 0x1.fc66660000000p-1f, 0x1.0000000000000p+0f,
};

namespace {

// torch.bucketize's boundaries: (code[i] + code[i + 1]) / 2 in f32.
struct Nf4Bounds {
  float mid[15];
  Nf4Bounds() {
    for (int i = 0; i < 15; ++i) mid[i] = (kNf4Code[i] + kNf4Code[i + 1]) / 2.0f;
  }
};
const Nf4Bounds& nf4_bounds() {
  static const Nf4Bounds b;
  return b;
}

uint8_t nf4_code_of(float scaled, const float* mid) {
  uint8_t q = 0;  // bucketize (right=False): the number of boundaries < scaled
  while (q < 15 && mid[q] < scaled) ++q;
  return q;
}

// Nearest entry of an ascending 256-entry map; ties to the lower index (argmin).
uint8_t nearest_code(const float* code, float v) {
  int best = 0;
  float best_d = std::fabs(v - code[0]);
  for (int i = 1; i < 256; ++i) {
    const float dd = std::fabs(v - code[i]);
    if (dd < best_d) {
      best_d = dd;
      best = i;
    }
  }
  return static_cast<uint8_t>(best);
}

// torch's f32 sum of a contiguous vector on the CPU, one thread (SumKernel.cpp's
// cascade_sum): 8-lane vectors in groups of 4 ("ilp"), summed by a 4-level
// cascade whose level step is 2^max(4, ceil(log2(groups)) / 4); then the tail
// elements, the 4 accumulators and the 8 lanes, each add rounded to f32.
using Lanes = std::array<float, 8>;

void add_lanes(Lanes& a, const Lanes& b) {
  for (int l = 0; l < 8; ++l) a[static_cast<size_t>(l)] += b[static_cast<size_t>(l)];
}

int64_t ceil_log2(int64_t n) {
  int64_t r = 0;
  while ((int64_t{1} << r) < n) ++r;
  return r;
}

float torch_sum_f32(const float* x, int64_t n) {
  constexpr int64_t kW = 8, kIlp = 4, kLevels = 4;
  const int64_t nvec = n / kW, groups = nvec / kIlp;
  auto vec = [&](int64_t v) {
    Lanes r;
    std::memcpy(r.data(), x + v * kW, sizeof r);
    return r;
  };
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  Lanes acc[kLevels][kIlp] = {};
  int64_t i = 0;
  while (i + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) add_lanes(acc[0][k], vec(i * kIlp + k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        add_lanes(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Lanes{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int64_t k = 0; k < kIlp; ++k) add_lanes(acc[0][k], vec(i * kIlp + k));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) add_lanes(acc[0][k], acc[j][k]);
  for (int64_t v = groups * kIlp; v < nvec; ++v) add_lanes(acc[0][0], vec(v));
  for (int64_t k = 1; k < kIlp; ++k) add_lanes(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t k = nvec * kW; k < n; ++k) total += x[k];
  for (int l = 0; l < 8; ++l) total += acc[0][0][static_cast<size_t>(l)];
  return total;
}

}  // namespace

void dequantize_row_nf4_ref(const void* src, float* dst, int64_t n) {
  LOOM_ASSERT(n >= 0 && n % kNf4Block == 0);
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / kNf4Block; ++b, p += sizeof(BlockNF4), dst += kNf4Block) {
    BlockNF4 blk;
    std::memcpy(&blk, p, sizeof blk);
    for (int i = 0; i < 32; ++i) {
      dst[2 * i] = kNf4Code[blk.qs[i] >> 4] * blk.d;
      dst[2 * i + 1] = kNf4Code[blk.qs[i] & 0x0f] * blk.d;
    }
  }
}

float quantize_block_nf4(const float* x, uint8_t* qs) {
  float amax = 0.0f;
  for (int k = 0; k < kNf4Block; ++k) amax = std::fmax(amax, std::fabs(x[k]));
  const float inv = 1.0f / std::fmax(amax, 1e-38f);
  const float* mid = nf4_bounds().mid;
  for (int i = 0; i < 32; ++i) {
    const float s0 = std::fmin(std::fmax(x[2 * i] * inv, -1.0f), 1.0f);
    const float s1 = std::fmin(std::fmax(x[2 * i + 1] * inv, -1.0f), 1.0f);
    qs[i] = static_cast<uint8_t>(nf4_code_of(s0, mid) << 4 | nf4_code_of(s1, mid));
  }
  return amax;
}

Nf4DoubleQuant double_quantize_absmax(const float* absmax, int64_t n) {
  Nf4DoubleQuant q;
  if (n <= 0) return q;
  q.offset = torch_sum_f32(absmax, n) / static_cast<float>(n);  // torch's absmax.mean()
  q.qabsmax.resize(static_cast<size_t>(n));
  for (int64_t b0 = 0; b0 < n; b0 += kNf4NestedBlock) {
    const int64_t b1 = b0 + kNf4NestedBlock < n ? b0 + kNf4NestedBlock : n;
    float a2 = 0.0f;
    for (int64_t i = b0; i < b1; ++i) a2 = std::fmax(a2, std::fabs(absmax[i] - q.offset));
    q.nested_absmax.push_back(a2);
    for (int64_t i = b0; i < b1; ++i) {
      const float v = absmax[i] - q.offset;
      const float normed = a2 > 0.0f ? v / a2 : 0.0f;
      q.qabsmax[static_cast<size_t>(i)] = nearest_code(kDynamicSignedMap, normed);
    }
  }
  return q;
}

float dequantize_absmax(const float* nested_code, uint8_t q, float nested_absmax, float offset) {
  const float scaled = nested_code[q] * nested_absmax;
  return scaled + offset;
}

void nf4_finish_double_quant(BlockNF4* blocks, int64_t n) {
  std::vector<float> absmax(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) absmax[static_cast<size_t>(i)] = blocks[i].d;
  const Nf4DoubleQuant q = double_quantize_absmax(absmax.data(), n);
  for (int64_t i = 0; i < n; ++i)
    blocks[i].d = dequantize_absmax(kDynamicSignedMap, q.qabsmax[static_cast<size_t>(i)],
                                    q.nested_absmax[static_cast<size_t>(i / kNf4NestedBlock)], q.offset);
}

void matmul_nf4_ref(const BlockNF4* W, int64_t N, int64_t K, const float* x, int64_t T, float* y) {
  LOOM_ASSERT(K % kNf4Block == 0);
  const int64_t nb = K / kNf4Block;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const BlockNF4& blk = W[n * nb + b];
        const float* xb = x + t * K + b * kNf4Block;
        float s = 0.0f;
        for (int i = 0; i < 32; ++i) {
          s = std::fma(kNf4Code[blk.qs[i] >> 4], xb[2 * i], s);
          s = std::fma(kNf4Code[blk.qs[i] & 0x0f], xb[2 * i + 1], s);
        }
        acc = std::fma(s, blk.d, acc);
      }
      y[t * N + n] = acc;
    }
}

}  // namespace loom
