// Writing INT8 / INT4 models as Hugging Face folders in the compressed-tensors
// format (what llm-compressor writes and vLLM, transformers with the
// compressed-tensors package, and loom load): the seven linear weights of
// every layer quantized (kernels/int_quant.h), embeddings, lm_head and norms in
// the folder's float dtype, and config.json's quantization_config saying how:
//   int8 ("int-quantized"):  <module>.weight I8 [out, in], <module>.weight_scale
//                            [out, 1] (channel) / [1] (tensor) / [out, in/group],
//                            <module>.weight_zero_point I8 (asymmetric only);
//   int4 ("pack-quantized"): <module>.weight_packed I32 [out, in/8] (code + 8 in
//                            nibble i % 8 of word i / 8), <module>.weight_scale
//                            [out, in/group], <module>.weight_shape I64 [2], and
//                            for asymmetric weights <module>.weight_zero_point
//                            I32 packed the same way down the rows [ceil(out/8), groups].
// W8A8 (SmoothQuant) adds input_activations: int8, symmetric, per token, dynamic.
// Scales are rounded to the folder's dtype before the codes are chosen, so the
// stored (code, scale) pairs are the ones the codes were rounded for.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "io/file_write.h"
#include "io/safetensors.h"
#include "kernels/int_quant.h"

namespace loom {

class Model;

struct CompressedTensorsScheme {
  IntQuantSpec weights;
  bool int8_dynamic_activations = false;  // W8A8
};

// config.json's "quantization_config" for the scheme (compressed-tensors' keys).
nlohmann::ordered_json compressed_tensors_config(const CompressedTensorsScheme& s);

struct LinearQuantReport {
  std::string module;
  double relative_error = 0;  // ||W - W'|| / ||W|| of the dequantized weight
};

// Writes `model`'s current weights (smoothed or not) as such a folder, whole
// (write_folder_atomic). Throws invalid_input naming the module when a row
// width does not fit the scheme's groups.
void write_compressed_tensors_folder(const Model& model, const std::string& out_dir, safetensors::StDType dtype,
                                     const CompressedTensorsScheme& scheme, const FolderWriteOptions& opt,
                                     const std::function<void(const LinearQuantReport&)>& report);

}  // namespace loom
