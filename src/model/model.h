// A loaded model: config, frozen weights (mmap'd from a GGUF file or a Hugging
// Face folder), tokenizer and chat template. MODEL paths are a .gguf file or a
// folder with config.json.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/config.h"
#include "model/pipeline_stage.h"
#include "model/weights.h"

namespace loom {

namespace gguf { class File; }
class HfFolder;
class Tokenizer;

class Model {
 public:
  struct LoadOptions {
    bool tokenizer = true;       // false: raw ids only (benchmarks, tests)
    bool pack = true;            // false: weights not prepared for a backend (inspection only: `loom info`)
    Backend* backend = nullptr;  // prepares the weights for its products; required when pack
    bool dequantize = false;     // expand every matrix to f32 first (reference checks, --f32)
    // Per-tensor output scales (LayerWeights::out_scale) folded into f32 copies
    // of their projections at load, for consumers that use the weights' values
    // (full fine-tuning, QAT, pruning, integer quantization); false keeps them
    // for the decoder and LoRA training to apply.
    bool fold_output_scales = false;
    // QLoRA's quantize_base: the layer matrices of an f32/f16/bf16 model quantized
    // at load to q8_0, q4_0 or nf4 (model/quantize_base.h); nullopt keeps them.
    std::optional<DType> quantize_base = std::nullopt;
    // Runs after the weights are bound (and dequantized) and before packing, e.g.
    // to merge an adapter into f32 copies of some matrices (model/adapter_merge.h).
    std::function<void(ModelWeights&, const ModelConfig&)> before_pack = nullptr;
    // Pipeline parallel: only this stage's layers (and embedding / head) are
    // kept, from the moment they are bound (model/pipeline_stage.h); the
    // config stays the whole model's.
    std::optional<PipelineStage> stage = std::nullopt;
  };
  // Loads weights and tokenizer. Throws loom::Error naming the path.
  static std::unique_ptr<Model> load(const std::string& path, const LoadOptions& options);
  static std::unique_ptr<Model> load(const std::string& path) { return load(path, LoadOptions{}); }
  ~Model();

  const std::string& path() const { return path_; }
  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  // For full fine-tuning, which updates the weights in place and repacks them.
  ModelWeights& mutable_weights() { return weights_; }
  // Structured pruning (quant/prune_structured.h): the new shapes, once the
  // caller has replaced the weights with matrices of those shapes.
  void reshape(const ModelConfig& c) { config_ = c; }
  bool has_tokenizer() const { return tokenizer_ != nullptr; }
  const Tokenizer& tokenizer() const;
  // The chat template text from the model's metadata, if any.
  const std::optional<std::string>& chat_template_text() const { return chat_template_; }
  // Extra end-of-generation ids from generation_config.json.
  const std::vector<int32_t>& extra_eos_ids() const { return extra_eos_; }
  bool is_gguf() const { return gguf_ != nullptr; }
  const gguf::File* gguf_file() const { return gguf_.get(); }

  // The folder's bitsandbytes quantization ("nf4"), empty for other models.
  const std::string& bnb_quant_type() const { return bnb_quant_type_; }

  // Counts and bytes of the weights, for `loom info`: the count is the whole
  // model's, the bytes those held (a pipeline stage's own).
  int64_t parameter_count() const;
  size_t weight_bytes() const;
  // A pipeline stage's cut (LoadOptions::stage); nullopt: the whole model.
  const std::optional<PipelineStage>& stage() const { return stage_; }

 private:
  Model() = default;

  std::string path_;
  ModelConfig config_;
  ModelWeights weights_;
  std::unique_ptr<gguf::File> gguf_;
  std::unique_ptr<HfFolder> hf_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<std::string> chat_template_;
  std::vector<int32_t> extra_eos_;
  std::string bnb_quant_type_;
  std::optional<PipelineStage> stage_;
};

}  // namespace loom
