// Block-wise 8-bit quantization and the fused 8-bit AdamW step on the CPU.
// The map lookup is bitsandbytes' own: one fused multiply-add gives an index
// into a 65536-entry table of nearest codes (no search).
// torch / bitsandbytes round every product: no fused multiply-add but the explicit ones.
#pragma GCC optimize("fp-contract=off")

#include "kernels/cpu/optim8bit.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace loom {

namespace {

constexpr size_t kB = kBlockwise8Block;
constexpr int64_t kGrain = 8;  // blocks per task: 2048 elements

// max(0, max |x|) with NaN lanes ignored (max_ps returns its second operand on NaN).
float block_absmax(const float* x, size_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float am = 0.0f;
  for (float l : lanes)
    if (am < l) am = l;
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (am < a) am = a;
  }
  return am;
}

// codes of one block x [n <= 256] whose absmax is am > 0.
void quantize_block(const Blockwise8Map& map, const float* x, size_t n, float am, uint8_t* codes) {
  const float scale = 1.0f / am;
  const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-1.0f), hi = _mm256_set1_ps(1.0f);
  const __m256 half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(65535.0f);
  alignas(32) int32_t idx[kB];
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    // A NaN becomes -1 here and index 0 either way (the scalar path: NaN -> 0).
    const __m256 c = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), lo), hi);
    const __m256 t = _mm256_mul_ps(_mm256_add_ps(c, hi), half);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx + i), _mm256_cvttps_epi32(_mm256_fmadd_ps(t, top, half)));
  }
  for (size_t k = 0; k < i; ++k) codes[k] = map.lut[static_cast<uint16_t>(idx[k])];
  for (; i < n; ++i) codes[i] = map.lut[blockwise8_lut_index(x[i] * scale)];
}

void quantize_one(const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes, float* absmax) {
  const float am = block_absmax(x, n);
  *absmax = am;
  if (am == 0.0f)
    std::fill_n(codes, n, uint8_t{0});
  else
    quantize_block(map, x, n, am, codes);
}

void dequantize_one(const Blockwise8Map& map, const uint8_t* codes, float am, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = map.code[codes[i]] * am;
}

// The AdamW arithmetic of kernels/ref/optim8bit_ref.cpp on one block.
void update_block(const Adam8bitUpdate& u, float* p, const float* g, float* m, float* v, size_t n) {
  const __m256 b1 = _mm256_set1_ps(u.b1), w1 = _mm256_set1_ps(u.w1), b2 = _mm256_set1_ps(u.b2);
  const __m256 w2 = _mm256_set1_ps(u.w2), bc2 = _mm256_set1_ps(u.bc2_sqrt), eps = _mm256_set1_ps(u.eps);
  const __m256 keep = _mm256_set1_ps(u.keep), ns = _mm256_set1_ps(-u.step_size);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 mi = _mm256_fmadd_ps(gi, w1, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
    const __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(w2, gi), gi, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    const __m256 kept = _mm256_mul_ps(_mm256_loadu_ps(p + i), keep);
    _mm256_storeu_ps(p + i, _mm256_add_ps(kept, _mm256_div_ps(_mm256_mul_ps(ns, mi), denom)));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  const float neg_step = -u.step_size;
  for (; i < n; ++i) {
    const float mi = m[i] * u.b1;
    m[i] = std::fma(g[i], u.w1, mi);
    const float vi = v[i] * u.b2;
    const float wg = u.w2 * g[i];
    v[i] = std::fma(wg, g[i], vi);
    const float sq = std::sqrt(v[i]);
    const float denom = sq / u.bc2_sqrt + u.eps;
    const float kept = p[i] * u.keep;
    const float num = neg_step * m[i];
    const float upd = num / denom;
    p[i] = kept + upd;
  }
}

// fn(block index, first element, length) for every block of n elements, in parallel.
template <typename F>
void for_blocks(ThreadPool& pool, size_t n, F&& fn) {
  const auto nb = static_cast<int64_t>(blockwise8_blocks(n));
  pool.parallel_for(
      nb,
      [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) {
          const size_t lo = static_cast<size_t>(k) * kB;
          fn(static_cast<size_t>(k), lo, std::min(kB, n - lo));
        }
      },
      kGrain);
}

}  // namespace

void quantize_blockwise_cpu(ThreadPool& pool, const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes,
                            float* absmax) {
  for_blocks(pool, n, [&](size_t b, size_t lo, size_t len) { quantize_one(map, x + lo, len, codes + lo, absmax + b); });
}

void dequantize_blockwise_cpu(ThreadPool& pool, const Blockwise8Map& map, const uint8_t* codes, const float* absmax,
                              size_t n, float* out) {
  for_blocks(pool, n, [&](size_t b, size_t lo, size_t len) { dequantize_one(map, codes + lo, absmax[b], len, out + lo); });
}

void adamw8bit_update_cpu(ThreadPool& pool, const Adam8bitUpdate& u, float* p, const float* g,
                          const Adam8bitState& s, size_t n) {
  for_blocks(pool, n, [&](size_t b, size_t lo, size_t len) {
    alignas(32) float m[kB], v[kB];
    dequantize_one(*s.m_map, s.m + lo, s.m_absmax[b], len, m);
    dequantize_one(*s.v_map, s.v + lo, s.v_absmax[b], len, v);
    update_block(u, p + lo, g + lo, m, v, len);
    quantize_one(*s.m_map, m, len, s.m + lo, s.m_absmax + b);
    quantize_one(*s.v_map, v, len, s.v + lo, s.v_absmax + b);
  });
}

}  // namespace loom
