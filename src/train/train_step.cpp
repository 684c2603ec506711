// Training forward/backward through the whole decoder with LoRA adapters.
#include "train/train_step.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/linear_backward.h"
#include "kernels/ops.h"
#include "kernels/ops_backward.h"
#include "kernels/cpu/dequant.h"

namespace loom {
namespace {

constexpr LoraTarget kQkv[] = {LoraTarget::q, LoraTarget::k, LoraTarget::v};

// dst = src * mask / (1 - p) with a mask that is a pure function of (seed, step,
// slot, element): the backward regenerates it instead of storing it.
void apply_dropout(float* dst, const float* src, int64_t n, double p, uint64_t seed, uint64_t step,
                   uint64_t slot) {
  CounterRng rng(seed ^ splitmix64(step * 0x9e3779b97f4a7c15ull + slot + 1));
  const auto keep_scale = static_cast<float>(1.0 / (1.0 - p));
  for (int64_t i = 0; i < n; ++i) dst[i] = rng.next_double() < p ? 0.0f : src[i] * keep_scale;
}

}  // namespace

const char* backward_mode_name(BackwardMode m) {
  switch (m) {
    case BackwardMode::exact: return "exact";
    case BackwardMode::f16: return "f16";
    case BackwardMode::int8: return "int8";
    case BackwardMode::bf16: return "bf16";
  }
  return "?";
}

BackwardMode backward_mode_for(CpuClass c) {
  // From LoRA training tokens/s of SmolLM2-135M per class (docs/training.md,
  // "Backward speed by CPU"). bf16 leads where AMX-BF16 or AVX512-BF16 multiply
  // it, and on AVX2 machines, whose f16 path is the slowest; on AVX-512 without
  // BF16 the f16 matmul kernels run at 16 lanes and bf16's FMA kernel at 8:
  // f16 is as fast, with 15x less error.
  switch (c) {
    case CpuClass::amx:
    case CpuClass::avx512_bf16:
    case CpuClass::avx2:
      return BackwardMode::bf16;
    case CpuClass::avx512:
      return BackwardMode::f16;
  }
  return BackwardMode::f16;
}

BackwardMode default_backward_mode() { return backward_mode_for(cpu_class()); }

std::optional<BackwardMode> backward_mode_from_name(std::string_view name) {
  if (name == "auto") return default_backward_mode();
  for (BackwardMode m : {BackwardMode::exact, BackwardMode::f16, BackwardMode::int8, BackwardMode::bf16})
    if (name == backward_mode_name(m)) return m;
  return std::nullopt;
}

TrainSession::TrainSession(const ModelConfig& config, const ModelWeights& weights, LoraModel& lora,
                           ThreadPool& pool, BackwardMode backward)
    : c_(config), w_(weights), lora_(&lora), pool_(pool), backward_(backward) {
  LOOM_ASSERT(lora.n_layers() == config.n_layers);
  refresh_weights();
}

TrainSession::TrainSession(const ModelConfig& config, const ModelWeights& weights, FullParams& full,
                           ThreadPool& pool, BackwardMode backward)
    : c_(config), w_(weights), full_(&full), pool_(pool), backward_(backward) {
  refresh_weights();
}

void TrainSession::refresh_weights() {
  LOOM_ASSERT(w_.packed.size() == w_.layers.size() && !w_.output_packed.empty());
  if (backward_ == BackwardMode::exact) return;
  const auto prec = backward_ == BackwardMode::int8   ? TransposedPrecision::int8
                    : backward_ == BackwardMode::bf16 ? TransposedPrecision::bf16
                                                      : TransposedPrecision::f16;
  // bf16 with AMX: supported weight types need no copy at all (an empty
  // PackedWeight tells input_grad to read W itself, dequantizing tile by tile).
  auto t = [&](const Tensor& W, PackedWeight& old) {
    if (prec == TransposedPrecision::bf16 && bf16_direct_available(W.dtype)) return PackedWeight();
    return pack_transposed(pool_, std::span<const Tensor>(&W, 1), prec, "backward weight", &old);
  };
  wt_.resize(w_.layers.size());
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const LayerWeights& L = w_.layers[l];
    TransposedLayer& O = wt_[l];
    O = {t(L.wq, O.wq), t(L.wk, O.wk), t(L.wv, O.wv), t(L.wo, O.wo), t(L.w_gate, O.w_gate), t(L.w_up, O.w_up),
         t(L.w_down, O.w_down)};
  }
  output_t_ = t(w_.output, output_t_);
}

void TrainSession::input_grad(const Tensor& W, const PackedWeight* Wt, const float* dy, float* dx, int64_t T) {
  if (Wt != nullptr && Wt->empty()) {
    linear_backward_input_bf16_direct(pool_, W, dy, W.rows(), dx, T, false, bwd_scratch_);
    return;
  }
  if (Wt != nullptr) {
    linear_backward_input_packed(pool_, *Wt, dy, W.rows(), dx, T, false, bwd_scratch_);
    return;
  }
  std::memset(dx, 0, static_cast<size_t>(T * W.cols()) * sizeof(float));
  linear_backward_input(pool_, W, dy, dx, T);
}

void TrainSession::input_grad_add(const Tensor& W, const PackedWeight* Wt, const float* dy, float* dx, int64_t T) {
  if (Wt != nullptr && Wt->empty())
    linear_backward_input_bf16_direct(pool_, W, dy, W.rows(), dx, T, true, bwd_scratch_);
  else if (Wt != nullptr)
    linear_backward_input_packed(pool_, *Wt, dy, W.rows(), dx, T, true, bwd_scratch_);
  else
    linear_backward_input(pool_, W, dy, dx, T);
}

void TrainSession::check_batch(const Batch& b) const {
  const auto n = static_cast<size_t>(b.rows * b.seq_len);
  if (b.rows < 1 || b.seq_len < 1 || b.tokens.size() != n || b.targets.size() != n ||
      b.positions.size() != n || b.seq_start.size() != n)
    fail(ErrorKind::invalid_input,
         "train batch: {} rows x {} tokens, but tokens/targets/positions/seq_start hold {}/{}/{}/{}", b.rows,
         b.seq_len, b.tokens.size(), b.targets.size(), b.positions.size(), b.seq_start.size());
  for (size_t i = 0; i < n; ++i) {
    const auto t = static_cast<int64_t>(i % static_cast<size_t>(b.seq_len));
    if (b.tokens[i] < 0 || b.tokens[i] >= c_.vocab_size)
      fail(ErrorKind::invalid_input, "train batch: token {} at index {} is outside the vocabulary [0, {})",
           b.tokens[i], i, c_.vocab_size);
    if (b.seq_start[i] < 0 || b.seq_start[i] > t)
      fail(ErrorKind::invalid_input, "train batch: seq_start {} at index {} is outside its row's [0, {}]",
           b.seq_start[i], i, t);
    if (b.positions[i] < 0)
      fail(ErrorKind::invalid_input, "train batch: negative position {} at index {}", b.positions[i], i);
  }
}

void TrainSession::layout(int64_t T, bool dropout) {
  if (T == T_ && dropout == dropout_layout_) return;
  T_ = T;
  dropout_layout_ = dropout;
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate, r = lora_ ? lora_->config().r : 0;
  // Two passes over the same carving: count, then assign.
  size_t total = 0;
  float* base = nullptr;
  auto carve = [&](int64_t n) {
    float* p = base == nullptr ? nullptr : base + total;
    total += static_cast<size_t>(n);
    return p;
  };
  auto carve_all = [&] {
    total = 0;
    layers_.resize(static_cast<size_t>(c_.n_layers));
    for (int64_t l = 0; l < c_.n_layers; ++l) {
      LayerActs& a = layers_[static_cast<size_t>(l)];
      a.x = carve(T * H);
      a.rstd1 = carve(T);
      a.xn1 = carve(T * H);
      a.q = carve(T * Q);
      a.k = carve(T * KV);
      a.v = carve(T * KV);
      a.att = carve(T * Q);
      a.lse = carve(T * c_.n_heads);
      a.xmid = carve(T * H);
      a.rstd2 = carve(T);
      a.xn2 = carve(T * H);
      a.gate = carve(T * F);
      a.up = carve(T * F);
      for (int t = 0; t < kLoraTargetCount; ++t) {
        const bool active = lora_ && lora_->slot(l, static_cast<LoraTarget>(t)).active;
        a.ax[static_cast<size_t>(t)] = active ? carve(T * r) : nullptr;
        a.xd[static_cast<size_t>(t)] =
            active && dropout ? carve(T * lora_->slot(l, static_cast<LoraTarget>(t)).in) : nullptr;
      }
    }
    x_final_ = carve(T * H);
    rstd_final_ = carve(T);
    xn_final_ = carve(T * H);
  };
  carve_all();
  acts_.assign(total, 0.0f);
  base = acts_.data();
  carve_all();

  const int64_t wide = std::max({H, Q, F});
  work_.assign(static_cast<size_t>(T * (2 * wide + 2 * Q + 2 * KV + 3 * F + H + r)), 0.0f);
  float* p = work_.data();
  auto take = [&](int64_t n) {
    float* q = p;
    p += n;
    return q;
  };
  dxn_ = take(T * wide);
  dq_ = take(T * Q);
  dk_ = take(T * KV);
  dv_ = take(T * KV);
  datt_ = take(T * Q);
  dff_ = take(T * F);
  dup_ = take(T * F);
  tmp_ = take(T * wide);
  dgate_ = take(T * F);
  dres_ = take(T * H);
  dax_ = take(T * r);
  LOOM_ASSERT(p <= work_.data() + work_.size());
}

void TrainSession::lora_forward(int64_t l, LoraTarget t, const float* x, float* y, int64_t T, bool dropout,
                                uint64_t step) {
  if (!lora_) return;
  const LoraSlot& s = lora_->slot(l, t);
  if (!s.active) return;
  LayerActs& a = layers_[static_cast<size_t>(l)];
  const auto ti = static_cast<size_t>(t);
  const float* xin = x;
  if (dropout) {
    apply_dropout(a.xd[ti], x, T * s.in, lora_->config().dropout, lora_->config().seed, step,
                  static_cast<uint64_t>(l * kLoraTargetCount) + ti);
    xin = a.xd[ti];
  }
  const int64_t r = lora_->config().r;
  float* ax = a.ax[ti];
  matmul(pool_, lora_->a(l, t), xin, ax, T, scratch_);
  const float sc = lora_->scale();
  for (int64_t i = 0; i < T * r; ++i) ax[i] *= sc;
  matmul(pool_, lora_->b(l, t), ax, tmp_, T, scratch_);
  add_inplace(y, tmp_, T * s.out);
}

void TrainSession::lora_backward(int64_t l, LoraTarget t, const float* x, const float* dy, float* dx,
                                 int64_t T, bool dropout, uint64_t step) {
  if (!lora_) return;
  const LoraSlot& s = lora_->slot(l, t);
  if (!s.active) return;
  const LayerActs& a = layers_[static_cast<size_t>(l)];
  const auto ti = static_cast<size_t>(t);
  const int64_t r = lora_->config().r;
  const float* xin = dropout ? a.xd[ti] : x;
  // y = B u with u = scale * A xin saved as ax: dB += dy^T u; du = dy B; d(A xin) = scale * du.
  linear_backward_weight(pool_, dy, a.ax[ti], lora_->grad_b(l, t).as<float>(), T, s.out, r);
  // du = dy B as a product with B^T [r, out] (B's r columns are too narrow for the
  // input-gradient tiles).
  const Tensor B = lora_->b(l, t);
  bt_.resize(static_cast<size_t>(r * s.out));
  for (int64_t n = 0; n < s.out; ++n)
    for (int64_t j = 0; j < r; ++j) bt_[static_cast<size_t>(j * s.out + n)] = B.as<const float>()[n * r + j];
  matmul(pool_, make_tensor(bt_.data(), DType::f32, {r, s.out}), dy, dax_, T, scratch_);
  const float sc = lora_->scale();
  for (int64_t i = 0; i < T * r; ++i) dax_[i] *= sc;
  linear_backward_weight(pool_, dax_, xin, lora_->grad_a(l, t).as<float>(), T, r, s.in);
  if (dx == nullptr) return;
  if (!dropout) {
    linear_backward_input(pool_, lora_->a(l, t), dax_, dx, T);
    return;
  }
  // Through the dropout: the same mask (regenerated) and scale apply to the gradient.
  std::memset(tmp_, 0, static_cast<size_t>(T * s.in) * sizeof(float));
  linear_backward_input(pool_, lora_->a(l, t), dax_, tmp_, T);
  apply_dropout(tmp_, tmp_, T * s.in, lora_->config().dropout, lora_->config().seed, step,
                static_cast<uint64_t>(l * kLoraTargetCount) + ti);
  add_inplace(dx, tmp_, T * s.in);
}

void TrainSession::forward_layer(int64_t l, int64_t T, bool dropout, uint64_t step) {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate;
  const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
  const PackedLayer& P = w_.packed[static_cast<size_t>(l)];
  LayerActs& a = layers_[static_cast<size_t>(l)];
  const auto eps = static_cast<float>(c_.rms_eps);
  const AttentionShape shape{c_.n_heads, c_.n_kv_heads, c_.head_dim, KV};
  float* x_next = l + 1 < c_.n_layers ? layers_[static_cast<size_t>(l + 1)].x : x_final_;

  rmsnorm_forward_train(a.xn1, a.rstd1, a.x, L.attn_norm, T, H, eps);
  const MatmulOut qkv[] = {{&P.wq, a.q, Q}, {&P.wk, a.k, KV}, {&P.wv, a.v, KV}};
  matmul_multi(pool_, qkv, a.xn1, H, T, scratch_);
  if (L.bq != nullptr)
    for (int64_t t = 0; t < T; ++t) {
      add_inplace(a.q + t * Q, L.bq, Q);
      add_inplace(a.k + t * KV, L.bk, KV);
      add_inplace(a.v + t * KV, L.bv, KV);
    }
  lora_forward(l, LoraTarget::q, a.xn1, a.q, T, dropout, step);
  lora_forward(l, LoraTarget::k, a.xn1, a.k, T, dropout, step);
  lora_forward(l, LoraTarget::v, a.xn1, a.v, T, dropout, step);
  rope_apply(w_.rope, a.q, T, c_.n_heads, pos_.data());
  rope_apply(w_.rope, a.k, T, c_.n_kv_heads, pos_.data());
  attention_forward_train(pool_, a.att, a.lse, a.q, a.k, a.v, shape, T, seq_start_.data());

  matmul(pool_, P.wo, a.att, a.xmid, T, scratch_);
  lora_forward(l, LoraTarget::o, a.att, a.xmid, T, dropout, step);
  add_inplace(a.xmid, a.x, T * H);

  rmsnorm_forward_train(a.xn2, a.rstd2, a.xmid, L.ffn_norm, T, H, eps);
  const MatmulOut gate_up[] = {{&P.w_gate, a.gate, F}, {&P.w_up, a.up, F}};
  matmul_multi(pool_, gate_up, a.xn2, H, T, scratch_);
  lora_forward(l, LoraTarget::gate, a.xn2, a.gate, T, dropout, step);
  lora_forward(l, LoraTarget::up, a.xn2, a.up, T, dropout, step);
  swiglu(dff_, a.gate, a.up, T * F);  // h = silu(gate) * up, not saved (recomputed in backward)
  matmul(pool_, P.w_down, dff_, x_next, T, scratch_);
  lora_forward(l, LoraTarget::down, dff_, x_next, T, dropout, step);
  add_inplace(x_next, a.xmid, T * H);
}

// dx: on entry d(loss)/d(layer output); on exit d(loss)/d(layer input).
void TrainSession::backward_layer(int64_t l, int64_t T, bool dropout, uint64_t step, float* dx) {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate;
  const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
  const LayerActs& a = layers_[static_cast<size_t>(l)];
  const AttentionShape shape{c_.n_heads, c_.n_kv_heads, c_.head_dim, KV};
  auto zero = [](float* p, int64_t n) { std::memset(p, 0, static_cast<size_t>(n) * sizeof(float)); };
  const TransposedLayer* Wt = wt_.empty() ? nullptr : &wt_[static_cast<size_t>(l)];
  const LayerGrads* G = full_ ? &full_->layer_grads(l) : nullptr;

  // x_next = xmid + down(h): dx is also d(xmid)'s residual part, kept in place.
  float* h = dup_;  // h = silu(gate) * up recomputed; dup_ is free until swiglu_backward
  swiglu(h, a.gate, a.up, T * F);
  if (G) linear_backward_weight(pool_, dx, h, G->w_down, T, H, F);
  input_grad(L.w_down, Wt ? &Wt->w_down : nullptr, dx, dff_, T);
  lora_backward(l, LoraTarget::down, h, dx, dff_, T, dropout, step);
  // dgate -> dgate_, dup -> dup_ (h is no longer needed).
  swiglu_backward(dgate_, dup_, dff_, a.gate, a.up, T * F);
  if (G) {
    linear_backward_weight(pool_, dgate_, a.xn2, G->w_gate, T, F, H);
    linear_backward_weight(pool_, dup_, a.xn2, G->w_up, T, F, H);
  }
  input_grad(L.w_gate, Wt ? &Wt->w_gate : nullptr, dgate_, dxn_, T);
  input_grad_add(L.w_up, Wt ? &Wt->w_up : nullptr, dup_, dxn_, T);
  lora_backward(l, LoraTarget::gate, a.xn2, dgate_, dxn_, T, dropout, step);
  lora_backward(l, LoraTarget::up, a.xn2, dup_, dxn_, T, dropout, step);
  rmsnorm_backward(dx, G ? G->ffn_norm : nullptr, dxn_, a.xmid, L.ffn_norm, a.rstd2, T, H);

  // xmid = x + o(att): dx now is d(xmid), which is also d(x)'s residual part.
  if (G) linear_backward_weight(pool_, dx, a.att, G->wo, T, H, Q);
  input_grad(L.wo, Wt ? &Wt->wo : nullptr, dx, datt_, T);
  lora_backward(l, LoraTarget::o, a.att, dx, datt_, T, dropout, step);
  zero(dq_, T * Q);
  zero(dk_, T * KV);
  zero(dv_, T * KV);
  attention_backward(pool_, dq_, dk_, dv_, datt_, a.q, a.k, a.v, a.att, a.lse, shape, T, seq_start_.data());
  rope_backward(w_.rope, dq_, T, c_.n_heads, pos_.data());
  rope_backward(w_.rope, dk_, T, c_.n_kv_heads, pos_.data());
  if (G) {
    linear_backward_weight(pool_, dq_, a.xn1, G->wq, T, Q, H);
    linear_backward_weight(pool_, dk_, a.xn1, G->wk, T, KV, H);
    linear_backward_weight(pool_, dv_, a.xn1, G->wv, T, KV, H);
    if (G->bq) {
      linear_backward_bias(dq_, G->bq, T, Q);
      linear_backward_bias(dk_, G->bk, T, KV);
      linear_backward_bias(dv_, G->bv, T, KV);
    }
  }
  // With LoRA the first layer's input is the frozen embedding: nothing below
  // needs its gradient.
  const bool need_dx = l > 0 || full_ != nullptr;
  if (need_dx) {
    input_grad(L.wq, Wt ? &Wt->wq : nullptr, dq_, dxn_, T);
    input_grad_add(L.wk, Wt ? &Wt->wk : nullptr, dk_, dxn_, T);
    input_grad_add(L.wv, Wt ? &Wt->wv : nullptr, dv_, dxn_, T);
  }
  const float* dqkv[] = {dq_, dk_, dv_};
  for (int i = 0; i < 3; ++i) lora_backward(l, kQkv[i], a.xn1, dqkv[i], need_dx ? dxn_ : nullptr, T, dropout, step);
  if (!need_dx) return;
  rmsnorm_backward(dx, G ? G->attn_norm : nullptr, dxn_, a.x, L.attn_norm, a.rstd1, T, H);
}

LossResult TrainSession::run(const Batch& batch, float grad_scale, uint64_t step, bool backward) {
  check_batch(batch);
  const int64_t T = batch.rows * batch.seq_len, H = c_.hidden;
  const bool dropout = backward && lora_ && lora_->config().dropout > 0;
  layout(T, dropout);
  pos_.assign(batch.positions.begin(), batch.positions.end());
  seq_start_.resize(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i)  // row-relative -> index into the concatenated rows
    seq_start_[static_cast<size_t>(i)] =
        static_cast<int32_t>((i / batch.seq_len) * batch.seq_len + batch.seq_start[static_cast<size_t>(i)]);

  const Tensor& e = w_.token_embd;
  float* x0 = layers_.empty() ? x_final_ : layers_[0].x;
  for (int64_t t = 0; t < T; ++t)
    dequantize_row(e.dtype, e.row_ptr(batch.tokens[static_cast<size_t>(t)]), x0 + t * H, H);
  for (int64_t l = 0; l < c_.n_layers; ++l) forward_layer(l, T, dropout, step);
  rmsnorm_forward_train(xn_final_, rstd_final_, x_final_, w_.output_norm, T, H,
                        static_cast<float>(c_.rms_eps));

  // d(final-norm output) lands in tmp_; d(residual stream) in dres_.
  ChunkedLossArgs la;
  la.dW = backward && full_ ? full_->output_grad() : nullptr;
  la.W = &w_.output;
  la.W_packed = &w_.output_packed;
  la.Wt_packed = wt_.empty() ? nullptr : &output_t_;
  la.h = xn_final_;
  la.labels = batch.targets.data();
  la.T = T;
  la.grad_scale = grad_scale;
  float* dh = tmp_;
  if (backward) {
    std::memset(dh, 0, static_cast<size_t>(T * H) * sizeof(float));
    la.dh = dh;
  }
  const LossResult res = chunked_cross_entropy(pool_, la, scratch_);
  if (!backward) return res;

  std::memset(dres_, 0, static_cast<size_t>(T * H) * sizeof(float));
  rmsnorm_backward(dres_, full_ ? full_->output_norm_grad() : nullptr, dh, x_final_, w_.output_norm, rstd_final_, T,
                   H);
  for (int64_t l = c_.n_layers - 1; l >= 0; --l) backward_layer(l, T, dropout, step, dres_);
  // dres_ is now d(embedding rows); with LoRA the embedding is frozen and it stops here.
  if (full_) embedding_backward(pool_, full_->token_embd_grad(), dres_, batch.tokens.data(), T, c_.vocab_size, H);
  return res;
}

LossResult TrainSession::forward_backward(const Batch& batch, float grad_scale, uint64_t step) {
  return run(batch, grad_scale, step, true);
}

LossResult TrainSession::forward_loss(const Batch& batch) { return run(batch, 0.0f, 0, false); }

}  // namespace loom
