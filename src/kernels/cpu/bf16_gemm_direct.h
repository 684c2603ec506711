// bf16 input-gradient products dx [T, K] (+)= bf16(dy) [T, N] bf16(W) [N, K]
// that read the frozen weight W in its own (GGUF) type and dequantize it on the
// fly into AMX B tiles: no transposed copy of W exists. Driver:
// bf16_gemm_direct.cpp; AMX kernel and AVX-512 dequantizers:
// bf16_gemm_direct_amx_avx512.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

// Forward declarations only: the AMX file must not instantiate shared inline code.
namespace loom {
class ThreadPool;
class MatmulScratch;
struct Tensor;
enum class DType : uint32_t;
}  // namespace loom

namespace loom::cpu {

// The weight types the dequantizers read (others use the copy path).
enum class DirectType : int { q4_0, q4_1, q5_0, q5_1, q8_0, f16, bf16, f32 };

// AMX's B operand of C[t, k] += sum_n dy[t, n] W[n, k] is a tile of 16 pair rows
// (n = n0 + 2j, n0 + 2j + 1) x 16 lanes (k = k0 + r) x 2 bf16: consecutive ROWS
// of W interleaved, i.e. the bf16_pairs layout of bf16_gemm.h without any
// transposition. One thread's share: panels (16 columns k) [p0, p1), all rows t.
struct Bf16DirectWork {
  const uint8_t* a = nullptr;  // all dy tiles: (tt, s) at a + (tt * n_steps + s) KB (bf16_gemm.h layout)
  int64_t n_steps = 0;
  const uint8_t* w = nullptr;  // W row 0; rows w_row_bytes apart
  size_t w_row_bytes = 0;
  DirectType type = DirectType::f32;
  int64_t N = 0, K = 0, T = 0;
  int64_t p0 = 0, p1 = 0;  // panels (p0 even)
  int64_t chunk = 0;       // steps per chunk of the n reduction (partial sums rest exactly in cbuf)
  int64_t tgroup = 0;      // t-tiles per group (a group's dy chunk stays in L2 across panels)
  uint8_t* bbuf = nullptr;  // 2 panels x chunk steps of dequantized B tiles (this thread's)
  float* cbuf = nullptr;    // partial sums: tile (tt - g0, p - p0) at cbuf + ((tt - g0) * (p1 - p0) + p - p0) * 256
  float* dx = nullptr;
  int64_t ldx = 0;
  bool accumulate = false;
};

// Runs one thread's work with AMX-BF16 (the caller checked availability).
void bf16_direct_work_amx(const Bf16DirectWork& w);

// Dequantizes W rows [n0, n0 + 32) (zeros past N) x columns [k0, k0 + 32) (zeros
// past K; k0 % 32 == 0) into the B tiles of panels k0 / 16 (dst0) and k0 / 16 + 1
// (dst1, may be nullptr), each value rounded as round_to_bf16. Exposed for tests.
void bf16_direct_dequant_tiles(const Bf16DirectWork& w, int64_t n0, int64_t k0, uint8_t* dst0, uint8_t* dst1);

// Whether W's dtype has a dequantizer here (and, for block types, K is whole blocks).
bool bf16_direct_type(DType t, DirectType* out);

// The product itself; W {N, K} of a type bf16_direct_type accepts, dy rows ldy
// floats apart, dx rows K floats apart. Needs AMX (else loom::Error(unsupported)). Each dx element
// is one chain of TDPBF16PS over n = 0, 32, ... in order, whatever the thread
// count. Scratch slots: 0 dy tiles, 2 + 2i / 3 + 2i thread i's B / partial sums.
void bf16_gemm_direct(ThreadPool& pool, const Tensor& W, const float* dy, int64_t ldy, float* dx, int64_t T,
                      bool accumulate, MatmulScratch& scratch);

}  // namespace loom::cpu
