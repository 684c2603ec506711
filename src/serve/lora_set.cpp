// Shape checks of ServeAdapter views (see lora_set.h).
#include "serve/lora_set.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"

namespace loom {

ServeAdapter ServeAdapter::empty(const ModelConfig& config, float scale) {
  ServeAdapter a;
  a.scale = scale;
  a.pairs.resize(static_cast<size_t>(config.n_layers * kLoraTargetCount));
  return a;
}

int64_t ServeAdapter::max_rank() const {
  int64_t r = 0;
  for (const ServeLoraPair& p : pairs)
    if (p.present()) r = std::max(r, p.rank());
  return r;
}

size_t ServeAdapter::factor_bytes() const {
  size_t n = 0;
  for (const ServeLoraPair& p : pairs) {
    if (!p.present()) continue;
    const auto a = static_cast<size_t>(p.rank() * p.a.dim(1)), b = static_cast<size_t>(p.rank() * p.b.dim(0));
    if (p.int8())  // codes and scales (kernels/lora_i8.h)
      n += lora_a8_bytes(p.rank(), p.a.dim(1)) + lora_b8_bytes(p.b.dim(0), p.rank());
    else if (p.bf16())  // B padded to a multiple of 8 rows (kernels/lora_b16.h)
      n += (a + static_cast<size_t>(lora_b16_elements(p.b.dim(0), p.rank()))) * sizeof(uint16_t);
    else if (p.quantized())  // codes, and an f32 scale per group
      n += (a + b) / 2 +
           (a / static_cast<size_t>(p.a4.group) + b / static_cast<size_t>(p.b4.group)) * sizeof(float);
    else
      n += (a + b) * sizeof(float);
  }
  return n;
}

void ServeAdapter::validate(const ModelConfig& config, std::string_view what) const {
  if (pairs.size() != static_cast<size_t>(config.n_layers * kLoraTargetCount))
    fail(ErrorKind::invalid_input, "{}: {} adapter slots, the model needs {} layers x {} targets", what,
         pairs.size(), config.n_layers, kLoraTargetCount);
  for (int64_t l = 0; l < config.n_layers; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const ServeLoraPair& p = pair(l, t);
      if (!p.present()) continue;
      const char* name = lora_target_peft_name(t);
      const int64_t in = lora_target_in(config, t), out = lora_target_out(config, t);
      if (p.a.dtype != DType::f32 || p.b.dtype != DType::f32 ||
          (!p.quantized() && !p.bf16() && !p.int8() && p.b.data == nullptr))
        fail(ErrorKind::invalid_input, "{}: layer {} {}: lora_A and lora_B must both be f32", what, l, name);
      if (p.a.ndim != 2 || p.b.ndim != 2 || p.a.dim(0) < 1 || p.a.dim(1) != in || p.b.dim(0) != out ||
          p.b.dim(1) != p.a.dim(0))
        fail(ErrorKind::invalid_input, "{}: layer {} {}: lora_A {} and lora_B {} do not fit in={} out={}",
             what, l, name, p.a.shape_string(), p.b.shape_string(), in, out);
    }
}

}  // namespace loom
