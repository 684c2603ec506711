// Training's LoRA adapters: the forward term y += scale * B (A x) with dropout
// and the saved inputs, and its backward (dA, dB, dx), at the session's
// precision (fp32, or bf16 / fp16 operands with f32 sums). The adapters of one
// point of the layer that read the same x (q/k/v over xn1, gate/up over xn2)
// run their A products as one GEMM over the stacked [A_q; A_k; A_v]: forward
// x A^T, backward dA and dx through A (not with dropout: each adapter then
// reads its own dropped x).
#include "train/train_step.h"

#include <algorithm>

#include "core/error.h"
#include "model/tensor_parallel.h"

namespace loom {

namespace {
DType precision_dtype(TrainPrecision p) {
  switch (p) {
    case TrainPrecision::fp32: return DType::f32;
    case TrainPrecision::bf16: return DType::bf16;
    case TrainPrecision::fp16: return DType::f16;
  }
  return DType::f32;
}
constexpr int64_t kMaxGroup = 3;  // q/k/v
}  // namespace

// The trained LoRA adapters on the layer's linear outputs (with dropout and saved inputs).
class TrainSession::TrainedAdapters final : public LayerAdapters {
 public:
  explicit TrainedAdapters(TrainSession& s) : s_(s) {}
  void apply(int64_t layer, std::span<const AdapterJob> jobs) override {
    for (const AdapterJob& j : jobs)
      LOOM_ASSERT(j.ldx == lora_target_in(s_.c_, j.target) && j.ldy == lora_target_out(s_.c_, j.target) &&
                  j.x == jobs[0].x);
    s_.lora_forward(layer, jobs, s_.tokens_, s_.dropout_, s_.step_);
  }

 private:
  TrainSession& s_;
};

std::unique_ptr<LayerAdapters> TrainSession::make_trained_adapters(TrainSession& s) {
  return std::make_unique<TrainedAdapters>(s);
}

void TrainSession::set_precision(TrainPrecision p) {
  if (p != TrainPrecision::fp32 && full_ != nullptr)
    fail(ErrorKind::unsupported, "precision: {} computes the LoRA products only; full fine-tuning runs in fp32 in "
         "this build", train_precision_name(p));
  precision_ = p;
  if (reserved_ > 0) reserve_lora_work(reserved_);
}

// Where the LoRA scratch sits in lora_work_ for micro-batches of up to T tokens
// (base null: only counts). xr: the adapters' input rounded; dyr: an output
// gradient rounded; bq: a B rounded; cat: [T, group * r] A products of a group;
// a: stacked (and rounded) A of a group; ga: their stacked gradients.
TrainSession::LoraWork TrainSession::lora_work_layout(int64_t T, float* base) const {
  LoraWork w;
  if (!lora_) return w;
  const int64_t H = c_.hidden, Q = c_.q_dim(), F = c_.intermediate, r = lora_->config().r;
  const int64_t in_max = std::max({H, Q, F}), out_max = std::max({H, Q, c_.kv_dim(), F});
  const bool round = precision_ != TrainPrecision::fp32;
  auto carve = [&](int64_t n) {
    float* p = base == nullptr ? nullptr : base + w.floats;
    w.floats += static_cast<size_t>(n);
    return p;
  };
  w.xr = carve(round ? T * in_max : 0);
  w.dyr = carve(round ? T * out_max : 0);
  w.bq = carve(round ? out_max * r : 0);
  w.cat = carve(T * kMaxGroup * r);
  w.a = carve(r * std::max({kMaxGroup * H, Q, F}));
  w.ga = carve(kMaxGroup * r * H);
  return w;
}

size_t TrainSession::lora_work_floats(int64_t T) const { return lora_work_layout(T, nullptr).floats; }

void TrainSession::reserve_lora_work(int64_t T) {
  lora_work_ = DeviceBuffer();
  const size_t n = lora_work_floats(T);
  if (n > 0) lora_work_ = be_.alloc(n * sizeof(float));
  lw_ = lora_work_layout(T, lora_work_.floats());
}

// Rounds n floats of src into dst at the session's precision; returns what the
// products read (src itself in fp32).
const float* TrainSession::lora_operand(float* dst, const float* src, int64_t n) {
  if (precision_ == TrainPrecision::fp32) return src;
  be_.round_to(precision_dtype(precision_), dst, src, n);
  return dst;
}

// u = scale * A x (rounded) is in a.ax; y += B u.
void TrainSession::lora_forward_b(int64_t l, LoraTarget t, float* y, int64_t T) {
  const LoraSlot& s = lora_->slot(l, t);
  const int64_t r = lora_->config().r;
  float* ax = layers_[static_cast<size_t>(l)].ax[static_cast<size_t>(t)];
  be_.scale(ax, lora_->scale(), T * r);
  lora_operand(ax, ax, T * r);
  if (adapters_merged_) return;  // QAT: s B A is inside the model's fq(W + s B A)
  const Tensor B = lora_->b(l, t);
  const float* b = lora_operand(lw_.bq, B.as<const float>(), s.out * r);
  be_.matmul_dense(*ws_, make_tensor(const_cast<float*>(b), DType::f32, {s.out, r}), ax, tmp_, T);
  be_.add(y, y, tmp_, T * s.out);
}

// The adapter input's dropout (its mask regenerated alike in the backward):
// one stream per (layer, target); under tensor parallel o and down hold this
// rank's columns of the input, which draw those columns of one process's mask.
void TrainSession::lora_dropout(float* dst, const float* src, int64_t l, LoraTarget t, int64_t T, uint64_t step) {
  const int64_t in = lora_->slot(l, t).in;
  MaskWindow w;
  if (tp_ranks_ > 1 && lora_target_row_parallel(t)) w = {in, in * tp_ranks_, in * tp_rank_};
  be_.dropout(dst, src, T * in, lora_->config().dropout, lora_->config().seed, step,
              static_cast<uint64_t>(l * kLoraTargetCount + static_cast<int64_t>(t)), w);
}

void TrainSession::lora_forward(int64_t l, std::span<const AdapterJob> jobs, int64_t T, bool dropout,
                                uint64_t step) {
  AdapterJob act[kMaxGroup];
  int64_t n = 0;
  for (const AdapterJob& j : jobs)
    if (lora_->slot(l, j.target).active) act[n++] = j;
  if (n == 0) return;
  LayerActs& a = layers_[static_cast<size_t>(l)];
  const int64_t r = lora_->config().r, in = lora_->slot(l, act[0].target).in;
  if (dropout || n == 1 || !fused_lora_) {
    for (int64_t i = 0; i < n; ++i) {
      const auto ti = static_cast<size_t>(act[i].target);
      const float* xin;
      if (dropout) {
        lora_dropout(a.xd[ti], act[i].x, l, act[i].target, T, step);
        xin = lora_operand(a.xd[ti], a.xd[ti], T * in);  // saved as the products read it
      } else {
        xin = lora_operand(lw_.xr, act[i].x, T * in);
      }
      const Tensor A = lora_->a(l, act[i].target);
      const float* w = lora_operand(lw_.a, A.as<const float>(), r * in);
      be_.matmul_dense(*ws_, make_tensor(const_cast<float*>(w), DType::f32, {r, in}), xin, a.ax[ti], T);
      lora_forward_b(l, act[i].target, act[i].y, T);
    }
    return;
  }
  // One product over the stacked A: each output element is the same FMA chain
  // over x as in its own product, so the results are those of the unfused path.
  const float* xin = lora_operand(lw_.xr, act[0].x, T * in);
  for (int64_t i = 0; i < n; ++i) {
    const Tensor A = lora_->a(l, act[i].target);
    be_.round_to(precision_dtype(precision_), lw_.a + i * r * in, A.as<const float>(), r * in);
  }
  be_.matmul_dense(*ws_, make_tensor(lw_.a, DType::f32, {n * r, in}), xin, lw_.cat, T);
  for (int64_t i = 0; i < n; ++i) {
    be_.copy_2d(a.ax[static_cast<size_t>(act[i].target)], r, lw_.cat + i * r, n * r, T, r);
    lora_forward_b(l, act[i].target, act[i].y, T);
  }
}

// dB += dy^T u and du = scale * dy B (rounded) into dax_, for one adapter.
void TrainSession::lora_backward_b(int64_t l, LoraTarget t, const float* dy, int64_t T) {
  const LoraSlot& s = lora_->slot(l, t);
  const int64_t r = lora_->config().r;
  const float* dyin = lora_operand(lw_.dyr, dy, T * s.out);  // fp16: overflows to inf, the scaler's signal
  be_.linear_backward_weight(*ws_, dyin, layers_[static_cast<size_t>(l)].ax[static_cast<size_t>(t)],
                             lora_->grad_b(l, t).as<float>(), T, s.out, r);
  // du = dy B as a product with B^T [r, out] (B's r columns are too narrow for the
  // input-gradient tiles).
  const Tensor B = lora_->b(l, t);
  LOOM_ASSERT(static_cast<size_t>(r * s.out) <= bt_.n_floats());
  be_.transpose(bt_.floats(), B.as<const float>(), s.out, r);
  lora_operand(bt_.floats(), bt_.floats(), r * s.out);
  be_.matmul_dense(*ws_, make_tensor(bt_.floats(), DType::f32, {r, s.out}), dyin, dax_, T);
  be_.scale(dax_, lora_->scale(), T * r);
  lora_operand(dax_, dax_, T * r);
}

void TrainSession::lora_backward(int64_t l, std::span<const LoraGrad> grads, const float* x, float* dx, int64_t T,
                                 bool dropout, uint64_t step) {
  if (!lora_) return;
  if (adapters_merged_) dx = nullptr;  // QAT: the base's input gradient used fq(W + s B A)
  LoraGrad act[kMaxGroup];
  int64_t n = 0;
  for (const LoraGrad& g : grads)
    if (lora_->slot(l, g.target).active) act[n++] = g;
  if (n == 0) return;
  const LayerActs& a = layers_[static_cast<size_t>(l)];
  const int64_t r = lora_->config().r, in = lora_->slot(l, act[0].target).in;
  const DType p = precision_dtype(precision_);
  if (dropout || n == 1 || !fused_lora_) {
    for (int64_t i = 0; i < n; ++i) {
      const LoraTarget t = act[i].target;
      const auto ti = static_cast<size_t>(t);
      const float* xin = dropout ? a.xd[ti] : lora_operand(lw_.xr, x, T * in);  // xd is saved rounded
      lora_backward_b(l, t, act[i].dy, T);
      be_.linear_backward_weight(*ws_, dax_, xin, lora_->grad_a(l, t).as<float>(), T, r, in);
      if (dx == nullptr) continue;
      const Tensor A = lora_->a(l, t);
      const float* w = lora_operand(lw_.a, A.as<const float>(), r * in);
      const Tensor Aq = make_tensor(const_cast<float*>(w), DType::f32, {r, in});
      if (!dropout) {
        be_.linear_backward_input(*ws_, Aq, nullptr, BackwardMode::exact, dax_, dx, T, true);
        continue;
      }
      // Through the dropout: the same mask (regenerated) and scale apply to the gradient.
      be_.linear_backward_input(*ws_, Aq, nullptr, BackwardMode::exact, dax_, tmp_, T, false);
      lora_dropout(tmp_, tmp_, l, t, T, step);
      be_.add(dx, dx, tmp_, T * in);
    }
    return;
  }
  // du of every adapter side by side in cat [T, n r]; dA and dx through A as one
  // product each over the stacked A (the same chains as one adapter at a time:
  // dA's over t from the accumulated value, dx's over q's, then k's, then v's rows).
  for (int64_t i = 0; i < n; ++i) {
    lora_backward_b(l, act[i].target, act[i].dy, T);
    be_.copy_2d(lw_.cat + i * r, n * r, dax_, r, T, r);
  }
  const float* xin = lora_operand(lw_.xr, x, T * in);
  for (int64_t i = 0; i < n; ++i)
    be_.copy_2d(lw_.ga + i * r * in, in, lora_->grad_a(l, act[i].target).as<const float>(), in, r, in);
  be_.linear_backward_weight(*ws_, lw_.cat, xin, lw_.ga, T, n * r, in);
  for (int64_t i = 0; i < n; ++i)
    be_.copy_2d(lora_->grad_a(l, act[i].target).as<float>(), in, lw_.ga + i * r * in, in, r, in);
  if (dx == nullptr) return;
  for (int64_t i = 0; i < n; ++i) {
    const Tensor A = lora_->a(l, act[i].target);
    be_.round_to(p, lw_.a + i * r * in, A.as<const float>(), r * in);
  }
  be_.linear_backward_input(*ws_, make_tensor(lw_.a, DType::f32, {n * r, in}), nullptr, BackwardMode::exact,
                            lw_.cat, dx, T, true);
}

}  // namespace loom
