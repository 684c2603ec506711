// LayerAdapters::base_pass (model/decoder.h): adapter products run in the base
// weights' matmul_multi call give the same layer outputs, bit for bit, as the
// adapter computing them itself, at all four points, with an f32 and a
// quantized base (A then is another dtype group of the same call).
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "model/decoder.h"
#include "model/model.h"
#include "ops_test_util.h"

namespace loom {
namespace {

using test_util::random_vec;

constexpr int64_t kRank = 4;

// Contiguous K/V of one pass over positions 0..T-1 (no cache).
class PlainAttention final : public AttentionStep {
 public:
  PlainAttention(const Decoder& d, const StepActivations& a, const int32_t* pos, int64_t T)
      : d_(d), a_(a), pos_(pos), T_(T) {}
  float* keys(int64_t) override { return a_.k; }
  float* values(int64_t) override { return a_.v; }
  void attend(int64_t, const float* q, const float* k, const float* v, float* att) override {
    d_.backend().attention(d_.attention_shape(), q, KvRows{k, v, DType::f32}, att, T_, pos_, nullptr);
  }

 private:
  const Decoder& d_;
  const StepActivations& a_;
  const int32_t* pos_;
  int64_t T_;
};

// y += B (A x) per target; A prepared for the backend. fused: A x comes from
// base_pass() (the base's matmul_multi), else from its own matmul in apply().
class TestAdapters final : public LayerAdapters {
 public:
  TestAdapters(const ModelConfig& c, Backend& be, Workspace& ws, int64_t T, bool fused)
      : c_(c), be_(be), ws_(ws), T_(T), fused_(fused) {
    uint32_t seed = 50;
    for (int64_t l = 0; l < c.n_layers; ++l)
      for (LoraTarget t : kAllLoraTargets) {
        const int64_t in = lora_target_in(c, t), out = lora_target_out(c, t);
        a_.push_back(random_vec(static_cast<size_t>(kRank * in), seed++, 0.2f));
        b_.push_back(random_vec(static_cast<size_t>(out * kRank), seed++, 0.2f));
        const std::string name = "A" + std::to_string(a_.size());
        prepared_.push_back(be.prepare_weight(make_tensor(a_.back().data(), DType::f32, {kRank, in}), name.c_str()));
      }
    for (auto& u : u_) u.resize(static_cast<size_t>(T * kRank));
  }
  int base_pass_calls = 0;

  std::span<const MatmulTarget> base_pass(int64_t layer, AdapterPoint point) override {
    if (!fused_) return {};
    ++base_pass_calls;
    n_targets_ = 0;
    for (LoraTarget t : targets(point))
      targets_[n_targets_++] = {prepared(layer, t), u_[static_cast<size_t>(t)].data(), kRank};
    return {targets_.data(), n_targets_};
  }
  void apply(int64_t layer, std::span<const AdapterJob> jobs) override {
    for (const AdapterJob& j : jobs) {
      float* u = u_[static_cast<size_t>(j.target)].data();
      if (!fused_) be_.matmul(ws_, *prepared(layer, j.target), j.x, j.ldx, u, kRank, T_);
      const std::vector<float>& b = b_[index(layer, j.target)];
      const int64_t out = lora_target_out(c_, j.target);
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t n = 0; n < out; ++n) {
          float s = 0;
          for (int64_t r = 0; r < kRank; ++r) s += b[static_cast<size_t>(n * kRank + r)] * u[t * kRank + r];
          j.y[t * j.ldy + n] += s;
        }
    }
  }

 private:
  static std::vector<LoraTarget> targets(AdapterPoint p) {
    switch (p) {
      case AdapterPoint::qkv: return {LoraTarget::q, LoraTarget::k, LoraTarget::v};
      case AdapterPoint::o: return {LoraTarget::o};
      case AdapterPoint::gate_up: return {LoraTarget::gate, LoraTarget::up};
      case AdapterPoint::down: return {LoraTarget::down};
    }
    return {};
  }
  size_t index(int64_t layer, LoraTarget t) const {
    return static_cast<size_t>(layer * kLoraTargetCount + static_cast<int64_t>(t));
  }
  const DeviceWeight* prepared(int64_t layer, LoraTarget t) const { return prepared_[index(layer, t)].get(); }

  const ModelConfig& c_;
  Backend& be_;
  Workspace& ws_;
  int64_t T_;
  bool fused_;
  std::vector<std::vector<float>> a_, b_;
  std::vector<WeightHandle> prepared_;
  std::array<std::vector<float>, kLoraTargetCount> u_;
  std::array<MatmulTarget, 3> targets_{};
  size_t n_targets_ = 0;
};

// The residual stream after every layer over T random tokens; adapters: 0 none, 1 own products, 2 base_pass.
std::vector<float> run_layers(const Model& m, Backend& be, int mode) {
  const ModelConfig& c = m.config();
  const int64_t T = 11;
  Decoder dec(c, m.weights(), be);
  StepActivations acts(c, be, T, /*kv_rows=*/true);
  auto ws = be.make_workspace();
  std::vector<int32_t> tokens, pos;
  for (int64_t t = 0; t < T; ++t) {
    tokens.push_back(static_cast<int32_t>((t * 37 + 5) % c.vocab_size));
    pos.push_back(static_cast<int32_t>(t));
  }
  TestAdapters adapters(c, be, *ws, T, mode == 2);
  PlainAttention attn(dec, acts, pos.data(), T);
  dec.embed(tokens.data(), T, acts.x);
  dec.rope_table(pos.data(), T, acts.rope_cs);
  const LayerBuffers b = acts.layer();
  for (int64_t l = 0; l < c.n_layers; ++l)
    dec.layer(*ws, l, T, b, acts.rope_cs, attn, mode == 0 ? nullptr : &adapters);
  if (mode == 2) {
    EXPECT_EQ(adapters.base_pass_calls, 4 * c.n_layers);
  }
  return std::vector<float>(acts.x, acts.x + T * c.hidden);
}

TEST(DecoderBasePass, AdapterProductsInTheBasePassGiveTheSameBits) {
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  for (const char* name : {"tiny-llama.f32.gguf", "tiny-llama.q4_1.gguf"}) {
    SCOPED_TRACE(name);
    auto m = Model::load(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/" + name,
                         {.tokenizer = false, .pack = true, .backend = backend.get()});
    const auto none = run_layers(*m, *backend, 0), own = run_layers(*m, *backend, 1),
               fused = run_layers(*m, *backend, 2);
    ASSERT_EQ(own.size(), fused.size());
    EXPECT_EQ(std::memcmp(own.data(), fused.data(), own.size() * sizeof(float)), 0);
    EXPECT_NE(std::memcmp(none.data(), own.data(), own.size() * sizeof(float)), 0);  // the adapters act
  }
}

}  // namespace
}  // namespace loom
