#include "kernels/cpu/lora_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/bf16_rows.h"
#include "kernels/cpu/int4_dequant.h"
#include "kernels/cpu/lora_rows_isa.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/prefetch_stream.h"
#include "kernels/cpu/simd_rows.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"

namespace loom {
namespace {

// Columns per unit of the second pass: a bf16 B's column block (lora_b16.h).
constexpr int64_t kLoraCols = kLoraBlockCols;
// Rows of one adapter computed together: by the first pass (each A chunk read
// once for them) and by the second (B's block transposed once for them).
constexpr int kTileRows = 3;
constexpr int kRunRows = 16;
// The second pass transposes B's block when a run has this many rows and the
// rank fits its stack buffer; shorter runs take dot8 row by row.
constexpr int kMinTransposedRun = 4;
constexpr int64_t kMaxTransposedRank = 64;
// Columns of 4-bit A rows the first pass dequantizes at a time (8 rows: 8 KiB, in L1).
constexpr int64_t kSegment = 256;
// Floats of a 4-bit B the second pass dequantizes at a time: a block of 64
// rows up to rank 64, fewer rows (a multiple of 8) past it.
constexpr int64_t kBFloats = kLoraCols * kMaxTransposedRank;
// How far the software prefetch runs ahead of the factor bytes being read
// (prefetch_stream.h), and the columns of A read between two of its steps.
constexpr size_t kPrefetchAhead = 16 << 10;
constexpr int64_t kPrefetchCols = 64;

// Bits per element of a factor as kept (f32, bf16, int8 or 4 bits).
size_t element_bits(const LoraFactor& f) { return f.bf16() ? 16 : f.int8() ? 8 : f.quantized() ? 4 : 32; }
// Some job of the call asked for its factors to be prefetched (else the
// passes' span walks end at once: nothing to walk for).
bool any_streams(std::span<const LoraRowsJob> jobs) {
  for (const LoraRowsJob& j : jobs)
    if (j.stream_factors) return true;
  return false;
}
// The bytes of a factor's A, and of B's rows [c0, c1), as kept.
void a_span(const LoraFactor& f, const void*& data, size_t& bytes) {
  if (f.int8()) {  // its scales, then its codes
    data = f.a8;
    bytes = lora_a8_bytes(f.rank, f.in);
    return;
  }
  data = f.bf16()        ? static_cast<const void*>(f.a16)
         : f.quantized() ? static_cast<const void*>(f.a4.codes)
                         : f.a;
  bytes = static_cast<size_t>(f.rank * f.in) * element_bits(f) / 8;
}
void b_span(const LoraFactor& f, int64_t c0, int64_t c1, const void*& data, size_t& bytes) {
  if (f.int8()) {  // the block's codes with their padding; the first block's span starts at the scales
    const int64_t q = c0 / kLoraCols;
    const size_t at = q == 0 ? 0 : lora_b8_codes_offset(f.out, f.rank, q);
    data = f.b8 + at;
    bytes = lora_b8_codes_offset(f.out, f.rank, q) - at +
            static_cast<size_t>(f.rank * lora_b16_block_width(f.out, q));
    return;
  }
  if (f.bf16()) c1 = c0 + lora_b16_block_width(f.out, c0 / kLoraCols);  // with its padding
  const size_t bits = element_bits(f), at = static_cast<size_t>(c0 * f.rank) * bits / 8;
  const void* base = f.bf16()        ? static_cast<const void*>(f.b16)
                     : f.quantized() ? static_cast<const void*>(f.b4.codes)
                                     : f.b;
  data = static_cast<const char*>(base) + at;
  bytes = static_cast<size_t>((c1 - c0) * f.rank) * bits / 8;
}

// Every dot product here ends as simd::dot4 / dot8 do: 8 lane sums, then
// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) for each of 4 accumulators.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// One row of an A factor as the first pass reads it: f32, 4-bit codes, bf16
// (element e0 of the flattened matrix onwards) or int8 (the row's codes c,
// read as they are, and its scale cs, applied to the row's dot products).
struct FactorRow {
  const float* f32 = nullptr;
  const Int4Rows* q = nullptr;
  const uint16_t* h = nullptr;
  int64_t e0 = 0;
  const int8_t* c = nullptr;
  float cs = 0.0f;

  static FactorRow of(const LoraFactor& f, int64_t r) {
    if (f.bf16()) return {nullptr, nullptr, f.a16, r * f.in};
    if (f.int8())
      return {nullptr, nullptr, nullptr, 0, lora_a8_codes(f.a8, f.rank) + r * f.in, lora_a8_scales(f.a8)[r]};
    if (!f.quantized()) return {f.a + r * f.in, nullptr, nullptr, 0};
    return {nullptr, &f.a4, nullptr, r * f.in};
  }
  size_t bits() const { return f32 != nullptr ? 32 : h != nullptr ? 16 : c != nullptr ? 8 : 4; }
  bool operator==(const FactorRow& o) const {
    return f32 == o.f32 && q == o.q && h == o.h && e0 == o.e0 && c == o.c;
  }
  // Element i as unpack_int4_rows (or the bf16 widening) gives it; an int8 code as it is.
  float at(int64_t i) const {
    if (f32 != nullptr) return f32[i];
    if (h != nullptr) return bf16_to_fp32(h[e0 + i]);
    if (c != nullptr) return static_cast<float>(c[i]);
    return int4::value(q->codes, e0 + i, q->scales[(e0 + i) / q->group]);
  }
  // Elements [c0, c0 + n) into out.
  void widen(int64_t c0, int64_t n, float* out) const {
    if (h != nullptr)
      bf16_to_f32_rows(out, h + e0 + c0, n);
    else if (c != nullptr)
      simd::widen(out, reinterpret_cast<const simd::I8*>(c + c0), n);
    else
      int4::dequant_span(*q, e0 + c0, n, out);
  }
};

// acc[i][j] += x[i][c] * a[j][c] lane-wise for the chunks of 8 in [c0, c1);
// A: float, or simd::Bf16 / simd::I8 widened in registers (exact).
template <int NR, int NA, typename A = float>
inline void accumulate(__m256 (&acc)[NR][NA], const float* const* x, const A* const* a, int64_t c0,
                       int64_t c1) {
  for (int64_t c = c0; c < c1; c += 8) {
    __m256 xc[NR];
    for (int i = 0; i < NR; ++i) xc[i] = _mm256_loadu_ps(x[i] + c);
    for (int j = 0; j < NA; ++j) {
      const __m256 ac = simd::load8(a[j] + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm256_fmadd_ps(xc[i], ac, acc[i][j]);
    }
  }
}

template <int NR, int NA>
inline void reduce_tile(__m256 (&acc)[NR][NA], float (*s)[NA]) {
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NA; j += 4)
      _mm_storeu_ps(&s[i][j], reduce4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]));
}

// s[i][j] = dot(x[i], a[j]) over n floats, NR rows x NA factor rows: each
// result the same operations as simd::dot4(x[i], a[j..]) gives (one FMA chain
// per lane, reduce4, scalar tail), but each chunk of a[j] is read once for all
// rows. `pf` is told of every kPrefetchCols columns read.
template <int NR, int NA, typename A, typename PF>
inline void dot_tile(const float* const* x, const A* const* a, int64_t n, float (*s)[NA], PF& pf) {
  static_assert(NA % 4 == 0);
  __m256 acc[NR][NA];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NA; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t c0 = 0; c0 < n8; c0 += kPrefetchCols) {
    const int64_t c1 = std::min(n8, c0 + kPrefetchCols);
    accumulate<NR, NA, A>(acc, x, a, c0, c1);
    pf.advance(static_cast<size_t>(NA * (c1 - c0)) * sizeof(A));
  }
  reduce_tile<NR, NA>(acc, s);
  for (int64_t c = n8; c < n; ++c)
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < NA; ++j) s[i][j] = std::fma(x[i][c], simd::load1(a[j] + c), s[i][j]);
}

// dot_tile with some factor rows in 4 bits, int8 or bf16, kSegment columns at a
// time: each such row's piece widened into `buf` [NA * kSegment] (L1) first,
// then the same FMAs in the same order as over f32 rows holding those values.
template <int NR, int NA, typename PF>
void dot_tile_packed(const float* const* x, const FactorRow* a, int64_t n, float* buf, float (*s)[NA],
                     PF& pf) {
  static_assert(NA % 4 == 0);
  __m256 acc[NR][NA];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NA; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t c0 = 0; c0 < n8; c0 += kSegment) {
    const int64_t w = std::min(kSegment, n8 - c0);
    const float* xs[NR];
    const float* as[NA];
    for (int i = 0; i < NR; ++i) xs[i] = x[i] + c0;
    for (int j = 0; j < NA; ++j) {
      if (a[j].f32 != nullptr) {
        as[j] = a[j].f32 + c0;
      } else if (j > 0 && a[j] == a[j - 1]) {  // the padding of the last block
        as[j] = as[j - 1];
      } else {
        a[j].widen(c0, w, buf + j * kSegment);
        as[j] = buf + j * kSegment;
      }
    }
    accumulate<NR, NA>(acc, xs, as, 0, w);
    pf.advance(static_cast<size_t>(NA * w) * a[0].bits() / 8);
  }
  reduce_tile<NR, NA>(acc, s);
  for (int64_t c = n8; c < n; ++c)
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < NA; ++j) s[i][j] = std::fma(x[i][c], a[j].at(c), s[i][j]);
}

// Whether a tile's A rows can be unpacked in registers: every row 4 bits, one
// group size for all, a multiple of 8 (no chunk of 8 crosses a group; the group
// divides the row, so the row has no tail).
inline bool int4_fits(const FactorRow* a, int n) {
  for (int j = 0; j < n; ++j)
    if (a[j].q == nullptr || a[j].q->group != a[0].q->group) return false;
  return a[0].q->group % 8 == 0;
}

inline bool same_factor(const LoraFactor* f, const LoraFactor* g) {
  if (f == g) return true;
  if (f == nullptr || g == nullptr) return false;
  return f->a == g->a && f->b == g->b && f->a4.codes == g->a4.codes && f->b4.codes == g->b4.codes &&
         f->a16 == g->a16 && f->b16 == g->b16 && f->a8 == g->a8 && f->b8 == g->b8 &&
         f->a4.scales == g->a4.scales && f->b4.scales == g->b4.scales && f->rank == g->rank &&
         f->in == g->in && f->out == g->out && f->scale == g->scale;
}

// Jobs [first, first + count) read the same x (q/k/v, gate/up): the first pass
// runs them as one product, the A factors of a row's adapter one after another.
struct JobGroup {
  int64_t first = 0, count = 0;
};

// The first pass's view of a call.
struct FirstPass {
  std::span<const LoraRowsJob> jobs;
  std::span<const int32_t> rows;
  int64_t R, T;
  float* u;
  bool avx512;  // 4-bit A rows two to a zmm (lora_rows_avx512f.cpp)

  const LoraFactor* factor(int64_t job, int64_t k) const { return jobs[static_cast<size_t>(job)].factors[k]; }
  // Rows k and k2 have the same factors for every job of g.
  bool same_rows(const JobGroup& g, int64_t k, int64_t k2) const {
    for (int64_t j = g.first; j < g.first + g.count; ++j)
      if (!same_factor(factor(j, k), factor(j, k2))) return false;
    return true;
  }

  // Some factor of group g at listed row k is kept in 4 bits or bf16.
  bool any_packed(const JobGroup& g, int64_t k) const {
    for (int64_t j = g.first; j < g.first + g.count; ++j)
      if (factor(j, k) != nullptr && factor(j, k)->packed()) return true;
    return false;
  }

  // u[job, row, :] = scale * (A x[row]) for the NR rows listed at k0.. (one
  // adapter) and every job of g, NA factor rows at a time across the jobs'
  // concatenated A (the last block padded with its last row). Packed: some of
  // the factors are 4-bit or bf16 (`buf`: dot_tile_packed's scratch).
  template <int NR, int NA, bool Packed, typename PF>
  void tile(const JobGroup& g, int64_t k0, float* buf, PF& pf) const {
    const LoraRowsJob& j0 = jobs[static_cast<size_t>(g.first)];
    const float* xs[NR];
    int64_t row[NR];
    for (int i = 0; i < NR; ++i) {
      row[i] = rows[static_cast<size_t>(k0 + i)];
      xs[i] = j0.x + row[i] * j0.ldx;
    }
    int64_t job = g.first, r = 0;  // cursor over the concatenated factor rows
    auto skip_empty = [&] {
      while (job < g.first + g.count && factor(job, k0) == nullptr) ++job;
    };
    skip_empty();
    while (job < g.first + g.count) {
      std::conditional_t<Packed, FactorRow, const float*> ap[NA];
      int64_t at_job[NA], at_r[NA];
      int m = 0;
      for (; m < NA && job < g.first + g.count; ++m) {
        const LoraFactor& f = *factor(job, k0);
        if constexpr (Packed)
          ap[m] = FactorRow::of(f, r);
        else
          ap[m] = f.a + r * f.in;
        at_job[m] = job;
        at_r[m] = r;
        if (++r == f.rank) {
          r = 0;
          ++job;
          skip_empty();
        }
      }
      for (int q = m; q < NA; ++q) ap[q] = ap[m - 1];
      float s[NR][NA];
      bool all_bf16 = Packed, all_int8 = Packed;
      if constexpr (Packed)
        for (int q = 0; q < NA; ++q) {
          all_bf16 = all_bf16 && ap[q].h != nullptr;
          all_int8 = all_int8 && ap[q].c != nullptr;
        }
      if constexpr (Packed) {
        if (all_int8) {  // the codes widened in registers
          const simd::I8* cp[NA];
          for (int q = 0; q < NA; ++q) cp[q] = reinterpret_cast<const simd::I8*>(ap[q].c);
          dot_tile<NR, NA, simd::I8>(xs, cp, factor(at_job[0], k0)->in, s, pf);
        } else if (all_bf16) {  // widened in registers: no pass through buf
          const simd::Bf16* hp[NA];
          for (int q = 0; q < NA; ++q) hp[q] = reinterpret_cast<const simd::Bf16*>(ap[q].h + ap[q].e0);
          dot_tile<NR, NA, simd::Bf16>(xs, hp, factor(at_job[0], k0)->in, s, pf);
        } else if (avx512 && int4_fits(ap, NA)) {  // unpacked in registers
          const int64_t in = factor(at_job[0], k0)->in;
          const uint8_t* codes[NA];
          const float* scales[NA];
          for (int q = 0; q < NA; ++q) {
            codes[q] = ap[q].q->codes + ap[q].e0 / 2;
            scales[q] = ap[q].q->scales + ap[q].e0 / ap[q].q->group;
          }
          pf.advance(static_cast<size_t>(NA * in) / 2);
          detail::dot_rows_int4_avx512(NR, NA, xs, codes, scales, in, ap[0].q->group, &s[0][0]);
        } else {
          dot_tile_packed<NR, NA>(xs, ap, factor(at_job[0], k0)->in, buf, s, pf);
        }
      } else
        dot_tile<NR, NA, float>(xs, ap, factor(at_job[0], k0)->in, s, pf);
      for (int q = 0; q < m; ++q) {
        const float scale = factor(at_job[q], k0)->scale;
        if constexpr (Packed) {
          if (ap[q].c != nullptr) {  // an int8 row: its scale on the codes' dot product, then the adapter's
            for (int i = 0; i < NR; ++i)
              u[(at_job[q] * T + row[i]) * R + at_r[q]] = s[i][q] * ap[q].cs * scale;
            continue;
          }
        }
        for (int i = 0; i < NR; ++i) u[(at_job[q] * T + row[i]) * R + at_r[q]] = s[i][q] * scale;
      }
    }
  }
  // Tiles with a 4-bit or bf16 factor go out of line, so that run's loop
  // keeps the f32 path's code (and speed) as it was.
  template <int NR, int NA, typename PF>
  [[gnu::noinline]] void tile_packed(const JobGroup& g, int64_t k0, float* buf, PF& pf) const {
    tile<NR, NA, true>(g, k0, buf, pf);
  }
  template <int NR, int NA, typename PF>
  void tile(const JobGroup& g, int64_t k0, float* buf, PF& pf) const {
    if (any_packed(g, k0))
      tile_packed<NR, NA>(g, k0, buf, pf);
    else
      tile<NR, NA, false>(g, k0, buf, pf);
  }

  // The A factors run(g, k0, k1) reads, in its order (a row with the factors
  // of the row before it reads what is in cache, and jobs whose factors the
  // caller expects in cache: skipped).
  struct Spans {
    const FirstPass& p;
    const JobGroup& g;
    int64_t k, k1, job;
    Spans(const FirstPass& p, const JobGroup& g, int64_t k0, int64_t k1)
        : p(p), g(g), k(any_streams(p.jobs) ? k0 : k1), k1(k1), job(g.first) {}
    bool next(const void*& data, size_t& bytes) {
      for (;;) {
        if (job == g.first + g.count) {
          do ++k;
          while (k < k1 && p.same_rows(g, k - 1, k));
          job = g.first;
        }
        if (k >= k1) return false;
        const bool stream = p.jobs[static_cast<size_t>(job)].stream_factors;
        const LoraFactor* f = p.factor(job++, k);
        if (f == nullptr || !stream) continue;
        a_span(*f, data, bytes);
        return true;
      }
    }
  };

  // The listed rows [k0, k1) of group g, in tiles of one adapter's rows.
  void run(const JobGroup& g, int64_t k0, int64_t k1) const {
    alignas(32) float buf[8 * kSegment];  // 4-bit or bf16 A rows, widened a segment at a time
    Spans spans(*this, g, k0, k1);
    PrefetchStream<Spans> pf(spans, kPrefetchAhead);
    for (int64_t k = k0; k < k1;) {
      int n = 1;
      while (n < kTileRows && k + n < k1 && same_rows(g, k, k + n)) ++n;
      if (n == 3)
        tile<3, 4>(g, k, buf, pf);
      else if (n == 2)
        tile<2, 4>(g, k, buf, pf);
      else
        tile<1, 8>(g, k, buf, pf);
      k += n;
    }
  }
};

// y[n, n + 8) += d, the columns below c1 only.
inline void add_cols(float* y, int64_t n, int64_t c1, __m256 d) {
  if (n + 8 <= c1) {
    _mm256_storeu_ps(y + n, _mm256_add_ps(_mm256_loadu_ps(y + n), d));
  } else {
    alignas(32) float v[8];
    _mm256_store_ps(v, d);
    for (int64_t m = 0; n + m < c1; ++m) y[n + m] += v[m];
  }
}

// y[c0, c1) += B[c0, c1) u with 8 rows of B per dot product (padded with the
// last row); b_row(n): B's row n, r floats.
template <typename BRow>
inline void add_b_times_u(BRow b_row, int64_t r, const float* u, float* y, int64_t c0, int64_t c1) {
  for (int64_t n = c0; n < c1; n += 8) {
    decltype(b_row(0)) rows[8];
    for (int64_t m = 0; m < 8; ++m) rows[m] = b_row(std::min(n + m, c1 - 1));
    add_cols(y, n, c1, simd::dot8(u, rows, r));
  }
}

// bt[j * kLoraCols + n - c0] = B[n, j] for n in [c0, c1) (columns up to the next 8 zeroed).
template <typename BRow>
inline void transpose_b_block(BRow b_row, int64_t r, int64_t c0, int64_t c1, float* bt) {
  const int64_t w = c1 - c0, w8 = (w + 7) & ~int64_t{7};
  for (int64_t n = 0; n < w; ++n) {
    const auto* b = b_row(c0 + n);
    for (int64_t j = 0; j < r; ++j) bt[j * kLoraCols + n] = simd::load1(b + j);
  }
  for (int64_t j = 0; j < r; ++j)
    for (int64_t n = w; n < w8; ++n) bt[j * kLoraCols + n] = 0.0f;
}

// The same sums as add_b_times_u with columns in the lanes: lane sums over
// rank chunks into acc[l] (l = the rank's lane), then the same tree and tail,
// so each y element gets the same bits, with B's block read once for a run.
// column(j, n): B[n, n + 8)[j] of the block (its rank row j), as f32.
template <typename Column>
inline void add_columns_times_u(Column column, int64_t r, const float* u, float* y, int64_t w) {
  const int64_t r8 = r & ~int64_t{7};
  for (int64_t n = 0; n < w; n += 8) {
    __m256 acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = _mm256_setzero_ps();
    for (int64_t c = 0; c < r8; c += 8)
      for (int l = 0; l < 8; ++l)
        acc[l] = _mm256_fmadd_ps(_mm256_broadcast_ss(u + c + l), column(c + l, n), acc[l]);
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])),
                             _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7])));
    for (int64_t c = r8; c < r; ++c) s = _mm256_fmadd_ps(_mm256_broadcast_ss(u + c), column(c, n), s);
    add_cols(y, n, w, s);
  }
}
// bt: the block transposed, ld floats (or bf16, lora_b16.h) per rank row.
template <typename E>
inline void add_bt_times_u(const E* bt, int64_t ld, int64_t r, const float* u, float* y, int64_t w) {
  add_columns_times_u([&](int64_t j, int64_t n) { return simd::load8(bt + j * ld + n); }, r, u, y, w);
}

// us[c] = u[c] * s[c] for c < r (8 at a time: it runs per row and block).
inline void scale_rank(const float* u, const float* s, int64_t r, float* us) {
  int64_t c = 0;
  for (; c + 8 <= r; c += 8)
    _mm256_storeu_ps(us + c, _mm256_mul_ps(_mm256_loadu_ps(u + c), _mm256_loadu_ps(s + c)));
  for (; c < r; ++c) us[c] = u[c] * s[c];
}

// Each job's listed rows cut into segments (rows without a factor left out).
void segments_of(std::span<const LoraRowsJob> jobs, int64_t NR, std::vector<LoraSegment>& segs) {
  segs.clear();
  int64_t units = 0;
  for (int64_t j = 0; j < static_cast<int64_t>(jobs.size()); ++j) {
    const LoraFactor* const* fs = jobs[static_cast<size_t>(j)].factors;
    for (int64_t k = 0; k < NR;) {
      int64_t n = 1;
      while (n < kRunRows && k + n < NR && same_factor(fs[k + n], fs[k])) ++n;
      if (fs[k] != nullptr) {
        const int64_t blocks = (fs[k]->out + kLoraCols - 1) / kLoraCols;
        segs.push_back({j, k, n, fs[k], units, blocks});
        units += blocks * n;
      }
      k += n;
    }
  }
}

// The second pass's view of a call: units segment by segment, in a segment
// column block by block, in a block row by row. So a run of a segment's rows
// shares one block of B, and a segment of one row (a decode row, its own
// adapter) reads its B front to back, one stream.
struct SecondPass {
  std::span<const LoraRowsJob> jobs;
  std::span<const int32_t> rows;
  std::span<const LoraSegment> segs;
  int64_t R, T;
  const float* u;
  bool avx512;  // bf16 B blocks 16 columns at a time (lora_rows_avx512f.cpp)

  int64_t units() const {
    return segs.empty() ? 0 : segs.back().first_unit + segs.back().blocks * segs.back().len;
  }

  // Unit i: its segment, row within it and column block [c0, c1).
  struct Unit {
    const LoraSegment* seg;
    int64_t m, c0, c1;
  };
  Unit unit(int64_t i) const {
    const auto it = std::upper_bound(segs.begin(), segs.end(), i,
                                     [](int64_t v, const LoraSegment& sg) { return v < sg.first_unit; });
    const LoraSegment& sg = *(it - 1);
    const int64_t local = i - sg.first_unit, c0 = local / sg.len * kLoraCols;
    return {&sg, local % sg.len, c0, std::min(sg.f->out, c0 + kLoraCols)};
  }
  // The unit n after `at` (its segment's or a later one's; seg null past the
  // last): the walks below step through their units without unit()'s search,
  // which cost decode rows (a segment of one row per adapter and job) about a
  // fifth of the second pass.
  Unit after(const Unit& at, int64_t n) const {
    const LoraSegment* sg = at.seg;
    int64_t local = at.c0 / kLoraCols * sg->len + at.m + n;
    for (;;) {
      const int64_t units = sg->blocks * sg->len;
      if (local < units) break;
      local -= units;
      if (++sg == segs.data() + segs.size()) return {nullptr, 0, 0, 0};
    }
    const int64_t c0 = local / sg->len * kLoraCols;
    return {sg, local % sg->len, c0, std::min(sg->f->out, c0 + kLoraCols)};
  }

  // y[row][s0, s1) += B[s0, s1) u[row] for the listed rows k.. of a run of n
  // (one factor) of job j; b_row(n): B's row n. A long run with a narrow rank
  // transposes B's block once for all of them (the same bits).
  template <typename BRow>
  void add_rows(BRow b_row, int64_t r, int64_t j, int64_t k, int64_t n, int64_t s0, int64_t s1, bool transposed,
                float* bt) const {
    const LoraRowsJob& job = jobs[static_cast<size_t>(j)];
    if (transposed) transpose_b_block(b_row, r, s0, s1, bt);
    for (int64_t m = 0; m < n; ++m) {
      const int64_t row = rows[static_cast<size_t>(k + m)];
      const float* ur = u + (j * T + row) * R;
      float* y = job.y + row * job.ldy;
      if (transposed)
        add_bt_times_u(bt, kLoraCols, r, ur, y + s0, s1 - s0);
      else
        add_b_times_u(b_row, r, ur, y, s0, s1);
    }
  }

  // y[row][c0, c1) += B[c0, c1) u[row] for a run of n rows with a bf16 B, its
  // block read in place (already transposed, lora_b16.h) and widened in
  // registers: every row, a decode row of its own adapter too, takes the
  // columns-in-lanes sums, with no horizontal sum per output.
  void add_rows_bf16(const LoraFactor& f, int64_t j, int64_t k, int64_t n, int64_t c0, int64_t c1) const {
    const LoraRowsJob& job = jobs[static_cast<size_t>(j)];
    const uint16_t* block = f.b16 + c0 * f.rank;
    const int64_t ld = lora_b16_block_width(f.out, c0 / kLoraCols);
    for (int64_t m = 0; m < n; ++m) {
      const int64_t row = rows[static_cast<size_t>(k + m)];
      const float* ur = u + (j * T + row) * R;
      float* y = job.y + row * job.ldy + c0;
      if (avx512)
        detail::add_bt16_times_u_avx512(block, ld, f.rank, ur, y, c1 - c0);
      else
        add_bt_times_u(reinterpret_cast<const simd::Bf16*>(block), ld, f.rank, ur, y, c1 - c0);
    }
  }

  // add_rows_bf16 with an int8 B: u times the block's scales (one per rank
  // row), then the same sums over its codes widened in registers (16 columns
  // at a time with AVX-512); kernels/ref/lora_rows_ref.h states the order.
  void add_rows_int8(const LoraFactor& f, int64_t j, int64_t k, int64_t n, int64_t c0, int64_t c1) const {
    const LoraRowsJob& job = jobs[static_cast<size_t>(j)];
    const int64_t q = c0 / kLoraCols, ld = lora_b16_block_width(f.out, q), r = f.rank;
    const int8_t* block = lora_b8_codes(f.b8, f.out, r, q);
    const float* scales = lora_b8_scales(f.b8, r, q);
    float scaled[kMaxTransposedRank];
    std::vector<float> wide;  // only for a rank past the stack buffer
    if (r > kMaxTransposedRank) wide.resize(static_cast<size_t>(r));
    float* us = wide.empty() ? scaled : wide.data();
    for (int64_t m = 0; m < n; ++m) {
      const int64_t row = rows[static_cast<size_t>(k + m)];
      const float* ur = u + (j * T + row) * R;
      scale_rank(ur, scales, r, us);
      float* y = job.y + row * job.ldy + c0;
      if (avx512)
        detail::add_bt8_times_u_avx512(block, ld, r, us, y, c1 - c0);
      else
        add_bt_times_u(reinterpret_cast<const simd::I8*>(block), ld, r, us, y, c1 - c0);
    }
  }

  // y[row][c0, c1) += B[c0, c1) u[row] for a short run (decode rows) with a
  // 4-bit B of rank 8 or 16, one scale per row: B's columns in the lanes
  // straight from the codes (lora_rows_avx512f.cpp), add_bt_times_u's sums on
  // the same values, so its bits, with no block dequantized into a buffer.
  void add_rows_int4_avx512(const LoraFactor& f, int64_t j, int64_t k, int64_t n, int64_t c0,
                            int64_t c1) const {
    const LoraRowsJob& job = jobs[static_cast<size_t>(j)];
    for (int64_t m = 0; m < n; ++m) {
      const int64_t row = rows[static_cast<size_t>(k + m)];
      detail::add_b4_times_u_avx512(f.b4.codes, f.b4.scales, f.rank, u + (j * T + row) * R,
                                    job.y + row * job.ldy, c0, c1);
    }
  }

  // add_rows over [c0, c1) with a 4-bit B, dequantized once for the run: the
  // whole block (transposed: it fits) or pieces of a multiple of 8 rows (the
  // dot products' own). Out of line, like FirstPass::tile_packed.
  [[gnu::noinline]] void add_rows_int4(const LoraFactor& f, int64_t j, int64_t k, int64_t n, int64_t c0,
                                       int64_t c1, bool transposed, float* bt) const {
    const int64_t r = f.rank;
    alignas(32) float bq[kBFloats];
    std::vector<float> wide;  // only for a rank past the stack buffer
    if (8 * r > kBFloats) wide.resize(static_cast<size_t>(8 * r));
    float* buf = wide.empty() ? bq : wide.data();
    const int64_t h = transposed ? c1 - c0 : std::max<int64_t>(8, kBFloats / r / 8 * 8);
    for (int64_t s0 = c0; s0 < c1; s0 += h) {
      const int64_t s1 = std::min(c1, s0 + h);
      int4::dequant_span(f.b4, s0 * r, (s1 - s0) * r, buf);
      add_rows([&](int64_t row) { return buf + (row - s0) * r; }, r, j, k, n, s0, s1, transposed, bt);
    }
  }

  // The blocks of B run(b, e) reads, in its order (the block of each run
  // once; none of jobs whose factors the caller expects in cache).
  struct Spans {
    const SecondPass& p;
    int64_t i, e;
    Unit at;
    Spans(const SecondPass& p, int64_t b, int64_t e)
        : p(p), i(any_streams(p.jobs) ? b : e), e(e), at(i < e ? p.unit(i) : Unit{}) {}
    bool next(const void*& data, size_t& bytes) {
      while (i < e) {
        const Unit u = at;
        const int64_t n = u.seg->len - u.m;  // to the next block (or segment)
        i += n;
        if (i < e) at = p.after(u, n);
        if (!p.jobs[static_cast<size_t>(u.seg->j)].stream_factors) continue;
        b_span(*u.seg->f, u.c0, u.c1, data, bytes);
        return true;
      }
      return false;
    }
  };

  void run(int64_t b, int64_t e) const {
    alignas(32) float bt[kMaxTransposedRank * kLoraCols];
    Spans spans(*this, b, e);
    PrefetchStream<Spans> pf(spans, kPrefetchAhead);
    const bool streams = any_streams(jobs);  // else the stream has nothing to walk: no spans to count
    Unit at = b < e ? unit(b) : Unit{};
    for (int64_t i = b; i < e;) {
      const auto [seg, m, c0, c1] = at;
      const LoraFactor* f = seg->f;
      // The run: the segment's rows m.. of this block, inside [b, e).
      const int64_t n = std::min(seg->len - m, e - i);
      if (streams) {
        // What b_span told the stream of this block (an int8 block's scales too,
        // a bf16 or int8 one's padding), so the prefetch keeps its distance ahead.
        const void* block = nullptr;
        size_t block_bytes = 0;
        b_span(*f, c0, c1, block, block_bytes);
        pf.advance(block_bytes);
      }
      const bool transposed = n >= kMinTransposedRun && f->rank <= kMaxTransposedRank;
      const float* b0 = f->b;
      const int64_t r = f->rank, j = seg->j, k = seg->k0 + m;
      if (f->bf16())
        add_rows_bf16(*f, j, k, n, c0, c1);
      else if (f->int8())
        add_rows_int8(*f, j, k, n, c0, c1);
      else if (f->quantized() && avx512 && !transposed && (r == 8 || r == 16) && f->b4.group == r)
        add_rows_int4_avx512(*f, j, k, n, c0, c1);
      else if (f->packed())
        add_rows_int4(*f, j, k, n, c0, c1, transposed, bt);
      else
        add_rows([b0, r](int64_t row) { return b0 + row * r; }, r, j, k, n, c0, c1, transposed, bt);
      i += n;
      if (i < e) at = after(at, n);
    }
  }
};

// base[at, at + n) = x, as f32 or as IEEE half (the F16C instruction and the scalar tail agree).
void store_row(void* base, int64_t at, const float* x, int64_t n, bool f16) {
  if (!f16) {
    std::memcpy(static_cast<float*>(base) + at, x, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  store_f16(static_cast<uint16_t*>(base) + at, x, n);
}

}  // namespace

void lora_rows(ThreadPool& pool, std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows,
               int64_t max_rank, float* u, int64_t T, LoraRowsScratch& scratch) {
  LOOM_ASSERT(jobs.size() <= 3);
  const auto NR = static_cast<int64_t>(rows.size());
  const int64_t n_jobs = static_cast<int64_t>(jobs.size());
  if (NR == 0 || n_jobs == 0) return;
  JobGroup groups[3];
  int64_t n_groups = 0;
  for (int64_t j = 0; j < n_jobs; ++j) {
    const LoraRowsJob& job = jobs[static_cast<size_t>(j)];
    const LoraRowsJob* prev = j > 0 ? &jobs[static_cast<size_t>(j - 1)] : nullptr;
    if (prev != nullptr && prev->x == job.x && prev->ldx == job.ldx)
      ++groups[n_groups - 1].count;
    else
      groups[n_groups++] = {j, 1};
  }
  const bool avx512 = usable_cpu_features().has_avx512_f32();
  const FirstPass p1{jobs, rows, max_rank, T, u, avx512};
  pool.parallel_for(n_groups * NR, [&](int64_t b, int64_t e) {
    for (int64_t g = b / NR; g < n_groups && g * NR < e; ++g)
      p1.run(groups[g], std::max(b - g * NR, int64_t{0}), std::min(e - g * NR, NR));
  });
  segments_of(jobs, NR, scratch.segments);
  const SecondPass p2{jobs, rows, scratch.segments, max_rank, T, u, avx512};
  pool.parallel_for(p2.units(), [&](int64_t b, int64_t e) { p2.run(b, e); });
}

void paged_store(ThreadPool& pool, const AttentionShape& s, void* k_store, void* v_store, DType dtype,
                 int64_t block_size, const float* k, const float* v, const int64_t* slots, int64_t T) {
  const bool f16 = dtype == DType::f16;
  const int64_t hd = s.head_dim, G = s.n_kv_heads, KV = s.kv_stride;
  pool.parallel_for(
      T,
      [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const int64_t slot = slots[t];
          for (int64_t g = 0; g < G; ++g) {
            const int64_t at = ((slot / block_size * G + g) * block_size + slot % block_size) * hd;
            store_row(k_store, at, k + t * KV + g * hd, hd, f16);
            store_row(v_store, at, v + t * KV + g * hd, hd, f16);
          }
        }
      },
      4);
}

}  // namespace loom
