// What lora_rows.cpp calls in lora_rows_avx512f.cpp (its AVX-512 loop over a
// bf16 B; the same bits as its AVX2 loop).
#pragma once

#include <cstdint>

namespace loom::detail {

// y[0, w) += B u for one row u of a bf16 B's transposed block bt (kernels/lora_b16.h):
// bt[j * ld + n] = B[n][j], ld (>= w, a multiple of 8) columns a rank row.
void add_bt16_times_u_avx512(const uint16_t* bt, int64_t ld, int64_t r, const float* u, float* y, int64_t w);

}  // namespace loom::detail
