// Shared by the tests that compare loom's LoRA training with PyTorch+PEFT
// fixtures: HF-convention rows -> loom Batch, and f32 tensors out of safetensors.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "train/data.h"

namespace loom::test_util {

// HF rows (labels unshifted, one sample per row) -> loom's Batch (targets[t] is the label of t + 1).
inline Batch batch_from_hf(const std::vector<std::vector<int32_t>>& ids,
                           const std::vector<std::vector<int32_t>>& labels) {
  Batch b;
  b.rows = static_cast<int64_t>(ids.size());
  b.seq_len = static_cast<int64_t>(ids[0].size());
  for (size_t r = 0; r < ids.size(); ++r)
    for (int64_t t = 0; t < b.seq_len; ++t) {
      b.tokens.push_back(ids[r][static_cast<size_t>(t)]);
      const int32_t y = t + 1 < b.seq_len ? labels[r][static_cast<size_t>(t + 1)] : kIgnoreLabel;
      b.targets.push_back(y);
      b.positions.push_back(static_cast<int32_t>(t));
      b.seq_start.push_back(0);
      b.target_tokens += y != kIgnoreLabel;
    }
  return b;
}

// The f32 tensor `name` (expected to hold `numel` values); a mismatch is a test failure.
inline std::vector<float> read_f32(const safetensors::File& f, const std::string& name, int64_t numel) {
  const Tensor t = f.view(name);
  EXPECT_EQ(t.dtype, DType::f32) << name;
  EXPECT_EQ(t.numel(), numel) << name;
  std::vector<float> v(static_cast<size_t>(numel));
  if (t.numel() == numel) std::memcpy(v.data(), t.data, v.size() * sizeof(float));
  return v;
}

}  // namespace loom::test_util
