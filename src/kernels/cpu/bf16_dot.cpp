#include "kernels/cpu/bf16_dot.h"

#include <cstdio>
#include <cstdlib>

#include "core/cpu_features.h"

namespace loom::cpu {

std::optional<Bf16Dot> choose_bf16_dot(std::string_view env, const Bf16DotTiming& t) {
  if (env == "vdpbf16ps") return Bf16Dot::vdpbf16ps;
  if (env == "fma") return Bf16Dot::fma;
  if (!env.empty()) return std::nullopt;
  // One vdpbf16ps does two FMAs' products: it wins where it is not slower than two.
  return t.vdpbf16ps_s <= 2.0 * t.fma_s ? Bf16Dot::vdpbf16ps : Bf16Dot::fma;
}

Bf16Dot bf16_dot() {
  static const Bf16Dot choice = [] {
    if (!usable_cpu_features().avx512bf16) return Bf16Dot::fma;
    const char* env = std::getenv("LOOM_BF16_DOT");
    const std::string_view e = env != nullptr ? env : "";
    if (!e.empty()) {
      if (const auto forced = choose_bf16_dot(e, {})) return *forced;
      std::fprintf(stderr, "loom: warning: LOOM_BF16_DOT=%s is not one of vdpbf16ps, fma; ignored\n", env);
    }
    return *choose_bf16_dot("", time_bf16_dot_instructions());
  }();
  return choice;
}

}  // namespace loom::cpu
