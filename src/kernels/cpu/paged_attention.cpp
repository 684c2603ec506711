// AVX2 paged attention: a unit (adjacent rows of one sequence, a kv head, a
// segment of positions) reads each key and value row once for all its rows and
// the query heads of the group, with an online softmax over tiles of 16
// positions, so no buffer grows with the context length.
#include "kernels/cpu/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/scratch.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/simd_rows.h"

namespace loom {

namespace {

constexpr int64_t kTile = 16;      // positions per softmax tile (two AVX2 vectors of scores)
constexpr int64_t kMaxGroup = 64;  // query heads per kv head handled by one unit

// o[i] = o[i] * corr + sum_j w[j] * v[j][i] for i < d, j < n; fixed order per element.
template <int NV, typename E>
inline void accumulate_chunk(float* o, float corr, const float* w, const E* const* v, int64_t n, int64_t c) {
  __m256 acc[NV];
  const __m256 vc = _mm256_set1_ps(corr);
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(o + c + 8 * i), vc);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    const E* vj = v[j] + c;
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(wj, simd::load8(vj + 8 * i), acc[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o + c + 8 * i, acc[i]);
}

template <typename E>
void accumulate(float* o, float corr, const float* w, const E* const* v, int64_t n, int64_t d) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) accumulate_chunk<8, E>(o, corr, w, v, n, c);
  if (c + 32 <= d) {
    accumulate_chunk<4, E>(o, corr, w, v, n, c);
    c += 32;
  }
  if (c + 16 <= d) {
    accumulate_chunk<2, E>(o, corr, w, v, n, c);
    c += 16;
  }
  if (c + 8 <= d) {
    accumulate_chunk<1, E>(o, corr, w, v, n, c);
    c += 8;
  }
  for (; c < d; ++c) {
    float acc = o[c] * corr;
    for (int64_t j = 0; j < n; ++j) acc = std::fma(w[j], simd::load1(v[j] + c), acc);
    o[c] = acc;
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

struct Unit {
  const AttentionShape& s;
  const PagedKv& kv;
  int64_t group;
  float scale;
};

// Softmax state of one query head: running max and sum of exp(score - max).
struct HeadState {
  float m = -INFINITY;
  float l = 0.0f;
};

// One tile of nt (<= kTile) positions for the G query heads of a unit: scores,
// the online-softmax update, and o = o * corr + sum_j w_j v_j. kr has kTile
// valid pointers (padded); lanes at or past nt are dead.
template <typename R>
void attend_tile(const float* qg, float* og, HeadState* st, int64_t G, int64_t d, float scale,
                 const R* const* kr, const R* const* vr, int64_t nt) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
  const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nt)), lane));
  const __m256 live1 =
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nt) - 8), lane));
  alignas(32) float w[kTile];
  for (int64_t h = 0; h < G; ++h) {
    const float* qh = qg + h * d;
    const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(simd::dot8(qh, kr, d), vscale), live0);
    const __m256 s1 =
        nt > 8 ? _mm256_blendv_ps(ninf, _mm256_mul_ps(simd::dot8(qh, kr + 8, d), vscale), live1) : ninf;
    HeadState& hs = st[h];
    const float mn = std::max(hs.m, hmax(_mm256_max_ps(s0, s1)));
    // exp(m_old - m_new) rescales what earlier tiles accumulated; 0 on the first.
    const float corr = hs.m == -INFINITY ? 0.0f
                       : hs.m == mn      ? 1.0f
                                         : _mm256_cvtss_f32(simd::exp_ps(_mm256_set1_ps(hs.m - mn)));
    hs.m = mn;
    const __m256 vmn = _mm256_set1_ps(mn);
    const __m256 e0 = _mm256_and_ps(simd::exp_ps(_mm256_sub_ps(s0, vmn)), live0);
    const __m256 e1 = _mm256_and_ps(simd::exp_ps(_mm256_sub_ps(s1, vmn)), live1);
    _mm256_store_ps(w, e0);
    _mm256_store_ps(w + 8, e1);
    hs.l = hs.l * corr + simd::hsum(_mm256_add_ps(e0, e1));
    accumulate(og + h * d, corr, w, vr, nt, d);
  }
}

constexpr int64_t kMaxConvertDim = 256;  // head_dim up to which f16 tiles are widened once

// Walks the store rows (elements from the store's start) of kv head g for
// consecutive positions of a sequence, from position p.
struct RowCursor {
  const int32_t* table;
  int64_t g, n_kv, bs, d, block, slot;
  RowCursor(const int32_t* t, int64_t g_, int64_t n_kv_, int64_t bs_, int64_t d_, int64_t p)
      : table(t), g(g_), n_kv(n_kv_), bs(bs_), d(d_), block(p / bs_), slot(p % bs_) {}
  int64_t offset() const { return ((static_cast<int64_t>(table[block]) * n_kv + g) * bs + slot) * d; }
  void next() {
    if (++slot == bs) {
      slot = 0;
      ++block;
    }
  }
};

// One row of a span: its G query heads, where its sums go (G x d, zeroed by the
// caller), its softmax state, the end of its positions in the span, and its
// index in the batch.
struct SpanRow {
  const float* qg;
  float* sums;
  HeadState* st;
  int64_t end, t;
};

// Positions [p_begin, ...) of one sequence's kv head g for rows of that
// sequence: row r takes the positions below rows[r].end. Each tile's rows are
// located (and f16 ones widened) once for all the rows; each row then runs
// attend_tile exactly as it would alone (lanes past its end are masked), so
// how many rows share a span never changes a row's result. p_begin is a
// multiple of kTile.
template <typename E>
void attend_span(const Unit& u, int64_t g, const int32_t* table, int64_t p_begin, const SpanRow* rows,
                 int64_t n_rows) {
  const int64_t d = u.s.head_dim, G = u.group, bs = u.kv.block_size, n_kv = u.s.n_kv_heads;
  int64_t p_end = p_begin;
  for (int64_t r = 0; r < n_rows; ++r) p_end = std::max(p_end, rows[r].end);
  const E* kr[kTile];
  const E* vr[kTile];
  const E* kbase = static_cast<const E*>(u.kv.k);
  const E* vbase = static_cast<const E*>(u.kv.v);
  constexpr bool widen = std::is_same_v<E, uint16_t>;
  alignas(32) float kf[widen ? kTile * kMaxConvertDim : 1];
  alignas(32) float vf[widen ? kTile * kMaxConvertDim : 1];
  const float* kfr[kTile];
  const float* vfr[kTile];
  RowCursor at{table, g, n_kv, bs, d, p_begin};  // rows of the tile at p0
  for (int64_t p0 = p_begin; p0 < p_end; p0 += kTile) {
    const int64_t nt = std::min(kTile, p_end - p0);
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t off = at.offset();
      kr[j] = kbase + off;
      vr[j] = vbase + off;
      at.next();
    }
    for (int64_t j = nt; j < kTile; ++j) kr[j] = kr[0];  // padding rows; their scores are dropped
    const float* const* kt = nullptr;
    const float* const* vt = nullptr;
    if constexpr (widen) {
      if (d <= kMaxConvertDim) {
        // f16 rows are widened to f32 once per tile rather than once per query
        // head and row (exact, so the result is the same either way).
        for (int64_t j = 0; j < nt; ++j) {
          simd::widen(kf + j * d, kr[j], d);
          simd::widen(vf + j * d, vr[j], d);
          kfr[j] = kf + j * d;
          vfr[j] = vf + j * d;
        }
        for (int64_t j = nt; j < kTile; ++j) kfr[j] = kfr[0];
        kt = kfr;
        vt = vfr;
      }
    }
    for (int64_t r = 0; r < n_rows; ++r) {
      const SpanRow& row = rows[r];
      const int64_t n = std::min(kTile, row.end - p0);
      if (n <= 0) continue;
      if (kt != nullptr)
        attend_tile(row.qg, row.sums, row.st, G, d, u.scale, kt, vt, n);
      else
        attend_tile(row.qg, row.sums, row.st, G, d, u.scale, kr, vr, n);
    }
  }
}

// Partial results of one segment of a long row, for the G heads of a kv head:
// the unnormalised sums (G x d), then each head's running max and sum.
struct Partial {
  float* o;
  float* m;
  float* l;
};

// Row t's output for kv head g from its segments' partials, merged in segment
// order (so the result does not depend on which thread ran which segment):
// M = max m_s, L = sum l_s exp(m_s - M), out = sum o_s exp(m_s - M) / L.
template <class PartOf>
void merge_segments(const Unit& u, const PartOf& part_of, int64_t n_seg, float* og) {
  const int64_t d = u.s.head_dim, G = u.group;
  for (int64_t h = 0; h < G; ++h) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n_seg; ++i) mx = std::max(mx, part_of(i).m[h]);
    float* o = og + h * d;
    std::fill(o, o + d, 0.0f);
    float l = 0.0f;
    for (int64_t i = 0; i < n_seg; ++i) {
      const Partial p = part_of(i);
      const float w = _mm256_cvtss_f32(simd::exp_ps(_mm256_set1_ps(p.m[h] - mx)));
      l += p.l[h] * w;
      const float* os = p.o + h * d;
      for (int64_t c = 0; c < d; ++c) o[c] = std::fma(os[c], w, o[c]);
    }
    const float inv = 1.0f / l;
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
  }
}

// One piece of work: segment `seg` of kv head g for rows [t0, t1), which read
// one sequence (the rows of a prefill chunk; a decode row alone).
struct WorkItem {
  int64_t t0, t1, g, seg;
};

// Rows of one sequence per work item at most: their softmax states stay on the stack.
constexpr int64_t kMaxRun = 32;

// A thread's buffers on the two-pass path: an item's key and value rows, located
// once for all its rows, and the scores of a pass of query heads.
template <typename E>
struct PagedScratch {
  std::vector<const E*> k, v;
  std::vector<float> w, kt;  // kt: K^T of an item's keys, when its rows are many
  PagedScratch(int64_t span, int64_t scores, int64_t kt_floats)
      : k(static_cast<size_t>(span + cpu::kPagedPrefetchRows)),
        v(static_cast<size_t>(span + cpu::kPagedPrefetchRows)),
        w(static_cast<size_t>(scores)),
        kt(static_cast<size_t>(kt_floats)) {}
};

// The two-pass kernels of one ISA for E elements (kernels/cpu/attention_rows.h).
template <typename E>
struct TwoPassKernels {
  void (*transpose)(const E* const*, int64_t, int64_t, float*, int64_t);
  void (*rows)(const float*, int, const E* const*, const E* const*, int64_t, int64_t, float, float*, int64_t,
               float*, float*, float*);
  void (*rows_kt)(const float*, int, const float*, int64_t, const E* const*, int64_t, int64_t, float, float*,
                  int64_t, float*, float*, float*);
  explicit TwoPassKernels(AttnIsa isa) {
    if (isa == AttnIsa::avx512) {
      transpose = cpu::transpose_rows_avx512;
      rows = cpu::paged_rows_avx512;
      rows_kt = cpu::paged_rows_kt_avx512;
    } else {
      transpose = cpu::transpose_rows_avx2;
      rows = cpu::paged_rows_avx2;
      rows_kt = cpu::paged_rows_kt_avx2;
    }
  }
};

// Rows of one item from which its keys are read transposed: the transpose
// costs about what one row's scores do (ops.cpp's kKeysTransposedMinT).
constexpr int64_t kPagedKeysTransposedMinRows = 16;

}  // namespace

void paged_attention(ThreadPool& pool, const AttentionShape& s, const PagedKv& kv, const float* q, float* out,
                     int64_t T, const int32_t* pos, const int32_t* const* tables, int64_t segment,
                     AttnIsa isa) {
  LOOM_ASSERT(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0 && kv.block_size > 0);
  LOOM_ASSERT(segment > 0 && segment % kTile == 0);
  const Unit u{s, kv, s.n_heads / s.n_kv_heads, 1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  LOOM_ASSERT(u.group <= kMaxGroup && (kv.dtype == DType::f32 || kv.dtype == DType::f16));
  const int64_t n_kv = s.n_kv_heads, G = u.group, d = s.head_dim;
  if (T <= 0) return;
  // Rows longer than one segment are split into segments of `segment`
  // positions (by the row's own length only); the unit that finishes a row's
  // kv head last merges its segments. Adjacent rows of one sequence (up to
  // kMaxRun) share their work items, each tile read once for all of them.
  std::vector<int64_t> n_seg(static_cast<size_t>(T)), first_part(static_cast<size_t>(T), -1);
  std::vector<WorkItem> items;
  int64_t n_parts = 0;  // partial slots: one per (segment, kv head) of the split rows
  for (int64_t t0 = 0; t0 < T;) {
    int64_t t1 = t0, run_seg = 0;
    for (; t1 < T && t1 - t0 < kMaxRun && tables[t1] == tables[t0]; ++t1) {
      const int64_t ns = (static_cast<int64_t>(pos[t1]) + segment) / segment;  // ceil((pos + 1) / segment)
      n_seg[static_cast<size_t>(t1)] = ns;
      if (ns > 1) {
        first_part[static_cast<size_t>(t1)] = n_parts;
        n_parts += ns * n_kv;
      }
      run_seg = std::max(run_seg, ns);
    }
    for (int64_t g = 0; g < n_kv; ++g)
      for (int64_t i = 0; i < run_seg; ++i) items.push_back({t0, t1, g, i});
    t0 = t1;
  }
  // Per partial: G x d sums, G maxima, G sums of exponentials, each partial on
  // its own cache lines (threads write their units' sums every tile).
  const int64_t part_floats = (G * (d + 2) + 15) / 16 * 16;
  ScratchFloats part_buf;  // 64-byte aligned
  float* part_store = n_parts > 0 ? part_buf.reserve(static_cast<size_t>(n_parts * part_floats)) : nullptr;
  std::vector<std::atomic<int64_t>> done(n_parts > 0 ? static_cast<size_t>(T * n_kv) : 0);
  auto partial = [&](int64_t t, int64_t g, int64_t i) {
    float* base = part_store +
                  (first_part[static_cast<size_t>(t)] + g * n_seg[static_cast<size_t>(t)] + i) * part_floats;
    return Partial{base, base + G * d, base + G * d + G};
  };
  const bool f16 = kv.dtype == DType::f16;
  // Two passes (scores, then softmax and sums) where the kernels take the
  // head_dim; the AVX2 online softmax over tiles otherwise.
  const bool two_pass = d % 16 == 0;  // the head dims both ISAs' two-pass kernels take
  LOOM_ASSERT(attention_isa_supported(isa));
  // A row's merge, by the last of its segments to finish (acq_rel: it sees the others' partials).
  auto segment_done = [&](int64_t t, int64_t g) {
    const int64_t ns = n_seg[static_cast<size_t>(t)];
    if (done[static_cast<size_t>(t * n_kv + g)].fetch_add(1, std::memory_order_acq_rel) + 1 == ns)
      merge_segments(
          u, [&](int64_t i) { return partial(t, g, i); }, ns, out + (t * s.n_heads + g * G) * d);
  };
  // Two passes: each row of the item over the item's positions, located once for all rows.
  int64_t max_span = 0;
  for (int64_t t = 0; t < T; ++t) max_span = std::max(max_span, std::min(int64_t{pos[t]} + 1, segment));
  const int64_t wstride = max_span + 16;
  const int64_t ldk = (max_span + 15) / 16 * 16 + 16;  // K^T columns: round_up(n, 16) are read
  bool any_chunk = false;
  for (const WorkItem& w : items) any_chunk |= w.t1 - w.t0 >= kPagedKeysTransposedMinRows;
  auto run_item_two_pass = [&]<typename E>(const WorkItem& w, const TwoPassKernels<E>& kern,
                                           PagedScratch<E>& sc) {
    const int64_t p0 = w.seg * segment;
    int64_t p_end = p0;
    for (int64_t t = w.t0; t < w.t1; ++t)
      p_end = std::max(p_end, std::min(int64_t{pos[t]} + 1, p0 + segment));
    RowCursor at{tables[w.t0], w.g, n_kv, kv.block_size, d, p0};
    for (int64_t p = p0; p < p_end; ++p, at.next()) {
      sc.k[static_cast<size_t>(p - p0)] = static_cast<const E*>(kv.k) + at.offset();
      sc.v[static_cast<size_t>(p - p0)] = static_cast<const E*>(kv.v) + at.offset();
    }
    // The prefetch distance past the last row: the last row again (already read).
    std::fill_n(sc.k.begin() + (p_end - p0), cpu::kPagedPrefetchRows,
                sc.k[static_cast<size_t>(p_end - p0 - 1)]);
    std::fill_n(sc.v.begin() + (p_end - p0), cpu::kPagedPrefetchRows,
                sc.v[static_cast<size_t>(p_end - p0 - 1)]);
    int64_t n_rows = 0;
    for (int64_t t = w.t0; t < w.t1; ++t) n_rows += n_seg[static_cast<size_t>(t)] > w.seg;
    // Many rows over the same keys (a prefill chunk) read them transposed, as
    // ops.h's batches do: one reduction tree per 16 keys, not a sum per key.
    const bool kt = n_rows >= kPagedKeysTransposedMinRows && cpu::attend_rows_kt_supports(d);
    if (kt) kern.transpose(sc.k.data(), p_end - p0, d, sc.kt.data(), ldk);
    for (int64_t t = w.t0; t < w.t1; ++t) {
      const int64_t ns = n_seg[static_cast<size_t>(t)];
      if (ns <= w.seg) continue;  // ends in an earlier segment
      const int64_t n = std::min(int64_t{pos[t]} + 1, p0 + segment) - p0;
      const Partial pt =
          ns == 1 ? Partial{out + (t * s.n_heads + w.g * G) * d, nullptr, nullptr} : partial(t, w.g, w.seg);
      const float* qg = q + (t * s.n_heads + w.g * G) * d;
      if (kt)
        kern.rows_kt(qg, static_cast<int>(G), sc.kt.data(), ldk, sc.v.data(), d, n, u.scale, sc.w.data(),
                     wstride, pt.o, pt.m, pt.l);
      else
        kern.rows(qg, static_cast<int>(G), sc.k.data(), sc.v.data(), d, n, u.scale, sc.w.data(), wstride,
                  pt.o, pt.m, pt.l);
      if (ns > 1) segment_done(t, w.g);
    }
  };
  auto run_item = [&](const WorkItem& w) {
    const int64_t p0 = w.seg * segment;
    HeadState st[kMaxRun][kMaxGroup];
    SpanRow rows[kMaxRun];
    int64_t n_rows = 0;
    for (int64_t t = w.t0; t < w.t1; ++t) {
      if (n_seg[static_cast<size_t>(t)] <= w.seg) continue;  // ends in an earlier segment
      const int64_t n = static_cast<int64_t>(pos[t]) + 1;
      float* sums =
          n_seg[static_cast<size_t>(t)] == 1 ? out + (t * s.n_heads + w.g * G) * d : partial(t, w.g, w.seg).o;
      std::fill(sums, sums + G * d, 0.0f);
      rows[n_rows] = {q + (t * s.n_heads + w.g * G) * d, sums, st[n_rows], std::min(n, p0 + segment), t};
      ++n_rows;
    }
    if (f16)
      attend_span<uint16_t>(u, w.g, tables[w.t0], p0, rows, n_rows);
    else
      attend_span<float>(u, w.g, tables[w.t0], p0, rows, n_rows);
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t t = rows[r].t, ns = n_seg[static_cast<size_t>(t)];
      const HeadState* hs = rows[r].st;
      float* og = out + (t * s.n_heads + w.g * G) * d;
      if (ns == 1) {
        for (int64_t h = 0; h < G; ++h) {
          const float inv = 1.0f / hs[h].l;
          for (int64_t i = 0; i < d; ++i) og[h * d + i] *= inv;
        }
        continue;
      }
      const Partial pt = partial(t, w.g, w.seg);
      for (int64_t h = 0; h < G; ++h) {
        pt.m[h] = hs[h].m;
        pt.l[h] = hs[h].l;
      }
      segment_done(t, w.g);
    }
  };
  // Units differ in cost (context lengths differ), so threads take them one by
  // one; which thread computes a unit does not change its result.
  std::atomic<int64_t> next{0};
  const auto n_items = static_cast<int64_t>(items.size());
  auto run_items = [&](auto&& run) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      run(items[static_cast<size_t>(i)]);
  };
  const int64_t w_floats = std::min(G, int64_t{4}) * wstride;  // paged_rows_avx512 takes heads 4 at a time
  const int64_t kt_floats = any_chunk ? d * ldk : 0;
  pool.run([&](int, int) {
    if (!two_pass) return run_items(run_item);
    if (f16) {
      const TwoPassKernels<uint16_t> kern(isa);
      PagedScratch<uint16_t> sc(max_span, w_floats, kt_floats);
      return run_items([&](const WorkItem& w) { run_item_two_pass(w, kern, sc); });
    }
    const TwoPassKernels<float> kern(isa);
    PagedScratch<float> sc(max_span, w_floats, kt_floats);
    run_items([&](const WorkItem& w) { run_item_two_pass(w, kern, sc); });
  });
}

}  // namespace loom
