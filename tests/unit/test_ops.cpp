// Fast row-wise operators against their scalar double-precision references.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/half.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/ref/ops_ref.h"
#include "ops_test_util.h"

namespace loom {
namespace {

using test_util::random_vec;

void expect_close(const std::vector<float>& a, const std::vector<float>& b, float rtol, float atol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_NEAR(a[i], b[i], atol + rtol * std::fabs(b[i])) << "at " << i;
}

TEST(Ops, RmsNormMatchesReference) {
  for (int64_t n : {1, 7, 64, 577}) {
    const int64_t T = 3;
    auto x = random_vec(static_cast<size_t>(T * n), 1, 3.0f), w = random_vec(static_cast<size_t>(n), 2);
    std::vector<float> a(x.size()), b(x.size());
    rmsnorm(a.data(), x.data(), w.data(), T, n, 1e-5f);
    ref::rmsnorm(b.data(), x.data(), w.data(), T, n, 1e-5f);
    expect_close(a, b, 1e-5f, 1e-6f);
  }
}

TEST(Ops, SwiGluMatchesReference) {
  for (int64_t n : {1, 9, 1537}) {
    auto g = random_vec(static_cast<size_t>(n), 3, 6.0f), u = random_vec(static_cast<size_t>(n), 4);
    g[0] = -90.f;  // exp overflow region must stay finite
    std::vector<float> a(g.size()), b(g.size());
    swiglu(a.data(), g.data(), u.data(), n);
    ref::swiglu(b.data(), g.data(), u.data(), n);
    expect_close(a, b, 1e-5f, 1e-6f);
  }
}

TEST(Ops, RopeMatchesReferenceBothLayouts) {
  for (bool inter : {true, false}) {
    RopeTable rope;
    rope.head_dim = 16;
    rope.interleaved = inter;
    for (int i = 0; i < 8; ++i) rope.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / 16)));
    const int64_t T = 5, H = 3;
    auto x = random_vec(static_cast<size_t>(T * H * 16), 5);
    std::vector<int32_t> pos = {0, 1, 17, 300, 8191};
    auto a = x, b = x;
    rope_apply(rope, a.data(), T, H, pos.data());
    ref::rope_apply(rope, b.data(), T, H, pos.data());
    expect_close(a, b, 1e-5f, 1e-5f);
  }
}

TEST(Ops, AttentionMatchesReferenceWithGqaAndPacking) {
  ThreadPool pool(2);
  AttentionShape s{6, 2, 20, 2 * 20 + 3};  // awkward head_dim and padded kv stride
  const int64_t T = 13, ctx = 40;
  auto q = random_vec(static_cast<size_t>(T * 6 * 20), 6, 2.0f);
  auto k = random_vec(static_cast<size_t>(ctx * s.kv_stride), 7, 2.0f);
  auto v = random_vec(static_cast<size_t>(ctx * s.kv_stride), 8);
  std::vector<int32_t> pos(T), start(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[static_cast<size_t>(t)] = static_cast<int32_t>(20 + t);
    start[static_cast<size_t>(t)] = t < 6 ? 0 : 26;  // second packed sample begins at position 26
  }
  std::vector<float> a(q.size()), b(q.size());
  attention(pool, s, q.data(), k.data(), v.data(), a.data(), T, pos.data(), start.data());
  ref::attention(s, q.data(), k.data(), v.data(), b.data(), T, pos.data(), start.data());
  expect_close(a, b, 1e-4f, 1e-5f);
}

// The blocked kernel (4 keys a pass over q, the weighted sum in registers,
// rows dealt round-robin) gives the same bits as the plain per-key loop it
// replaced (simd::dot per key, simd::axpy per key), which this test keeps as
// its reference: every head_dim path (64, 128, 32 in registers; 48 and 20 by
// axpy), key counts not a multiple of 4, 1 and 3 threads.
void plain_attention(const AttentionShape& s, const float* q, const float* k, const float* v, float* out,
                     int64_t T, const int32_t* pos, const int32_t* start) {
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> w(static_cast<size_t>(pos[T - 1]) + 9);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < s.n_heads; ++h) {
      const float* qv = q + (t * s.n_heads + h) * d;
      const int64_t first = start[t], n = pos[t] - first + 1, g = h / group;
      float mx = -INFINITY;
      for (int64_t p = 0; p < n; ++p) {
        w[static_cast<size_t>(p)] = simd::dot(qv, k + (first + p) * s.kv_stride + g * d, d) * scale;
        mx = std::max(mx, w[static_cast<size_t>(p)]);
      }
      const __m256 vmx = _mm256_set1_ps(mx);
      __m256 vsum = _mm256_setzero_ps();
      int64_t p = 0;
      for (; p + 8 <= n; p += 8) {
        const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(&w[static_cast<size_t>(p)]), vmx));
        _mm256_storeu_ps(&w[static_cast<size_t>(p)], e);
        vsum = _mm256_add_ps(vsum, e);
      }
      float sum = simd::hsum(vsum);
      for (; p < n; ++p) {
        w[static_cast<size_t>(p)] = std::exp(w[static_cast<size_t>(p)] - mx);
        sum += w[static_cast<size_t>(p)];
      }
      float* o = out + (t * s.n_heads + h) * d;
      std::fill(o, o + d, 0.0f);
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < n; ++j)
        simd::axpy(o, w[static_cast<size_t>(j)] * inv, v + (first + j) * s.kv_stride + g * d, d);
    }
}

// A case's keys and values as the kernel reads them: f32 as drawn, or rounded
// to IEEE half (an f16 store; the kernel reads the bits, the plain loop the
// widened values, and the two must agree bit for bit).
struct KvCase {
  std::vector<float> k, v;         // what the plain loop reads
  std::vector<uint16_t> k16, v16;  // the f16 store
  DType dtype;

  KvCase(std::vector<float> k_, std::vector<float> v_, DType dt)
      : k(std::move(k_)), v(std::move(v_)), dtype(dt) {
    if (dt != DType::f16) return;
    for (auto [x, h] : {std::pair{&k, &k16}, std::pair{&v, &v16}})
      for (float& e : *x) {
        h->push_back(fp32_to_fp16(e));
        e = fp16_to_fp32(h->back());
      }
  }
  KvRows rows() const {
    if (dtype == DType::f16) return {k16.data(), v16.data(), DType::f16};
    return {k.data(), v.data(), DType::f32};
  }
};

// On AVX-512 machines the heads of a GQA group run in one pass
// (kernels/cpu/attention_rows.h): groups of 1, 2, 3 and 6 (a pass of 4 rows,
// then 2), one head per pass when the batch is small (T = 1: decode; T = 16 on
// 5 threads), head_dim 16 to 256, batches of 16+ rows on K^T (head_dim 32, 64,
// 96, 128), two packed samples, f32 and f16 stores, and every result still
// equal to the plain loop's bits.
TEST(Ops, BlockedAttentionEqualsThePlainLoopBitForBit) {
  const std::pair<int64_t, int64_t> heads[] = {{6, 2}, {6, 1}, {4, 4}, {4, 2}};
  for (DType dt : {DType::f32, DType::f16})
    for (int64_t d : {64, 128, 32, 96, 48, 20, 16, 256}) {
      for (const auto& [n_heads, kv_heads] : heads) {
        for (int64_t T : {23, 1, 16}) {
          for (bool packed : {false, true}) {
            for (int threads : {1, 3, 5}) {
              ThreadPool pool(threads);
              AttentionShape s{n_heads, kv_heads, d, kv_heads * d + 5};
              const int64_t ctx = 61;
              auto q = random_vec(static_cast<size_t>(T * n_heads * d), 16, 3.0f);
              const KvCase kv(random_vec(static_cast<size_t>(ctx * s.kv_stride), 17, 3.0f),
                              random_vec(static_cast<size_t>(ctx * s.kv_stride), 18), dt);
              std::vector<int32_t> pos(T), start(T);
              for (int64_t t = 0; t < T; ++t) {
                pos[static_cast<size_t>(t)] = static_cast<int32_t>(60 - T + 1 + t);
                // packed: rows past the middle begin a sample at key 41 (not a multiple of 16)
                start[static_cast<size_t>(t)] =
                    packed && 2 * t >= T ? std::min(41, pos[static_cast<size_t>(t)]) : 0;
              }
              std::vector<float> a(q.size()), b(q.size());
              attention(pool, s, q.data(), kv.rows(), a.data(), T, pos.data(),
                        packed ? start.data() : nullptr);
              plain_attention(s, q.data(), kv.k.data(), kv.v.data(), b.data(), T, pos.data(), start.data());
              ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                  << dtype_name(dt) << ", head_dim " << d << ", heads " << n_heads << "/" << kv_heads
                  << ", T " << T << ", packed " << packed << ", " << threads << " threads";
            }
          }
        }
      }
    }
}

// Rows whose keys span several chunks of the AVX2 scores (256 keys, kScoreChunk
// in kernels/cpu/ops.cpp) and end off a block of 8 or 16: 531 keys, the second
// packed sample from key 297; f32 and f16 stores.
TEST(Ops, LongRowsOnKeysTransposedEqualThePlainLoopBitForBit) {
  const std::pair<int64_t, int64_t> heads[] = {{6, 2}, {4, 4}};
  for (DType dt : {DType::f32, DType::f16})
    for (int64_t d : {64, 128, 96}) {
      for (const auto& [n_heads, kv_heads] : heads) {
        for (bool packed : {false, true}) {
          for (int threads : {1, 3}) {
            ThreadPool pool(threads);
            AttentionShape s{n_heads, kv_heads, d, kv_heads * d + 3};
            const int64_t ctx = 531, T = 20;
            auto q = random_vec(static_cast<size_t>(T * n_heads * d), 26, 3.0f);
            const KvCase kv(random_vec(static_cast<size_t>(ctx * s.kv_stride), 27, 3.0f),
                            random_vec(static_cast<size_t>(ctx * s.kv_stride), 28), dt);
            std::vector<int32_t> pos(T), start(T);
            for (int64_t t = 0; t < T; ++t) {
              pos[static_cast<size_t>(t)] = static_cast<int32_t>(ctx - T + t);
              start[static_cast<size_t>(t)] = packed && 2 * t >= T ? 297 : 0;
            }
            std::vector<float> a(q.size()), b(q.size());
            attention(pool, s, q.data(), kv.rows(), a.data(), T, pos.data(), packed ? start.data() : nullptr);
            plain_attention(s, q.data(), kv.k.data(), kv.v.data(), b.data(), T, pos.data(), start.data());
            ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                << dtype_name(dt) << ", head_dim " << d << ", heads " << n_heads << "/" << kv_heads
                << ", packed " << packed << ", " << threads << " threads";
          }
        }
      }
    }
}

// Decode rows over long contexts (keys and values of at least 512 KiB: both
// ISAs split keys and value columns across the threads, kKeysSplitMinBytes in
// kernels/cpu/ops.cpp; the AVX2 kernels under the unit_cpu_avx2 ctest entry):
// GQA groups of 3, 6 (AVX2 scores three heads at a time, AVX-512 a pass of 4
// then 2), 4 and 1; head dims 32, 64, 128 and 96, so the value columns split
// unevenly (32 on 3 threads leaves one without, 96 on 2 gives each 3 blocks of
// 16); key counts that end off a block of 4, 2 and 3 threads, a packed sample
// starting at key 301; f32 and f16 stores (the split counts keys, not bytes):
// the plain loop's bits.
TEST(Ops, LongDecodeRowsEqualThePlainLoopBitForBit) {
  const std::pair<int64_t, int64_t> heads[] = {{9, 3}, {12, 2}, {8, 2}, {4, 4}};
  for (DType dt : {DType::f32, DType::f16})
    for (int64_t d : {64, 32, 128, 96}) {
      for (const auto& [n_heads, kv_heads] : heads) {
        for (int64_t ctx : {int64_t{1703}, int64_t{1090}}) {
          for (bool packed : {false, true}) {
            for (int threads : {2, 3}) {
              ThreadPool pool(threads);
              AttentionShape s{n_heads, kv_heads, d, kv_heads * d + 8};
              const KvCase kv(random_vec(static_cast<size_t>(ctx * s.kv_stride), 37, 3.0f),
                              random_vec(static_cast<size_t>(ctx * s.kv_stride), 38), dt);
              ASSERT_GE(ctx * s.kv_stride * 8, int64_t{512} << 10);
              auto q = random_vec(static_cast<size_t>(n_heads * d), 36, 3.0f);
              const int32_t pos = static_cast<int32_t>(ctx - 1), start = packed ? 301 : 0;
              std::vector<float> a(q.size()), b(q.size());
              attention(pool, s, q.data(), kv.rows(), a.data(), 1, &pos, packed ? &start : nullptr);
              plain_attention(s, q.data(), kv.k.data(), kv.v.data(), b.data(), 1, &pos, &start);
              ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                  << dtype_name(dt) << ", head_dim " << d << ", heads " << n_heads << "/" << kv_heads << ", "
                  << ctx << " keys, packed " << packed << ", " << threads << " threads";
            }
          }
        }
      }
    }
}

}  // namespace
}  // namespace loom
