// Activation quantizers (q8_0, q8_1, q8_K; i8_ch's whole-row codes) in AVX2,
// bit-identical to the scalar *_ref versions in kernels/ref/dequant_ref.h and
// kernels/ref/i8ch_ref.h, and the act rows the kernels read.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/panel.h"
#include "kernels/cpu/matmul.h"
#include "kernels/quant_blocks.h"

namespace loom {
namespace cpu {
namespace {

inline uint16_t to_fp16(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }
inline float from_fp16(uint16_t h) { return _cvtsh_ss(h); }

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// Largest |x| over n (multiple of 8) floats; NaNs are skipped like std::max(amax, |x|).
inline float absmax(const float* x, int n) {
  __m256 acc = _mm256_setzero_ps();
  // max_ps returns its second operand when either is NaN, so NaN lanes keep acc.
  for (int i = 0; i < n; i += 8) acc = _mm256_max_ps(abs_ps(_mm256_loadu_ps(x + i)), acc);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 floats (already scaled and rounded to integers, NaN-free) -> int8 in order.
inline __m256i pack_i8x32(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
  const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
  const __m256i p = _mm256_packs_epi16(p01, p23);
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline void store_i8x32(__m256i i0, __m256i i1, __m256i i2, __m256i i3, int8_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), pack_i8x32(i0, i1, i2, i3));
}

// roundf (half away from zero), clamped to [-128, 127], NaN -> 0.
inline __m256i round_away_i8range(__m256 v) {
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 frac = abs_ps(_mm256_sub_ps(v, t));
  const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, _mm256_set1_ps(-0.0f)));
  t = _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one));
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
  return _mm256_cvttps_epi32(_mm256_andnot_ps(nan, t));
}

// Round half to even (ggml's nearest_int), clamped to [-128, 127], NaN -> 0.
inline __m256i round_even_i8range(__m256 v) {
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  __m256 t = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
  t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvttps_epi32(_mm256_andnot_ps(nan, t));
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// Quantizes 32 floats like quantize_row_q8_0_ref; returns d, writes qs, *sum = sum(qs).
inline float q8_32(const float* x, int8_t* qs, int* sum) {
  const float amax = absmax(x, 32);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = round_away_i8range(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vid));
  store_i8x32(q[0], q[1], q[2], q[3], qs);
  *sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  return d;
}

// roundf (half away from zero), clamped to [-127, 127], NaN -> 0: the i8_ch
// activation codes (never -128: the AVX2 kernel's sign trick relies on it).
inline __m256i round_away_i8sym(__m256 v) {
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 frac = abs_ps(_mm256_sub_ps(v, t));
  const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, _mm256_set1_ps(-0.0f)));
  t = _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one));
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  return _mm256_cvttps_epi32(_mm256_andnot_ps(nan, t));
}

}  // namespace

void quantize_act_row_i8ch(const float* x, int64_t K, uint8_t* dst) {
  static const bool avx512 = usable_cpu_features().has_avx512_f32();
  if (avx512) return quantize_act_row_i8ch_avx512(x, K, dst);
  quantize_act_row_i8ch_avx2(x, K, dst);
}

void quantize_act_row_i8ch_avx2(const float* x, int64_t K, uint8_t* dst) {
  // amax over the whole row; NaNs skipped as std::max(amax, |x|) skips them.
  __m256 vmax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(abs_ps(_mm256_loadu_ps(x + k)), vmax);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  float amax = _mm_cvtss_f32(m);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax / 127.0f;
  const float id = s != 0.0f ? 1.0f / s : 0.0f;

  uint8_t* q = dst + kI8ChActHeader;
  const __m256 vid = _mm256_set1_ps(id);
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i vsum = _mm256_setzero_si256();
  k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; ++i) v[i] = round_away_i8sym(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * i), vid));
    vsum = _mm256_add_epi32(vsum, _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_xor_si256(pack_i8x32(v[0], v[1], v[2], v[3]), bias));
  }
  int32_t sum = hsum_i32(vsum);
  for (; k < K; ++k) {
    const float v = x[k] * id;
    const int c = std::isnan(v) ? 0 : static_cast<int>(std::clamp(std::round(v), -127.0f, 127.0f));
    q[k] = static_cast<uint8_t>(c + 128);
    sum += c;
  }
  const int64_t padded = static_cast<int64_t>(i8ch_act_row_bytes(K) - kI8ChActHeader);
  std::memset(q + K, 0x80, static_cast<size_t>(padded - K));  // qx = 0
  std::memset(dst, 0, kI8ChActHeader);
  std::memcpy(dst, &s, 4);
  std::memcpy(dst + 4, &sum, 4);
}

float quantize_block_q8_32(const float* x, int8_t* qs) {
  int sum;
  return q8_32(x, qs, &sum);
}

float quantize_block_q8_k(const float* x, int8_t* qs, int16_t* bsums) {
  const float amax = absmax(x, QK_K);
  if (!(amax > 0.0f)) {  // all zeros (or NaNs): ggml's block is all zero
    std::memset(qs, 0, QK_K);
    std::memset(bsums, 0, QK_K / 16 * sizeof(int16_t));
    return 0.0f;
  }
  // The signed value of the first element with the largest magnitude.
  float max = 0.0f;
  const __m256 va = _mm256_set1_ps(amax);
  for (int i = 0; i < QK_K; i += 8) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(abs_ps(_mm256_loadu_ps(x + i)), va, _CMP_EQ_OQ));
    if (m != 0) {
      max = x[i + __builtin_ctz(static_cast<unsigned>(m))];
      break;
    }
  }
  const float iscale = -127.0f / max;
  const __m256 vs = _mm256_set1_ps(iscale);
  for (int i = 0; i < QK_K; i += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = round_even_i8range(_mm256_mul_ps(vs, _mm256_loadu_ps(x + i + 8 * j)));
    store_i8x32(q[0], q[1], q[2], q[3], qs + i);
    // Sums of 16: q[0]+q[1] are elements i..i+15, q[2]+q[3] the next 16.
    bsums[i / 16] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(q[0], q[1])));
    bsums[i / 16 + 1] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(q[2], q[3])));
  }
  return 1.0f / iscale;
}

ActKind act_kind(DType type, bool bf16_pairs) {
  switch (type) {
    case DType::q4_0:
    case DType::q4_1:
    case DType::q5_0:
    case DType::q5_1:
    case DType::q8_0:
    case DType::iq4_nl:
    case DType::mxfp4:
    case DType::nvfp4:
    case DType::q1_0:
      return ActKind::q8x32;
    case DType::iq4_xs:
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq1_s:
    case DType::iq1_m:
    case DType::q2_k:
    case DType::q3_k:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k:
    case DType::tq1_0:
    case DType::tq2_0:
      return ActKind::q8k;
    case DType::i8_ch:
      return ActKind::i8row;
    case DType::bf16:
      return bf16_pairs ? ActKind::bf16pairs : ActKind::bf16f32;
    default:
      return ActKind::f32;
  }
}

size_t act_row_bytes(ActKind kind, int64_t K) {
  switch (kind) {
    case ActKind::q8x32:
      return static_cast<size_t>(K / 32) * sizeof(ActQ8x32);
    case ActKind::q8k:
    case ActKind::q8k_u8:
      return static_cast<size_t>(K / QK_K) * sizeof(ActQ8K);
    case ActKind::i8row:
      return i8ch_act_row_bytes(K);
    case ActKind::bf16pairs:
      return static_cast<size_t>(bf16_pair_count(K)) * 2 * sizeof(uint16_t);
    case ActKind::bf16f32:
      return static_cast<size_t>(bf16_pair_count(K)) * 2 * sizeof(float);
    case ActKind::f32:
      return static_cast<size_t>(K) * sizeof(float);
  }
  return 0;
}

void quantize_act_row(ActKind kind, DType type, const float* x, int64_t K, uint8_t* dst) {
  switch (kind) {
    case ActKind::q8x32: {
      auto* a = reinterpret_cast<ActQ8x32*>(dst);
      const bool with_s = type == DType::q4_1 || type == DType::q5_1;
      const int32_t offset = type == DType::q4_0 || type == DType::q1_0     ? -8
                             : type == DType::q5_0                          ? -16
                             : type == DType::mxfp4 || type == DType::nvfp4 ? -12
                                                                            : -128;
      for (int64_t b = 0; b < K / 32; ++b, x += 32, ++a) {
        int sum;
        const float d = q8_32(x, a->qs, &sum);
        a->d = from_fp16(to_fp16(d));
        if (with_s) {
          const float s = from_fp16(to_fp16(static_cast<float>(sum) * d));
          std::memcpy(&a->aux, &s, 4);
        } else if (type == DType::nvfp4) {  // each half's offset (NVFP4 has a scale per 16)
          int lo = 0;
          for (int j = 0; j < 16; ++j) lo += a->qs[j];
          a->aux = nvfp4_act_aux(offset * lo, offset * (sum - lo));
        } else {
          a->aux = offset * sum;
        }
      }
      return;
    }
    case ActKind::q8k:
    case ActKind::q8k_u8: {
      auto* a = reinterpret_cast<ActQ8K*>(dst);
      for (int64_t b = 0; b < K / QK_K; ++b, x += QK_K, ++a) {
        int16_t bs[16];
        a->d = quantize_block_q8_k(x, a->qs, bs);
        for (int j = 0; j < 16; ++j) {
          a->s16[j] = bs[j];
          a->b16[j] = -32 * bs[j];
        }
        for (int g = 0; g < 8; ++g) a->s32[g] = static_cast<int16_t>(bs[2 * g] + bs[2 * g + 1]);
        a->pad[0] = a->pad[1] = a->pad[2] = 0;
        if (kind == ActKind::q8k_u8)
          for (int i = 0; i < QK_K; i += 32) {
            auto* q = reinterpret_cast<__m256i*>(a->qs + i);
            _mm256_storeu_si256(
                q, _mm256_xor_si256(_mm256_loadu_si256(q), _mm256_set1_epi8(static_cast<char>(0x80))));
          }
      }
      return;
    }
    case ActKind::i8row:
      quantize_act_row_i8ch(x, K, dst);
      return;
    case ActKind::bf16pairs: {
      auto* h = reinterpret_cast<uint16_t*>(dst);
      round_to_bf16(x, h, K);
      if (K % 2 != 0) h[K] = 0;
      return;
    }
    case ActKind::bf16f32: {
      auto* f = reinterpret_cast<float*>(dst);
      round_to_bf16_as_f32(x, f, K);
      if (K % 2 != 0) f[K] = 0.0f;
      return;
    }
    case ActKind::f32:
      break;
  }
  LOOM_ASSERT(false && "quantize_act_row: float weights take f32 activations");
}

}  // namespace cpu

namespace {

// q8_0 / q8_1 rows: blocks of 32 with an f16 scale; q8_1 also s = fp16(d * sum(qs)).
template <typename Block>
void quantize_row_q8_32(const float* x, void* dst, int64_t n) {
  LOOM_ASSERT(n >= 0 && n % 32 == 0);
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / 32; ++i) {
    Block b;
    int sum;
    const float d = cpu::q8_32(x + i * 32, b.qs, &sum);
    b.d = cpu::to_fp16(d);
    if constexpr (requires { b.s; }) b.s = cpu::to_fp16(static_cast<float>(sum) * d);
    std::memcpy(out + i * sizeof b, &b, sizeof b);
  }
}

}  // namespace

void quantize_row_q8_0(const float* x, void* dst, int64_t n) { quantize_row_q8_32<BlockQ8_0>(x, dst, n); }
void quantize_row_q8_1(const float* x, void* dst, int64_t n) { quantize_row_q8_32<BlockQ8_1>(x, dst, n); }

void quantize_row_q8_k(const float* x, void* dst, int64_t n) {
  LOOM_ASSERT(n >= 0 && n % QK_K == 0);
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / QK_K; ++i) {
    BlockQ8_K b;
    b.d = cpu::quantize_block_q8_k(x + i * QK_K, b.qs, b.bsums);
    std::memcpy(out + i * sizeof b, &b, sizeof b);
  }
}

}  // namespace loom
