// Named views of a decoder's frozen weights, bound from a GGUF file or a
// Hugging Face folder. Matrices stay in their stored dtype (often mmap'd and
// quantized); small vectors (norms, biases) are held as f32.
#pragma once

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/shapes.h"
#include "model/config.h"
#include "model/lora.h"

namespace loom {

struct LayerWeights {
  const float* attn_norm = nullptr;  // [hidden]
  Tensor wq, wk, wv, wo;             // [q_dim, hidden], [kv_dim, hidden] x2, [hidden, q_dim]
  const float* bq = nullptr;         // qwen2 only: [q_dim], [kv_dim], [kv_dim]
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* ffn_norm = nullptr;   // [hidden]
  Tensor w_gate, w_up, w_down;       // [ffn, hidden] x2, [hidden, ffn]
  // Per-tensor output scales, in LoraTarget order (1: none). GGUF's
  // "<projection>.scale" (NVIDIA ModelOpt's weight_scale_2 in NVFP4 files):
  // the projection computes scale * (W x), before its bias and any adapter, as
  // llama.cpp's build_lora_mm does. The decoder and the LoRA backward apply it;
  // whatever mixes W's values with others (merging, full fine-tuning, export to
  // f32) folds it into an f32 copy first (fold_output_scales).
  std::array<float, kLoraTargetCount> out_scale = {1, 1, 1, 1, 1, 1, 1};
  float output_scale(LoraTarget t) const { return out_scale[static_cast<size_t>(t)]; }
  // False for a layer another pipeline stage holds (model/pipeline_stage.h):
  // every view empty, nothing prepared.
  bool held() const { return wq.data != nullptr; }
};

// The matrices of one layer as the backend prepared them for its products
// (the CPU: panels of kernels/cpu/matmul.h).
struct PreparedLayer {
  WeightHandle wq, wk, wv, wo, w_gate, w_up, w_down;
};

struct ModelWeights {
  // A pipeline stage's model leaves token_embd (stages after the first),
  // output and output_norm (stages before the last) empty.
  Tensor token_embd;                 // [vocab, hidden]
  Tensor output;                     // [vocab, hidden]; same view as token_embd when tied
  const float* output_norm = nullptr;
  std::vector<LayerWeights> layers;
  RopeTable rope;
  std::vector<PreparedLayer> prepared;  // filled by prepare_weights() (held layers); the forward multiplies these
  WeightHandle output_prepared;         // null without an output matrix
  std::vector<std::vector<float>> owned;  // f32 copies of vectors stored as f16/bf16/misaligned
  // Matrices made at load: quantize_base's copies (model/quantize_base.h), bitsandbytes
  // 4-bit weights converted to nf4 (model/bnb_folder.h).
  std::vector<std::vector<uint8_t>> owned_bytes;
};

// The matrix of layer L that LoRA target t adapts (q -> wq, ..., down -> w_down).
Tensor& target_matrix(LayerWeights& L, LoraTarget t);
const Tensor& target_matrix(const LayerWeights& L, LoraTarget t);

// Bytes of the matrices one decoded token reads: every held layer's seven and
// the output projection (a tied one is the embedding; an untied embedding is
// read a row at a time, so it does not count); the norm vectors are left out.
// The server's "do the weights and adapters fit the cache" test uses it.
size_t decode_matrix_bytes(const ModelWeights& w);

// Tensor names of the two on-disk layouts.
enum class WeightNaming { gguf, hugging_face };

// Looks a tensor up by its on-disk name; nullopt when absent.
using TensorLookup = std::function<std::optional<Tensor>(std::string_view name)>;

// Binds and validates every tensor (presence, shape, dtype) against `config`.
// `rope_freqs` (GGUF's per-pair divisors for Llama-3 scaling) may be null.
// Errors name `source` and the tensor.
ModelWeights bind_weights(const ModelConfig& config, WeightNaming naming, const TensorLookup& lookup,
                          const std::string& source);

// Replaces every matrix view by an f32 copy held in w.owned (reference runs),
// output scales folded in.
void dequantize_weights(ModelWeights& w);

// An f32 row-major copy of t, every value times `scale`.
std::vector<float> matrix_f32(const Tensor& t, float scale = 1.0f);

// True when some held layer has an output scale other than 1.
bool has_output_scales(const ModelWeights& w);

// Replaces each projection that has an output scale other than 1 by an f32
// copy (in w.owned) with the scale multiplied in, and sets the scale to 1: for
// consumers that use W's values directly (full fine-tuning, QAT, pruning,
// integer quantization). Unscaled matrices are left as they are.
void fold_output_scales(ModelWeights& w);

// Prepares every matrix held (LayerWeights::held, a non-empty output) for `backend`'s products (done once at load; again
// after full fine-tuning changed them, reusing the previous handles' memory).
void prepare_weights(ModelWeights& w, Backend& backend);

// Inverse RoPE frequencies for the config (theta, Llama-3 scaling).
RopeTable make_rope_table(const ModelConfig& config);

}  // namespace loom
