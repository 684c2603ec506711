#include "model/forward.h"

#include <algorithm>

#include "core/error.h"
#include "core/trace.h"

namespace loom {

namespace {

// K/V rows of positions [n_past, n_past + T) go into the contiguous cache: an
// f32 cache takes them straight from the projections, an f16 one from the
// step's rows (kv_rows), rounded once they are final (after RoPE). Attention
// then reads the cache up to each row's position, its own row included.
class CacheAttention final : public AttentionStep {
 public:
  CacheAttention(const Decoder& dec, KvCache& cache, const StepActivations& acts, int64_t n_past, int64_t T,
                 const int32_t* pos)
      : dec_(dec), cache_(cache), acts_(acts), n_past_(n_past), T_(T), pos_(pos) {}
  float* keys(int64_t layer) override { return direct() ? f32_at(cache_.keys_at(layer, n_past_)) : acts_.k; }
  float* values(int64_t layer) override {
    return direct() ? f32_at(cache_.values_at(layer, n_past_)) : acts_.v;
  }
  void attend(int64_t layer, const float* q, const float* k, const float* v, float* att) override {
    Backend& be = dec_.backend();
    if (!direct()) {
      const int64_t n = T_ * dec_.attention_shape().kv_stride;
      be.to_f16(static_cast<uint16_t*>(cache_.keys_at(layer, n_past_)), k, n);
      be.to_f16(static_cast<uint16_t*>(cache_.values_at(layer, n_past_)), v, n);
    }
    be.attention(dec_.attention_shape(), q, cache_.rows(layer), att, T_, pos_, nullptr);
  }

 private:
  bool direct() const { return cache_.dtype() == DType::f32; }
  static float* f32_at(void* p) { return static_cast<float*>(p); }

  const Decoder& dec_;
  KvCache& cache_;
  const StepActivations& acts_;
  int64_t n_past_, T_;
  const int32_t* pos_;
};

}  // namespace

InferenceSession::InferenceSession(const ModelConfig& config, const ModelWeights& weights, Backend& backend,
                                   int64_t n_ctx, DType kv_dtype, int64_t micro_batch)
    : c_(config),
      dec_(config, weights, backend),
      cache_(config, n_ctx, kv_dtype, backend),
      ws_(backend.make_workspace()),
      tracer_(backend.tracer()),
      micro_batch_(micro_batch),
      acts_(config, backend, micro_batch, /*kv_rows=*/kv_dtype != DType::f32) {
  LOOM_ASSERT(n_ctx > 0 && micro_batch > 0);
  pos_.resize(static_cast<size_t>(micro_batch));
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
  dec_.check_tokens(tokens);
  // A prompt (or a chunk of one) is prefill, one token after another decode.
  const TraceScope trace(tracer_, T > 1 ? "prefill" : "decode", {{"tokens", static_cast<double>(T)}});
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
  for (int64_t t = 0; t < T; ++t) pos_[static_cast<size_t>(t)] = static_cast<int32_t>(n_past_ + t);
  dec_.embed(tokens, T, acts_.x);
  dec_.rope_table(pos_.data(), T, acts_.rope_cs);
  const LayerBuffers b = acts_.layer();
  CacheAttention attn(dec_, cache_, acts_, n_past_, T, pos_.data());
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    if (hook_ != nullptr) hook_->residual(l, acts_.x, T);
    dec_.layer(*ws_, l, T, b, acts_.rope_cs, attn, hook_);
  }
  if (hook_ != nullptr) hook_->residual(c_.n_layers, acts_.x, T);
  n_past_ += T;
  if (logits_out == nullptr) return;
  // Only the rows whose logits are wanted pass the final norm and the output projection.
  const int64_t first = all_logits ? 0 : T - 1, rows = T - first;
  dec_.final_norm(acts_.x + first * c_.hidden, nullptr, rows, acts_.xn);
  dec_.logits(*ws_, acts_.xn, rows, logits_out);
}

}  // namespace loom
