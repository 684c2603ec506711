#include "train/qat.h"

#include <fmt/format.h>

#include <cstring>

#include "core/error.h"
#include "kernels/cpu/dequant.h"
#include "model/adapter_merge.h"

namespace loom {

IntQuantSpec qat_spec(const TrainConfig::Qat& q, const ModelConfig& c) {
  IntQuantSpec s;
  s.bits = q.bits;
  s.symmetric = q.symmetric;
  s.range = RangeMethod::minmax;
  s.group = 0;
  if (q.group_size > 0) {
    s.group = fitting_common_group(q.group_size, {c.hidden, c.q_dim(), c.intermediate});
    if (s.group == 0)
      fail(ErrorKind::invalid_input, "qat.group_size {}: no multiple of 32 up to it divides the input widths {}, {} "
           "and {}", q.group_size, c.hidden, c.q_dim(), c.intermediate);
  }
  return s;
}

QatWeights::QatWeights(ModelWeights& w, const IntQuantSpec& spec, bool lora)
    : spec_(spec), lora_(lora) {
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      Tensor& W = target_matrix(w.layers[l], t);
      check_int_quant_spec(spec, W.cols(), fmt::format("qat: layer {} {}", l, lora_target_peft_name(t)));
      Matrix m{static_cast<int64_t>(l), t, nullptr, {}, std::vector<float>(static_cast<size_t>(W.numel()))};
      if (lora) {
        m.latent_copy.resize(static_cast<size_t>(W.numel()));
        for (int64_t r = 0; r < W.rows(); ++r)
          dequantize_row(W.dtype, W.row_ptr(r), m.latent_copy.data() + r * W.cols(), W.cols());
        m.latent = m.latent_copy.data();
      } else {
        LOOM_ASSERT(W.dtype == DType::f32);  // the full fine-tuning arena
        m.latent = W.as<float>();
      }
      W.data = m.fq.data();
      W.dtype = DType::f32;
      m_.push_back(std::move(m));
    }
}

void QatWeights::refresh(ModelWeights& w, ThreadPool& pool, LoraModel* lora) {
  LOOM_ASSERT(lora_ == (lora != nullptr));
  pool.parallel_for(static_cast<int64_t>(m_.size()), [&](int64_t b, int64_t e) {
    std::vector<float> merged;
    for (int64_t i = b; i < e; ++i) {
      Matrix& m = m_[static_cast<size_t>(i)];
      if (m.fixed) continue;
      const Tensor& W = target_matrix(w.layers[static_cast<size_t>(m.layer)], m.target);
      const float* src = m.latent;
      m.fixed = lora != nullptr && !lora->slot(m.layer, m.target).active;
      if (lora != nullptr && !m.fixed) {
        merged.assign(m.latent, m.latent + W.numel());
        const Tensor A = lora->a(m.layer, m.target), B = lora->b(m.layer, m.target);
        merge_lora_rows(merged.data(), B.as<const float>(), A.as<const float>(), W.rows(), lora->config().r,
                        W.cols(), lora->config().scale());
        src = merged.data();
      }
      int_fake_quantize(src, W.rows(), W.cols(), spec_, m.fq.data());
    }
  });
}

void QatWeights::restore_latent(ModelWeights& w) {
  for (Matrix& m : m_) {
    Tensor& W = target_matrix(w.layers[static_cast<size_t>(m.layer)], m.target);
    W.data = m.latent;
  }
}

void QatWeights::point_at_fq(ModelWeights& w) {
  for (Matrix& m : m_) target_matrix(w.layers[static_cast<size_t>(m.layer)], m.target).data = m.fq.data();
}

std::string QatWeights::describe() const {
  const std::string groups = spec_.group > 0 ? fmt::format("groups of {}", spec_.group) : "per row";
  return fmt::format("int{} {}, {}", spec_.bits, groups, spec_.symmetric ? "symmetric" : "asymmetric");
}

}  // namespace loom
