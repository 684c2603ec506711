// Activation statistics of a calibration text, for SmoothQuant and AWQ: for
// every layer and each input the linear weights read (the attention norm's
// output for q/k/v, the attention output for o, the MLP norm's output for
// gate/up, the SwiGLU output for down), per channel the minimum, the maximum,
// the sum of |x| and of x^2 over all tokens, and (for AWQ's loss) a sample of rows;
// per layer, how much it turns the residual stream (layer pruning).
// Collected through the decoder's adapter hook (InferenceSession::
// set_layer_hook), i.e. on the same forward inference runs.
#pragma once

#include <cstdint>
#include <array>
#include <cmath>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "model/decoder.h"
#include "model/forward.h"

namespace loom {

struct ChannelStats {
  int64_t width = 0;
  std::vector<float> min, max;    // per channel, over every token
  std::vector<double> abs_sum;    // per channel
  std::vector<double> sq_sum;     // per channel, sum of x^2 (Wanda's ||X_j||_2 is its root)
  int64_t tokens = 0;
  std::vector<float> samples;     // up to max_samples rows of `width`, spread over the text
  int64_t sample_rows() const { return width > 0 ? static_cast<int64_t>(samples.size()) / width : 0; }
  float mean_abs(int64_t c) const { return tokens > 0 ? static_cast<float>(abs_sum[static_cast<size_t>(c)] / tokens) : 0; }
  float l2_norm(int64_t c) const { return static_cast<float>(std::sqrt(sq_sum[static_cast<size_t>(c)])); }
};

// The input point a linear weight reads (q/k/v -> qkv, o, gate/up -> gate_up, down).
AdapterPoint adapter_point_of(LoraTarget t);

// Per layer, the four inputs in AdapterPoint order (qkv, o, gate_up, down).
struct CalibrationStats {
  std::vector<std::array<ChannelStats, 4>> layers;
  int64_t chunks = 0, chunk_size = 0;
  // Per layer, the sum over tokens of the cosine between the residual stream
  // entering and leaving it; ShortGPT's Block Influence is 1 - its mean.
  std::vector<double> residual_cosine;
  int64_t residual_tokens = 0;
  double block_influence(int64_t layer) const {
    return residual_tokens > 0 ? 1.0 - residual_cosine[static_cast<size_t>(layer)] / static_cast<double>(residual_tokens)
                               : 0.0;
  }
  const ChannelStats& at(int64_t layer, AdapterPoint p) const {
    return layers[static_cast<size_t>(layer)][static_cast<size_t>(p)];
  }
  const ChannelStats& at(int64_t layer, LoraTarget t) const { return at(layer, adapter_point_of(t)); }
};

struct CalibrationOptions {
  int64_t n_ctx = 512;       // tokens per chunk
  int64_t max_chunks = -1;   // -1: all
  int32_t bos = -1;          // >= 0: the first token of every chunk becomes this
  int64_t max_samples = 0;   // rows kept per input for AWQ's loss (every k-th token)
};

// Loads the model at `model_path` for `backend`, tokenizes `text_file` and
// gathers the statistics of its first chunks; `log` gets one line.
CalibrationStats calibrate_on_text(const std::string& model_path, Backend& backend, const std::string& text_file,
                                   CalibrationOptions opt, const std::function<void(const std::string&)>& log);

// Runs `tokens` chunk by chunk through `session` and gathers the statistics.
// Throws invalid_input when the text has fewer than one chunk of tokens.
CalibrationStats collect_calibration(InferenceSession& session, const ModelConfig& config,
                                     std::span<const int32_t> tokens, const CalibrationOptions& opt,
                                     const std::function<void(int64_t, int64_t)>& on_chunk);

}  // namespace loom
