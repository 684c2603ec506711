// `loom prune`: a model (GGUF or Hugging Face folder) expanded to f32, its
// shapes shrunk (quant/prune_structured.h) and/or its linear weights zeroed
// (quant/prune.h), with the calibration statistics those need. The caller
// writes the result (an HF folder or a GGUF file).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/model.h"
#include "quant/prune.h"
#include "quant/prune_structured.h"

namespace loom {

struct PruneJob {
  std::string model_path;
  std::optional<PruneSpec> unstructured;  // after the structured step, if both
  StructuredSpec structured;
  std::string calib_file;  // needed by wanda and the structured methods
  int64_t calib_ctx = 512, calib_chunks = 32;
  int threads = 1;
  bool needs_calibration() const {
    return structured.any() || (unstructured && unstructured->method == PruneMethod::wanda);
  }
};

struct PruneResult {
  std::unique_ptr<Model> model;  // unpacked, its seven matrices f32, config updated
  std::vector<PruneReport> pruned;
  std::optional<StructuredReport> structure;
  int64_t calib_tokens = 0;
  int64_t linear_params_before = 0, linear_params_after = 0, linear_zeros = 0;
};

// Runs the job; `log` gets progress lines. Throws loom::Error naming the file or flag.
PruneResult run_prune(const PruneJob& job, const std::function<void(const std::string&)>& log);

}  // namespace loom
