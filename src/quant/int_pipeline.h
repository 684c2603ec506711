// `loom quantize --method int8|int4|awq|smoothquant`: a model (GGUF or Hugging
// Face folder) to a compressed-tensors folder (quant/ct_export.h), with the
// calibration SmoothQuant and AWQ need:
//   int8         RTN int8 weights (symmetric or not; per channel or tensor;
//                min-max / percentile / MSE range), W8A8 with per-token dynamic
//                int8 activations unless activations are left in float;
//   int4         RTN int4 weights in groups (128), W4A16;
//   awq          int4 groups with AWQ's per-channel scales searched on the
//                calibration text first (quant/smoothing.h);
//   smoothquant  SmoothQuant's scales (alpha) folded into the norms and
//                weights, then W8A8 per channel, symmetric, dynamic per token.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "quant/ct_export.h"
#include "quant/smoothing.h"

namespace loom {

enum class IntMethod { int8, int4, awq, smoothquant };
IntMethod int_method_from_name(const std::string& name);  // throws invalid_input
const char* int_method_name(IntMethod m);

struct IntQuantizeJob {
  std::string model_path, out_dir;
  IntMethod method = IntMethod::int8;
  CompressedTensorsScheme scheme;  // weights spec and activations, filled from the method by default_scheme()
  double alpha = 0.5;              // SmoothQuant; < 0: searched per mapping on the calibration rows ("auto")
  int awq_grid = 20;
  std::string calib_file;          // text; needed by awq and smoothquant
  int64_t calib_ctx = 512, calib_chunks = 32, awq_samples = 512;  // awq_samples: rows kept for AWQ / alpha auto
  safetensors::StDType dtype = safetensors::StDType::bf16;  // of the folder's float tensors and scales
  FolderWriteOptions folder;
  int threads = 1;
};

// The method's default scheme: int8 -> channel, symmetric, minmax, W8A8
// dynamic; int4 / awq -> groups of 128, asymmetric; smoothquant -> int8
// channel symmetric W8A8 dynamic.
CompressedTensorsScheme default_scheme(IntMethod m);

struct IntQuantizeReport {
  std::vector<SmoothReport> smoothing;
  std::vector<LinearQuantReport> linears;
  int64_t calib_tokens = 0;
};

// Runs the job; `log` gets progress lines. Throws loom::Error naming the file or flag.
IntQuantizeReport run_int_quantize(const IntQuantizeJob& job, const std::function<void(const std::string&)>& log);

}  // namespace loom
