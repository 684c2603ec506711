// Read-only views of the LoRA adapters the server applies per request
// (multi-LoRA: rows of one batch may use different adapters). Whoever loads an
// adapter owns its memory; a ServeAdapter only points into it.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "kernels/int4_rows.h"
#include "model/config.h"
#include "model/lora.h"

namespace loom {

// One adapted linear layer: y += scale * B (A x), A [r, in], B [out, r]
// (PEFT's shapes, B's rows in the model's row order, i.e. q/k already permuted
// for RopeLayout::interleaved models). A and B are f32 views, or, for an
// adapter served in 4 bits, a4 / b4 hold them (kernels/int4_rows.h, read in
// place by the LoRA kernel) and a / b keep only their shapes (null data); an
// adapter served in bf16 has a16 / b16 instead, one served in int8 a8 / b8
// (kernels/lora_i8.h), the same way. Not adapted: none of them.
struct ServeLoraPair {
  Tensor a;
  Tensor b;
  Int4Rows a4, b4;
  const uint16_t* a16 = nullptr;  // [r, in] bf16 bits
  const uint16_t* b16 = nullptr;  // [out, r] in column blocks (kernels/lora_b16.h)
  const uint8_t* a8 = nullptr;    // [r, in] in int8 with its scales (kernels/lora_i8.h)
  const uint8_t* b8 = nullptr;    // [out, r] in int8 column blocks with their scales
  bool quantized() const { return !a4.empty(); }
  bool bf16() const { return a16 != nullptr; }
  bool int8() const { return a8 != nullptr; }
  bool present() const { return a.data != nullptr || quantized() || bf16() || int8(); }
  int64_t rank() const { return a.dim(0); }
};

struct ServeAdapter {
  float scale = 1.0f;
  // [layer * kLoraTargetCount + target]; size n_layers * kLoraTargetCount.
  std::vector<ServeLoraPair> pairs;

  // An adapter with no pairs yet, sized for `config`.
  static ServeAdapter empty(const ModelConfig& config, float scale);
  const ServeLoraPair& pair(int64_t layer, LoraTarget t) const {
    return pairs[static_cast<size_t>(layer * kLoraTargetCount + static_cast<int64_t>(t))];
  }
  ServeLoraPair& pair(int64_t layer, LoraTarget t) {
    return pairs[static_cast<size_t>(layer * kLoraTargetCount + static_cast<int64_t>(t))];
  }
  // Largest rank of any pair (0 when none).
  int64_t max_rank() const;
  // Bytes of its factors as kept (f32, bf16, or int8 / 4-bit codes and scales).
  size_t factor_bytes() const;
  // Throws invalid_input naming `what`, the layer and target when the layout
  // or a pair's dtype or shape does not fit `config`.
  void validate(const ModelConfig& config, std::string_view what) const;
};

}  // namespace loom
