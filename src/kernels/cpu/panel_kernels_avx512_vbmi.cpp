// The AVX-512 kernels of the types whose panels unpack faster with AVX512-VBMI's
// byte permutes (has_vbmi_kernel): the same families as panel_kernels_avx512.cpp,
// this file built with -mavx512vbmi (Ice Lake and later, AMD Zen 4; not Skylake-X
// or Cascade Lake, which run the other file's).
#include "kernels/cpu/panel_kernels_avx512_impl.h"

namespace loom::cpu {

void panel_kernel_avx512_vbmi(DType type, const KernelArgs& a) {
  switch (type) {
    case DType::iq2_xxs:
      return drive_tiles<K16Impl<DType::iq2_xxs>>(a);
    case DType::iq2_xs:
      return drive_tiles<K16Impl<DType::iq2_xs>>(a);
    case DType::iq2_s:
      return drive_tiles<K16Impl<DType::iq2_s>>(a);
    case DType::iq3_xxs:
      return drive_tiles<K16Impl<DType::iq3_xxs>>(a);
    case DType::iq3_s:
      return drive_tiles<K16Impl<DType::iq3_s>>(a);
    default:
      __builtin_trap();  // panel_kernel_avx512 passes has_vbmi_kernel types only
  }
}

}  // namespace loom::cpu
