// Quantization-aware training: the forward multiplies the weights as a
// quantized export will hold them, and the backward passes the gradient
// straight through the rounding (the straight-through estimator: the
// derivative of fake quantization is taken as 1; with min-max ranges no value
// is ever clipped, so no gradient is masked).
//   LoRA:  every layer's seven matrices become fq(W + s B A), with W + s B A
//          summed as `loom merge` / `loom export` merge (model/adapter_merge.h),
//          so what is trained is what the exported quantized model computes;
//          B A then acts only through them (the adapters' own forward term
//          and input gradient are off), and dA, dB are the usual LoRA
//          gradients of that product: the STE chain rule through W + s B A.
//   full:  the seven matrices become fq(W) of the f32 weights being trained.
// fq is kernels/int_quant.h's quantize-dequantize with the scheme `loom
// quantize --method int4|int8 --scheme S --group G` uses (min-max range,
// f32 scales; the group fitted to the model's widths the same way).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/int_quant.h"
#include "model/model.h"
#include "train/lora_params.h"
#include "train/train_config.h"

namespace loom {

// The int quantization spec of a qat config for `c`: bits, symmetric, the
// group fitted to every input width. Throws invalid_input when no group fits.
IntQuantSpec qat_spec(const TrainConfig::Qat& q, const ModelConfig& c);

class QatWeights {
 public:
  // Takes over the seven matrices of every layer of `w`: their current values
  // (dequantized to f32; for full fine-tuning, the arena they point at) are the
  // latent weights, and the tensors are pointed at fake-quantized copies.
  QatWeights(ModelWeights& w, const IntQuantSpec& spec, bool lora);

  // The tensors again fq(latent) (full: after an update), or fq(W + s B A)
  // for the adapters' current values (LoRA; a matrix without an adapter is
  // fq(W) once). The caller then prepares the weights for the backend.
  void refresh(ModelWeights& w, ThreadPool& pool, LoraModel* lora);

  // Points the tensors back at the latent weights (full fine-tuning's output
  // is the trained f32 weights; `loom quantize` then exports them).
  void restore_latent(ModelWeights& w);
  // And at the fake-quantized copies again.
  void point_at_fq(ModelWeights& w);

  const IntQuantSpec& spec() const { return spec_; }
  std::string describe() const;  // "int4 groups of 96, symmetric"

 private:
  struct Matrix {
    int64_t layer;
    LoraTarget target;
    float* latent;              // the arena (full) or latent_copy
    std::vector<float> latent_copy;  // LoRA: the frozen base in f32
    std::vector<float> fq;      // what the forward multiplies
    bool fixed = false;         // LoRA: no adapter on it, fq(W) made once
  };
  IntQuantSpec spec_;
  bool lora_;
  std::vector<Matrix> m_;
};

}  // namespace loom
