// PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors):
// a neutral in-memory form, a writer that PEFT's loader accepts, and a reader
// that validates folders written by loom or by PEFT itself.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io/file_write.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/lora.h"

namespace loom::peft {

// PEFT's tensor name, e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight.
std::string tensor_name(int layer, LoraTarget t, bool lora_b);

struct AdapterConfig {
  int r = 8;
  double lora_alpha = 16;
  double lora_dropout = 0;
  bool use_rslora = false;
  std::vector<LoraTarget> target_modules;  // in kAllLoraTargets order when written
  // PEFT's layers_to_transform: the adapted layer indices, ascending; empty = all.
  std::vector<int> layers_to_transform;
  std::string base_model_name_or_path;
  std::string peft_version = "0.21.2";  // written as is; any version is read
  // The factor multiplying B·A in the forward pass (alpha/r, or alpha/sqrt(r) with rsLoRA).
  double scaling() const;
};

// One adapted linear layer: A is [r, in], B is [out, r], row-major fp32.
// Read with map_f32, an aligned F32 tensor is not copied: a_map / b_map point
// into the file's mapping (AdapterTensors::mapping) and a / b stay empty.
struct LoraPair {
  int64_t in = 0, out = 0;
  std::vector<float> a, b;
  const float* a_map = nullptr;
  const float* b_map = nullptr;
  const float* a_data() const { return a_map ? a_map : a.data(); }
  const float* b_data() const { return b_map ? b_map : b.data(); }
};

struct AdapterTensors {
  AdapterConfig config;
  std::map<std::pair<int, LoraTarget>, LoraPair> pairs;  // (layer, target)
  std::shared_ptr<const safetensors::File> mapping;     // set by read_adapter(dir, true)

  const LoraPair* find(int layer, LoraTarget t) const;
  int n_layers() const;  // 1 + the largest layer index, 0 when empty
};

// Writes the folder `dir` (adapter_config.json + adapter_model.safetensors) as
// a whole through write_folder_atomic (io/file_write.h): a crash leaves the old
// folder or the new one. A non-empty `dir` that is not a loom/PEFT output is
// refused unless opt.overwrite. `dtype`: F32, F16 or BF16.
// Throws invalid_input when a pair's sizes disagree with r / in / out or a pair's
// target is not in config.target_modules.
void write_adapter(const std::string& dir, const AdapterTensors& adapter,
                   safetensors::StDType dtype = safetensors::StDType::f32, const FolderWriteOptions& opt = {});

// Reads and validates a PEFT LoRA folder. Unsupported options (DoRA,
// fan_in_fan_out, non-LORA peft_type, layers_pattern other than "layers", rank/alpha patterns,
// biases, modules_to_save, unknown targets, ...) and malformed or missing
// tensors throw loom::Error naming the file and the field or tensor.
// map_f32: keep the safetensors file mapped and point at its aligned F32
// tensors instead of copying them (the server's adapters); F16/BF16 are
// converted either way.
AdapterTensors read_adapter(const std::string& dir, bool map_f32 = false);

// Checks layer count and every pair's in/out against the model; throws
// invalid_input naming `what` (e.g. the adapter folder) and the tensor.
void check_adapter_fits(const AdapterTensors& adapter, const ModelConfig& model, std::string_view what);

}  // namespace loom::peft
