// A model as the tensors and metadata of a GGUF file, for `loom quantize` and
// `loom export`: from a GGUF file as it is, or from a loaded model (a Hugging
// Face folder, or any model with an adapter merged into it) with llama.cpp's
// tensor names, its llama/qwen2 metadata keys, the tokenizer as
// tokenizer.ggml.* (tokenizer/tokenizer_gguf.h), the q/k rows of an HF Llama
// put in GGUF's RoPE-interleaved order (as convert_hf_to_gguf.py permutes
// them), and Llama 3 RoPE scaling as the rope_freqs.weight table.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/gguf_writer.h"

namespace loom {

class Model;
struct ModelConfig;
namespace gguf { class File; }
namespace peft { struct AdapterTensors; }

// One tensor to write: a view in its stored dtype, and how its rows map.
struct GgufTensorSource {
  std::string name;            // llama.cpp's name, e.g. "blk.0.attn_q.weight"
  Tensor view;                 // rows outermost; a vector is one row
  std::vector<int64_t> shape;  // the GGUF shape, outermost first
  // > 0: the rows are Hugging Face q/k rows of this many heads (rotate_half
  // order); row 2j of a head in the output is the head's row j, row 2j + 1 its
  // row j + head_dim / 2.
  int64_t qk_heads = 0;
  int64_t rows() const;
  int64_t cols() const { return shape.back(); }
  // The source row stored as output row r.
  const uint8_t* source_row(int64_t r) const;
  void row_f32(int64_t r, float* out) const;  // dequantized
};

struct GgufModelSource {
  std::string path;
  std::function<void(gguf::Writer&)> write_metadata;
  std::vector<GgufTensorSource> tensors;
  int64_t n_layers = 0, n_heads = 0, n_kv_heads = 0;
  std::string arch;
  std::shared_ptr<std::vector<std::vector<float>>> owned;  // vectors made for the export (norms, rope_freqs)
};

// A GGUF file as it is (metadata and tensors unchanged).
GgufModelSource gguf_source_of(const gguf::File& f);

// A loaded model's current weights (merged adapters, fine-tuned values
// included). A GGUF model keeps its file's metadata and extra tensors; a
// Hugging Face model gets metadata made from its config and tokenizer
// (`name` as general.name). Throws unsupported naming the model for what GGUF
// cannot hold (a tokenizer loom cannot write, see tokenizer_gguf.h).
GgufModelSource gguf_source_of(const Model& m, const std::string& name);

// Writes a PEFT LoRA adapter in llama.cpp's GGUF LoRA format (what
// convert_lora_to_gguf.py writes, `llama-cli --lora` reads): general.type
// adapter, adapter.type lora, adapter.lora.alpha (rsLoRA's alpha/sqrt(r) scale
// expressed as llama.cpp's alpha/r), general.architecture of the base, and per
// adapted weight "<name>.lora_a" [r, in] and "<name>.lora_b" [out, r], B's q/k
// rows in GGUF's RoPE order for a llama base. `base` is the adapted model's
// config (checked: layers, shapes). dtype f32 or f16. Written atomically.
void write_lora_gguf(const peft::AdapterTensors& adapter, const ModelConfig& base, const std::string& path,
                     DType dtype);

}  // namespace loom
