// Merging a PEFT LoRA adapter into f32 copies of the adapted matrices (see adapter_merge.h).
#include "model/adapter_merge.h"

#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "model/gguf_lora.h"
#include "model/lora.h"
#include "model/weights.h"

namespace loom {
namespace {

std::vector<uint8_t> zero_mask(const std::vector<float>& m) {
  std::vector<uint8_t> z(m.size());
  for (size_t i = 0; i < m.size(); ++i) z[i] = m[i] == 0.0f;
  return z;
}

}  // namespace

int64_t merge_lora_rows(float* w, const float* b, const float* a, int64_t out, int64_t r, int64_t in, double scale) {
  std::vector<double> row(static_cast<size_t>(in));
  int64_t bad = -1;
  for (int64_t o = 0; o < out; ++o) {
    std::fill(row.begin(), row.end(), 0.0);
    for (int64_t k = 0; k < r; ++k) {
      const double bk = b[o * r + k];
      const float* ak = a + k * in;
      for (int64_t i = 0; i < in; ++i) row[static_cast<size_t>(i)] += bk * ak[i];
    }
    float* dst = w + o * in;
    for (int64_t i = 0; i < in; ++i) {
      dst[i] = static_cast<float>(dst[i] + scale * row[static_cast<size_t>(i)]);
      if (bad < 0 && !std::isfinite(dst[i])) bad = o;
    }
  }
  return bad;
}

void merge_adapter(ModelWeights& w, const ModelConfig& c, const peft::AdapterTensors& a, bool permute_qk,
                   std::string_view what) {
  for (const auto& [key, pair] : a.pairs)  // named per tensor: check_adapter_fits only counts layers
    if (key.first >= c.n_layers)
      fail(ErrorKind::invalid_input, "{}: tensor '{}' is for layer {}, the model has {} layers", what,
           peft::tensor_name(key.first, key.second, false), key.first, c.n_layers);
  peft::check_adapter_fits(a, c, what);
  const double scale = a.config.scaling();
  for (const auto& [key, pair] : a.pairs) {
    const auto [layer, target] = key;
    LOOM_ASSERT(layer >= 0 && static_cast<size_t>(layer) < w.layers.size());
    LayerWeights& L = w.layers[static_cast<size_t>(layer)];
    Tensor& t = target_matrix(L, target);
    LOOM_ASSERT(t.rows() == pair.out && t.cols() == pair.in);
    const int64_t r = static_cast<int64_t>(pair.a.size()) / pair.in;
    std::vector<float> b = pair.b;
    if (permute_qk && (target == LoraTarget::q || target == LoraTarget::k))
      lora_permute_qk_rows(make_tensor(b.data(), DType::f32, {pair.out, r}),
                           target == LoraTarget::q ? c.n_heads : c.n_kv_heads, c.head_dim, /*hf_to_model=*/true);
    // W' = s W + scale B A: the projection's output scale is folded in, the
    // adapter's product is not scaled by it (llama.cpp's build_lora_mm).
    auto& m = w.owned.emplace_back(matrix_f32(t, L.output_scale(target)));
    L.out_scale[static_cast<size_t>(target)] = 1.0f;
    const std::vector<uint8_t> zeros = c.unstructured_pruning.empty() ? std::vector<uint8_t>{} : zero_mask(m);
    if (const int64_t bad = merge_lora_rows(m.data(), b.data(), pair.a.data(), pair.out, r, pair.in, scale); bad >= 0)
      // e.g. a huge lora_alpha: scale * B A overflows f32
      fail(ErrorKind::invalid_input, "{}: tensor '{}': the merged weight W + {:g} * B A is not finite (row {}); "
           "check lora_alpha ({:g}) and r ({}) in adapter_config.json", what,
           peft::tensor_name(layer, target, false), scale, bad, a.config.lora_alpha, a.config.r);
    // A pruned model keeps its zeros (loom prune; config unstructured_pruning).
    for (size_t i = 0; i < zeros.size(); ++i)
      if (zeros[i]) m[i] = 0.0f;
    t.data = m.data();
    t.dtype = DType::f32;
  }
}

std::function<void(ModelWeights&, const ModelConfig&)> adapter_merge_hook(std::string dir) {
  return [dir = std::move(dir)](ModelWeights& w, const ModelConfig& c) {
    const peft::AdapterTensors a = peft::read_any_adapter(dir, c);  // a PEFT folder or a GGUF LoRA file
    merge_adapter(w, c, a, lora_needs_qk_permutation(c), fmt::format("adapter {}", dir));
  };
}

}  // namespace loom
