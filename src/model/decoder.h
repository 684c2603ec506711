// One Llama-family decoder layer, written once, run by every caller through the
// Backend op table (kernels/backend.h): InferenceSession (contiguous KV cache),
// the server's BatchForward (paged KV cache, per-row LoRA) and training's
// TrainSession (activations kept for the backward, LoRA with gradients). The
// callers differ only in the parts they plug in:
//  - AttentionStep: where K/V land and which attention reads them;
//  - LayerAdapters: extra terms on the linear outputs (LoRA), or none;
//  - LayerBuffers: which activations are separate (kept for backward) or share memory.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/backend.h"
#include "model/config.h"
#include "model/tensor_parallel.h"
#include "model/lora.h"
#include "model/weights.h"

namespace loom {

// Activations of one layer over T rows. Aliasing allowed where noted; the
// others must be distinct. Inference points x/xmid/out at one residual buffer
// and xn1/o/xn2/down at one scratch buffer; training keeps each.
struct LayerBuffers {
  float* x = nullptr;      // [T, H] layer input
  float* xn1 = nullptr;    // [T, H] attention-norm output
  float* rstd1 = nullptr;  // [T] its inverse RMS, kept when not null
  float* q = nullptr;      // [T, q_dim]
  float* att = nullptr;    // [T, q_dim] attention output
  float* o = nullptr;      // [T, H] output projection (may alias xmid)
  float* xmid = nullptr;   // [T, H] x + o (may alias x)
  float* xn2 = nullptr;    // [T, H] MLP-norm output (may alias xn1 when not kept)
  float* rstd2 = nullptr;  // [T], kept when not null
  float* gate = nullptr;   // [T, F]
  float* up = nullptr;     // [T, F]
  float* h = nullptr;      // [T, F] silu(gate) * up (may alias gate)
  float* down = nullptr;   // [T, H] down projection (may alias out)
  float* out = nullptr;    // [T, H] xmid + down: the layer output (may alias xmid)
};

// The activations of a step that keeps nothing for a backward (inference and
// serving): one residual stream x and one scratch row set xn for the norms and
// projections, carved from one buffer of the backend's memory for up to
// `max_rows` rows. k/v rows are allocated only when the caller's attention
// does not write the projections elsewhere (the contiguous cache does).
struct StepActivations {
  StepActivations(const ModelConfig& c, Backend& backend, int64_t max_rows, bool kv_rows);
  LayerBuffers layer() const;  // x/xmid/out = x, xn1/o/xn2/down = xn, h = gate

  DeviceBuffer memory;
  float *x = nullptr, *xn = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *gate = nullptr,
        *up = nullptr, *rope_cs = nullptr;
};

// Where a layer's keys and values go and which attention reads them.
class AttentionStep {
 public:
  virtual ~AttentionStep() = default;
  // Where layer `layer`'s K and V projections are written: [T, kv_dim] each.
  virtual float* keys(int64_t layer) = 0;
  virtual float* values(int64_t layer) = 0;
  // Called with q, k and v after biases, adapters and RoPE: keeps k and v
  // where the caller stores them and writes att [T, q_dim].
  virtual void attend(int64_t layer, const float* q, const float* k, const float* v, float* att) = 0;
};

// y [rows, out] (rows ldy apart) += the adapter's term for input x (rows ldx
// apart). `rows` is the step's T (observers such as calibration read x over it).
struct AdapterJob {
  LoraTarget target;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
  int64_t rows = 0;
};
// The four adaptation points of a layer, in order.
enum class AdapterPoint { qkv, o, gate_up, down };

// Extra terms on a layer's linear outputs (LoRA adapters). apply() is called
// once after q/k/v, o, gate/up and down with the jobs of that point.
//
// base_pass() (optional) returns products to run in the same matmul_multi
// call as the point's base weights, over the same x: e.g. each target's A
// prepared for the backend (Backend::prepare_weight, refilled with `recycle`
// after each update), writing x A^T into the adapters' own buffer, which the
// point's apply() then reads instead of computing A x itself. x is then read,
// quantized and dispatched once per weight dtype for the base weights and
// them: one pass when A is prepared in the base's dtype (an f32/bf16 base),
// one more dispatch of the same call otherwise (a quantized base). Each result
// is bit-identical to its own matmul. Training (train/train_step_lora.cpp)
// can return its stacked [A_q; A_k; A_v] and [A_gate; A_up] here when the
// adapters read x undropped (dropout 0) and compute in fp32; with dropout
// each adapter reads its own dropped x and this does not apply.
class LayerAdapters {
 public:
  virtual ~LayerAdapters() = default;
  virtual std::span<const MatmulTarget> base_pass(int64_t layer, AdapterPoint point) { return {}; }
  virtual void apply(int64_t layer, std::span<const AdapterJob> jobs) = 0;
  // The residual stream x [T, hidden] entering layer `layer` (n_layers: leaving
  // the last), for observers such as layer pruning's calibration. Only
  // InferenceSession calls it.
  virtual void residual(int64_t layer, const float* x, int64_t T) {}
};

class Decoder {
 public:
  // Most products one point's matmul_multi may carry: base weights plus base_pass().
  static constexpr size_t kMaxPassTargets = 16;

  // `weights` must be prepared (prepare_weights) for `backend`.
  Decoder(const ModelConfig& config, const ModelWeights& weights, Backend& backend);

  const ModelConfig& config() const { return c_; }
  const ModelWeights& weights() const { return w_; }
  Backend& backend() const { return be_; }
  AttentionShape attention_shape() const { return {c_.n_heads, c_.n_kv_heads, c_.head_dim, c_.kv_dim()}; }

  // Throws invalid_input for an id outside the vocabulary.
  void check_tokens(std::span<const int32_t> tokens) const;
  // x [T, H] = embedding rows of tokens.
  void embed(const int32_t* tokens, int64_t T, float* x) const;
  // cs [T, head_dim]: RoPE cos | sin of each row's position, once per step for all layers.
  void rope_table(const int32_t* pos, int64_t T, float* cs) const;
  // One layer forward over T rows (see LayerBuffers); adapters may be null.
  void layer(Workspace& ws, int64_t l, int64_t T, const LayerBuffers& b, const float* rope_cs, AttentionStep& attn,
             LayerAdapters* adapters) const;
  // out [n, H] = final norm of rows rows[i] of x (rows null: rows 0..n-1); rstd [n] kept when not null.
  void final_norm(const float* x, const int64_t* rows, int64_t n, float* out, float* rstd = nullptr) const;
  // logits [n, vocab] = xn [n, H] W_out^T.
  void logits(Workspace& ws, const float* xn, int64_t n, float* logits) const;
  // Tensor parallel (model/tensor_parallel.h): the weights are one rank's
  // shard and layer() sums the o and down products over the ranks.
  void set_partial_sums(PartialSums* p) { partial_ = p; }
  PartialSums* partial_sums() const { return partial_; }

 private:
  // y = x W^T for the point's base targets plus the adapters' base_pass() products, one call.
  void base_products(Workspace& ws, int64_t l, AdapterPoint point, std::span<const MatmulTarget> base,
                     const float* x, int64_t ldx, int64_t T, LayerAdapters* adapters) const;
  // y [n] *= projection t's output scale (LayerWeights::out_scale) when not 1.
  void scale_output(const LayerWeights& L, LoraTarget t, float* y, int64_t n) const;

  const ModelConfig& c_;
  const ModelWeights& w_;
  Backend& be_;
  PartialSums* partial_ = nullptr;
};

}  // namespace loom
