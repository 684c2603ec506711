// A Hugging Face model folder: config.json, weights in model.safetensors or
// sharded via model.safetensors.index.json, and the optional tokenizer and
// generation files. Opening validates the weight map against the shards.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace loom {

// Reads and parses a JSON file. Throws not_found / io naming the file, or
// invalid_input naming the file, line, column and byte of a syntax error.
nlohmann::json read_json_file(const std::string& path);
// Same for text already in memory; `path` is only used in messages.
nlohmann::json parse_json_text(std::string_view text, const std::string& path);

// The parts of tokenizer_config.json that loom uses. Token strings may be
// written as plain strings or as AddedToken objects ({"content": ...}).
struct TokenizerSettings {
  std::optional<std::string> chat_template;  // a list of named templates -> the "default" one
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  std::optional<std::string> pad_token;
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
};
TokenizerSettings parse_tokenizer_settings(const nlohmann::json& j, const std::string& path);

// Sampling and stop defaults from generation_config.json.
struct GenerationDefaults {
  std::vector<int64_t> eos_token_ids;  // eos_token_id may be an int or a list
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<bool> do_sample;
  std::optional<int64_t> max_new_tokens;
};
GenerationDefaults parse_generation_defaults(const nlohmann::json& j, const std::string& path);

class HfFolder {
 public:
  struct WeightRef {
    const safetensors::File* file = nullptr;  // the shard holding it
    const safetensors::TensorInfo* info = nullptr;
    std::optional<Tensor> view;               // set for F32 / F16 / BF16
  };

  // Opens `dir`. config.json is required; weights are required unless
  // `require_weights` is false (tokenizer/config-only use). Throws loom::Error.
  static std::unique_ptr<HfFolder> open(const std::string& dir, bool require_weights = true);

  const std::string& dir() const { return dir_; }
  std::string path_of(std::string_view file_name) const;
  const nlohmann::json& config() const { return config_; }

  // Weights across all shards, names sorted.
  std::vector<std::string> tensor_names() const;
  // Raw entry (any dtype), nullptr if absent.
  const WeightRef* find_weight(std::string_view name) const;
  // The raw entry of a quantized checkpoint's part, which must be there with
  // dtype `dt`; else invalid_input naming the folder, `owner` (what needs it,
  // e.g. "bitsandbytes weight 'W'") and the tensor, or the shard and the dtypes.
  const WeightRef& weight_part(std::string_view name, safetensors::StDType dt, std::string_view owner) const;
  // F32 / F16 / BF16 view, nullptr if absent; other dtypes throw unsupported
  // naming the shard and tensor.
  const Tensor* find_tensor(std::string_view name) const;
  // As find_tensor, but absence is a not_found error naming the folder and tensor.
  const Tensor& tensor(std::string_view name) const;
  const std::vector<std::unique_ptr<safetensors::File>>& shards() const { return shards_; }
  bool sharded() const { return sharded_; }

  std::optional<std::string> tokenizer_json_path() const { return tokenizer_json_path_; }
  const std::optional<nlohmann::json>& tokenizer_config() const { return tokenizer_config_; }
  const std::optional<nlohmann::json>& generation_config() const { return generation_config_; }
  // Parsed forms; empty settings when the file is absent.
  TokenizerSettings tokenizer_settings() const;
  GenerationDefaults generation_defaults() const;

 private:
  HfFolder() = default;
  void load_single(const std::string& path);
  void load_sharded(const std::string& index_path);

  std::string dir_;
  nlohmann::json config_;
  bool sharded_ = false;
  std::vector<std::unique_ptr<safetensors::File>> shards_;
  std::map<std::string, WeightRef, std::less<>> weights_;
  std::optional<std::string> tokenizer_json_path_;
  std::optional<nlohmann::json> tokenizer_config_;
  std::optional<nlohmann::json> generation_config_;
};

}  // namespace loom
