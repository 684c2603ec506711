// Hyper-parameters of a Llama-family decoder, read from GGUF metadata or a
// Hugging Face config.json. Everything the forward pass needs, nothing else.
#pragma once

#include <cstdint>
#include <string>

namespace loom {

enum class Arch { llama, qwen2 };

// How RoPE pairs dimensions: `interleaved` rotates (x[2i], x[2i+1]) (GGUF
// llama, whose q/k rows were permuted by the converter); `half` rotates
// (x[i], x[i + d/2]) (Hugging Face rotate_half; GGUF qwen2).
enum class RopeLayout { interleaved, half };

struct RopeScaling {
  // Llama 3.1 "llama3" frequency scaling; factor == 0 means none.
  double factor = 0.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct ModelConfig {
  Arch arch = Arch::llama;
  std::string name;
  int64_t vocab_size = 0;
  int64_t hidden = 0;          // d_model
  int64_t intermediate = 0;    // SwiGLU width
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_context = 0;
  double rms_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeLayout rope_layout = RopeLayout::interleaved;
  RopeScaling rope_scaling;
  bool tied_embeddings = false;
  bool qkv_bias = false;       // qwen2
  std::string torch_dtype;     // config.json's storage dtype ("bfloat16"); empty when unknown (GGUF)
  // `loom prune`'s unstructured pruning ("wanda 50% per row", "magnitude 2:4"):
  // the zeros it left are kept by fine-tuning and merges. Empty: not pruned.
  // config.json "loom_pruning": {"unstructured": ...}; GGUF loom.pruning.unstructured.
  std::string unstructured_pruning;

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
};

const char* arch_name(Arch a);

}  // namespace loom
