// Activation statistics of a calibration text, for SmoothQuant and AWQ: for
// every layer and each input the linear weights read (the attention norm's
// output for q/k/v, the attention output for o, the MLP norm's output for
// gate/up, the SwiGLU output for down), per channel the minimum, the maximum
// and the sum of |x| over all tokens, and (for AWQ's loss) a sample of rows.
// Collected through the decoder's adapter hook (InferenceSession::
// set_layer_hook), i.e. on the same forward inference runs.
#pragma once

#include <cstdint>
#include <array>
#include <functional>
#include <span>
#include <vector>

#include "model/decoder.h"
#include "model/forward.h"

namespace loom {

struct ChannelStats {
  int64_t width = 0;
  std::vector<float> min, max;    // per channel, over every token
  std::vector<double> abs_sum;    // per channel
  int64_t tokens = 0;
  std::vector<float> samples;     // up to max_samples rows of `width`, spread over the text
  int64_t sample_rows() const { return width > 0 ? static_cast<int64_t>(samples.size()) / width : 0; }
  float mean_abs(int64_t c) const { return tokens > 0 ? static_cast<float>(abs_sum[static_cast<size_t>(c)] / tokens) : 0; }
};

// Per layer, the four inputs in AdapterPoint order (qkv, o, gate_up, down).
struct CalibrationStats {
  std::vector<std::array<ChannelStats, 4>> layers;
  int64_t chunks = 0, chunk_size = 0;
  const ChannelStats& at(int64_t layer, AdapterPoint p) const {
    return layers[static_cast<size_t>(layer)][static_cast<size_t>(p)];
  }
};

struct CalibrationOptions {
  int64_t n_ctx = 512;       // tokens per chunk
  int64_t max_chunks = -1;   // -1: all
  int32_t bos = -1;          // >= 0: the first token of every chunk becomes this
  int64_t max_samples = 0;   // rows kept per input for AWQ's loss (every k-th token)
};

// Runs `tokens` chunk by chunk through `session` and gathers the statistics.
// Throws invalid_input when the text has fewer than one chunk of tokens.
CalibrationStats collect_calibration(InferenceSession& session, const ModelConfig& config,
                                     std::span<const int32_t> tokens, const CalibrationOptions& opt,
                                     const std::function<void(int64_t, int64_t)>& on_chunk);

}  // namespace loom
