#include "model/modelopt_folder.h"

#include <filesystem>

#include "core/error.h"
#include "io/hf_folder.h"
#include "kernels/quant_blocks.h"

namespace loom {
namespace {

using json = nlohmann::json;
using safetensors::StDType;
constexpr int64_t kGroup = QK_NVFP4_SUB;  // ModelOpt's NVFP4 group: one E4M3 scale per 16 weights

// The quantization object's algorithm, checked: NVFP4 weights in groups of 16.
ModelOptQuantConfig checked(const json& q, const std::string& where) {
  ModelOptQuantConfig c;
  c.source = where;
  const auto algo = q.find("quant_algo");
  if (algo == q.end() || !algo->is_string())
    fail(ErrorKind::invalid_input, "{}: 'quant_algo' must be a string", where);
  c.quant_algo = algo->get<std::string>();
  if (c.quant_algo != "NVFP4" && c.quant_algo != "W4A16_NVFP4")
    fail(ErrorKind::unsupported, "{}: ModelOpt quant_algo '{}' is not supported (NVFP4 and W4A16_NVFP4 are)",
         where, c.quant_algo);
  if (const auto g = q.find("group_size");
      g != q.end() && !g->is_null() && (!g->is_number_integer() || *g != kGroup))
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

}  // namespace

std::map<std::string, Tensor, std::less<>> load_modelopt_weights(const HfFolder& hf,
                                                                 const ModelOptQuantConfig&,
                                                                 std::vector<std::vector<uint8_t>>& store) {
  std::map<std::string, Tensor, std::less<>> out;
  for (const std::string& name : hf.tensor_names()) {
    if (!name.ends_with(".weight") || hf.find_weight(name + "_scale") == nullptr) continue;
    if (hf.find_weight(name)->info->st_dtype != StDType::u8) continue;  // e.g. an excluded module's own scale
    out.emplace(name, repack(hf, name, store));
  }
  return out;
}

}  // namespace loom
