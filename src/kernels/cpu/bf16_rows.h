// f32 <-> bf16 storage conversion of activation rows (training's
// `activation_dtype: bf16`: saved activations kept as bf16, widened back to f32
// for the backward).
#pragma once

#include <cstdint>

namespace loom {

// dst [n] = src as bf16 bits, rounded as cpu::round_to_bf16 (to nearest even,
// NaNs stay NaN, f32 subnormals become signed zeros). AVX2 body, scalar tail.
void f32_to_bf16_rows(uint16_t* dst, const float* src, int64_t n);
// dst [n] = src widened to f32 (exact).
void bf16_to_f32_rows(float* dst, const uint16_t* src, int64_t n);

}  // namespace loom
