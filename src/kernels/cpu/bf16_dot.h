// Which way bf16 weights are multiplied on AVX-512: `vdpbf16ps`, or its exact
// emulation with f32 FMAs (the odd product, then the even one, under DAZ + FTZ).
// Both give the same bits, so the choice is only about speed, and the speed of
// `vdpbf16ps` against FMAs differs by microarchitecture more than the feature
// flags tell: AMD Zen 4 runs one `vdpbf16ps` zmm (32 products) per FMA slot, twice
// the FMAs' rate; Intel Sapphire/Emerald Rapids one per four FMA slots, half
// their rate. So loom times both instructions once per process (about 0.2 ms).
#pragma once

#include <optional>
#include <string_view>

namespace loom::cpu {

enum class Bf16Dot { vdpbf16ps, fma };

// The stand-alone loops' times for the same number of instructions, the shortest
// of a few alternating passes: 12 independent chains of `vdpbf16ps` zmm and of
// `vfmadd231ps` zmm (avx512bf16 only: bf16_dot_probe_avx512.cpp).
struct Bf16DotTiming {
  double vdpbf16ps_s = 0;
  double fma_s = 0;
};
Bf16DotTiming time_bf16_dot_instructions();

// The choice from LOOM_BF16_DOT (`vdpbf16ps` or `fma`; empty: measure) and the
// timing: `vdpbf16ps` where it multiplies at least as many pairs per second as
// two FMAs do (one instruction's time under twice an FMA's). nullopt for an
// unknown LOOM_BF16_DOT value.
std::optional<Bf16Dot> choose_bf16_dot(std::string_view env, const Bf16DotTiming& t);

// This process's choice, made once: `fma` where AVX512-BF16 is absent or masked
// (LOOM_CPU), else choose_bf16_dot on a measurement (an unknown LOOM_BF16_DOT
// is ignored with a warning).
Bf16Dot bf16_dot();

}  // namespace loom::cpu
