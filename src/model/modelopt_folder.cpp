#include "model/modelopt_folder.h"

#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/half.h"
#include "io/hf_folder.h"
#include "kernels/quant_blocks.h"

namespace loom {
namespace {

using json = nlohmann::json;
using safetensors::StDType;
constexpr int64_t kGroup = QK_NVFP4_SUB;  // ModelOpt's NVFP4 group: one E4M3 scale per 16 weights

// The quantization object's algorithm, checked: NVFP4 weights in groups of
// 16, or FP8 weights with one scale per tensor.
ModelOptQuantConfig checked(const json& q, const std::string& where) {
  ModelOptQuantConfig c;
  c.source = where;
  const auto algo = q.find("quant_algo");
  if (algo == q.end() || !algo->is_string())
    fail(ErrorKind::invalid_input, "{}: 'quant_algo' must be a string", where);
  c.quant_algo = algo->get<std::string>();
  if (c.quant_algo != "NVFP4" && c.quant_algo != "W4A16_NVFP4" && c.quant_algo != "FP8")
    fail(ErrorKind::unsupported,
         "{}: ModelOpt quant_algo '{}' is not supported (NVFP4, W4A16_NVFP4 and FP8 are)", where,
         c.quant_algo);
  const auto g = q.find("group_size");
  if (!c.fp8() && g != q.end() && !g->is_null() && (!g->is_number_integer() || *g != kGroup))
    fail(ErrorKind::unsupported, "{}: group_size {} (NVFP4 scales groups of 16)", where, g->dump());
  return c;
}

}  // namespace

std::optional<ModelOptQuantConfig> modelopt_quant_config(const json& config, const std::string& config_path,
                                                         const std::string& dir) {
  if (const auto it = config.find("quantization_config"); it != config.end() && it->is_object()) {
    if (it->value("quant_method", std::string()) != "modelopt") return std::nullopt;
    return checked(*it, config_path + ": quantization_config");
  }
  // Older exports name the method only in hf_quant_config.json.
  const std::string hq = (std::filesystem::path(dir) / "hf_quant_config.json").string();
  if (!std::filesystem::is_regular_file(hq)) return std::nullopt;
  const json j = read_json_file(hq);
  const auto producer = j.find("producer");
  if (producer == j.end() || !producer->is_object() || producer->value("name", std::string()) != "modelopt")
    return std::nullopt;
  const auto q = j.find("quantization");
  if (q == j.end() || !q->is_object())
    fail(ErrorKind::invalid_input, "{}: 'quantization' must be an object", hq);
  return checked(*q, hq + ": quantization");
}

namespace {

// One ModelOpt NVFP4 weight repacked into nvfp4 blocks: per 64 columns the four
// 16-column scales (E4M3's bits without the sign, as GGUF's UE4M3), then each
// 16's codes with byte j holding column j (low nibble) and j + 8 (high).
Tensor repack(const HfFolder& hf, const std::string& name, std::vector<std::vector<uint8_t>>& store) {
  const std::string owner = fmt::format("NVFP4 weight '{}'", name);
  const auto& codes = hf.weight_part(name, StDType::u8, owner);
  const auto& scales = hf.weight_part(name + "_scale", StDType::f8_e4m3, owner);
  const safetensors::TensorInfo& c = *codes.info;
  const safetensors::TensorInfo& s = *scales.info;
  if (c.ndim != 2 || s.ndim != 2)
    fail(ErrorKind::invalid_input, "{}: tensors '{}' {} and '{}' {} must be matrices", codes.file->path(),
         name, c.shape_string(), s.name, s.shape_string());
  const int64_t rows = c.shape[0], cols = 2 * c.shape[1];
  if (s.shape[0] != rows || s.shape[1] * kGroup != cols)
    fail(ErrorKind::invalid_input, "{}: tensor '{}' has shape {}; the codes {} of '{}' need [{}, {}] scales",
         scales.file->path(), s.name, s.shape_string(), c.shape_string(), name, rows, cols / kGroup);
  if (cols % QK_NVFP4 != 0)
    fail(ErrorKind::unsupported,
         "{}: tensor '{}' has {} columns; loom's NVFP4 blocks hold 64 (a multiple of 64 is needed)",
         codes.file->path(), name, cols);
  const int64_t per_row = cols / QK_NVFP4;
  auto& buf = store.emplace_back(static_cast<size_t>(rows * per_row) * sizeof(BlockNVFP4));
  const uint8_t* code = c.data;
  const uint8_t* scale = s.data;
  auto* out = reinterpret_cast<BlockNVFP4*>(buf.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < per_row; ++b, ++out) {
      for (int sub = 0; sub < 4; ++sub) {
        const int64_t group = r * (cols / kGroup) + b * 4 + sub;
        out->d[sub] = static_cast<uint8_t>(scale[group] & 0x7f);
        const uint8_t* src = code + group * (kGroup / 2);  // 8 bytes: columns 2i (low), 2i + 1 (high)
        for (int j = 0; j < 8; ++j) {
          const auto nibble = [src](int col) { return (src[col / 2] >> (4 * (col % 2))) & 0xf; };
          out->qs[8 * sub + j] = static_cast<uint8_t>(nibble(j) | nibble(j + 8) << 4);
        }
      }
    }
  return make_tensor(buf.data(), DType::nvfp4, {rows, cols});
}

// FP8 E4M3 (fn) bits as f16 bits, exact: every E4M3 value has at most 4
// significant bits between 2^-9 and 448, an f16 normal. 0x7f / 0xff (NaN) is
// refused by the caller.
uint16_t e4m3_to_f16(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  const float v =
      e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  return fp32_to_fp16((b & 0x80) ? -v : v);
}

// One ModelOpt FP8 weight (F8_E4M3 [out, in], one F32 weight_scale) as an f16
// matrix of the same values; the scale becomes its output scale.
Tensor widen_fp8(const HfFolder& hf, const std::string& name, std::vector<std::vector<uint8_t>>& store) {
  const std::string owner = fmt::format("FP8 weight '{}'", name);
  const auto& w = hf.weight_part(name, StDType::f8_e4m3, owner);
  const auto& s = hf.weight_part(name + "_scale", StDType::f32, owner);
  const safetensors::TensorInfo& wi = *w.info;
  if (wi.ndim != 2)
    fail(ErrorKind::invalid_input, "{}: tensor '{}' has shape {}, expected a matrix", w.file->path(), name,
         wi.shape_string());
  if (s.info->numel() != 1)
    fail(ErrorKind::unsupported, "{}: tensor '{}' has shape {}: per-channel FP8 scales are not supported",
         s.file->path(), s.info->name, s.info->shape_string());
  uint16_t table[256];
  for (int b = 0; b < 256; ++b) table[b] = e4m3_to_f16(static_cast<uint8_t>(b));
  const auto n = static_cast<size_t>(wi.numel());
  auto& buf = store.emplace_back(n * sizeof(uint16_t));
  auto* out = reinterpret_cast<uint16_t*>(buf.data());
  for (size_t i = 0; i < n; ++i) {
    if ((wi.data[i] & 0x7f) == 0x7f)
      fail(ErrorKind::invalid_input, "{}: tensor '{}': element {} is an FP8 NaN", w.file->path(), name, i);
    out[i] = table[wi.data[i]];
  }
  return make_tensor(buf.data(), DType::f16, {wi.shape[0], wi.shape[1]});
}

// A module's per-tensor output scale as the one-element f32 tensor the binder
// reads ("<module>.output_scale", model/weights.h).
Tensor scalar(const HfFolder& hf, const std::string& name, std::vector<std::vector<uint8_t>>& store) {
  const auto& r = hf.weight_part(name, StDType::f32, fmt::format("weight '{}'", name));
  if (r.info->numel() != 1)
    fail(ErrorKind::invalid_input, "{}: tensor '{}' has shape {}, expected one value", r.file->path(), name,
         r.info->shape_string());
  auto& buf = store.emplace_back(sizeof(float));
  std::memcpy(buf.data(), r.info->data, sizeof(float));
  return make_tensor(buf.data(), DType::f32, {1});
}

}  // namespace

std::map<std::string, Tensor, std::less<>> load_modelopt_weights(const HfFolder& hf,
                                                                 const ModelOptQuantConfig& qc,
                                                                 std::vector<std::vector<uint8_t>>& store) {
  std::map<std::string, Tensor, std::less<>> out;
  const StDType stored = qc.fp8() ? StDType::f8_e4m3 : StDType::u8;
  for (const std::string& name : hf.tensor_names()) {
    if (!name.ends_with(".weight") || hf.find_weight(name + "_scale") == nullptr) continue;
    if (hf.find_weight(name)->info->st_dtype != stored) continue;  // e.g. an excluded module's own scale
    const std::string module = name.substr(0, name.size() - std::string_view(".weight").size());
    out.emplace(name, qc.fp8() ? widen_fp8(hf, name, store) : repack(hf, name, store));
    out.emplace(module + ".output_scale", scalar(hf, qc.fp8() ? name + "_scale" : name + "_scale_2", store));
  }
  return out;
}

}  // namespace loom
