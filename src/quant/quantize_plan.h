// Which type each tensor of a model gets when it is quantized to a file type:
// llama.cpp's llama-quantize rules (src/llama-quant.cpp: llama_tensor_get_type),
// so `loom quantize` writes the same mixes users know. A "_M" type is a mix:
// Q4_K_M keeps attn_v and ffn_down of some layers (use_more_bits) in Q6_K and
// the output projection in Q6_K; rows whose width is not a multiple of a
// k-quant's 256 fall back to a 32-block type (Q4_K -> Q5_0, Q6_K -> Q8_0, ...).
// Only the file types of the formats loom reads are planned (no IQ types).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace loom {

// llama.cpp's llama_ftype numbering (general.file_type in GGUF files).
enum class FileType : uint32_t {
  all_f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q8_0 = 7,
  q5_0 = 8,
  q5_1 = 9,
  q2_k = 10,
  q3_k_s = 11,
  q3_k_m = 12,
  q3_k_l = 13,
  q4_k_s = 14,
  q4_k_m = 15,
  q5_k_s = 16,
  q5_k_m = 17,
  q6_k = 18,
  iq2_xxs = 19,
  iq2_xs = 20,
  q2_k_s = 21,
  iq3_xs = 22,
  iq3_xxs = 23,
  iq1_s = 24,
  iq4_nl = 25,
  iq3_s = 26,
  iq3_m = 27,
  iq2_s = 28,
  iq2_m = 29,
  iq4_xs = 30,
  iq1_m = 31,
  bf16 = 32,
  tq1_0 = 36,
  tq2_0 = 37,
  q1_0 = 40,
  q2_0 = 41,
};

// "Q4_K_M", "q4_k_m", "F16", "F32" (case-insensitive), or llama-quantize's
// numeric id ("15"). nullopt for anything else.
std::optional<FileType> file_type_from_name(std::string_view name);
const char* file_type_name(FileType t);  // "Q4_K_M"
std::vector<FileType> all_file_types();
// The type most tensors get (Q4_K_M -> q4_k).
DType file_type_default(FileType t);

// What the rules look at besides the tensor itself.
struct ModelShapeInfo {
  int64_t n_layers = 0;
  int64_t n_heads = 0, n_kv_heads = 0;
  bool is_70b = false;  // llama.cpp's LLM_TYPE_70B (80-layer Llama / Qwen2): attn_v one step up
};

// A tensor regex override (llama-quantize --tensor-type PATTERN=TYPE).
struct TensorTypeOverride {
  std::string pattern;  // ECMAScript regex, searched in the tensor name
  DType type;
};

struct QuantizeOptions {
  FileType file_type = FileType::q4_k_m;
  bool pure = false;                 // every quantizable tensor gets the default type (no mix)
  bool has_imatrix = false;          // changes ffn_down of Q4_0/Q5_0 early layers, as in llama.cpp
  bool quantize_output = true;       // false: --leave-output-tensor
  std::optional<DType> output_type;  // --output-tensor-type
  std::optional<DType> token_embedding_type;  // --token-embedding-type
  std::vector<TensorTypeOverride> overrides;  // checked in order; the first match wins
};

struct TensorInput {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;  // outermost first; shape.back() is the row width
};

struct TensorPlan {
  std::string name;
  DType from, to;
  bool quantized = false;  // a quantizable weight (2D+, "*weight", not a norm)
  bool fallback = false;   // the chosen k-quant did not fit the row width
};

// Whether quantizing this tensor as planned needs its importance (an imatrix
// entry), as llama-quantize refuses without one (tensor_requires_imatrix): the
// very-low-bit grid types (iq3_xxs, iq2_xxs, iq2_xs, iq2_s, iq1_s, iq1_m) and
// Q2_K_S's q2_k, never token_embd or output.
bool plan_requires_importance(const TensorPlan& p, FileType file_type);

// The plan for every tensor, in llama.cpp's processing order (tensors of no
// layer first, then by layer, each group by name), which is also the order
// `loom quantize` writes them. Throws invalid_input for a bad override type.
std::vector<TensorPlan> plan_quantization(std::vector<TensorInput> tensors, const ModelShapeInfo& model,
                                          const QuantizeOptions& opt);

// Whether llama-quantize would quantize this tensor at all (2D+, name ends
// in "weight", not a norm; output.weight unless quantize_output is false).
bool tensor_is_quantizable(const TensorInput& t, bool quantize_output);

}  // namespace loom
