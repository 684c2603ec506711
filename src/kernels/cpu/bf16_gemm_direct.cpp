// Driver of the direct bf16 input-gradient product (bf16_gemm_direct.h): packs dy
// into tiles once, splits the output columns over threads and runs the AMX kernel.
#include "kernels/cpu/bf16_gemm_direct.h"

#include <algorithm>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/matmul.h"

namespace loom::cpu {
namespace {

// The reduction runs in chunks of at most kChunkSteps steps, so that a panel
// pair's dequantized chunk (2 x 16 KB) stays in L1 while every t-tile of the
// group uses it (the tile loads, not TDPBF16PS, bound these products).
constexpr int64_t kChunkSteps = 16;
// A t-group's dy chunk plus its partial sums, kept in L2 across the panel pairs:
// the larger the group, the fewer times each weight is dequantized (once per group).
constexpr int64_t kGroupBytes = 1536 * 1024;

}  // namespace

bool bf16_direct_type(DType t, DirectType* out) {
  DirectType d;
  switch (t) {
    case DType::q4_0: d = DirectType::q4_0; break;
    case DType::q4_1: d = DirectType::q4_1; break;
    case DType::q5_0: d = DirectType::q5_0; break;
    case DType::q5_1: d = DirectType::q5_1; break;
    case DType::q8_0: d = DirectType::q8_0; break;
    case DType::f16: d = DirectType::f16; break;
    case DType::bf16: d = DirectType::bf16; break;
    case DType::f32: d = DirectType::f32; break;
    default: return false;
  }
  if (out != nullptr) *out = d;
  return true;
}

void bf16_gemm_direct(ThreadPool& pool, const Tensor& W, const float* dy, int64_t ldy, float* dx, int64_t T,
                      bool accumulate, MatmulScratch& scratch) {
  if (!bf16_kernel_available(Bf16Kernel::amx))
    fail(ErrorKind::unsupported, "bf16 direct input gradients need AMX-BF16, which this machine lacks");
  DirectType type;
  if (!bf16_direct_type(W.dtype, &type))
    fail(ErrorKind::unsupported, "bf16 direct input gradients: weight type {} has no tile dequantizer",
         dtype_name(W.dtype));
  const int64_t N = W.rows(), K = W.cols();
  if (ldy < N) fail(ErrorKind::invalid_input, "bf16 direct input gradients: dy stride {} < N = {}", ldy, N);
  if (K % dtype_block_size(W.dtype) != 0)
    fail(ErrorKind::invalid_input, "bf16 direct input gradients: width {} is not whole {} blocks", K,
         dtype_name(W.dtype));
  if (T <= 0 || K <= 0) return;
  if (N == 0) {  // an empty sum
    if (!accumulate)
      for (int64_t t = 0; t < T; ++t) std::fill_n(dx + t * K, K, 0.0f);
    return;
  }
  const int64_t ns = (N + kBf16Step - 1) / kBf16Step, ntt = (T + 15) / 16, np = (K + 15) / 16;
  const int64_t npp = (np + 1) / 2;
  const int nt = pool.size();
  const int64_t gk = std::min<int64_t>(nt, npp);
  const size_t tb = kBf16TileBytes;

  Bf16DirectWork base;
  base.n_steps = ns;
  base.w = static_cast<const uint8_t*>(W.data);
  base.w_row_bytes = W.row_bytes();
  base.type = type;
  base.N = N;
  base.K = K;
  base.T = T;
  base.dx = dx;
  base.ldx = K;
  base.accumulate = accumulate;
  const int64_t n_chunks = (ns + kChunkSteps - 1) / kChunkSteps;
  base.chunk = (ns + n_chunks - 1) / n_chunks;
  const int64_t max_panels = 2 * ((npp + gk - 1) / gk);
  const int64_t per_tile = (base.chunk + (n_chunks > 1 ? max_panels : 0)) * static_cast<int64_t>(tb);
  base.tgroup = std::max<int64_t>(2, kGroupBytes / per_tile / 2 * 2);
  // Every thread reads all of dy: pack it once, in parallel.
  uint8_t* a = scratch.get(0, static_cast<size_t>(ntt * ns) * tb);
  pool.parallel_for(ntt, [&](int64_t t0, int64_t t1) {
    pack_dy_tiles_avx512(dy, ldy, N, T, t0, t1, ns, a + static_cast<size_t>(t0 * ns) * tb);
  });
  base.a = a;
  // Per-thread buffers, grown here (get() is not for concurrent use).
  for (int64_t i = 0; i < gk; ++i) {
    scratch.get(2 + 2 * static_cast<size_t>(i), 2 * static_cast<size_t>(base.chunk) * tb);
    if (n_chunks > 1)
      scratch.get(3 + 2 * static_cast<size_t>(i), static_cast<size_t>(std::min(base.tgroup, ntt) * max_panels) * tb);
  }
  auto work = [&](int ti, int) {
    if (ti >= gk) return;
    Bf16DirectWork w = base;
    w.p0 = std::min(np, 2 * (npp * ti / gk));
    w.p1 = std::min(np, 2 * (npp * (ti + 1) / gk));
    if (w.p0 >= w.p1) return;
    w.bbuf = scratch.ptr(2 + 2 * static_cast<size_t>(ti));
    if (n_chunks > 1) w.cbuf = reinterpret_cast<float*>(scratch.ptr(3 + 2 * static_cast<size_t>(ti)));
    bf16_direct_work_amx(w);
  };
  if (nt == 1)
    work(0, 1);
  else
    pool.run(work);
}

}  // namespace loom::cpu
