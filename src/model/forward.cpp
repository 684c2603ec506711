#include "model/forward.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "kernels/ops.h"
#include "kernels/cpu/dequant.h"

namespace loom {

InferenceSession::InferenceSession(const ModelConfig& config, const ModelWeights& weights, ThreadPool& pool,
                                   int64_t n_ctx, int64_t micro_batch)
    : c_(config), w_(weights), pool_(pool), cache_(config, n_ctx), micro_batch_(micro_batch) {
  LOOM_ASSERT(n_ctx > 0 && micro_batch > 0);
  LOOM_ASSERT(weights.packed.size() == weights.layers.size() && !weights.output_packed.empty());
  const auto mb = static_cast<size_t>(micro_batch);
  x_.resize(mb * static_cast<size_t>(c_.hidden));
  xn_.resize(x_.size());
  q_.resize(mb * static_cast<size_t>(c_.q_dim()));
  att_.resize(q_.size());
  k_.resize(mb * static_cast<size_t>(c_.kv_dim()));
  v_.resize(k_.size());
  gate_.resize(mb * static_cast<size_t>(c_.intermediate));
  up_.resize(gate_.size());
  pos_.resize(mb);
}

void InferenceSession::truncate(int64_t n) {
  LOOM_ASSERT(n >= 0 && n <= n_past_);
  n_past_ = n;
}

const float* InferenceSession::eval(std::span<const int32_t> tokens, bool all_logits) {
  const auto T = static_cast<int64_t>(tokens.size());
  if (T == 0) fail(ErrorKind::invalid_input, "eval: no tokens");
  if (n_past_ + T > cache_.n_ctx())
    fail(ErrorKind::invalid_input, "context is full: {} tokens already, {} more would exceed the context size {}",
         n_past_, T, cache_.n_ctx());
  for (int32_t t : tokens)
    if (t < 0 || t >= c_.vocab_size)
      fail(ErrorKind::invalid_input, "token id {} is outside the vocabulary [0, {})", t, c_.vocab_size);
  const auto V = static_cast<size_t>(c_.vocab_size);
  logits_.resize(all_logits ? V * static_cast<size_t>(T) : V);
  for (int64_t b = 0; b < T; b += micro_batch_) {
    const int64_t n = std::min(micro_batch_, T - b);
    const bool last = b + n == T;
    float* out = all_logits ? logits_.data() + static_cast<size_t>(b) * V : (last ? logits_.data() : nullptr);
    forward_batch(tokens.data() + b, n, all_logits, out);
  }
  return all_logits ? logits_.data() + (static_cast<size_t>(T) - 1) * V : logits_.data();
}

void InferenceSession::forward_batch(const int32_t* tokens, int64_t T, bool all_logits, float* logits_out) {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate;
  float* x = x_.data();
  float* xn = xn_.data();
  for (int64_t t = 0; t < T; ++t) {
    pos_[static_cast<size_t>(t)] = static_cast<int32_t>(n_past_ + t);
    const Tensor& e = w_.token_embd;
    dequantize_row(e.dtype, e.row_ptr(tokens[t]), x + t * H, H);
  }
  const AttentionShape shape{c_.n_heads, c_.n_kv_heads, c_.head_dim, KV};
  const auto eps = static_cast<float>(c_.rms_eps);

  for (int64_t l = 0; l < c_.n_layers; ++l) {
    const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
    const PackedLayer& P = w_.packed[static_cast<size_t>(l)];
    rmsnorm(xn, x, L.attn_norm, T, H, eps);
    float* kc = cache_.keys(l) + n_past_ * KV;
    float* vc = cache_.values(l) + n_past_ * KV;
    // One activation quantization and one dispatch for q, k and v; keys and
    // values land in the cache rows directly.
    const MatmulOut qkv[] = {{&P.wq, q_.data(), Q}, {&P.wk, kc, KV}, {&P.wv, vc, KV}};
    matmul_multi(pool_, qkv, xn, H, T, scratch_);
    if (L.bq != nullptr) {
      for (int64_t t = 0; t < T; ++t) {
        add_inplace(q_.data() + t * Q, L.bq, Q);
        add_inplace(kc + t * KV, L.bk, KV);
        add_inplace(vc + t * KV, L.bv, KV);
      }
    }
    rope_apply(w_.rope, q_.data(), T, c_.n_heads, pos_.data());
    rope_apply(w_.rope, kc, T, c_.n_kv_heads, pos_.data());
    attention(pool_, shape, q_.data(), cache_.keys(l), cache_.values(l), att_.data(), T, pos_.data(), nullptr);
    matmul(pool_, P.wo, att_.data(), xn, T, scratch_);
    add_inplace(x, xn, T * H);

    rmsnorm(xn, x, L.ffn_norm, T, H, eps);
    const MatmulOut gate_up[] = {{&P.w_gate, gate_.data(), F}, {&P.w_up, up_.data(), F}};
    matmul_multi(pool_, gate_up, xn, H, T, scratch_);
    pool_.parallel_for(T * F, [&](int64_t b, int64_t e) { swiglu(gate_.data() + b, gate_.data() + b, up_.data() + b, e - b); }, 64);
    matmul(pool_, P.w_down, gate_.data(), xn, T, scratch_);
    add_inplace(x, xn, T * H);
  }
  n_past_ += T;
  if (logits_out == nullptr) return;
  // Only the rows whose logits are wanted pass the final norm and the output projection.
  const int64_t first = all_logits ? 0 : T - 1, rows = T - first;
  rmsnorm(xn, x + first * H, w_.output_norm, rows, H, eps);
  matmul(pool_, w_.output_packed, xn, logits_out, rows, scratch_);
}

}  // namespace loom
