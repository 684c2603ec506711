// Training's LoRA adapters: the forward term y += scale * B (A x) with dropout
// and the saved inputs, and its backward (dA, dB, dx). Split from
// train_step.cpp so the adapters' arithmetic (fusing, precision) lives in one file.
#include "train/train_step.h"

#include "core/error.h"

namespace loom {

// The trained LoRA adapters on the layer's linear outputs (with dropout and saved inputs).
class TrainSession::TrainedAdapters final : public LayerAdapters {
 public:
  explicit TrainedAdapters(TrainSession& s) : s_(s) {}
  void apply(int64_t layer, std::span<const AdapterJob> jobs) override {
    for (const AdapterJob& j : jobs) {
      LOOM_ASSERT(j.ldx == lora_target_in(s_.c_, j.target) && j.ldy == lora_target_out(s_.c_, j.target));
      s_.lora_forward(layer, j.target, j.x, j.y, s_.tokens_, s_.dropout_, s_.step_);
    }
  }

 private:
  TrainSession& s_;
};

std::unique_ptr<LayerAdapters> TrainSession::make_trained_adapters(TrainSession& s) {
  return std::make_unique<TrainedAdapters>(s);
}

void TrainSession::lora_forward(int64_t l, LoraTarget t, const float* x, float* y, int64_t T, bool dropout,
                                uint64_t step) {
  const LoraSlot& s = lora_->slot(l, t);
  if (!s.active) return;
  LayerActs& a = layers_[static_cast<size_t>(l)];
  const auto ti = static_cast<size_t>(t);
  const float* xin = x;
  if (dropout) {
    be_.dropout(a.xd[ti], x, T * s.in, lora_->config().dropout, lora_->config().seed, step,
                static_cast<uint64_t>(l * kLoraTargetCount) + ti);
    xin = a.xd[ti];
  }
  const int64_t r = lora_->config().r;
  float* ax = a.ax[ti];
  be_.matmul_dense(*ws_, lora_->a(l, t), xin, ax, T);
  be_.scale(ax, lora_->scale(), T * r);
  be_.matmul_dense(*ws_, lora_->b(l, t), ax, tmp_, T);
  be_.add(y, y, tmp_, T * s.out);
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
  be_.linear_backward_weight(*ws_, dy, a.ax[ti], lora_->grad_b(l, t).as<float>(), T, s.out, r);
  // du = dy B as a product with B^T [r, out] (B's r columns are too narrow for the
  // input-gradient tiles).
  const Tensor B = lora_->b(l, t);
  LOOM_ASSERT(static_cast<size_t>(r * s.out) <= bt_.n_floats());
  be_.transpose(bt_.floats(), B.as<const float>(), s.out, r);
  be_.matmul_dense(*ws_, make_tensor(bt_.floats(), DType::f32, {r, s.out}), dy, dax_, T);
  be_.scale(dax_, lora_->scale(), T * r);
  be_.linear_backward_weight(*ws_, dax_, xin, lora_->grad_a(l, t).as<float>(), T, r, s.in);
  if (dx == nullptr) return;
  const Tensor A = lora_->a(l, t);
  if (!dropout) {
    be_.linear_backward_input(*ws_, A, nullptr, BackwardMode::exact, dax_, dx, T, true);
    return;
  }
  // Through the dropout: the same mask (regenerated) and scale apply to the gradient.
  be_.linear_backward_input(*ws_, A, nullptr, BackwardMode::exact, dax_, tmp_, T, false);
  be_.dropout(tmp_, tmp_, T * s.in, lora_->config().dropout, lora_->config().seed, step,
              static_cast<uint64_t>(l * kLoraTargetCount) + ti);
  be_.add(dx, dx, tmp_, T * s.in);
}

}  // namespace loom
