// Builds a ModelConfig from GGUF metadata or a Hugging Face config.json, and
// validates it. Errors name the file and the key that is missing or wrong.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "io/gguf.h"
#include "model/config.h"

namespace loom {

// general.architecture "llama" or "qwen2"; other architectures (and MoE
// llama files) raise unsupported. RoPE layout: llama -> interleaved (the GGUF
// converter permuted q/k rows), qwen2 -> half. Tied embeddings when the file
// has no output.weight. Llama-3.1 scaling in GGUF lives in the rope_freqs.weight
// tensor and is applied by the weight binder, not here.
ModelConfig config_from_gguf(const gguf::File& file);

// model_type "llama", "mistral" (a llama) or "qwen2". Reads both the
// transformers 4 (rope_theta, rope_scaling) and 5 (rope_parameters) spellings.
// RoPE layout is always half (rotate_half). `path` is used in messages.
ModelConfig config_from_hf(const nlohmann::json& config, const std::string& path);

// The source's spelling of each field, so that messages name the key the
// user would edit. Defaults are ModelConfig's member names.
struct ConfigKeyNames {
  std::string vocab_size = "vocab_size";
  std::string hidden = "hidden";
  std::string intermediate = "intermediate";
  std::string n_layers = "n_layers";
  std::string n_heads = "n_heads";
  std::string n_kv_heads = "n_kv_heads";
  std::string head_dim = "head_dim";
  std::string max_context = "max_context";
  std::string rms_eps = "rms_eps";
  std::string rope_theta = "rope_theta";
  std::string rope_scaling = "rope_scaling";
};

// Checks the invariants every consumer relies on: positive sizes within sane
// bounds (so products such as vocab * hidden cannot overflow), kv heads
// dividing heads, even head_dim, finite positive eps and theta, consistent
// llama3 scaling. (Heads dividing hidden is checked by the loaders, only
// where head_dim is derived from it.) Both loaders call it.
void validate_config(const ModelConfig& c, const std::string& source, const ConfigKeyNames& keys = {});

}  // namespace loom
