#include "model/compressed_tensors.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "io/hf_folder.h"
#include "kernels/cpu/dequant.h"
#include "kernels/quant_blocks.h"

namespace loom {
namespace {

using json = nlohmann::json;

const json& member(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) fail(ErrorKind::invalid_input, "{}: no '{}'", where, key);
  return *it;
}

// A raw tensor of the folder and its checked dtype and shape.
const safetensors::TensorInfo& raw(const HfFolder& hf, const std::string& name, safetensors::StDType dtype,
                                   const std::string& dir) {
  const HfFolder::WeightRef* w = hf.find_weight(name);
  if (w == nullptr) fail(ErrorKind::invalid_input, "{}: tensor '{}' is missing", dir, name);
  if (w->info->st_dtype != dtype)
    fail(ErrorKind::invalid_input, "{}: tensor '{}' is {}, expected {}", dir, name, st_dtype_name(w->info->st_dtype),
         st_dtype_name(dtype));
  return *w->info;
}

// The scales (any float dtype) as f32, with their 2-D shape [rows, n].
std::vector<float> scales_f32(const HfFolder& hf, const std::string& name, int64_t rows, int64_t n,
                              const std::string& dir) {
  const Tensor* t = hf.find_tensor(name);
  if (t == nullptr) fail(ErrorKind::invalid_input, "{}: tensor '{}' is missing", dir, name);
  if (t->numel() != rows * n)
    fail(ErrorKind::invalid_input, "{}: tensor '{}' holds {} values, expected {} x {}", dir, name, t->numel(), rows, n);
  std::vector<float> out(static_cast<size_t>(rows * n));
  dequantize_row(t->dtype, t->data, out.data(), rows * n);
  return out;
}

// 4-bit code i of a densely packed int32 line (value + 8 in nibble i % 8 of word i / 8).
int8_t nibble(const uint8_t* words, int64_t i) {
  uint32_t w;
  std::memcpy(&w, words + 4 * (i / 8), 4);
  return static_cast<int8_t>(static_cast<int>((w >> (4 * (i % 8))) & 0xF) - 8);
}

struct Decoded {
  int64_t rows = 0, cols = 0, groups = 1;
  std::vector<int8_t> codes;           // rows x cols
  std::vector<float> scale, zero;      // rows x groups
};

Decoded decode(const HfFolder& hf, const CtQuantConfig& qc, const std::string& m, const std::string& dir) {
  Decoded d;
  if (qc.bits == 8) {
    const auto& w = raw(hf, m + ".weight", safetensors::StDType::i8, dir);
    if (w.ndim != 2) fail(ErrorKind::invalid_input, "{}: tensor '{}.weight' is not 2-D", dir, m);
    d.rows = w.shape[0];
    d.cols = w.shape[1];
    d.codes.assign(reinterpret_cast<const int8_t*>(w.data), reinterpret_cast<const int8_t*>(w.data) + w.nbytes());
  } else {
    const auto& shp = raw(hf, m + ".weight_shape", safetensors::StDType::i64, dir);
    if (shp.numel() != 2) fail(ErrorKind::invalid_input, "{}: tensor '{}.weight_shape' must hold 2 values", dir, m);
    int64_t s[2];
    std::memcpy(s, shp.data, sizeof s);
    d.rows = s[0];
    d.cols = s[1];
    const auto& p = raw(hf, m + ".weight_packed", safetensors::StDType::i32, dir);
    const int64_t words = (d.cols + 7) / 8;
    if (p.numel() != d.rows * words)
      fail(ErrorKind::invalid_input, "{}: tensor '{}.weight_packed' holds {} int32, expected {} x {}", dir, m,
           p.numel(), d.rows, words);
    d.codes.resize(static_cast<size_t>(d.rows * d.cols));
    for (int64_t r = 0; r < d.rows; ++r)
      for (int64_t c = 0; c < d.cols; ++c) d.codes[static_cast<size_t>(r * d.cols + c)] = nibble(p.data + 4 * r * words, c);
  }
  d.groups = qc.strategy == "group" ? d.cols / qc.group : 1;
  if (qc.strategy == "group" && (qc.group <= 0 || d.cols % qc.group != 0))
    fail(ErrorKind::invalid_input, "{}: '{}' has rows of {} values, not a multiple of group_size {}", dir, m, d.cols,
         qc.group);
  const int64_t srows = qc.strategy == "tensor" ? 1 : d.rows;
  d.scale = scales_f32(hf, m + ".weight_scale", srows, d.groups, dir);
  d.zero.assign(d.scale.size(), 0.0f);
  if (!qc.symmetric) {
    if (qc.bits == 8) {
      const auto& z = raw(hf, m + ".weight_zero_point", safetensors::StDType::i8, dir);
      if (z.numel() != srows * d.groups) fail(ErrorKind::invalid_input, "{}: '{}.weight_zero_point' has the wrong size", dir, m);
      for (size_t i = 0; i < d.zero.size(); ++i) d.zero[i] = static_cast<float>(reinterpret_cast<const int8_t*>(z.data)[i]);
    } else {
      // Packed down the rows: [ceil(rows / 8), groups]; element (r, g) is code r of column g.
      const auto& z = raw(hf, m + ".weight_zero_point", safetensors::StDType::i32, dir);
      const int64_t words = (srows + 7) / 8;
      if (z.numel() != words * d.groups) fail(ErrorKind::invalid_input, "{}: '{}.weight_zero_point' has the wrong size", dir, m);
      for (int64_t g = 0; g < d.groups; ++g)
        for (int64_t r = 0; r < srows; ++r) {
          uint32_t w;
          std::memcpy(&w, z.data + 4 * ((r / 8) * d.groups + g), 4);
          d.zero[static_cast<size_t>(r * d.groups + g)] = static_cast<float>(static_cast<int>((w >> (4 * (r % 8))) & 0xF) - 8);
        }
    }
  }
  if (qc.strategy == "tensor") {  // one scale for every row
    d.scale.assign(static_cast<size_t>(d.rows), d.scale[0]);
    d.zero.assign(static_cast<size_t>(d.rows), d.zero[0]);
  }
  return d;
}

Tensor owned_tensor(std::vector<std::vector<uint8_t>>& store, std::vector<uint8_t> bytes, DType t, int64_t rows,
                    int64_t cols) {
  store.push_back(std::move(bytes));
  return make_tensor(store.back().data(), t, {rows, cols});
}

// int8 per row -> i8_ch rows: {f32 scale, f32 zero} then the codes.
Tensor to_i8_ch(const Decoded& d, std::vector<std::vector<uint8_t>>& store) {
  const size_t row = dtype_row_bytes(DType::i8_ch, d.cols);
  std::vector<uint8_t> b(row * static_cast<size_t>(d.rows));
  for (int64_t r = 0; r < d.rows; ++r) {
    uint8_t* p = b.data() + static_cast<size_t>(r) * row;
    std::memcpy(p, &d.scale[static_cast<size_t>(r)], 4);
    std::memcpy(p + 4, &d.zero[static_cast<size_t>(r)], 4);
    std::memcpy(p + 8, d.codes.data() + r * d.cols, static_cast<size_t>(d.cols));
  }
  return owned_tensor(store, std::move(b), DType::i8_ch, d.rows, d.cols);
}

// Per group (or row) parameters of element block b (32 wide) of row r.
int64_t param_index(const Decoded& d, int64_t r, int64_t c) { return r * d.groups + c / (d.cols / d.groups); }

Tensor to_q8_0(const Decoded& d, std::vector<std::vector<uint8_t>>& store) {
  const int64_t nb = d.cols / 32;
  std::vector<uint8_t> b(static_cast<size_t>(d.rows * nb) * sizeof(BlockQ8_0));
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t k = 0; k < nb; ++k) {
      BlockQ8_0 blk;
      blk.d = fp32_to_fp16(d.scale[static_cast<size_t>(param_index(d, r, k * 32))]);
      std::memcpy(blk.qs, d.codes.data() + r * d.cols + k * 32, 32);
      std::memcpy(b.data() + static_cast<size_t>(r * nb + k) * sizeof blk, &blk, sizeof blk);
    }
  return owned_tensor(store, std::move(b), DType::q8_0, d.rows, d.cols);
}

template <typename Block>
Tensor to_q4(const Decoded& d, DType type, std::vector<std::vector<uint8_t>>& store) {
  const int64_t nb = d.cols / 32;
  std::vector<uint8_t> b(static_cast<size_t>(d.rows * nb) * sizeof(Block));
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t k = 0; k < nb; ++k) {
      const auto pi = static_cast<size_t>(param_index(d, r, k * 32));
      Block blk{};
      blk.d = fp32_to_fp16(d.scale[pi]);
      if constexpr (std::is_same_v<Block, BlockQ4_1>) blk.m = fp32_to_fp16(-d.scale[pi] * (8.0f + d.zero[pi]));
      const int8_t* q = d.codes.data() + r * d.cols + k * 32;
      for (int j = 0; j < 16; ++j)  // ggml's nibble order: element j low, j + 16 high
        blk.qs[j] = static_cast<uint8_t>((q[j] + 8) | ((q[j + 16] + 8) << 4));
      std::memcpy(b.data() + static_cast<size_t>(r * nb + k) * sizeof blk, &blk, sizeof blk);
    }
  return owned_tensor(store, std::move(b), type, d.rows, d.cols);
}

Tensor to_f32(const Decoded& d, std::vector<std::vector<uint8_t>>& store) {
  std::vector<uint8_t> b(static_cast<size_t>(d.rows * d.cols) * 4);
  auto* out = reinterpret_cast<float*>(b.data());
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t c = 0; c < d.cols; ++c) {
      const auto pi = static_cast<size_t>(param_index(d, r, c));
      out[r * d.cols + c] = (static_cast<float>(d.codes[static_cast<size_t>(r * d.cols + c)]) - d.zero[pi]) * d.scale[pi];
    }
  return owned_tensor(store, std::move(b), DType::f32, d.rows, d.cols);
}

}  // namespace

std::optional<CtQuantConfig> ct_quant_config(const json& config, const std::string& path) {
  const auto it = config.find("quantization_config");
  if (it == config.end() || !it->is_object()) return std::nullopt;
  const json& q = *it;
  if (q.value("quant_method", std::string()) != "compressed-tensors") return std::nullopt;
  const std::string where = path + ": quantization_config";
  const json& groups = member(q, "config_groups", where);
  if (!groups.is_object() || groups.size() != 1)
    fail(ErrorKind::unsupported, "{}: {} config groups; loom reads compressed-tensors models with one", where,
         groups.is_object() ? groups.size() : 0);
  const std::string gw = where + ".config_groups." + groups.begin().key();
  const json& g = groups.begin().value();
  const json& w = member(g, "weights", gw);
  CtQuantConfig c;
  c.format = g.contains("format") && g["format"].is_string() ? g["format"].get<std::string>()
                                                              : q.value("format", std::string());
  if (c.format != "int-quantized" && c.format != "naive-quantized" && c.format != "pack-quantized")
    fail(ErrorKind::unsupported, "{}: format '{}' is not supported (int-quantized, naive-quantized, pack-quantized are)",
         where, c.format);
  if (w.value("type", std::string("int")) != "int")
    fail(ErrorKind::unsupported, "{}.weights: type '{}' is not supported (int is)", gw, w.value("type", std::string()));
  c.bits = w.value("num_bits", 8);
  if (c.bits != 8 && c.bits != 4)
    fail(ErrorKind::unsupported, "{}.weights: {} bits are not supported (4 and 8 are)", gw, c.bits);
  if ((c.bits == 4) != (c.format == "pack-quantized"))
    fail(ErrorKind::unsupported, "{}: {}-bit weights in format '{}' are not supported", gw, c.bits, c.format);
  c.symmetric = w.value("symmetric", true);
  c.strategy = w.value("strategy", std::string("tensor"));
  if (c.strategy != "channel" && c.strategy != "tensor" && c.strategy != "group")
    fail(ErrorKind::unsupported, "{}.weights: strategy '{}' is not supported (channel, tensor, group are)", gw,
         c.strategy);
  if (c.strategy == "group") c.group = w.value("group_size", int64_t{0});
  if (w.contains("actorder") && !w["actorder"].is_null() && w["actorder"] != false)
    fail(ErrorKind::unsupported, "{}.weights: actorder (GPTQ activation ordering with g_idx) is not supported", gw);
  if (g.contains("input_activations") && !g["input_activations"].is_null()) {
    const json& a = g["input_activations"];
    if (a.value("num_bits", 8) != 8 || a.value("type", std::string("int")) != "int" || !a.value("dynamic", false) ||
        a.value("strategy", std::string()) != "token")
      fail(ErrorKind::unsupported,
           "{}.input_activations: only dynamic per-token int8 activations are supported (static scales are not)", gw);
    c.dynamic_activations = true;
  }
  if (q.contains("sparsity_config") && q["sparsity_config"].is_object() && !q["sparsity_config"].empty() &&
      q["sparsity_config"].value("format", std::string("dense")) != "dense")
    fail(ErrorKind::unsupported, "{}: sparse compressed-tensors models are not supported", where);
  return c;
}

std::map<std::string, Tensor, std::less<>> load_ct_weights(const HfFolder& hf, const CtQuantConfig& qc,
                                                          std::vector<std::vector<uint8_t>>& store) {
  std::map<std::string, Tensor, std::less<>> out;
  const std::string suffix = ".weight_scale";
  for (const std::string& name : hf.tensor_names()) {
    if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string m = name.substr(0, name.size() - suffix.size());
    const Decoded d = decode(hf, qc, m, hf.dir());
    Tensor t;
    if (qc.bits == 8 && qc.strategy != "group") t = to_i8_ch(d, store);
    else if (d.cols % 32 != 0 || (qc.strategy == "group" && qc.group % 32 != 0)) t = to_f32(d, store);
    else if (qc.bits == 8) t = qc.symmetric ? to_q8_0(d, store) : to_f32(d, store);
    else if (qc.symmetric) t = to_q4<BlockQ4_0>(d, DType::q4_0, store);
    else t = to_q4<BlockQ4_1>(d, DType::q4_1, store);
    out.emplace(m + ".weight", t);
  }
  if (out.empty())
    fail(ErrorKind::invalid_input, "{}: config.json has a compressed-tensors quantization_config, but no tensor has a "
         "weight_scale", hf.dir());
  return out;
}

}  // namespace loom
