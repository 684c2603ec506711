// The instruction loops behind cpu::time_bf16_dot_instructions (bf16_dot.h):
// 12 independent accumulators, enough to cover either instruction's latency at
// its throughput, on constant operands (no loads: the instruction alone).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "kernels/cpu/bf16_dot.h"

namespace loom::cpu {
namespace {

#define LOOM_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define LOOM_ACC(i) __m512 a##i = _mm512_set1_ps(static_cast<float>(i) * seed);
#define LOOM_SUM(i) s = _mm512_add_ps(s, a##i);

// The result keeps the loop alive (GCC 12's lane extracts warn spuriously).
float first_lane(__m512 s) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  return lanes[0];
}

__attribute__((noinline)) float dot_loop(int64_t iters, float seed) {
  LOOM_R12(LOOM_ACC)
  const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));  // 1.0 pairs
  const __m512bh y = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f003f00));  // 0.5 pairs
  for (int64_t k = 0; k < iters; ++k) {
#define LOOM_STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
    LOOM_R12(LOOM_STEP)
#undef LOOM_STEP
  }
  __m512 s = _mm512_setzero_ps();
  LOOM_R12(LOOM_SUM)
  return first_lane(s);
}

__attribute__((noinline)) float fma_loop(int64_t iters, float seed) {
  LOOM_R12(LOOM_ACC)
  const __m512 x = _mm512_set1_ps(seed), y = _mm512_set1_ps(0.5f);
  for (int64_t k = 0; k < iters; ++k) {
#define LOOM_STEP(i) a##i = _mm512_fmadd_ps(x, y, a##i);
    LOOM_R12(LOOM_STEP)
#undef LOOM_STEP
  }
  __m512 s = _mm512_setzero_ps();
  LOOM_R12(LOOM_SUM)
  return first_lane(s);
}

#undef LOOM_SUM
#undef LOOM_ACC
#undef LOOM_R12

// The empty asm statements pin the loop between the two clock reads: its count is
// "changed" after the first and its result "used" before the second, so no
// compiler can hoist, sink or drop the call (the loops have no side effects).
template <class Loop>
double seconds(Loop loop, int64_t iters, volatile float& sink) {
  const auto t0 = std::chrono::steady_clock::now();
  asm volatile("" : "+r"(iters) : : "memory");
  const float r = loop(iters, 1.0f);
  asm volatile("" : : "x"(r) : "memory");
  const auto t1 = std::chrono::steady_clock::now();
  sink = sink + r;
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace

Bf16DotTiming time_bf16_dot_instructions() {
  constexpr int64_t kIters = 2048;  // 24k instructions a pass: ~10-40 us
  volatile float sink = 0;
  seconds(fma_loop, 4 * kIters, sink);  // wake the upper 256 bits of the units before timing
  Bf16DotTiming t{1e30, 1e30};
  for (int pass = 0; pass < 5; ++pass) {
    t.vdpbf16ps_s = std::min(t.vdpbf16ps_s, seconds(dot_loop, kIters, sink));
    t.fma_s = std::min(t.fma_s, seconds(fma_loop, kIters, sink));
  }
  return t;
}

}  // namespace loom::cpu
