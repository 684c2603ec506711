// AVX-512 (F/BW/VL/VNNI) panel kernels: the dispatch over the kernel families of
// panel_kernels_avx512_impl.h.
#include "kernels/cpu/panel_kernels_avx512_impl.h"

namespace loom::cpu {

UnpackedPanels unpacked_panels_avx512(DType type, int64_t K) {
  return unpacked_panels_of<Q32Packed, Q45KPacked, K16Packed, FloatImpl>(type, K);
}

void panel_kernel_avx512(DType type, const KernelArgs& a) {
  if (type == DType::nf4) return nf4_panel_kernel_avx512(a);
  if (type == DType::i8_ch) return i8ch_panel_kernel_avx512(a);
  if (a.vbmi && has_vbmi_kernel(type)) return panel_kernel_avx512_vbmi(type, a);
  if (type == DType::bf16) {
    if (a.bf16_pairs) return drive_tiles<Bf16DotImpl>(a);
    const DenormalsAreZero daz;
    return drive_tiles<Bf16EmuImpl>(a);
  }
  run_panel_kernel<Q32Packed, Q45KPacked, K16Packed, FloatImpl>(type, a);
}

}  // namespace loom::cpu
