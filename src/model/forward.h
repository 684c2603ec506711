// Inference forward pass of a Llama-family decoder over a KV cache: batched
// prefill (in micro-batches) and incremental decode share one code path, the
// decoder layer of model/decoder.h over a contiguous KV cache.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "model/decoder.h"
#include "model/kv_cache.h"
#include "model/weights.h"

namespace loom {

class InferenceSession {
 public:
  // n_ctx: positions this session can hold (<= the model's context length).
  // `weights` must be prepared for `backend`. kv_dtype: the cache's element
  // type, f16 (as llama.cpp's and loom's server cache) or f32.
  InferenceSession(const ModelConfig& config, const ModelWeights& weights, Backend& backend, int64_t n_ctx,
                   DType kv_dtype = DType::f16, int64_t micro_batch = 256);

  // Appends `tokens` at positions [n_past, n_past + size) and returns the
  // logits of the last one ([vocab]). With all_logits, logits() holds
  // [size, vocab] for every appended token instead.
  const float* eval(std::span<const int32_t> tokens, bool all_logits = false);

  const std::vector<float>& logits() const { return logits_; }
  int64_t n_past() const { return n_past_; }
  int64_t n_ctx() const { return cache_.n_ctx(); }
  int64_t vocab_size() const { return c_.vocab_size; }
  // Forgets positions >= n (n <= n_past), e.g. to restart a conversation.
  void truncate(int64_t n);
  size_t kv_bytes() const { return cache_.bytes(); }
  DType kv_dtype() const { return cache_.dtype(); }
  // Adapters every layer calls after its projections (null: none, the default).
  // Calibration (quant/: importance matrices, activation statistics) observes
  // the inputs of every linear layer through it.
  void set_layer_hook(LayerAdapters* hook) { hook_ = hook; }

 private:
  void forward_batch(const int32_t* tokens, int64_t T, bool all_logits, float* logits_out);

  const ModelConfig& c_;
  Decoder dec_;
  KvCache cache_;
  std::unique_ptr<Workspace> ws_;
  Tracer* tracer_;  // the backend's (profiling), or null
  int64_t micro_batch_;
  int64_t n_past_ = 0;
  StepActivations acts_;  // of one micro-batch
  std::vector<int32_t> pos_;
  std::vector<float> logits_;
  LayerAdapters* hook_ = nullptr;
};

}  // namespace loom
