// Which instruction set the CPU attention kernels (inference, paged, training)
// run on, chosen at run time.
#pragma once

#include "core/cpu_features.h"

namespace loom {

enum class AttnIsa { avx2, avx512 };

// Whether this CPU can run `isa`'s kernels (AVX-512 needs AVX-512 F alone: the
// f32 kernels use nothing else).
inline bool attention_isa_supported(AttnIsa isa) {
  return isa == AttnIsa::avx2 || cpu_features().has_avx512_f32();
}

// The ISA the plain entry points use: AVX-512 where the CPU has it, unless
// LOOM_CPU=avx2.
inline AttnIsa default_attention_isa() {
  return usable_cpu_features().has_avx512_f32() ? AttnIsa::avx512 : AttnIsa::avx2;
}

}  // namespace loom
