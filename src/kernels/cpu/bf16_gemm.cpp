// bf16 input-gradient products: packs W^T and dy into the tile layouts of
// bf16_gemm.h, splits the output over threads and runs the AMX, AVX-512 or AVX2
// kernel; the AVX2 (bf16 -> f32, f32 FMA) kernel lives here too.
#include "kernels/cpu/bf16_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/matmul.h"

namespace loom::cpu {
namespace {

// Reductions of up to kMaxSteps steps (N <= 2048) run in one chunk (no partial
// sums through memory); longer ones in chunks of at most kChunkSteps, so that a
// panel pair's chunk (64 KB) is reused from cache by every t-tile of a group.
constexpr int64_t kMaxSteps = 64, kChunkSteps = 32;
constexpr int64_t kGroupBytes = 384 * 1024;  // dy tiles of a t-group's chunk (kept in L2)

// round_to_bf16 on 8 lanes: x + 0x7fff + bit 16 of x, top half; NaNs keep their
// top half with the quiet bit set; subnormals (exponent 0) keep only the sign.
inline __m256i round8(__m256i x) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i r =
      _mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_and_si256(_mm256_srli_epi32(x, 16), one));
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i sub =
      _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
  const __m256i q = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));  // top half | 0x40
  const __m256i z = _mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_srli_epi32(_mm256_blendv_epi8(_mm256_blendv_epi8(r, q, nan), z, sub), 16);
}

// 32 floats -> 32 bf16 (64 bytes).
inline void round32(const float* x, uint8_t* dst) {
  for (int h = 0; h < 2; ++h) {
    const __m256i a = round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h)));
    const __m256i b = round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h + 8)));
    // packus works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, then put the quarters in order.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * h),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8));
  }
}

// AVX2 kernel: 4 rows x one panel (two ymm of 8 lanes) in registers; per pair
// row, lane value bf16 -> f32 is a shift (even n) or a mask (odd n), then f32 FMA
// over n in order.
struct Avx2Impl {
  static void micro(const Bf16Work& w, int64_t tt, int q, int64_t p, int64_t s0, int64_t s1, bool first,
                    bool last) {
    float* ctile = w.cbuf ? c_tile(w, tt, p) : nullptr;
    __m256 acc[4][2];
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h)
        acc[c][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(ctile + (q + c) * 16 + 8 * h);
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t s = s0; s < s1; ++s) {
      const uint8_t* bs = b_tile(w, p, s);
      const uint8_t* as = a_tile(w, tt, s) + q * 64;
      for (int j = 0; j < 16; ++j) {
        __m256 lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + j * 64 + 32 * h));
          lo[h] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
          hi[h] = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
        }
        for (int c = 0; c < 4; ++c) {
          int32_t pair;
          std::memcpy(&pair, as + c * 64 + j * 4, 4);
          const __m256i d = _mm256_set1_epi32(pair);
          const __m256 dlo = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
          const __m256 dhi = _mm256_castsi256_ps(_mm256_and_si256(d, hi_mask));
          for (int h = 0; h < 2; ++h) {
            acc[c][h] = _mm256_fmadd_ps(lo[h], dlo, acc[c][h]);
            acc[c][h] = _mm256_fmadd_ps(hi[h], dhi, acc[c][h]);
          }
        }
      }
    }
    if (!last) {
      for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(ctile + (q + c) * 16 + 8 * h, acc[c][h]);
      return;
    }
    const int64_t k0 = 16 * p, cols = std::min<int64_t>(16, w.K - k0);
    for (int c = 0; c < 4; ++c) {
      const int64_t t = 16 * tt + q + c;
      if (t >= w.T) break;
      float* o = w.dx + t * w.ldx + k0;
      alignas(32) float row[16];
      _mm256_store_ps(row, acc[c][0]);
      _mm256_store_ps(row + 8, acc[c][1]);
      for (int64_t k = 0; k < cols; ++k) o[k] = w.accumulate ? o[k] + row[k] : row[k];
    }
  }

  static void block(const Bf16Work& w, int64_t tt0, int64_t tt1, int64_t p0, int64_t p1, int64_t s0,
                    int64_t s1, bool first, bool last) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t tt = tt0; tt < tt1; ++tt)
        for (int q = 0; q < 16 && 16 * tt + q < w.T; q += 4) micro(w, tt, q, p, s0, s1, first, last);
  }
};

}  // namespace

uint16_t round_to_bf16(float x) {
  const uint32_t u = float_to_bits(x);
  return (u & 0x7f800000u) == 0 ? static_cast<uint16_t>(u >> 16 & 0x8000u) : fp32_to_bf16(x);
}

void round_to_bf16(const float* x, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) round32(x + i, reinterpret_cast<uint8_t*>(dst + i));
  for (; i < n; ++i) dst[i] = round_to_bf16(x[i]);
}

void round_to_bf16_as_f32(const float* x, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i h = round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(h, 16));
  }
  for (; i < n; ++i) dst[i] = bf16_to_fp32(round_to_bf16(x[i]));
}

void pack_dy_tiles_avx2(const float* dy, int64_t ldy, int64_t N, int64_t T, int64_t tt0, int64_t tt1,
                        int64_t n_steps, uint8_t* dst) {
  for (int64_t tt = tt0; tt < tt1; ++tt)
    for (int64_t s = 0; s < n_steps; ++s) {
      uint8_t* tile = dst + static_cast<size_t>((tt - tt0) * n_steps + s) * kBf16TileBytes;
      const int64_t n0 = s * kBf16Step, len = std::min(kBf16Step, N - n0);
      for (int r = 0; r < 16; ++r) {
        const int64_t t = 16 * tt + r;
        uint8_t* row = tile + r * 64;
        if (t >= T) {
          std::memset(row, 0, 64);
        } else if (len == kBf16Step) {
          round32(dy + t * ldy + n0, row);
        } else {
          auto* h = reinterpret_cast<uint16_t*>(row);
          for (int64_t i = 0; i < kBf16Step; ++i) h[i] = i < len ? round_to_bf16(dy[t * ldy + n0 + i]) : 0;
        }
      }
    }
}

void bf16_work_avx2(const Bf16Work& w) { drive_bf16<Avx2Impl>(w); }

void store_bf16_pairs(PackedWeight& Wt, int64_t k0, int64_t rows, const float* wt, int64_t ld) {
  LOOM_ASSERT(Wt.layout() == PackedLayout::bf16_pairs && k0 % 16 == 0);
  const int64_t N = Wt.cols(), ns = bf16_steps(N);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    uint8_t* pan = Wt.mutable_panel((k0 + r0) / 16);
    const int64_t lanes = std::min<int64_t>(16, rows - r0);
    std::memset(pan, 0, Wt.panel_bytes());
    for (int64_t r = 0; r < lanes; ++r) {
      const float* src = wt + (r0 + r) * ld;
      for (int64_t s = 0; s < ns; ++s) {
        auto* tile = reinterpret_cast<uint16_t*>(pan + static_cast<size_t>(s) * kBf16TileBytes);
        const int64_t n0 = s * kBf16Step, len = std::min(kBf16Step, N - n0);
        uint16_t v[kBf16Step];
        round_to_bf16(src + n0, v, len);
        for (int64_t i = 0; i < len; ++i) tile[(i / 2) * 32 + r * 2 + (i & 1)] = v[i];
      }
    }
  }
}

Bf16Kernel resolve_bf16_kernel(Bf16Kernel k) {
  if (k == Bf16Kernel::automatic) return automatic_bf16_kernel(usable_cpu_features());
  if (!bf16_kernel_available(k))
    fail(ErrorKind::unsupported, "bf16 input gradients: the {} kernel needs CPU features this machine lacks",
         k == Bf16Kernel::amx ? "AMX-BF16" : "AVX512-BF16");
  return k;
}

void bf16_gemm(ThreadPool& pool, Bf16Kernel kernel, const PackedWeight& Wt, const float* dy, int64_t ldy,
               float* dx, int64_t T, bool accumulate, MatmulScratch& scratch) {
  LOOM_ASSERT(Wt.layout() == PackedLayout::bf16_pairs);
  const int64_t K = Wt.rows(), N = Wt.cols();
  if (ldy < N) fail(ErrorKind::invalid_input, "linear_backward_input_packed: dy stride {} < N = {}", ldy, N);
  const Bf16Kernel k = resolve_bf16_kernel(kernel);
  if (T <= 0 || K <= 0) return;
  if (N == 0) {  // an empty sum
    if (!accumulate)
      for (int64_t t = 0; t < T; ++t) std::fill_n(dx + t * K, K, 0.0f);
    return;
  }
  const int64_t ns = bf16_steps(N), ntt = (T + 15) / 16, np = Wt.n_panels();
  const int nt = pool.size();
  const int64_t npp = (np + 1) / 2, ntp = (ntt + 1) / 2;
  const size_t tb = kBf16TileBytes;
  const PackDyFn pack = k == Bf16Kernel::avx2 ? pack_dy_tiles_avx2 : pack_dy_tiles_avx512;

  Bf16Work base;
  base.b = Wt.panel(0);
  base.pstride = Wt.panel_bytes();
  base.n_steps = ns;
  base.n_panels = np;
  base.dx = dx;
  base.ldx = K;
  base.T = T;
  base.K = K;
  base.accumulate = accumulate;
  const int64_t n_chunks = ns <= kMaxSteps ? 1 : (ns + kChunkSteps - 1) / kChunkSteps;
  base.chunk = (ns + n_chunks - 1) / n_chunks;
  if (n_chunks > 1) base.cbuf = reinterpret_cast<float*>(scratch.get(1, static_cast<size_t>(ntt * np) * tb));

  // Many rows: threads split them, and each packs its t-groups of dy itself right
  // before use (still in its L2), reading all of W^T per group. Few rows (e.g.
  // the loss projection's 64): threads split the panels, each streaming its own
  // part of W^T, after one parallel pass that packs all of dy. Any split gives
  // the same results.
  const bool split_rows = ntp >= 4 * nt;
  int64_t gk = 1, gt = nt;
  if (split_rows) {
    base.tgroup = std::max<int64_t>(2, kGroupBytes / (ns * static_cast<int64_t>(tb)) / 2 * 2);
    base.dy = dy;
    base.ldy = ldy;
    base.N = N;
    base.pack = pack;
    for (int i = 0; i < nt; ++i)
      scratch.get(2 + static_cast<size_t>(i), static_cast<size_t>(base.tgroup * ns) * tb);
  } else {
    base.tgroup = std::max<int64_t>(2, kGroupBytes / (base.chunk * static_cast<int64_t>(tb)) / 2 * 2);
    uint8_t* a = scratch.get(0, static_cast<size_t>(ntt * ns) * tb);
    pool.parallel_for(ntt, [&](int64_t t0, int64_t t1) {
      pack(dy, ldy, N, T, t0, t1, ns, a + static_cast<size_t>(t0 * ns) * tb);
    });
    base.a = a;
    gk = std::min<int64_t>(nt, npp);
    gt = std::min<int64_t>(nt / gk, ntp);
  }
  void (*run)(const Bf16Work&) = k == Bf16Kernel::amx      ? bf16_work_amx
                                 : k == Bf16Kernel::avx512 ? bf16_work_avx512
                                                           : bf16_work_avx2;
  auto work = [&](int ti, int) {
    if (ti >= gk * gt) return;
    const int64_t ki = ti % gk, tj = ti / gk;
    Bf16Work w = base;
    if (split_rows) w.a = scratch.ptr(2 + static_cast<size_t>(ti));
    w.p0 = std::min(np, 2 * (npp * ki / gk));
    w.p1 = std::min(np, 2 * (npp * (ki + 1) / gk));
    w.tt0 = std::min(ntt, 2 * (ntp * tj / gt));
    w.tt1 = std::min(ntt, 2 * (ntp * (tj + 1) / gt));
    if (w.p0 < w.p1 && w.tt0 < w.tt1) run(w);
  };
  if (nt == 1)
    work(0, 1);
  else
    pool.run(work);
}

}  // namespace loom::cpu

namespace loom {

Bf16Kernel automatic_bf16_kernel(const CpuFeatures& f) {
  if (!f.has_avx512_kernels() || !f.avx512bf16) return Bf16Kernel::avx2;
  return f.amx_tile && f.amx_bf16 ? Bf16Kernel::amx : Bf16Kernel::avx512;
}

bool bf16_kernel_available(Bf16Kernel k) {
  const CpuFeatures& f = cpu_features();
  const bool avx512 = f.has_avx512_kernels() && f.avx512bf16;
  switch (k) {
    case Bf16Kernel::amx:
      return avx512 && f.amx_bf16 && amx_tile_state_granted();
    case Bf16Kernel::avx512:
      return avx512;
    default:
      return true;
  }
}

}  // namespace loom
