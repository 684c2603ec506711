// `loom quantize` and `loom export`: every tensor of a model is planned
// (quant/quantize_plan.h), expanded to f32 row block by row block, quantized
// with ggml's quantizers (kernels/quantize.h, bit-exact to llama-quantize,
// weighted by an importance matrix when one is given) and streamed into a new
// GGUF file whose metadata is the source's plus general.file_type,
// general.quantization_version and the quantize.imatrix.* keys, as
// llama-quantize writes them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "quant/quantize_plan.h"

namespace loom {

struct GgufModelSource;

struct GgufQuantizeOptions {
  QuantizeOptions plan;
  // Quantizing an already quantized tensor to another quantized type loses
  // accuracy twice; refused unless set (llama-quantize --allow-requantize).
  // Expanding one to f16/bf16/f32 is always allowed.
  bool allow_requantize = false;
  // Per-column importance by tensor name (Imatrix::importance()), or null.
  const std::map<std::string, std::vector<float>>* importance = nullptr;
  std::string imatrix_file;              // recorded in the output's metadata
  std::vector<std::string> imatrix_datasets;
  int64_t imatrix_chunks = 0;
};

struct QuantizeSummary {
  std::vector<TensorPlan> plan;
  uint64_t bytes_in = 0, bytes_out = 0;
  int64_t elements = 0;
  int64_t fallbacks = 0;
  std::vector<std::string> without_importance;  // quantized tensors the imatrix had no entry for
};

// What the rules need to know of a model (layers, heads).
ModelShapeInfo model_shape_of(const GgufModelSource& src);

// Quantizes `src` (a GGUF file as it is, or a loaded Hugging Face / merged
// model: model/gguf_export.h) into the GGUF file `out` (written atomically).
// on_tensor(plan, i, n) is called before each tensor is written. Throws
// invalid_input naming the file and tensor (a quantized tensor without
// allow_requantize, an imatrix row of the wrong width), io for the output.
QuantizeSummary quantize_gguf(ThreadPool& pool, const GgufModelSource& src, const std::string& out,
                              const GgufQuantizeOptions& opt,
                              const std::function<void(const TensorPlan&, size_t, size_t)>& on_tensor);

}  // namespace loom
