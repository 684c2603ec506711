#include "kernels/cpu/lora_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/simd_rows.h"

namespace loom {

namespace {

// Columns per unit of the second pass.
constexpr int64_t kLoraCols = 64;

// y[n0, n1) += B[n0, n1) u with 8 rows of B per dot product (padded with the last row).
void add_b_times_u(const LoraFactor& f, const float* u, float* y, int64_t c0, int64_t c1) {
  const int64_t r = f.rank;
  for (int64_t n = c0; n < c1; n += 8) {
    const float* rows[8];
    for (int64_t m = 0; m < 8; ++m) rows[m] = f.b + std::min(n + m, c1 - 1) * r;
    const __m256 d = simd::dot8(u, rows, r);
    if (n + 8 <= c1) {
      _mm256_storeu_ps(y + n, _mm256_add_ps(_mm256_loadu_ps(y + n), d));
    } else {
      alignas(32) float v[8];
      _mm256_store_ps(v, d);
      for (int64_t m = 0; n + m < c1; ++m) y[n + m] += v[m];
    }
  }
}

// u[:rank] = scale * (A x), 4 rows of A per dot product (padded with the last row).
void scaled_a_times_x(const LoraFactor& f, const float* x, float* u) {
  const int64_t r = f.rank, in = f.in;
  for (int64_t j = 0; j < r; j += 4) {
    const float* rows[4];
    for (int64_t k = 0; k < 4; ++k) rows[k] = f.a + std::min(j + k, r - 1) * in;
    float s[4];
    simd::dot4(x, rows, in, s);
    for (int64_t k = 0; k < 4 && j + k < r; ++k) u[j + k] = s[k] * f.scale;
  }
}

// base[at, at + n) = x, as f32 or as IEEE half (the F16C instruction and the scalar tail agree).
void store_row(void* base, int64_t at, const float* x, int64_t n, bool f16) {
  if (!f16) {
    std::memcpy(static_cast<float*>(base) + at, x, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(base) + at;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) d[i] = fp32_to_fp16(x[i]);
}

}  // namespace

void lora_rows(ThreadPool& pool, std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows,
               int64_t max_rank, float* u, int64_t T) {
  LOOM_ASSERT(jobs.size() <= 3);
  const auto NR = static_cast<int64_t>(rows.size());
  const int64_t R = max_rank, n_jobs = static_cast<int64_t>(jobs.size());
  pool.parallel_for(n_jobs * NR, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const LoraRowsJob& job = jobs[static_cast<size_t>(i / NR)];
      const int64_t k = i % NR, row = rows[static_cast<size_t>(k)];
      const LoraFactor* f = job.factors[k];
      if (f == nullptr) continue;
      scaled_a_times_x(*f, job.x + row * job.ldx, u + ((i / NR) * T + row) * R);
    }
  });
  // Units of the second pass: job-major, then column block, then row (rows of
  // one adapter adjacent), so a thread's run of units reuses one block of B.
  int64_t first[4] = {0, 0, 0, 0};
  for (int64_t j = 0; j < n_jobs; ++j)
    first[j + 1] = first[j] + NR * ((jobs[static_cast<size_t>(j)].out + kLoraCols - 1) / kLoraCols);
  pool.parallel_for(first[n_jobs], [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t j = 0;
      while (i >= first[j + 1]) ++j;
      const LoraRowsJob& job = jobs[static_cast<size_t>(j)];
      const int64_t k = i - first[j], row = rows[static_cast<size_t>(k % NR)];
      const LoraFactor* f = job.factors[k % NR];
      if (f == nullptr) continue;
      const int64_t c0 = (k / NR) * kLoraCols, c1 = std::min(f->out, c0 + kLoraCols);
      add_b_times_u(*f, u + (j * T + row) * R, job.y + row * job.ldy, c0, c1);
    }
  });
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
