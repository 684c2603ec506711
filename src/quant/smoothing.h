// Output-preserving per-channel rescaling before quantization, applied to a
// model whose matrices and norms are mutable f32 copies (make_weights_mutable):
//
// - SmoothQuant (Xiao et al. 2022), as llm-compressor's SmoothQuantModifier
//   computes it: s_j = range_j^alpha / (2 max_i |W_ij|)^(1 - alpha) over the
//   calibration range (max - min) of input channel j and every balanced
//   weight, at least 1e-5; the smoothed side is divided by s and the weights'
//   columns multiplied, so activation outliers move into the weights before
//   W8A8. Mappings: attention norm -> q/k/v and MLP norm -> gate/up (as
//   llm-compressor), and also up -> down (the SwiGLU output, whose outliers
//   per-token int8 suffers most from; dividing up's rows by s leaves its
//   per-row int8 quantization unchanged) and v -> o when every head has its
//   own K/V. On SmolLM2 the up -> down mapping takes W8A8 from +2.6% to +1.5%
//   perplexity at alpha 0.5 (docs/quantization.md).
// - AWQ (Lin et al. 2023), as llm-compressor's AWQModifier searches it: for
//   norm -> q/k/v, norm -> gate/up, up -> down (and v -> o when every head
//   has its own K/V), s = mean|x|^r / (mean normalized |W|)^(1 - r) (duo
//   scaling) over a grid of r in [0, 1] plus identity, normalized by
//   sqrt(max s * min s); the s minimizing the squared error of the balanced
//   layers' outputs over sampled calibration rows, with the weights
//   fake-quantized by the INT4 spec, is folded in. (llm-compressor measures
//   the error at the output of the whole attention or MLP block; loom at the
//   balanced layers' own outputs.)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/weights.h"
#include "quant/calibration.h"
#include "kernels/int_quant.h"

namespace loom {

// Replaces every matrix by an f32 copy and every norm vector by an owned copy,
// so the transforms below may change them.
void make_weights_mutable(ModelWeights& w, const ModelConfig& c);

struct SmoothReport {
  int64_t layer = 0;
  std::string mapping;   // "attn_norm -> q,k,v"
  double ratio = 0;      // AWQ: the chosen r (-1: identity)
  double error_before = 0, error_after = 0;  // AWQ: the loss at identity and at the chosen s
  float scale_min = 0, scale_max = 0;
};
using SmoothCallback = std::function<void(const SmoothReport&)>;

void apply_smoothquant(ModelWeights& w, const ModelConfig& c, const CalibrationStats& stats, double alpha,
                       const SmoothCallback& report);

// SmoothQuant with alpha chosen per mapping on the calibration text: of
// `alphas`, the one whose smoothed W8A8 product (weights int8 per channel,
// symmetric; activations int8 per token, as loom's i8_ch runs them) is
// closest, in squared error over the sampled calibration rows, to the f32
// product. SmoothReport::ratio holds the chosen alpha.
void apply_smoothquant_search(Backend& backend, ModelWeights& w, const ModelConfig& c, const CalibrationStats& stats,
                              const std::vector<double>& alphas, const SmoothCallback& report);

struct AwqOptions {
  IntQuantSpec spec;  // the weights' quantization (INT4 groups of 128)
  int n_grid = 20;
};
// Products run on `backend` (f32 matrices, not prepared).
void apply_awq(Backend& backend, ModelWeights& w, const ModelConfig& c, const CalibrationStats& stats,
               const AwqOptions& opt, const SmoothCallback& report);

}  // namespace loom
