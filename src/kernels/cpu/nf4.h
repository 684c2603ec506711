// NF4 weights on the CPU (kernels/ref/nf4_ref.h defines the format and the
// arithmetic): row dequantization and the matmul panels.
//
// Panel block (576 bytes per 64 columns, 16 rows): the rows' f32 absmax d[16]
// @0, then 32 slots of 16 bytes @64: byte r of slot j = qs[j] of row r (element
// 2j of the row in the high nibble, 2j + 1 in the low one). A kernel widens a
// slot to 16 int32 lanes and looks the codes up in the 16-entry table
// (vpermps on AVX-512 with the nibble as index; two 8-entry permutes and a
// blend on AVX2), so the weights become exact f32 code values; per block
//   s = 0; for k: s = fma(code_k, x_k, s);  acc = fma(s, d, acc)
// (matmul_nf4_ref), with f32 activations.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom::cpu {

struct KernelArgs;

constexpr size_t kNf4PanelBlockBytes = 576;

// Bit-identical to dequantize_row_nf4_ref.
void dequantize_row_nf4(const void* src, float* dst, int64_t n);

// Row r (< 16) of a panel: its nf4 blocks of K columns into the panel blocks.
void pack_nf4_row(const uint8_t* row, int r, int64_t K, uint8_t* panel);

void nf4_panel_kernel_avx2(const KernelArgs& a);
void nf4_panel_kernel_avx512(const KernelArgs& a);

}  // namespace loom::cpu
