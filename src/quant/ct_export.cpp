#include "quant/ct_export.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "model/hf_export.h"
#include "model/model.h"

namespace loom {
namespace {

// A float as the folder stores it (what a reader will multiply by).
float stored(float x, safetensors::StDType dtype) {
  switch (dtype) {
    case safetensors::StDType::bf16: return bf16_to_fp32(fp32_to_bf16(x));
    case safetensors::StDType::f16: return fp16_to_fp32(fp32_to_fp16(x));
    default: return x;
  }
}

std::vector<int64_t> param_shape(const IntQuantSpec& s, int64_t rows, int64_t cols) {
  if (s.group < 0) return {1};
  if (s.group == 0) return {rows, 1};
  return {rows, cols / s.group};
}

nlohmann::ordered_json quant_args(int bits, bool symmetric, const char* strategy, int64_t group, bool dynamic) {
  nlohmann::ordered_json a;
  a["num_bits"] = bits;
  a["type"] = "int";
  a["symmetric"] = symmetric;
  a["group_size"] = group > 0 ? nlohmann::ordered_json(group) : nlohmann::ordered_json(nullptr);
  a["strategy"] = strategy;
  a["block_structure"] = nullptr;
  a["dynamic"] = dynamic;
  a["actorder"] = nullptr;
  a["scale_dtype"] = nullptr;
  a["zp_dtype"] = symmetric ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json("torch.int8");
  a["observer"] = dynamic ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json("minmax");
  a["observer_kwargs"] = nlohmann::ordered_json::object();
  return a;
}

// Packs 4-bit codes (-8..7, stored + 8) eight to an int32, along the rows of an
// [n_lines, line] matrix read by `code(line, i)`.
std::string pack_int4(int64_t n_lines, int64_t line, const std::function<int8_t(int64_t, int64_t)>& code) {
  const int64_t words = (line + 7) / 8;
  std::string out(static_cast<size_t>(n_lines * words * 4), '\0');
  for (int64_t r = 0; r < n_lines; ++r)
    for (int64_t w = 0; w < words; ++w) {
      uint32_t v = 0;
      for (int64_t k = 0; k < 8 && w * 8 + k < line; ++k)
        v |= static_cast<uint32_t>(code(r, w * 8 + k) + 8) << (4 * k);
      std::memcpy(out.data() + 4 * (r * words + w), &v, 4);
    }
  return out;
}

void add_linear(const std::string& m, std::vector<float>& w, int64_t rows, int64_t cols,
                const CompressedTensorsScheme& scheme, safetensors::StDType dtype, safetensors::Writer& st,
                const std::function<void(const LinearQuantReport&)>& report) {
  const IntQuantSpec& spec = scheme.weights;
  check_int_quant_spec(spec, cols, m);
  IntQuantParams p = choose_int_quant_params(w.data(), rows, cols, spec);
  for (float& s : p.scale) s = stored(s, dtype);
  const std::vector<int8_t> q = int_quantize(w.data(), rows, cols, spec, p);
  const std::vector<int64_t> pshape = param_shape(spec, rows, cols);
  st.add(m + ".weight_scale", p.scale, pshape, dtype);
  if (spec.bits == 8) {
    st.add_raw(m + ".weight", safetensors::StDType::i8, {rows, cols},
               std::string_view(reinterpret_cast<const char*>(q.data()), q.size()));
    if (!spec.symmetric) {
      std::vector<int8_t> z(p.zero.begin(), p.zero.end());
      st.add_raw(m + ".weight_zero_point", safetensors::StDType::i8, pshape,
                 std::string_view(reinterpret_cast<const char*>(z.data()), z.size()));
    }
  } else {
    st.add_raw(m + ".weight_packed", safetensors::StDType::i32, {rows, (cols + 7) / 8},
               pack_int4(rows, cols, [&](int64_t r, int64_t c) { return q[static_cast<size_t>(r * cols + c)]; }));
    const int64_t shape[2] = {rows, cols};
    st.add_raw(m + ".weight_shape", safetensors::StDType::i64, {2},
               std::string_view(reinterpret_cast<const char*>(shape), sizeof shape));
    if (!spec.symmetric) {
      const int64_t groups = pshape.back();
      // Zero points are packed down the rows: line = a group column, element = a row.
      st.add_raw(m + ".weight_zero_point", safetensors::StDType::i32, {(rows + 7) / 8, groups},
                 [&] {
                   std::string t = pack_int4(groups, rows, [&](int64_t g, int64_t r) {
                     return static_cast<int8_t>(p.zero[static_cast<size_t>(r * groups + g)]);
                   });
                   // pack_int4 wrote [groups, words]; the tensor is [words, groups].
                   const int64_t words = (rows + 7) / 8;
                   std::string tr(t.size(), '\0');
                   for (int64_t g = 0; g < groups; ++g)
                     for (int64_t wd = 0; wd < words; ++wd)
                       std::memcpy(tr.data() + 4 * (wd * groups + g), t.data() + 4 * (g * words + wd), 4);
                   return tr;
                 }());
    }
  }
  if (report) {
    const std::vector<float> back = int_dequantize(q.data(), rows, cols, spec, p);
    double err = 0, ref = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      err += (static_cast<double>(back[i]) - w[i]) * (static_cast<double>(back[i]) - w[i]);
      ref += static_cast<double>(w[i]) * w[i];
    }
    report({m, ref > 0 ? std::sqrt(err / ref) : 0.0});
  }
}

}  // namespace

nlohmann::ordered_json compressed_tensors_config(const CompressedTensorsScheme& s) {
  const IntQuantSpec& w = s.weights;
  const char* strategy = w.group < 0 ? "tensor" : w.group == 0 ? "channel" : "group";
  nlohmann::ordered_json group;
  group["targets"] = {"Linear"};
  group["weights"] = quant_args(w.bits, w.symmetric, strategy, w.group, false);
  group["input_activations"] = s.int8_dynamic_activations ? quant_args(8, true, "token", 0, true)
                                                          : nlohmann::ordered_json(nullptr);
  group["output_activations"] = nullptr;
  group["format"] = nullptr;
  nlohmann::ordered_json c;
  c["config_groups"] = {{"group_0", group}};
  c["quant_method"] = "compressed-tensors";
  c["kv_cache_scheme"] = nullptr;
  c["format"] = w.bits == 8 ? "int-quantized" : "pack-quantized";
  c["quantization_status"] = "compressed";
  c["global_compression_ratio"] = nullptr;
  c["ignore"] = {"lm_head"};
  return c;
}

void write_compressed_tensors_folder(const Model& model, const std::string& out_dir, safetensors::StDType dtype,
                                     const CompressedTensorsScheme& scheme, const FolderWriteOptions& opt,
                                     const std::function<void(const LinearQuantReport&)>& report) {
  if (scheme.weights.bits == 4 && scheme.weights.group == -1)
    fail(ErrorKind::invalid_input, "INT4 weights are quantized per channel or per group, not per tensor");
  HfExportHooks hooks;
  hooks.quantization_config = compressed_tensors_config(scheme);
  hooks.linear = [&](const std::string& m, std::vector<float>& w, int64_t rows, int64_t cols,
                     safetensors::Writer& st) { add_linear(m, w, rows, cols, scheme, dtype, st, report); };
  write_hf_folder(model, out_dir, dtype, opt, hooks);
}

}  // namespace loom
