// Constants of the vector exp used by softmax (simd::exp_ps, 8 lanes, and the
// 16-lane copy in attention_rows_avx512f.cpp, which must give the same bits per
// lane): clamp range, Cody-Waite split of ln 2, degree-6 polynomial.
#pragma once

namespace loom::exp_poly {
constexpr float kMaxX = 88.3762626647949f, kMinX = -87.3365478515625f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f, kP3 = 4.1665795894E-2f,
                kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;
}  // namespace loom::exp_poly
