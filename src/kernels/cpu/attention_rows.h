// Inference attention for the query heads that share one KV head, on AVX-512 F:
// every key and value row is loaded once for all of them (the GQA group), 16
// lanes at a time. Each output row is bit-identical to ops.cpp's per-head AVX2
// loop (the same FMA chain per lane, the same lane reductions, the same exp
// polynomial and softmax sum order), so which path, grouping or thread count
// computed a row never changes it: decode and prefill stay batch invariant.
#pragma once

#include <cstdint>

namespace loom::cpu {

// Where key or value row p is, for the kernels of both ISA files: rows at a
// fixed stride (a contiguous cache), or one pointer per row (positions gathered
// from the blocks of a paged store).
template <typename E>
struct Strided {
  using Elem = E;
  const E* base;
  int64_t stride;
  const E* operator()(int64_t p) const { return base + p * stride; }
};
template <typename E>
struct Gathered {
  using Elem = E;
  const E* const* rows;
  const E* operator()(int64_t p) const { return rows[p]; }
};

// Whether attend_rows_avx512 takes this head_dim (a positive multiple of 16).
inline bool attend_rows_avx512_supports(int64_t head_dim) { return head_dim > 0 && head_dim % 16 == 0; }

// For r < rows: o[r * d ..] = softmax(q[r * d ..] . K^T * scale) V over keys
// [0, n); key/value p at kb / vb + p * stride. w: scratch of rows * wstride
// floats, wstride >= n + 16 (its padding may hold anything). Needs AVX-512 F/DQ.
// The uint16_t overloads here and below read keys and values as IEEE half,
// widened exactly: the bits of the f32 kernel on the widened values.
void attend_rows_avx512(const float* q, int rows, const float* kb, const float* vb, int64_t stride, int64_t d,
                        int64_t n, float scale, float* w, int64_t wstride, float* o);
void attend_rows_avx512(const float* q, int rows, const uint16_t* kb, const uint16_t* vb, int64_t stride,
                        int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o);

// attend_rows_avx512 on rows located one by one (a paged store's positions,
// kernels/cpu/paged_attention.cpp): key / value p at kr[p] / vr[p], p < n;
// kr and vr hold n + kPagedPrefetchRows readable pointers (the ones past n are
// only prefetched).
// With m == nullptr, o gets attend_rows_avx512's bits for the same rows
// gathered. Otherwise (a segment of a longer row) o[r] gets the unnormalized
// sums sum_p exp(s_p - m[r]) v_p, m[r] the largest score, l[r] the sum of the
// exponentials, for the caller to merge segments.
void paged_rows_avx512(const float* q, int rows, const float* const* kr, const float* const* vr, int64_t d,
                       int64_t n, float scale, float* w, int64_t wstride, float* o, float* m, float* l);
void paged_rows_avx512(const float* q, int rows, const uint16_t* const* kr, const uint16_t* const* vr,
                       int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                       float* l);

// The AVX2 counterpart (kernels/cpu/ops.cpp; head_dim a multiple of 16): ops.h's
// AVX2 attention arithmetic (the same bits as attend_rows_avx512) on the
// located rows; w holds min(rows, 3) rows of wstride floats.
void paged_rows_avx2(const float* q, int rows, const float* const* kr, const float* const* vr, int64_t d,
                     int64_t n, float scale, float* w, int64_t wstride, float* o, float* m, float* l);
void paged_rows_avx2(const float* q, int rows, const uint16_t* const* kr, const uint16_t* const* vr,
                     int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                     float* l);

// And on K^T (kernels/cpu/ops.cpp; as paged_rows_kt_avx512 below, reading K^T
// to round_up(n, 8)); w holds min(rows, 3) rows of wstride floats.
void paged_rows_kt_avx2(const float* q, int rows, const float* kt, int64_t ldk, const float* const* vr,
                        int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                        float* l);
void paged_rows_kt_avx2(const float* q, int rows, const float* kt, int64_t ldk, const uint16_t* const* vr,
                        int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                        float* l);
void transpose_rows_avx2(const float* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk);
void transpose_rows_avx2(const uint16_t* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk);

// Rows of a prefill chunk in a paged store (many rows over the same positions):
// keys from K^T as attend_rows_kt_avx512 reads them, values at vr[p], and the
// output as paged_rows_avx512's (the same bits, m == nullptr or not).
void paged_rows_kt_avx512(const float* q, int rows, const float* kt, int64_t ldk, const float* const* vr,
                          int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                          float* l);
void paged_rows_kt_avx512(const float* q, int rows, const float* kt, int64_t ldk, const uint16_t* const* vr,
                          int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                          float* l);
// kt[e * ldk + p] = rows[p][e] widened to f32, for e < d (a multiple of 16) and
// p < round_up(n, 16): rows holds that many readable pointers.
void transpose_rows_avx512(const float* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk);
void transpose_rows_avx512(const uint16_t* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk);

// Batches (prefill) read the keys of one KV head transposed, K^T[e * ldk + p] =
// k[p * stride + e], 16 keys across the lanes of each FMA, which leaves one
// reduction tree per 16 keys instead of a horizontal sum per key; the products,
// chains and tree are attend_rows_avx512's, so the bits are too. These are the
// head dims the K^T kernels are built for (unrolled per size; ops.cpp has the
// AVX2 kernel, 8 keys a vector).
inline bool attend_rows_kt_supports(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
}

// fn.template operator()<R>(r0) for the rows [r0, r0 + R) of each pass, passes of
// 4 rows (the register budget of both ISA files' kernels) and a last shorter one.
template <class Fn>
inline void visit_row_passes(int rows, Fn&& fn) {
  for (int r0 = 0; r0 < rows; r0 += 4) {
    switch (rows - r0 < 4 ? rows - r0 : 4) {
      case 1:
        fn.template operator()<1>(r0);
        break;
      case 2:
        fn.template operator()<2>(r0);
        break;
      case 3:
        fn.template operator()<3>(r0);
        break;
      default:
        fn.template operator()<4>(r0);
        break;
    }
  }
}

// fn.template operator()<M>() with M = head_dim / 16, for a supported head_dim:
// both ISA files' kernels are unrolled per M.
template <class Fn>
inline void visit_head_blocks(int64_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 32:
      return fn.template operator()<2>();
    case 64:
      return fn.template operator()<4>();
    case 96:
      return fn.template operator()<6>();
    case 128:
      return fn.template operator()<8>();
    default:
      __builtin_trap();  // attend_rows_kt_supports
  }
}

// attend_rows_avx512 with the keys from K^T: kt points at the first key's
// column and may be read up to column round_up(n, 16) (ldk leaves room).
void attend_rows_kt_avx512(const float* q, int rows, const float* kt, int64_t ldk, const float* vb,
                           int64_t stride, int64_t d, int64_t n, float scale, float* w, int64_t wstride,
                           float* o);

// Rows past the current key a paged row's score pass prefetches (both ISAs).
constexpr int64_t kPagedPrefetchRows = 32;

// Requests key and value rows p + kPagedPrefetchRows .. + 3 (row_bytes each)
// into L1: a paged store's blocks lie anywhere, so the hardware's stream
// prefetchers stop at each block's end.
template <typename E>
inline void prefetch_paged_rows4(const E* const* kr, const E* const* vr, int64_t p, int64_t row_bytes) {
  for (int64_t j = p + kPagedPrefetchRows; j < p + kPagedPrefetchRows + 4; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kr[j]) + b, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(vr[j]) + b, 0, 3);
    }
}

// K/V rows ahead that a long decode row's passes prefetch (both ISAs).
constexpr int64_t kDecodePrefetchRows = 16;

// A long decode row split across threads by keys and value columns (ops.cpp's
// decode_attention_keys_split), in three passes, each lane's arithmetic that of
// attend_rows_avx512 (so attend_row's bits).
// 1. Scores of keys [p0, p1) for all n_heads heads (GQA groups of `group` heads
//    sharing a KV head, K head g at k + g * d): w[h * ws + p], the groups' heads
//    4 at a time on each 4 keys. Keys past p0 + 4 rows ahead are prefetched when
//    below n (the whole row's key count).
void decode_scores_avx512(const float* q, int64_t n_heads, int64_t group, const float* k, int64_t stride,
                          int64_t d, float scale, float* w, int64_t ws, int64_t p0, int64_t p1, int64_t n);
void decode_scores_avx512(const float* q, int64_t n_heads, int64_t group, const uint16_t* k, int64_t stride,
                          int64_t d, float scale, float* w, int64_t ws, int64_t p0, int64_t p1, int64_t n);
// 2. One head's scores to softmax weights divided by their sum, in place;
//    w has room for n + 16 floats.
void decode_softmax_avx512(float* w, int64_t n);
// 3. o[r * d + c] = sum_j a[r * ws + j] v_j[c] for r < rows, c in [c0, c1)
//    (multiples of 16), V rows prefetched ahead.
void decode_weighted_sums_avx512(const float* a, int rows, int64_t ws, const float* v, int64_t stride,
                                 int64_t n, float* o, int64_t d, int64_t c0, int64_t c1);
void decode_weighted_sums_avx512(const float* a, int rows, int64_t ws, const uint16_t* v, int64_t stride,
                                 int64_t n, float* o, int64_t d, int64_t c0, int64_t c1);

}  // namespace loom::cpu
