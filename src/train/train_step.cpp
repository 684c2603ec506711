// Training forward/backward through the whole decoder with LoRA adapters.
#include "train/train_step.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <optional>

#include "core/error.h"
#include "core/trace.h"

namespace loom {

const char* backward_mode_name(BackwardMode m) {
  switch (m) {
    case BackwardMode::exact: return "exact";
    case BackwardMode::f16: return "f16";
    case BackwardMode::int8: return "int8";
    case BackwardMode::bf16: return "bf16";
  }
  return "?";
}

const char* train_precision_name(TrainPrecision p) {
  switch (p) {
    case TrainPrecision::fp32: return "fp32";
    case TrainPrecision::bf16: return "bf16";
    case TrainPrecision::fp16: return "fp16";
  }
  return "?";
}

std::optional<TrainPrecision> train_precision_from_name(std::string_view name) {
  for (TrainPrecision p : {TrainPrecision::fp32, TrainPrecision::bf16, TrainPrecision::fp16})
    if (name == train_precision_name(p)) return p;
  return std::nullopt;
}

BackwardMode backward_mode_for(CpuClass c, cpu::Bf16Dot dot) {
  // From LoRA training tokens/s of SmolLM2-135M per class (docs/training.md,
  // "Backward speed by CPU"). bf16 leads where AMX-BF16 or AVX512-BF16 multiply
  // it. Without them bf16's products are emulated exactly (two dependent FMAs
  // per pair), and f16's widened products are faster: on AVX-512 without BF16
  // (16-lane f16 kernels against 8-lane bf16 FMAs) and on a real AVX2 machine
  // (AMD Zen 2: f16 1.19x bf16), with 15x less error; and where vdpbf16ps
  // multiplies pairs more slowly than two FMAs (Emerald Rapids without AMX: f16
  // 1.2x bf16).
  switch (c) {
    case CpuClass::amx:
      return BackwardMode::bf16;
    case CpuClass::avx512_bf16:
      return dot == cpu::Bf16Dot::vdpbf16ps ? BackwardMode::bf16 : BackwardMode::f16;
    case CpuClass::avx2:
    case CpuClass::avx512:
      return BackwardMode::f16;
  }
  return BackwardMode::f16;
}

BackwardMode default_backward_mode() { return backward_mode_for(cpu_class(), cpu::bf16_dot()); }

std::optional<BackwardMode> backward_mode_from_name(std::string_view name) {
  if (name == "auto") return default_backward_mode();
  for (BackwardMode m : {BackwardMode::exact, BackwardMode::f16, BackwardMode::int8, BackwardMode::bf16})
    if (name == backward_mode_name(m)) return m;
  return std::nullopt;
}

// Attention over the batch's own rows, keeping K, V (the projections land in
// the layer's saved rows) and the log-sum-exp for the backward.
class TrainSession::SavedAttention final : public AttentionStep {
 public:
  explicit SavedAttention(TrainSession& s) : s_(s) {}
  float* keys(int64_t layer) override { return s_.layers_[static_cast<size_t>(layer)].k; }
  float* values(int64_t layer) override { return s_.layers_[static_cast<size_t>(layer)].v; }
  void attend(int64_t layer, const float* q, const float* k, const float* v, float* att) override {
    s_.be_.attention_train(*s_.ws_, s_.dec_.attention_shape(), att, s_.layers_[static_cast<size_t>(layer)].lse, q,
                           k, v, s_.tokens_, s_.seq_start_.data());
  }

 private:
  TrainSession& s_;
};

TrainSession::TrainSession(const ModelConfig& config, const ModelWeights& weights, LoraModel& lora,
                           Backend& backend, BackwardMode backward)
    : TrainSession(config, weights, &lora, nullptr, backend, backward) {
  LOOM_ASSERT(lora.n_layers() == config.n_layers);
}

TrainSession::TrainSession(const ModelConfig& config, const ModelWeights& weights, FullParams& full,
                           Backend& backend, BackwardMode backward)
    : TrainSession(config, weights, nullptr, &full, backend, backward) {}

TrainSession::TrainSession(const ModelConfig& config, const ModelWeights& weights, LoraModel* lora,
                           FullParams* full, Backend& backend, BackwardMode backward,
                           std::shared_ptr<TransposedWeights> transposed)
    : c_(config),
      w_(weights),
      lora_(lora),
      full_(full),
      dec_(config, weights, backend),
      be_(backend),
      backward_(backward),
      ws_(backend.make_workspace()),
      attention_(std::make_unique<SavedAttention>(*this)),
      adapters_(lora ? make_trained_adapters(*this) : nullptr),
      wt_(std::move(transposed)),
      span_(held_layers(weights)) {
  // Full fine-tuning's weight gradients do not carry output scales: its
  // weights are loaded with them folded in (Model::LoadOptions::fold_output_scales).
  LOOM_ASSERT(full == nullptr || !has_output_scales(weights));
  if (wt_) return;
  wt_ = std::make_shared<TransposedWeights>();
  refresh_weights();
}

TrainSession::~TrainSession() = default;

// The run of layers the weights hold: all, or a pipeline stage's (model/pipeline_stage.h).
LayerSpan TrainSession::held_layers(const ModelWeights& w) {
  const auto L = static_cast<int64_t>(w.layers.size());
  LayerSpan s{L, 0};
  for (int64_t l = 0; l < L; ++l)
    if (w.layers[static_cast<size_t>(l)].held()) {
      s.first = std::min(s.first, l);
      s.last = l + 1;
    }
  if (s.last == 0) s.first = 0;  // no layer (a model of none)
  for (int64_t l = s.first; l < s.last; ++l) LOOM_ASSERT(w.layers[static_cast<size_t>(l)].held());  // one run
  return s;
}

std::unique_ptr<TrainSession> TrainSession::sibling() {
  std::unique_ptr<TrainSession> s(new TrainSession(c_, w_, lora_, full_, be_, backward_, wt_));
  s->set_precision(precision_);
  s->set_activation_options(opts_);
  s->fused_lora_ = fused_lora_;
  s->adapters_merged_ = adapters_merged_;
  if (partial_ != nullptr) s->set_tensor_parallel(partial_, tp_rank_, tp_ranks_);  // a stage's tensor-parallel shard
  return s;
}

void TrainSession::refresh_weights() {
  LOOM_ASSERT(w_.prepared.size() == w_.layers.size() && (w_.output.data == nullptr) == (w_.output_prepared == nullptr));
  if (backward_ == BackwardMode::exact) return;
  // Full fine-tuning (and QAT's LoRA) repack every step: with the workspace's scratch, in place.
  Workspace* scratch = full_ || adapters_merged_ ? ws_.get() : nullptr;
  auto t = [&](const Tensor& W, WeightHandle& old) {
    return be_.prepare_transposed(W, backward_, "backward weight", std::move(old), scratch);
  };
  TransposedWeights& wt = *wt_;
  wt.layers.resize(w_.layers.size());
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const LayerWeights& L = w_.layers[l];
    if (!L.held()) continue;  // another pipeline stage's layer
    TransposedLayer& O = wt.layers[l];
    TransposedLayer N;
    N.wq = t(L.wq, O.wq);
    N.wk = t(L.wk, O.wk);
    N.wv = t(L.wv, O.wv);
    N.wo = t(L.wo, O.wo);
    N.w_gate = t(L.w_gate, O.w_gate);
    N.w_up = t(L.w_up, O.w_up);
    N.w_down = t(L.w_down, O.w_down);
    O = std::move(N);
  }
  if (w_.output.data != nullptr) wt.output = t(w_.output, wt.output);
}

void TrainSession::input_grad(const LayerWeights& L, LoraTarget t, const DeviceWeight* Wt, const float* dy,
                              float* dx, int64_t T, bool accumulate) {
  const Tensor& W = target_matrix(L, t);
  if (const float s = L.output_scale(t); s != 1.0f) {
    // y = s (W x): dx = W^T (s dy). dy is still needed (the adapters' and
    // weights' gradients), so the scaled copy goes to tmp_, free here.
    be_.copy_2d(tmp_, W.rows(), dy, W.rows(), T, W.rows());
    be_.scale(tmp_, s, T * W.rows());
    dy = tmp_;
  }
  be_.linear_backward_input(*ws_, W, Wt, backward_, dy, dx, T, accumulate);
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

int64_t TrainSession::segment_layers() const {
  const int64_t n = opts_.checkpoint_every;
  return n > 0 && n < c_.n_layers ? n : 0;
}

int64_t TrainSession::n_segments() const {
  const int64_t N = segment_layers();
  return N == 0 ? 1 : (c_.n_layers + N - 1) / N;
}

int64_t TrainSession::segment_start(int64_t k) const {
  const int64_t N = segment_layers();
  return k == 0 ? 0 : c_.n_layers - (n_segments() - k) * N;
}

int64_t TrainSession::segment_of(int64_t l) const {
  const int64_t N = segment_layers(), first = segment_start(1);
  return N == 0 || l < first ? 0 : 1 + (l - first) / N;
}

int64_t TrainSession::segment_begin(int64_t k) const { return std::max(segment_start(k), span_.first); }

int64_t TrainSession::segment_end(int64_t k) const {
  return std::min(k + 1 < n_segments() ? segment_start(k + 1) : c_.n_layers, span_.last);
}

void TrainSession::set_activation_options(const ActivationOptions& o) {
  if (o.checkpoint_every < 0)
    fail(ErrorKind::invalid_input, "gradient_checkpointing: {} is negative (0 is off, N keeps every Nth layer's input)",
         o.checkpoint_every);
  opts_ = o;
  reserved_ = 0;  // laid out again at the next reserve()
}

size_t TrainSession::activation_layout(int64_t T, float* base, ActsLayout* out) const {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate, r = lora_ ? lora_->config().r : 0;
  const int64_t L = c_.n_layers, N = segment_layers(), first = span_.first, last = span_.last;
  const bool records = bf16_records();
  // Dropout's saved inputs whenever the adapters have dropout (evaluation runs
  // without it in the same layout, so switching never re-lays out).
  const bool dropout = lora_ && lora_->config().dropout > 0;
  size_t total = 0;
  auto carve = [&](int64_t n) {
    float* p = base == nullptr ? nullptr : base + total;
    total += static_cast<size_t>(n);
    return p;
  };
  auto carve_bf16 = [&](int64_t n) { return reinterpret_cast<uint16_t*>(carve((n + 1) / 2)); };
  auto active = [&](int64_t l, int t) { return lora_ && lora_->slot(l, static_cast<LoraTarget>(t)).active; };
  auto active_any = [&](int t) {
    for (int64_t l = 0; l < L; ++l)
      if (active(l, t)) return true;
    return false;
  };
  auto target_in = [&](int t) { return lora_target_in(c_, static_cast<LoraTarget>(t)); };
  // Every buffer of one layer; `l` < 0: a slot shared by layers (adapters active in any).
  auto carve_layer = [&](LayerActs& a, int64_t l) {
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
      const bool on = l >= 0 ? active(l, t) : active_any(t);
      a.ax[static_cast<size_t>(t)] = on ? carve(T * r) : nullptr;
      a.xd[static_cast<size_t>(t)] = on && dropout ? carve(T * target_in(t)) : nullptr;
    }
  };
  ActsLayout none;
  ActsLayout& o = out ? *out : none;
  o.layers.assign(static_cast<size_t>(L), LayerActs{});
  o.checkpoints.clear();
  o.records.clear();
  // Only the layers of the session's span (a pipeline stage's own) get buffers.
  if (N == 0 && !records) {
    for (int64_t l = first; l < last; ++l) carve_layer(o.layers[static_cast<size_t>(l)], l);
  } else {
    std::vector<LayerActs> slots(static_cast<size_t>(N > 0 ? std::min(N, last - first) : 2));
    for (LayerActs& a : slots) carve_layer(a, -1);
    for (int64_t l = first; l < last; ++l) {
      LayerActs& a = o.layers[static_cast<size_t>(l)];
      a = slots[static_cast<size_t>(N > 0 ? l - segment_begin(segment_of(l)) : l % 2)];
      for (int t = 0; t < kLoraTargetCount; ++t)
        if (!active(l, t)) a.ax[static_cast<size_t>(t)] = a.xd[static_cast<size_t>(t)] = nullptr;
    }
    // Segment k's input where the span recomputes it (the model's last segment never is).
    const int64_t n_checkpoints = N > 0 ? n_segments() - 1 : 0;
    o.checkpoints.assign(static_cast<size_t>(n_checkpoints), nullptr);
    for (int64_t k = N > 0 ? segment_of(first) : 0; k < n_checkpoints && segment_start(k) < last; ++k)
      o.checkpoints[static_cast<size_t>(k)] = opts_.bf16 ? reinterpret_cast<float*>(carve_bf16(T * H)) : carve(T * H);
    if (records) {
      // The small ones (rstd, lse, A x) of every layer stay f32 and per layer; the
      // large ones of layers 0 .. L-2 get bf16 records (the model's last layer's
      // stay in its slot).
      for (int64_t l = first; l < last; ++l) {
        LayerActs& a = o.layers[static_cast<size_t>(l)];
        a.rstd1 = carve(T);
        a.lse = carve(T * c_.n_heads);
        a.rstd2 = carve(T);
        for (int t = 0; t < kLoraTargetCount; ++t) a.ax[static_cast<size_t>(t)] = active(l, t) ? carve(T * r) : nullptr;
      }
      o.records.resize(static_cast<size_t>(L - 1));
      for (int64_t l = first; l < std::min(last, L - 1); ++l) {
        LayerRecord& rec = o.records[static_cast<size_t>(l)];
        rec.x = carve_bf16(T * H);
        rec.xn1 = carve_bf16(T * H);
        rec.q = carve_bf16(T * Q);
        rec.k = carve_bf16(T * KV);
        rec.v = carve_bf16(T * KV);
        rec.att = carve_bf16(T * Q);
        rec.xmid = carve_bf16(T * H);
        rec.xn2 = carve_bf16(T * H);
        rec.gate = carve_bf16(T * F);
        rec.up = carve_bf16(T * F);
        for (int t = 0; t < kLoraTargetCount; ++t)
          rec.xd[static_cast<size_t>(t)] = active(l, t) && dropout ? carve_bf16(T * target_in(t)) : nullptr;
      }
    }
  }
  o.x_final = carve(T * H);  // the head's input, or a stage's output (kept, and sent, until its next forward)
  if (last == L) {
    o.rstd_final = carve(T);
    o.xn_final = carve(T * H);
  }
  o.rope_cs = carve(T * c_.head_dim);
  return total;
}

std::array<TrainSession::RecordField, 10 + kLoraTargetCount> TrainSession::record_fields(int64_t l, int64_t T) const {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate;
  const LayerActs& a = layers_[static_cast<size_t>(l)];
  const LayerRecord& r = records_[static_cast<size_t>(l)];
  std::array<RecordField, 10 + kLoraTargetCount> f{
      RecordField{a.x, r.x, T * H},       RecordField{a.xn1, r.xn1, T * H}, RecordField{a.q, r.q, T * Q},
      RecordField{a.k, r.k, T * KV},      RecordField{a.v, r.v, T * KV},    RecordField{a.att, r.att, T * Q},
      RecordField{a.xmid, r.xmid, T * H}, RecordField{a.xn2, r.xn2, T * H}, RecordField{a.gate, r.gate, T * F},
      RecordField{a.up, r.up, T * F}};
  for (int t = 0; t < kLoraTargetCount; ++t) {
    uint16_t* h = r.xd[static_cast<size_t>(t)];
    f[static_cast<size_t>(10 + t)] =
        h ? RecordField{a.xd[static_cast<size_t>(t)], h, T * lora_target_in(c_, static_cast<LoraTarget>(t))}
          : RecordField{nullptr, nullptr, 0};
  }
  return f;
}

void TrainSession::save_record(int64_t l, int64_t T) {
  for (const auto& [f, h, n] : record_fields(l, T))
    if (n > 0) be_.to_bf16(h, f, n);
}

void TrainSession::load_record(int64_t l, int64_t T) {
  for (const auto& [f, h, n] : record_fields(l, T))
    if (n > 0) be_.from_bf16(f, h, n);
}

size_t TrainSession::work_floats(int64_t T) const {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate, r = lora_ ? lora_->config().r : 0;
  const int64_t wide = std::max({H, Q, F});
  return static_cast<size_t>(T * (2 * wide + 2 * Q + 2 * KV + 3 * F + H + r));
}

size_t TrainSession::bt_floats() const {
  if (!lora_) return 0;
  const int64_t widest = std::max({c_.hidden, c_.q_dim(), c_.kv_dim(), c_.intermediate});
  return static_cast<size_t>(lora_->config().r * widest);
}

size_t TrainSession::activation_bytes_for(int64_t tokens) const {
  return activation_layout(tokens, nullptr, nullptr) * sizeof(float);
}

size_t TrainSession::scratch_bytes_for(int64_t tokens) const {
  return (work_floats(tokens) + bt_floats() + lora_work_floats(tokens)) * sizeof(float) +
         2 * static_cast<size_t>(tokens) * sizeof(int32_t);
}

size_t TrainSession::scratch_bytes() const {
  return work_.bytes() + bt_.bytes() + lora_work_.bytes() + (pos_.capacity() + seq_start_.capacity()) * sizeof(int32_t);
}

size_t TrainSession::transposed_bytes() const {
  size_t n = wt_->output ? wt_->output->nbytes() : 0;
  for (const TransposedLayer& L : wt_->layers)
    for (const WeightHandle* h : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
      if (*h) n += (*h)->nbytes();
  return n;
}

void TrainSession::reserve(int64_t T) {
  if (T <= reserved_) return;
  reserved_ = T;
  acts_ = DeviceBuffer();  // the old arena goes before the new one comes
  acts_ = be_.alloc(activation_layout(T, nullptr, nullptr) * sizeof(float));
  ActsLayout o;
  activation_layout(T, acts_.floats(), &o);
  layers_ = std::move(o.layers);
  checkpoints_ = std::move(o.checkpoints);
  records_ = std::move(o.records);
  x_final_ = o.x_final;
  rstd_final_ = o.rstd_final;
  xn_final_ = o.xn_final;
  rope_cs_ = o.rope_cs;

  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate, r = lora_ ? lora_->config().r : 0;
  const int64_t wide = std::max({H, Q, F});
  work_ = DeviceBuffer();
  work_ = be_.alloc(work_floats(T) * sizeof(float));
  float* p = work_.floats();
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
  LOOM_ASSERT(p <= work_.floats() + work_.n_floats());
  if (bt_.empty() && bt_floats() > 0) bt_ = be_.alloc(bt_floats() * sizeof(float));
  reserve_lora_work(T);
  pos_.reserve(static_cast<size_t>(T));
  seq_start_.reserve(static_cast<size_t>(T));
  be_.reserve_workspace(*ws_, workspace_shape(T));
}

WorkspaceShape TrainSession::workspace_shape(int64_t tokens) const {
  WorkspaceShape s;
  s.rows = tokens;
  s.max_in = std::max({c_.hidden, c_.q_dim(), c_.intermediate});
  s.max_out = std::max({c_.hidden, c_.q_dim(), c_.kv_dim(), c_.intermediate});
  s.vocab = w_.output.data != nullptr ? c_.vocab_size : 0;  // a pipeline stage without the head has no loss
  s.hidden = c_.hidden;
  s.precision = backward_;
  s.attention = dec_.attention_shape();
  s.lora_rank = lora_ ? lora_->config().r : 0;
  s.repack = full_ != nullptr;
  return s;
}

float* TrainSession::next_input(int64_t l) {
  return l + 1 < span_.last ? layers_[static_cast<size_t>(l + 1)].x : x_final_;
}

void TrainSession::forward_layer(int64_t l, int64_t T, bool dropout, uint64_t step, float* x_next) {
  LayerActs& a = layers_[static_cast<size_t>(l)];
  LayerBuffers b;
  b.x = a.x;
  b.xn1 = a.xn1;
  b.rstd1 = a.rstd1;
  b.q = a.q;
  b.att = a.att;
  b.o = b.xmid = a.xmid;
  b.xn2 = a.xn2;
  b.rstd2 = a.rstd2;
  b.gate = a.gate;
  b.up = a.up;
  b.h = dff_;  // h = silu(gate) * up, not saved (recomputed in backward)
  b.down = b.out = x_next;
  dropout_ = dropout;
  step_ = step;
  dec_.layer(*ws_, l, T, b, rope_cs_, *attention_, lora_ ? adapters_.get() : nullptr);
}

// dx: on entry d(loss)/d(layer output); on exit d(loss)/d(layer input).
void TrainSession::backward_layer(int64_t l, int64_t T, bool dropout, uint64_t step, float* dx) {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate;
  const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
  const LayerActs& a = layers_[static_cast<size_t>(l)];
  const TraceLayer trace_layer(be_.tracer(), l);
  const AttentionShape shape = dec_.attention_shape();
  const TransposedLayer* Wt = wt_->layers.empty() ? nullptr : &wt_->layers[static_cast<size_t>(l)];
  auto wt = [&](const WeightHandle TransposedLayer::*m) { return Wt ? (Wt->*m).get() : nullptr; };
  const LayerGrads* G = full_ ? &full_->layer_grads(l) : nullptr;

  // x_next = xmid + down(h): dx is also d(xmid)'s residual part, kept in place.
  float* h = dup_;  // h = silu(gate) * up recomputed; dup_ is free until swiglu_backward
  be_.swiglu(h, a.gate, a.up, T, F);
  if (G) be_.linear_backward_weight(*ws_, dx, h, G->w_down, T, H, F);
  input_grad(L, LoraTarget::down, wt(&TransposedLayer::w_down), dx, dff_, T);
  const LoraGrad g_down[] = {{LoraTarget::down, dx}};
  lora_backward(l, g_down, h, dff_, T, dropout, step);
  // dgate -> dgate_, dup -> dup_ (h is no longer needed).
  be_.swiglu_backward(dgate_, dup_, dff_, a.gate, a.up, T * F);
  if (G) {
    be_.linear_backward_weight(*ws_, dgate_, a.xn2, G->w_gate, T, F, H);
    be_.linear_backward_weight(*ws_, dup_, a.xn2, G->w_up, T, F, H);
  }
  input_grad(L, LoraTarget::gate, wt(&TransposedLayer::w_gate), dgate_, dxn_, T);
  input_grad(L, LoraTarget::up, wt(&TransposedLayer::w_up), dup_, dxn_, T, true);
  const LoraGrad g_gate_up[] = {{LoraTarget::gate, dgate_}, {LoraTarget::up, dup_}};
  lora_backward(l, g_gate_up, a.xn2, dxn_, T, dropout, step);
  if (partial_ != nullptr) partial_->sum(dxn_, T * H);  // tensor parallel: this rank's channels' share
  be_.rmsnorm_backward(dx, G ? G->ffn_norm : nullptr, dxn_, a.xmid, L.ffn_norm, a.rstd2, T, H);

  // xmid = x + o(att): dx now is d(xmid), which is also d(x)'s residual part.
  if (G) be_.linear_backward_weight(*ws_, dx, a.att, G->wo, T, H, Q);
  input_grad(L, LoraTarget::o, wt(&TransposedLayer::wo), dx, datt_, T);
  const LoraGrad g_o[] = {{LoraTarget::o, dx}};
  lora_backward(l, g_o, a.att, datt_, T, dropout, step);
  be_.zero(dq_, T * Q);
  be_.zero(dk_, T * KV);
  be_.zero(dv_, T * KV);
  be_.attention_backward(*ws_, shape, dq_, dk_, dv_, datt_, a.q, a.k, a.v, a.att, a.lse, T, seq_start_.data());
  be_.rope(w_.rope, rope_cs_, dq_, T, c_.n_heads, true);
  be_.rope(w_.rope, rope_cs_, dk_, T, c_.n_kv_heads, true);
  if (G) {
    be_.linear_backward_weight(*ws_, dq_, a.xn1, G->wq, T, Q, H);
    be_.linear_backward_weight(*ws_, dk_, a.xn1, G->wk, T, KV, H);
    be_.linear_backward_weight(*ws_, dv_, a.xn1, G->wv, T, KV, H);
    if (G->bq) {
      be_.linear_backward_bias(dq_, G->bq, T, Q);
      be_.linear_backward_bias(dk_, G->bk, T, KV);
      be_.linear_backward_bias(dv_, G->bv, T, KV);
    }
  }
  // With LoRA the first layer's input is the frozen embedding: nothing below
  // needs its gradient.
  const bool need_dx = l > 0 || full_ != nullptr;
  if (need_dx) {
    input_grad(L, LoraTarget::q, wt(&TransposedLayer::wq), dq_, dxn_, T);
    input_grad(L, LoraTarget::k, wt(&TransposedLayer::wk), dk_, dxn_, T, true);
    input_grad(L, LoraTarget::v, wt(&TransposedLayer::wv), dv_, dxn_, T, true);
  }
  const LoraGrad g_qkv[] = {{LoraTarget::q, dq_}, {LoraTarget::k, dk_}, {LoraTarget::v, dv_}};
  lora_backward(l, g_qkv, a.xn1, need_dx ? dxn_ : nullptr, T, dropout, step);
  if (!need_dx) return;
  if (partial_ != nullptr) partial_->sum(dxn_, T * H);  // tensor parallel: this rank's heads' share
  be_.rmsnorm_backward(dx, G ? G->attn_norm : nullptr, dxn_, a.x, L.attn_norm, a.rstd1, T, H);
}

void TrainSession::set_positions(const Batch& batch) {
  const int64_t T = batch.rows * batch.seq_len;
  tokens_ = T;
  pos_.assign(batch.positions.begin(), batch.positions.end());
  seq_start_.resize(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i)  // row-relative -> index into the concatenated rows
    seq_start_[static_cast<size_t>(i)] =
        static_cast<int32_t>((i / batch.seq_len) * batch.seq_len + batch.seq_start[static_cast<size_t>(i)]);
}

// The final norm, the loss and (backward) the gradient down to the last
// layer's output in dres_, for the micro-batch set up by set_positions.
LossResult TrainSession::loss_and_head_backward(const Batch& batch, float grad_scale, bool backward) {
  const int64_t T = tokens_, H = c_.hidden;
  dec_.final_norm(x_final_, nullptr, T, xn_final_, rstd_final_);

  // d(final-norm output) lands in tmp_; d(residual stream) in dres_.
  LossOp op;
  op.dW = backward && full_ ? full_->output_grad() : nullptr;
  op.W = &w_.output;
  op.W_prepared = w_.output_prepared.get();
  op.precision = backward_;
  op.Wt = wt_->output.get();
  op.h = xn_final_;
  op.labels = batch.targets.data();
  op.T = T;
  op.grad_scale = grad_scale;
  op.count_correct = !backward;  // token accuracy is an evaluation figure; the step skips it
  float* dh = tmp_;
  if (backward) {
    be_.zero(dh, T * H);
    op.dh = dh;
  }
  const LossResult res = be_.cross_entropy(*ws_, op);
  if (!backward) return res;

  be_.zero(dres_, T * H);
  be_.rmsnorm_backward(dres_, full_ ? full_->output_norm_grad() : nullptr, dh, x_final_, w_.output_norm, rstd_final_,
                       T, H);
  return res;
}

LossResult TrainSession::run(const Batch& batch, float grad_scale, uint64_t step, bool backward) {
  LOOM_ASSERT(span_.first == 0 && span_.last == c_.n_layers && w_.output.data != nullptr);  // a whole model
  check_batch(batch);
  const int64_t T = batch.rows * batch.seq_len, H = c_.hidden;
  const bool dropout = backward && lora_ && lora_->config().dropout > 0;
  reserve(T);
  set_positions(batch);
  const std::initializer_list<TraceArg> tokens = {{"tokens", static_cast<double>(T)}};
  std::optional<TraceScope> phase(std::in_place, be_.tracer(), "forward", tokens);

  dec_.embed(batch.tokens.data(), T, layers_.empty() ? x_final_ : layers_[0].x);
  dec_.rope_table(pos_.data(), T, rope_cs_);
  forward_layers(T, dropout, step, backward);
  if (backward) phase.emplace(be_.tracer(), "backward", tokens);  // ends the forward's
  const LossResult res = loss_and_head_backward(batch, grad_scale, backward);
  if (!backward) return res;
  backward_segments(T, dropout, step);
  // dres_ is now d(embedding rows); with LoRA the embedding is frozen and it stops here.
  if (full_)
    be_.embedding_backward(full_->token_embd_grad(), dres_, batch.tokens.data(), T, c_.vocab_size, H);
  return res;
}

// The span's layers forward from layers_[first].x; `backward`: keeping what
// the backward needs (segment inputs, bf16 records).
void TrainSession::forward_layers(int64_t T, bool dropout, uint64_t step, bool backward) {
  const int64_t N = segment_layers(), H = c_.hidden;
  for (int64_t l = span_.first; l < span_.last; ++l) {
    const int64_t k = segment_of(l);
    if (backward && N > 0 && l == segment_begin(k) && static_cast<size_t>(k) < checkpoints_.size()) {
      float* c = checkpoints_[static_cast<size_t>(k)];
      if (opts_.bf16)
        be_.to_bf16(reinterpret_cast<uint16_t*>(c), layers_[static_cast<size_t>(l)].x, T * H);
      else
        std::memcpy(c, layers_[static_cast<size_t>(l)].x, static_cast<size_t>(T * H) * sizeof(float));
    }
    forward_layer(l, T, dropout, step, next_input(l));
    if (backward && bf16_records() && l + 1 < c_.n_layers) save_record(l, T);
  }
}

// The layers' backward, last to first, into dres_. With checkpointing each
// segment but the last is first recomputed from its checkpoint (its last
// layer's output, not needed, spills into dxn_: between layers of the backward
// only dres_ is live); with bf16 records each layer is first widened into its slot.
void TrainSession::backward_segments(int64_t T, bool dropout, uint64_t step) {
  const int64_t L = c_.n_layers, N = segment_layers();
  if (N == 0) {
    for (int64_t l = span_.last - 1; l >= span_.first; --l) {
      if (bf16_records() && l + 1 < L) load_record(l, T);
      backward_layer(l, T, dropout, step, dres_);
      if (layer_done_) layer_done_(l);
    }
    return;
  }
  const int64_t n = n_segments();
  for (int64_t k = segment_of(span_.last - 1); k >= segment_of(span_.first); --k) {
    const int64_t s = segment_begin(k), e = segment_end(k);
    if (k + 1 < n) {
      const float* c = checkpoints_[static_cast<size_t>(k)];
      float* x = layers_[static_cast<size_t>(s)].x;
      if (opts_.bf16)
        be_.from_bf16(x, reinterpret_cast<const uint16_t*>(c), T * c_.hidden);
      else
        std::memcpy(x, c, static_cast<size_t>(T * c_.hidden) * sizeof(float));
      for (int64_t l = s; l < e; ++l) forward_layer(l, T, dropout, step, l + 1 < e ? next_input(l) : dxn_);
    }
    for (int64_t l = e - 1; l >= s; --l) {
      backward_layer(l, T, dropout, step, dres_);
      if (layer_done_) layer_done_(l);
    }
  }
}

LossResult TrainSession::forward_backward(const Batch& batch, float grad_scale, uint64_t step) {
  return run(batch, grad_scale, step, true);
}

LossResult TrainSession::forward_loss(const Batch& batch) { return run(batch, 0.0f, 0, false); }

}  // namespace loom
