// What lora_rows.cpp calls in lora_rows_avx512f.cpp (its AVX-512 loops over a
// bf16 or int8 B and its columns-in-lanes loop over a 4-bit B; the same bits as
// its AVX2 loops).
#pragma once

#include <cstdint>

namespace loom::detail {

// y[0, w) += B u for one row u of a bf16 B's transposed block bt (kernels/lora_b16.h):
// bt[j * ld + n] = B[n][j], ld (>= w, a multiple of 8) columns a rank row.
void add_bt16_times_u_avx512(const uint16_t* bt, int64_t ld, int64_t r, const float* u, float* y, int64_t w);
// The same for an int8 B's block of codes (kernels/lora_i8.h), u already times its scales.
void add_bt8_times_u_avx512(const int8_t* bt, int64_t ld, int64_t r, const float* u, float* y, int64_t w);

// s[i][j] = dot(x[i], A_j) over n columns, nr x rows and na rows of 4-bit A
// that codes[j] (the row's first byte) and scales[j] (its first group's scale)
// point at, n and the group a multiple of 8, (nr, na) one of lora_rows.cpp's
// tiles ((1, 8), (2, 4), (3, 4)): two factor rows a zmm, each half the AVX2
// tile's lane sums and reduction on the same values (dot_tile), so its bits.
void dot_rows_int4_avx512(int nr, int na, const float* const* x, const uint8_t* const* codes,
                          const float* const* scales, int64_t n, int64_t group, float* s);

// y[c0, c1) += B u for one row u of a 4-bit B (kernels/int4_rows.h) of rank 8
// or 16 with one scale per row of B (the server's layout): columns in the lanes
// straight from the codes, the same sums as the transposed AVX2 loop on the
// dequantized values.
void add_b4_times_u_avx512(const uint8_t* codes, const float* scales, int64_t r, const float* u, float* y,
                           int64_t c0, int64_t c1);

}  // namespace loom::detail
