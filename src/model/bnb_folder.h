// Hugging Face folders that bitsandbytes quantized (`*-bnb-4bit`): config.json
// has a quantization_config with quant_method "bitsandbytes" and load_in_4bit;
// each quantized linear weight is stored as
//   <name>                     U8, the 4-bit codes, 2 per byte
//   <name>.absmax              U8 (double quantization) or F32, one per block
//   <name>.nested_absmax       F32, one per 256 blocks (double quantization)
//   <name>.nested_quant_map    F32 [256], the absmax codes' map
//   <name>.quant_map           F32 [16], the 4-bit code table
//   <name>.quant_state.bitsandbytes__nf4   U8, JSON: quant_type, blocksize,
//                              shape, dtype, nested_blocksize, nested_offset
// They are converted into loom nf4 blocks (kernels/ref/nf4_ref.h) without
// going through bf16: the block absmax is the f32 that bitsandbytes'
// dequantize_4bit uses, the codes are copied.
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

struct BnbQuantConfig {
  std::string quant_type;     // "nf4"
  bool double_quant = false;  // bnb_4bit_use_double_quant
  std::string compute_dtype;  // informational: loom computes in f32
};

// nullopt when config.json has no quantization_config. Other quantization
// methods, 8-bit bitsandbytes, fp4 and non-uint8 storage raise unsupported /
// invalid_input naming `path` and the key.
std::optional<BnbQuantConfig> bnb_quant_config(const nlohmann::json& config, const std::string& path);

// Every bitsandbytes 4-bit weight of the folder (names ending in ".weight"
// with a quant_state entry), converted to an nf4 Tensor of its quant_state
// shape whose bytes live in `store`. Errors name the shard file and tensor
// (missing absmax, wrong shapes or dtypes, unknown quant_type, a code table
// that is not NF4's).
std::map<std::string, Tensor, std::less<>> load_bnb_weights(const HfFolder& hf, const BnbQuantConfig& qc,
                                                           std::vector<std::vector<uint8_t>>& store);

}  // namespace loom
