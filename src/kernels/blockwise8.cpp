// The dynamic map and lookup table of bitsandbytes' 8-bit blockwise format.
// torch / bitsandbytes round every product: no fused multiply-add but the explicit ones.
#pragma GCC optimize("fp-contract=off")

#include "kernels/blockwise8.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom {

namespace {

// torch.linspace(0.1, 1, steps, dtype=float32) on CPU: a f32 step, the first
// half start + step * i and the second end - step * (steps - 1 - i), each one
// fused multiply-add (what its kernels compile to).
std::vector<float> linspace_f32(float start, float end, int steps) {
  const float step = (end - start) / static_cast<float>(steps - 1);
  std::vector<float> out(static_cast<size_t>(steps));
  for (int i = 0; i < steps; ++i)
    out[static_cast<size_t>(i)] = i < steps / 2 ? std::fma(step, static_cast<float>(i), start)
                                                : std::fma(-step, static_cast<float>(steps - 1 - i), end);
  return out;
}

}  // namespace

std::array<float, 256> dynamic_map(bool is_signed) {
  constexpr int kMaxExp = 7, kNonSign = 7;
  std::vector<float> data;
  for (int i = 0; i < kMaxExp; ++i) {
    const int items = is_signed ? (1 << (i + kNonSign - kMaxExp)) + 1 : (1 << (i + kNonSign - kMaxExp + 1)) + 1;
    const std::vector<float> b = linspace_f32(0.1f, 1.0f, items);
    // The Python scale 10 ** (i - 6) multiplies the f32 means as an f32 scalar.
    const auto scale = static_cast<float>(std::pow(10.0, i - (kMaxExp - 1)));
    for (size_t k = 0; k + 1 < b.size(); ++k) {
      const float mean = (b[k] + b[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  // additional_items = 2^(7-7) - 1 = 0: none. Then 0 and 1.
  data.push_back(0.0f);
  data.push_back(1.0f);
  while (data.size() < 256) data.push_back(0.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> out{};
  std::copy_n(data.begin(), 256, out.begin());
  return out;
}

void build_blockwise8_map(Blockwise8Map& m, bool is_signed) {
  const std::array<float, 256> code = dynamic_map(is_signed);
  std::copy(code.begin(), code.end(), m.code);
  float mid[255];
  for (int j = 0; j < 255; ++j) mid[j] = (code[static_cast<size_t>(j)] + code[static_cast<size_t>(j) + 1]) * 0.5f;
  // Entry i stands for 2i / 65535 - 1; the first code whose midpoint to the next is not below it.
  int idx = 0;
  for (size_t i = 0; i < kBlockwise8Lut; ++i) {
    const float v = (static_cast<float>(i) + static_cast<float>(i)) / 65535.0f - 1.0f;
    while (idx < 255 && v > mid[idx]) ++idx;
    m.lut[i] = static_cast<uint8_t>(idx);
  }
}

uint16_t blockwise8_lut_index(float x) {
  if (std::isnan(x)) return 0;
  const float c = x < -1.0f ? -1.0f : (1.0f < x ? 1.0f : x);
  const float t = (c + 1.0f) * 0.5f;
  return static_cast<uint16_t>(static_cast<int32_t>(std::fma(t, 65535.0f, 0.5f)));
}

}  // namespace loom
