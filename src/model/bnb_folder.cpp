#include "model/bnb_folder.h"

#include <cstring>

#include "core/error.h"
#include "io/hf_folder.h"
#include "kernels/ref/nf4_ref.h"

namespace loom {
namespace {

using json = nlohmann::json;
using safetensors::StDType;
constexpr std::string_view kStateSuffix = ".quant_state.bitsandbytes__";

std::string str_key(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string())
    fail(ErrorKind::invalid_input, "{}: '{}' must be a string", where, key);
  return it->get<std::string>();
}

bool bool_key(const json& j, const char* key, bool dflt, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) fail(ErrorKind::invalid_input, "{}: '{}' must be a boolean", where, key);
  return it->get<bool>();
}

// One bitsandbytes weight: its entries in the folder, checked.
class BnbTensor {
 public:
  BnbTensor(const HfFolder& hf, std::string name, std::string quant_type) : hf_(hf), name_(std::move(name)) {
    const auto* state = entry(name_ + std::string(kStateSuffix) + quant_type, StDType::u8);
    where_ = state->file->path();
    const auto* st = state->info;
    try {
      state_ = json::parse(std::string(reinterpret_cast<const char*>(st->data), st->nbytes()));
    } catch (const json::exception& e) {
      fail(ErrorKind::invalid_input, "{}: tensor '{}': quant_state is not valid JSON: {}", where_, st->name,
           e.what());
    }
    if (!state_.is_object())
      fail(ErrorKind::invalid_input, "{}: tensor '{}': quant_state must be a JSON object", where_, st->name);
  }

  Tensor convert(std::vector<std::vector<uint8_t>>& store) const {
    const std::string qt = str_key(state_, "quant_type", where_ + ": " + name_ + " quant_state");
    if (qt != "nf4")
      fail(ErrorKind::unsupported, "{}: tensor '{}': bitsandbytes quant_type '{}' is not supported (only nf4)",
           where_, name_, qt);
    const int64_t bs = int_key("blocksize");
    if (bs != kNf4Block)
      fail(ErrorKind::unsupported, "{}: tensor '{}': blocksize {} (loom's nf4 reads blocksize 64)", where_, name_,
           bs);
    const auto shape = state_.find("shape");
    if (shape == state_.end() || !shape->is_array() || shape->size() != 2 || !(*shape)[0].is_number_integer() ||
        !(*shape)[1].is_number_integer())
      fail(ErrorKind::invalid_input, "{}: tensor '{}': quant_state 'shape' must be [rows, cols]", where_, name_);
    const int64_t rows = (*shape)[0].get<int64_t>(), cols = (*shape)[1].get<int64_t>();
    if (rows <= 0 || cols <= 0 || cols % kNf4Block != 0 || rows > (int64_t{1} << 24) || cols > (int64_t{1} << 24))
      fail(ErrorKind::invalid_input, "{}: tensor '{}': shape [{}, {}]: columns must be a positive multiple of 64",
           where_, name_, rows, cols);
    const int64_t nblocks = rows * cols / kNf4Block;
    const auto* codes = entry(name_, StDType::u8);
    expect_bytes(*codes, static_cast<size_t>(rows * cols / 2), "packed 4-bit codes");
    const auto* qmap = entry(name_ + ".quant_map", StDType::f32);
    expect_bytes(*qmap, 16 * sizeof(float), "quant_map");
    if (std::memcmp(qmap->info->data, kNf4Code, sizeof kNf4Code) != 0)
      fail(ErrorKind::invalid_input, "{}: tensor '{}.quant_map' is not bitsandbytes' NF4 code table", where_,
           name_);
    const std::vector<float> absmax = block_absmax(nblocks);

    auto& buf = store.emplace_back(static_cast<size_t>(nblocks) * sizeof(BlockNF4));
    for (int64_t i = 0; i < nblocks; ++i) {
      BlockNF4 b;
      b.d = absmax[static_cast<size_t>(i)];
      std::memcpy(b.qs, codes->info->data + 32 * i, 32);
      std::memcpy(buf.data() + i * sizeof(BlockNF4), &b, sizeof b);
    }
    Tensor t;
    t.data = buf.data();
    t.dtype = DType::nf4;
    t.ndim = 2;
    t.shape = {rows, cols, 0, 0};
    return t;
  }

 private:
  const HfFolder::WeightRef* entry(const std::string& name, StDType dt) const {
    return &hf_.weight_part(name, dt, fmt::format("bitsandbytes weight '{}'", name_));
  }

  void expect_bytes(const HfFolder::WeightRef& r, size_t n, const char* what) const {
    if (r.info->nbytes() != n)
      fail(ErrorKind::invalid_input, "{}: tensor '{}' ({}) has shape {} ({} bytes), expected {} bytes for '{}'",
           r.file->path(), r.info->name, what, r.info->shape_string(), r.info->nbytes(), n, name_);
  }

  int64_t int_key(const char* key) const {
    const auto it = state_.find(key);
    if (it == state_.end() || !it->is_number_integer())
      fail(ErrorKind::invalid_input, "{}: tensor '{}': quant_state '{}' must be an integer", where_, name_, key);
    return it->get<int64_t>();
  }

  std::vector<float> read_f32(const HfFolder::WeightRef& r) const {
    std::vector<float> v(r.info->nbytes() / sizeof(float));
    std::memcpy(v.data(), r.info->data, v.size() * sizeof(float));
    return v;
  }

  // The f32 absmax of every block: read, or rebuilt from double quantization
  // exactly as bitsandbytes does (dequantize_blockwise, then + offset).
  std::vector<float> block_absmax(int64_t nblocks) const {
    const auto* a = hf_.find_weight(name_ + ".absmax");
    if (a == nullptr)
      fail(ErrorKind::invalid_input, "{}: bitsandbytes weight '{}' has no tensor '{}.absmax'", hf_.dir(), name_,
           name_);
    if (a->info->st_dtype == StDType::f32) {
      expect_bytes(*a, static_cast<size_t>(nblocks) * sizeof(float), "absmax");
      return read_f32(*a);
    }
    const auto* q = entry(name_ + ".absmax", StDType::u8);
    expect_bytes(*q, static_cast<size_t>(nblocks), "absmax codes");
    if (int_key("nested_blocksize") != kNf4NestedBlock)
      fail(ErrorKind::unsupported, "{}: tensor '{}': nested_blocksize must be 256", where_, name_);
    const auto off = state_.find("nested_offset");
    if (off == state_.end() || !off->is_number())
      fail(ErrorKind::invalid_input, "{}: tensor '{}': quant_state 'nested_offset' must be a number", where_, name_);
    const float offset = static_cast<float>(off->get<double>());
    const int64_t n2 = (nblocks + kNf4NestedBlock - 1) / kNf4NestedBlock;
    const auto* na = entry(name_ + ".nested_absmax", StDType::f32);
    expect_bytes(*na, static_cast<size_t>(n2) * sizeof(float), "nested_absmax");
    const auto* nm = entry(name_ + ".nested_quant_map", StDType::f32);
    expect_bytes(*nm, 256 * sizeof(float), "nested_quant_map");
    const std::vector<float> nested = read_f32(*na), map = read_f32(*nm);
    std::vector<float> out(static_cast<size_t>(nblocks));
    for (int64_t i = 0; i < nblocks; ++i)
      out[static_cast<size_t>(i)] =
          dequantize_absmax(map.data(), q->info->data[i], nested[static_cast<size_t>(i / kNf4NestedBlock)], offset);
    return out;
  }

  const HfFolder& hf_;
  std::string name_;
  std::string where_;
  json state_;
};

}  // namespace

std::optional<BnbQuantConfig> bnb_quant_config(const json& config, const std::string& path) {
  const auto it = config.find("quantization_config");
  if (it == config.end() || it->is_null()) return std::nullopt;
  const std::string where = path + ": quantization_config";
  if (!it->is_object()) fail(ErrorKind::invalid_input, "{} must be an object", where);
  const json& q = *it;
  const std::string method = str_key(q, "quant_method", where);
  // model/compressed_tensors.h and model/modelopt_folder.h read those.
  if (method == "compressed-tensors" || method == "modelopt") return std::nullopt;
  if (method != "bitsandbytes")
    fail(ErrorKind::unsupported,
         "{}: quant_method '{}' is not supported (bitsandbytes 4-bit, compressed-tensors and ModelOpt "
         "NVFP4 / FP8 folders are)",
         where, method);
  if (bool_key(q, "load_in_8bit", false, where))
    fail(ErrorKind::unsupported,
         "{}: load_in_8bit: 8-bit bitsandbytes (LLM.int8) checkpoints are not supported (4-bit nf4 ones are)", where);
  if (!bool_key(q, "load_in_4bit", false, where))
    fail(ErrorKind::invalid_input, "{}: load_in_4bit must be true", where);
  BnbQuantConfig c;
  c.quant_type = q.contains("bnb_4bit_quant_type") ? str_key(q, "bnb_4bit_quant_type", where) : "fp4";
  if (c.quant_type != "nf4")
    fail(ErrorKind::unsupported, "{}: bnb_4bit_quant_type '{}' is not supported (only nf4)", where, c.quant_type);
  c.double_quant = bool_key(q, "bnb_4bit_use_double_quant", false, where);
  if (q.contains("bnb_4bit_quant_storage") && !q["bnb_4bit_quant_storage"].is_null()) {
    const std::string st = str_key(q, "bnb_4bit_quant_storage", where);
    if (st != "uint8")
      fail(ErrorKind::unsupported, "{}: bnb_4bit_quant_storage '{}' is not supported (uint8 is)", where, st);
  }
  if (q.contains("bnb_4bit_compute_dtype") && q["bnb_4bit_compute_dtype"].is_string())
    c.compute_dtype = q["bnb_4bit_compute_dtype"].get<std::string>();
  return c;
}

std::map<std::string, Tensor, std::less<>> load_bnb_weights(const HfFolder& hf, const BnbQuantConfig& qc,
                                                           std::vector<std::vector<uint8_t>>& store) {
  std::map<std::string, Tensor, std::less<>> out;
  for (const std::string& n : hf.tensor_names()) {
    const size_t pos = n.find(kStateSuffix);
    if (pos == std::string::npos) continue;
    const std::string type = n.substr(pos + kStateSuffix.size());
    const std::string base = n.substr(0, pos);
    if (type != qc.quant_type)
      fail(ErrorKind::unsupported, "{}: tensor '{}': quant_state of type '{}' in a {} folder (only nf4 is supported)",
           hf.dir(), n, type, qc.quant_type);
    out.emplace(base, BnbTensor(hf, base, type).convert(store));
  }
  if (out.empty())
    fail(ErrorKind::invalid_input, "{}: config.json has a bitsandbytes quantization_config, but no tensor has a quant_state",
         hf.dir());
  return out;
}

}  // namespace loom
