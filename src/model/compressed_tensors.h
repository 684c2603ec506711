// Hugging Face folders in the compressed-tensors format (llm-compressor's
// output, vLLM's INT8 and INT4 checkpoints, and `loom quantize --method
// int8|int4|awq|smoothquant`): config.json's quantization_config with
// quant_method "compressed-tensors" and one config group of integer weights.
// Each quantized linear weight becomes a loom tensor the matmul kernels run:
//   int8 per channel or tensor ("int-quantized" / "naive-quantized") -> i8_ch
//       (int8 codes, per-row f32 scale and zero point; products on per-token
//       int8 activations, W8A8);
//   int8 symmetric groups of a multiple of 32 -> q8_0 (each block the group's scale);
//   int4 ("pack-quantized") in groups (or per channel) of a multiple of 32 ->
//       q4_0 (symmetric: d = scale) or q4_1 (asymmetric: d = scale,
//       m = -scale * (8 + zero), rounded to f16);
//   any other group size -> f32 (dequantized at load).
// Scales are read in their stored dtype (bf16, f16, f32) and become f16 in the
// q4/q8 blocks (exact for scales in f16's normal range).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace loom {

class HfFolder;

struct CtQuantConfig {
  std::string format;       // "int-quantized", "naive-quantized", "pack-quantized"
  int bits = 8;
  bool symmetric = true;
  std::string strategy;     // "channel", "tensor", "group"
  int64_t group = 0;
  bool dynamic_activations = false;  // int8 per-token dynamic input activations (W8A8)
};

// nullopt unless config.json's quantization_config has quant_method
// "compressed-tensors". Anything loom cannot run (float types, several config
// groups, activation schemes other than dynamic int8 per token, sparsity)
// throws unsupported naming `path` and the key.
std::optional<CtQuantConfig> ct_quant_config(const nlohmann::json& config, const std::string& path);

// Every quantized linear weight of the folder under its plain name
// ("model.layers.0.self_attn.q_proj.weight"), bytes in `store`. Errors name
// the shard and tensor (missing scales, wrong shapes or dtypes).
std::map<std::string, Tensor, std::less<>> load_ct_weights(const HfFolder& hf, const CtQuantConfig& qc,
                                                          std::vector<std::vector<uint8_t>>& store);

}  // namespace loom
