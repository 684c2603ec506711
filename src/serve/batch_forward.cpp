// Batched forward step over the paged KV cache (see batch_forward.h). Buffers
// are sized at construction (the logits and LoRA buffers grow only past their
// largest use), so a step does not allocate after warm-up.
#include "serve/batch_forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/ops.h"
#include "kernels/paged_attention.h"
#include "kernels/cpu/dequant.h"
#include "kernels/simd_avx2.h"
#include "kernels/simd_rows.h"

namespace loom {

namespace {

template <typename T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// base[at, at + n) = x, as f32 or as IEEE half (round to nearest even; the
// F16C instruction and the scalar tail agree).
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

// Columns per unit of the LoRA output products and of SwiGLU.
constexpr int64_t kLoraCols = 64;
constexpr int64_t kSwigluCols = 256;

}  // namespace

BatchForward::BatchForward(const ModelConfig& config, const ModelWeights& weights, ThreadPool& pool,
                           KvPool& kv, int64_t max_batch_tokens, int64_t max_logit_rows)
    : c_(config), w_(weights), pool_(pool), kv_(kv), max_tokens_(max_batch_tokens) {
  LOOM_ASSERT(max_batch_tokens > 0 && max_logit_rows > 0);
  LOOM_ASSERT(weights.packed.size() == weights.layers.size() && !weights.output_packed.empty());
  LOOM_ASSERT(kv.n_layers() == config.n_layers && kv.n_kv_heads() == config.n_kv_heads &&
              kv.head_dim() == config.head_dim);
  const auto mt = static_cast<size_t>(max_batch_tokens);
  pos_.resize(mt);
  kv_slot_.resize(mt);
  tables_.resize(mt);
  rope_cs_.resize(mt * static_cast<size_t>(c_.head_dim));
  row_adapter_.resize(mt);
  lora_rows_.reserve(mt);
  logit_src_.reserve(mt);
  x_.resize(mt * static_cast<size_t>(c_.hidden));
  xn_.resize(x_.size());
  q_.resize(mt * static_cast<size_t>(c_.q_dim()));
  att_.resize(q_.size());
  k_.resize(mt * static_cast<size_t>(c_.kv_dim()));
  v_.resize(k_.size());
  gate_.resize(mt * static_cast<size_t>(c_.intermediate));
  up_.resize(gate_.size());
  logits_.resize(static_cast<size_t>(std::min(max_logit_rows, max_batch_tokens) * c_.vocab_size));
}

const float* BatchForward::logits(size_t chunk) const {
  LOOM_ASSERT(chunk < logit_row_.size());
  const int64_t i = logit_row_[chunk];
  return i < 0 ? nullptr : logits_.data() + i * c_.vocab_size;
}

// Per-row bookkeeping of a step: positions, KV rows, RoPE angles, adapters.
void BatchForward::prepare(std::span<const BatchChunk> chunks) {
  int64_t T = 0;
  for (const BatchChunk& ch : chunks) {
    LOOM_ASSERT(ch.table != nullptr && !ch.tokens.empty() && ch.n_past >= 0);
    for (int32_t t : ch.tokens)
      if (t < 0 || t >= c_.vocab_size)
        fail(ErrorKind::invalid_input, "token id {} is outside the vocabulary [0, {})", t, c_.vocab_size);
    T += static_cast<int64_t>(ch.tokens.size());
  }
  LOOM_ASSERT(T <= max_tokens_);
  T_ = T;

  const int64_t bs = kv_.block_size(), half = w_.rope.head_dim / 2;
  logit_row_.assign(chunks.size(), -1);
  logit_src_.clear();
  lora_rows_.clear();
  lora_rank_ = 0;
  int64_t r = 0;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const BatchChunk& ch = chunks[ci];
    const int64_t n = static_cast<int64_t>(ch.tokens.size()), end = ch.n_past + n;
    const BlockTable& tb = *ch.table;
    LOOM_ASSERT(end <= tb.n_blocks() * bs);
    // The blocks written must belong to this sequence alone (never a shared prefix block).
    for (int64_t b = ch.n_past / bs; b < (end + bs - 1) / bs; ++b)
      LOOM_ASSERT(kv_.ref_count(tb.blocks[static_cast<size_t>(b)]) == 1);
    if (ch.adapter != nullptr) {
      LOOM_ASSERT(ch.adapter->pairs.size() == static_cast<size_t>(c_.n_layers * kLoraTargetCount));
      if (ci == 0 || chunks[ci - 1].adapter != ch.adapter)
        lora_rank_ = std::max(lora_rank_, ch.adapter->max_rank());
    }
    for (int64_t i = 0; i < n; ++i, ++r) {
      const auto ur = static_cast<size_t>(r);
      const int64_t p = ch.n_past + i;
      pos_[ur] = static_cast<int32_t>(p);
      kv_slot_[ur] = kv_.slot_of(tb, p);
      tables_[ur] = tb.blocks.data();
      row_adapter_[ur] = ch.adapter;
      if (ch.adapter != nullptr) lora_rows_.push_back(static_cast<int32_t>(r));
      // The angles of rope_rotate (kernels/ops.cpp), computed once per step instead of per layer.
      float* cs = rope_cs_.data() + r * w_.rope.head_dim;
      for (int64_t j = 0; j < half; ++j) {
        const double a = static_cast<double>(p) * w_.rope.inv_freq[static_cast<size_t>(j)];
        cs[j] = static_cast<float>(std::cos(a));
        cs[half + j] = static_cast<float>(std::sin(a));
      }
    }
    if (ch.want_logits) {
      logit_row_[ci] = static_cast<int64_t>(logit_src_.size());
      logit_src_.push_back(r - 1);
    }
  }
  // Rows of one adapter next to each other: the LoRA passes then walk each
  // adapter's A and B once per run of rows (from cache) instead of once per row
  // (a 256-row prefill chunk read ~2 GB of adapter weights otherwise). Order
  // only decides which thread computes a row; each row's result is unchanged.
  std::sort(lora_rows_.begin(), lora_rows_.end(), [&](int32_t a, int32_t b) {
    const ServeAdapter* pa = row_adapter_[static_cast<size_t>(a)];
    const ServeAdapter* pb = row_adapter_[static_cast<size_t>(b)];
    return pa != pb ? std::less<const ServeAdapter*>()(pa, pb) : a < b;
  });
  grow(lora_u_, static_cast<size_t>(3 * T * lora_rank_));
  grow(logits_, logit_src_.size() * static_cast<size_t>(c_.vocab_size));
}

void BatchForward::step(std::span<const BatchChunk> chunks) {
  if (chunks.empty()) {
    logit_row_.clear();
    return;
  }
  prepare(chunks);
  const int64_t T = T_, H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate;
  const auto eps = static_cast<float>(c_.rms_eps);
  float* x = x_.data();
  float* xn = xn_.data();
  {
    int64_t r = 0;
    const Tensor& e = w_.token_embd;
    for (const BatchChunk& ch : chunks)
      for (int32_t t : ch.tokens) dequantize_row(e.dtype, e.row_ptr(t), x + (r++) * H, H);
  }
  const AttentionShape shape{c_.n_heads, c_.n_kv_heads, c_.head_dim, KV};
  const bool lora = !lora_rows_.empty();

  for (int64_t l = 0; l < c_.n_layers; ++l) {
    const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
    const PackedLayer& P = w_.packed[static_cast<size_t>(l)];
    pool_.parallel_for(
        T, [&](int64_t b, int64_t e) { rmsnorm(xn + b * H, x + b * H, L.attn_norm, e - b, H, eps); }, 8);
    const MatmulOut qkv[] = {{&P.wq, q_.data(), Q}, {&P.wk, k_.data(), KV}, {&P.wv, v_.data(), KV}};
    matmul_multi(pool_, qkv, xn, H, T, scratch_);
    if (L.bq != nullptr) {
      for (int64_t t = 0; t < T; ++t) {
        add_inplace(q_.data() + t * Q, L.bq, Q);
        add_inplace(k_.data() + t * KV, L.bk, KV);
        add_inplace(v_.data() + t * KV, L.bv, KV);
      }
    }
    if (lora) {
      const LoraJob jobs[] = {{LoraTarget::q, xn, H, q_.data(), Q},
                              {LoraTarget::k, xn, H, k_.data(), KV},
                              {LoraTarget::v, xn, H, v_.data(), KV}};
      apply_lora(l, jobs);
    }
    rope_and_store(l);
    const PagedKv kv{kv_.keys(l), kv_.values(l), kv_.block_size(), kv_.dtype()};
    paged_attention(pool_, shape, kv, q_.data(), att_.data(), T, pos_.data(), tables_.data());
    matmul(pool_, P.wo, att_.data(), xn, T, scratch_);
    if (lora) {
      const LoraJob jobs[] = {{LoraTarget::o, att_.data(), Q, xn, H}};
      apply_lora(l, jobs);
    }
    add_inplace(x, xn, T * H);

    pool_.parallel_for(
        T, [&](int64_t b, int64_t e) { rmsnorm(xn + b * H, x + b * H, L.ffn_norm, e - b, H, eps); }, 8);
    const MatmulOut gate_up[] = {{&P.w_gate, gate_.data(), F}, {&P.w_up, up_.data(), F}};
    matmul_multi(pool_, gate_up, xn, H, T, scratch_);
    if (lora) {
      const LoraJob jobs[] = {{LoraTarget::gate, xn, H, gate_.data(), F},
                              {LoraTarget::up, xn, H, up_.data(), F}};
      apply_lora(l, jobs);
    }
    swiglu_rows();
    matmul(pool_, P.w_down, gate_.data(), xn, T, scratch_);
    if (lora) {
      const LoraJob jobs[] = {{LoraTarget::down, gate_.data(), F, xn, H}};
      apply_lora(l, jobs);
    }
    add_inplace(x, xn, T * H);
  }

  // Only the rows whose logits are wanted pass the final norm and the output projection.
  const auto n_out = static_cast<int64_t>(logit_src_.size());
  if (n_out == 0) return;
  for (int64_t i = 0; i < n_out; ++i)
    rmsnorm(xn + i * H, x + logit_src_[static_cast<size_t>(i)] * H, w_.output_norm, 1, H, eps);
  matmul(pool_, w_.output_packed, xn, logits_.data(), n_out, scratch_);
}

// RoPE on q and k with the step's angles (the arithmetic of rope_rotate), then
// k and v rows into the sequence's blocks.
void BatchForward::rope_and_store(int64_t layer) {
  const int64_t d = w_.rope.head_dim, half = d / 2, Q = c_.q_dim(), KV = c_.kv_dim(), hd = c_.head_dim;
  const bool inter = w_.rope.interleaved;
  void* kc = kv_.keys(layer);
  void* vc = kv_.values(layer);
  const bool f16 = kv_.dtype() == DType::f16;
  pool_.parallel_for(
      T_,
      [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const float* cs = rope_cs_.data() + t * d;
          auto rotate = [&](float* row, int64_t n_heads) {
            for (int64_t h = 0; h < n_heads; ++h) {
              float* v = row + h * d;
              for (int64_t i = 0; i < half; ++i) {
                const int64_t i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + half;
                const float c = cs[i], s = cs[half + i];
                const float x0 = v[i0], x1 = v[i1];
                v[i0] = x0 * c - x1 * s;
                v[i1] = x0 * s + x1 * c;
              }
            }
          };
          rotate(q_.data() + t * Q, c_.n_heads);
          float* kr = k_.data() + t * KV;
          rotate(kr, c_.n_kv_heads);
          const int64_t slot = kv_slot_[static_cast<size_t>(t)];
          for (int64_t g = 0; g < c_.n_kv_heads; ++g) {
            const int64_t at = kv_.offset(slot, g);
            store_row(kc, at, kr + g * hd, hd, f16);
            store_row(vc, at, v_.data() + t * KV + g * hd, hd, f16);
          }
        }
      },
      4);
}

// gate = silu(gate) * up, in fixed column blocks so each element's arithmetic
// (vector body or scalar tail of swiglu) depends on its column only.
void BatchForward::swiglu_rows() {
  const int64_t F = c_.intermediate, nb = (F + kSwigluCols - 1) / kSwigluCols;
  float* g = gate_.data();
  const float* u = up_.data();
  pool_.parallel_for(T_ * nb, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / nb, c0 = (i % nb) * kSwigluCols, n = std::min(kSwigluCols, F - c0);
      swiglu(g + t * F + c0, g + t * F + c0, u + t * F + c0, n);
    }
  });
}

// Two passes, each one parallel dispatch over all jobs and adapter rows:
//   u[j, row, :] = scale * (A x[row])        (rank dot products of length in, 4 at a time)
//   y[row, n]   += dot(B[n, :], u[j, row, :]) (per column block, 8 at a time)
// Each element is computed by one fixed sequence of operations, so a row's
// result does not depend on the other rows or on the threads.
void BatchForward::apply_lora(int64_t layer, std::span<const LoraJob> jobs) {
  LOOM_ASSERT(jobs.size() <= 3);
  const auto NR = static_cast<int64_t>(lora_rows_.size());
  const int64_t R = lora_rank_, n_jobs = static_cast<int64_t>(jobs.size());
  float* U = lora_u_.data();
  auto pair_of = [&](int64_t row, LoraTarget t) -> const ServeLoraPair* {
    const ServeLoraPair& p = row_adapter_[static_cast<size_t>(row)]->pair(layer, t);
    return p.present() ? &p : nullptr;
  };
  pool_.parallel_for(n_jobs * NR, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const LoraJob& job = jobs[static_cast<size_t>(i / NR)];
      const int64_t row = lora_rows_[static_cast<size_t>(i % NR)];
      const ServeLoraPair* p = pair_of(row, job.target);
      if (p == nullptr) continue;
      const float scale = row_adapter_[static_cast<size_t>(row)]->scale;
      const int64_t r = p->rank(), in = p->a.dim(1);
      const float* A = p->a.as<float>();
      const float* xr = job.x + row * job.ldx;
      float* u = U + ((i / NR) * T_ + row) * R;
      for (int64_t j = 0; j < r; j += 4) {
        const float* rows[4];
        for (int64_t k = 0; k < 4; ++k) rows[k] = A + std::min(j + k, r - 1) * in;  // pad with the last row
        float s[4];
        simd::dot4(xr, rows, in, s);
        for (int64_t k = 0; k < 4 && j + k < r; ++k) u[j + k] = s[k] * scale;
      }
    }
  });
  // Units of the second pass: job-major, then column block, then row (rows of
  // one adapter adjacent), so a thread's run of units reuses one block of B.
  int64_t first[4] = {0, 0, 0, 0}, nblk[3] = {0, 0, 0};
  for (int64_t j = 0; j < n_jobs; ++j) {
    nblk[j] = (lora_target_out(c_, jobs[static_cast<size_t>(j)].target) + kLoraCols - 1) / kLoraCols;
    first[j + 1] = first[j] + NR * nblk[j];
  }
  pool_.parallel_for(first[n_jobs], [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t j = 0;
      while (i >= first[j + 1]) ++j;
      const LoraJob& job = jobs[static_cast<size_t>(j)];
      const int64_t k = i - first[j], row = lora_rows_[static_cast<size_t>(k % NR)];
      const ServeLoraPair* p = pair_of(row, job.target);
      if (p == nullptr) continue;
      const int64_t r = p->rank(), out = p->b.dim(0);
      const int64_t c0 = (k / NR) * kLoraCols, c1 = std::min(out, c0 + kLoraCols);
      const float* B = p->b.as<float>();
      const float* u = U + (j * T_ + row) * R;
      float* y = job.y + row * job.ldy;
      for (int64_t n = c0; n < c1; n += 8) {
        const float* rows[8];
        for (int64_t m = 0; m < 8; ++m) rows[m] = B + std::min(n + m, c1 - 1) * r;  // pad with the last row
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
  });
}

}  // namespace loom
