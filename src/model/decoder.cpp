#include "model/decoder.h"

#include <algorithm>
#include <iterator>

#include "core/error.h"
#include "core/trace.h"

namespace loom {

StepActivations::StepActivations(const ModelConfig& c, Backend& backend, int64_t max_rows, bool kv_rows) {
  const int64_t T = max_rows, KV = kv_rows ? T * c.kv_dim() : 0;
  float** views[] = {&x, &xn, &q, &k, &v, &att, &gate, &up, &rope_cs};
  const int64_t sizes[] = {T * c.hidden,       T * c.hidden, T * c.q_dim(),        KV, KV, T * c.q_dim(),
                           T * c.intermediate, T * c.intermediate, T * c.head_dim};
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  memory = backend.alloc(static_cast<size_t>(total) * sizeof(float));
  float* p = memory.floats();
  for (size_t i = 0; i < std::size(views); ++i) {
    *views[i] = sizes[i] > 0 ? p : nullptr;
    p += sizes[i];
  }
}

LayerBuffers StepActivations::layer() const {
  LayerBuffers b;
  b.x = b.xmid = b.out = x;
  b.xn1 = b.o = b.xn2 = b.down = xn;
  b.q = q;
  b.att = att;
  b.gate = b.h = gate;
  b.up = up;
  return b;
}

Decoder::Decoder(const ModelConfig& config, const ModelWeights& weights, Backend& backend)
    : c_(config), w_(weights), be_(backend) {
  LOOM_ASSERT(weights.prepared.size() == weights.layers.size() &&
              (weights.output.data == nullptr) == (weights.output_prepared == nullptr));
}

void Decoder::check_tokens(std::span<const int32_t> tokens) const {
  for (int32_t t : tokens)
    if (t < 0 || t >= c_.vocab_size)
      fail(ErrorKind::invalid_input, "token id {} is outside the vocabulary [0, {})", t, c_.vocab_size);
}

void Decoder::embed(const int32_t* tokens, int64_t T, float* x) const { be_.embedding(w_.token_embd, tokens, T, x); }

void Decoder::rope_table(const int32_t* pos, int64_t T, float* cs) const { be_.rope_table(w_.rope, pos, T, cs); }

void Decoder::layer(Workspace& ws, int64_t l, int64_t T, const LayerBuffers& b, const float* rope_cs,
                    AttentionStep& attn, LayerAdapters* adapters) const {
  const int64_t H = c_.hidden, Q = c_.q_dim(), KV = c_.kv_dim(), F = c_.intermediate;
  const auto eps = static_cast<float>(c_.rms_eps);
  const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
  const PreparedLayer& P = w_.prepared[static_cast<size_t>(l)];
  LOOM_ASSERT(L.held());  // a pipeline stage runs only its own layers
  const TraceLayer trace_layer(be_.tracer(), l);
  float* k = attn.keys(l);
  float* v = attn.values(l);

  // Attention block: one activation quantization and one dispatch for q, k and v.
  be_.rmsnorm(b.xn1, b.rstd1, b.x, L.attn_norm, T, H, eps);
  const MatmulTarget qkv[] = {{P.wq.get(), b.q, Q}, {P.wk.get(), k, KV}, {P.wv.get(), v, KV}};
  base_products(ws, l, AdapterPoint::qkv, qkv, b.xn1, H, T, adapters);
  scale_output(L, LoraTarget::q, b.q, T * Q);
  scale_output(L, LoraTarget::k, k, T * KV);
  scale_output(L, LoraTarget::v, v, T * KV);
  if (L.bq != nullptr) {
    be_.add_bias(b.q, L.bq, T, Q);
    be_.add_bias(k, L.bk, T, KV);
    be_.add_bias(v, L.bv, T, KV);
  }
  if (adapters != nullptr) {
    const AdapterJob jobs[] = {{LoraTarget::q, b.xn1, H, b.q, Q, T},
                               {LoraTarget::k, b.xn1, H, k, KV, T},
                               {LoraTarget::v, b.xn1, H, v, KV, T}};
    adapters->apply(l, jobs);
  }
  be_.rope(w_.rope, rope_cs, b.q, T, c_.n_heads, false);
  be_.rope(w_.rope, rope_cs, k, T, c_.n_kv_heads, false);
  attn.attend(l, b.q, k, v, b.att);
  const MatmulTarget o[] = {{P.wo.get(), b.o, H}};
  base_products(ws, l, AdapterPoint::o, o, b.att, Q, T, adapters);
  scale_output(L, LoraTarget::o, b.o, T * H);
  if (adapters != nullptr) {
    const AdapterJob jobs[] = {{LoraTarget::o, b.att, Q, b.o, H, T}};
    adapters->apply(l, jobs);
  }
  if (partial_ != nullptr) partial_->sum(b.o, T * H);  // tensor parallel: this rank's heads' share
  be_.add(b.xmid, b.x, b.o, T * H);

  // MLP block.
  be_.rmsnorm(b.xn2, b.rstd2, b.xmid, L.ffn_norm, T, H, eps);
  const MatmulTarget gate_up[] = {{P.w_gate.get(), b.gate, F}, {P.w_up.get(), b.up, F}};
  base_products(ws, l, AdapterPoint::gate_up, gate_up, b.xn2, H, T, adapters);
  scale_output(L, LoraTarget::gate, b.gate, T * F);
  scale_output(L, LoraTarget::up, b.up, T * F);
  if (adapters != nullptr) {
    const AdapterJob jobs[] = {{LoraTarget::gate, b.xn2, H, b.gate, F, T}, {LoraTarget::up, b.xn2, H, b.up, F, T}};
    adapters->apply(l, jobs);
  }
  be_.swiglu(b.h, b.gate, b.up, T, F);
  const MatmulTarget down[] = {{P.w_down.get(), b.down, H}};
  base_products(ws, l, AdapterPoint::down, down, b.h, F, T, adapters);
  scale_output(L, LoraTarget::down, b.down, T * H);
  if (adapters != nullptr) {
    const AdapterJob jobs[] = {{LoraTarget::down, b.h, F, b.down, H, T}};
    adapters->apply(l, jobs);
  }
  if (partial_ != nullptr) partial_->sum(b.down, T * H);  // tensor parallel: this rank's channels' share
  be_.add(b.out, b.xmid, b.down, T * H);
}

void Decoder::base_products(Workspace& ws, int64_t l, AdapterPoint point, std::span<const MatmulTarget> base,
                            const float* x, int64_t ldx, int64_t T, LayerAdapters* adapters) const {
  const std::span<const MatmulTarget> extra =
      adapters != nullptr ? adapters->base_pass(l, point) : std::span<const MatmulTarget>();
  if (extra.empty()) {
    if (base.size() == 1)
      be_.matmul(ws, *base[0].W, x, ldx, base[0].y, base[0].ldy < 0 ? base[0].W->rows() : base[0].ldy, T);
    else
      be_.matmul_multi(ws, base, x, ldx, T);
    return;
  }
  LOOM_ASSERT(base.size() + extra.size() <= kMaxPassTargets);
  MatmulTarget all[kMaxPassTargets];
  std::copy(base.begin(), base.end(), all);
  std::copy(extra.begin(), extra.end(), all + base.size());
  be_.matmul_multi(ws, std::span<const MatmulTarget>(all, base.size() + extra.size()), x, ldx, T);
}

void Decoder::scale_output(const LayerWeights& L, LoraTarget t, float* y, int64_t n) const {
  if (const float s = L.output_scale(t); s != 1.0f) be_.scale(y, s, n);
}

void Decoder::final_norm(const float* x, const int64_t* rows, int64_t n, float* out, float* rstd) const {
  const int64_t H = c_.hidden;
  const auto eps = static_cast<float>(c_.rms_eps);
  if (rows == nullptr) {
    be_.rmsnorm(out, rstd, x, w_.output_norm, n, H, eps);
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    be_.rmsnorm(out + i * H, rstd ? rstd + i : nullptr, x + rows[i] * H, w_.output_norm, 1, H, eps);
}

void Decoder::logits(Workspace& ws, const float* xn, int64_t n, float* logits) const {
  be_.matmul(ws, *w_.output_prepared, xn, c_.hidden, logits, c_.vocab_size, n);
}

}  // namespace loom
