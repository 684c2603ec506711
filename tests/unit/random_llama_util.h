// A random f32 llama of the tiny model's shapes (hidden 64, 4 heads of 16, 2 kv
// heads, ffn 176, vocabulary 320) with any number of layers, as a Hugging Face
// folder: for tests that need more layers than the 2 of tiny-llama.f32.gguf.
#pragma once

#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors_writer.h"
#include "train/data.h"

namespace loom::test_util {

// `tied`: no lm_head.weight, the output is the token embedding (SmolLM2's way).
inline void write_random_llama(const std::string& dir, int64_t layers, bool tied = false) {
  constexpr int64_t kHidden = 64, kFfn = 176, kVocab = 320, kHeads = 4, kKvHeads = 2, kHeadDim = 16;
  std::ofstream(dir + "/config.json") << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": )"
                                      << layers << R"(, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": 320, "tie_word_embeddings": )"
                                      << (tied ? "true" : "false") << R"(,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2})";
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.08f);
  safetensors::Writer w(dir + "/model.safetensors");
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool ones = false) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = ones ? 1.0f + 0.1f * normal(rng) : normal(rng);
    w.add(name, v, std::move(shape));
  };
  add("model.embed_tokens.weight", {kVocab, kHidden});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {kHidden}, true);
    add(p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden});
    add(p + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, kHidden});
    add(p + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, kHidden});
    add(p + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim});
    add(p + "post_attention_layernorm.weight", {kHidden}, true);
    add(p + "mlp.gate_proj.weight", {kFfn, kHidden});
    add(p + "mlp.up_proj.weight", {kFfn, kHidden});
    add(p + "mlp.down_proj.weight", {kHidden, kFfn});
  }
  add("model.norm.weight", {kHidden}, true);
  if (!tied) add("lm_head.weight", {kVocab, kHidden});
  w.write();
}

// Two rows of 24 tokens of the model's 320 (random, seeded); row 1 packs two
// samples (seq_start restarts at 10); some targets ignored.
inline Batch random_packed_batch(uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b;
  b.rows = 2;
  b.seq_len = 24;
  for (int64_t r = 0; r < b.rows; ++r)
    for (int32_t t = 0; t < b.seq_len; ++t) {
      const int32_t start = r == 1 && t >= 10 ? 10 : 0;
      b.tokens.push_back(static_cast<int32_t>(rng() % 320));
      const bool target = t + 1 < b.seq_len && t != 9 && t % 5 != 0;
      b.targets.push_back(target ? static_cast<int32_t>(rng() % 320) : kIgnoreLabel);
      b.positions.push_back(t - start);
      b.seq_start.push_back(start);
      b.target_tokens += target ? 1 : 0;
    }
  return b;
}

}  // namespace loom::test_util
