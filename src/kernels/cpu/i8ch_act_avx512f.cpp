// The i8_ch act row (kernels/cpu/i8ch.h) with AVX-512 F/BW/VL: the same float
// operations as the AVX2 quantize_act_row_i8ch and quantize_act_row_i8ch_ref
// (max |x|, one product x * id, round half away from zero, clamp to
// [-127, 127], NaN -> 0), 16 lanes at a time, with vpmovsdb for the bytes.
// quantize_act_row_i8ch calls it where usable_cpu_features().has_avx512_f32().
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/i8ch.h"

namespace loom::cpu {
namespace {

inline __m512 abs16(__m512 v) { return _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_castps_si512(_mm512_set1_ps(-0.0f)), _mm512_castps_si512(v))); }

// roundf, clamped to [-127, 127], NaN -> 0 (as round_away_i8sym in quant_act.cpp).
inline __m512i round_away_i8sym(__m512 v) {
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __mmask16 up = _mm512_cmp_ps_mask(abs16(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __m512 one = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(_mm512_set1_ps(1.0f)),
      _mm512_and_si512(_mm512_castps_si512(v), _mm512_castps_si512(_mm512_set1_ps(-0.0f)))));
  t = _mm512_mask_add_ps(t, up, t, one);
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  return _mm512_cvttps_epi32(_mm512_maskz_mov_ps(static_cast<__mmask16>(~nan), t));
}

}  // namespace

void quantize_act_row_i8ch_avx512(const float* x, int64_t K, uint8_t* dst) {
  // max |x| (max_ps returns its second operand, the running max, for a NaN).
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(abs16(_mm512_loadu_ps(x + k)), vmax);
  const auto tail = static_cast<__mmask16>((1u << (K - k)) - 1);  // K - k < 16
  if (k < K) vmax = _mm512_max_ps(abs16(_mm512_maskz_loadu_ps(tail, x + k)), vmax);  // zeros change no max
  const float amax = _mm512_reduce_max_ps(vmax);
  const float s = amax / 127.0f;
  const float id = s != 0.0f ? 1.0f / s : 0.0f;

  uint8_t* q = dst + kI8ChActHeader;
  const __m512 vid = _mm512_set1_ps(id);
  const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80));
  __m512i vsum = _mm512_setzero_si512();
  for (k = 0; k + 16 <= K; k += 16) {
    const __m512i c = round_away_i8sym(_mm512_mul_ps(_mm512_loadu_ps(x + k), vid));
    vsum = _mm512_add_epi32(vsum, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm_xor_si128(_mm512_cvtsepi32_epi8(c), bias));
  }
  if (k < K) {  // masked lanes are 0: code 0, nothing added
    const __m512i c = round_away_i8sym(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + k), vid));
    vsum = _mm512_add_epi32(vsum, c);
    _mm_mask_storeu_epi8(q + k, tail, _mm_xor_si128(_mm512_cvtsepi32_epi8(c), bias));
  }
  const int32_t sum = _mm512_reduce_add_epi32(vsum);
  const size_t padded = i8ch_act_row_bytes(K) - kI8ChActHeader;
  std::memset(q + K, 0x80, padded - static_cast<size_t>(K));  // qx = 0
  std::memset(dst, 0, kI8ChActHeader);
  std::memcpy(dst, &s, 4);
  std::memcpy(dst + 4, &sum, 4);
}

}  // namespace loom::cpu
