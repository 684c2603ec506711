// Training forward and backward of a Llama/Qwen2 decoder with LoRA adapters
// (frozen base weights in their stored dtype, trainable adapters in f32) or of
// every weight (full fine-tuning). The forward is the decoder layer of
// model/decoder.h keeping every activation the backward needs; the backward
// runs the layers in reverse down to the embedding, through Backend ops.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/cpu_features.h"
#include "kernels/backend.h"
#include "kernels/cpu/bf16_dot.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/pipeline_stage.h"
#include "model/weights.h"
#include "train/data.h"
#include "train/full_params.h"
#include "train/lora_params.h"

namespace loom {

// Input gradients through frozen weights (kernels/cpu/linear_backward.h):
//  exact: W dequantized tile by tile, exact products; no extra memory, slowest.
//  f16:   W^T packed once for the matmul kernels, quantized weights as f16
//         (~7e-4 relative gradient error on a Q4_1 model); one f16 copy of the
//         weights. Exact for f32/f16/bf16 weights.
//  int8:  as f16 but quantized weights as q8_0 and gradients quantized to q8_0:
//         ~3e-2 relative gradient error.
//  bf16:  W^T and the gradients rounded to bf16, products with AMX-BF16 tiles
//         (else AVX512-BF16, else f32 FMA) and f32 sums: the fastest with
//         AMX-BF16, AVX512-BF16 or AVX2 alone; ~1e-2 relative gradient error (cosine 0.99994) on a Q4_1
//         model; one bf16 copy of the weights. Rounds f32/f16 weights too.
using BackwardMode = BackwardPrecision;  // kernels/backend.h: exact, f16, int8, bf16
const char* backward_mode_name(BackwardMode m);
// Also accepts "auto": default_backward_mode().
std::optional<BackwardMode> backward_mode_from_name(std::string_view name);
// `loom train`'s default on a machine of class `c`: the fastest mode whose
// gradient error is no worse than bf16 mixed-precision training's (so never
// int8), from the measured table in docs/training.md; between modes of equal
// speed the more exact one. `dot`: how this CPU multiplies bf16 pairs on AVX-512
// (kernels/cpu/bf16_dot.h); where vdpbf16ps is slower than two FMAs (Intel
// Sapphire/Emerald Rapids without AMX) f16's widened products are faster than bf16's.
BackwardMode backward_mode_for(CpuClass c, cpu::Bf16Dot dot);
// backward_mode_for(cpu_class(), cpu::bf16_dot()): decided by the instructions
// present, LOOM_CPU's masks applied, and vdpbf16ps's measured speed.
BackwardMode default_backward_mode();

// precision: the compute of what is trained (LoRA products; a full fine-tune's
// weight products). Master weights and optimizer state stay f32.
enum class TrainPrecision { fp32, bf16, fp16 };
const char* train_precision_name(TrainPrecision p);
std::optional<TrainPrecision> train_precision_from_name(std::string_view name);

class TrainSession {
 public:
  // `weights` must be prepared for `backend` (prepare_weights). Keeps references to all arguments.
  // backward: how input gradients pass the frozen weights (see BackwardMode).
  TrainSession(const ModelConfig& config, const ModelWeights& weights, LoraModel& lora, Backend& backend,
               BackwardMode backward = BackwardMode::f16);
  // Full fine-tuning: `weights` point into `full` (FullParams re-points them);
  // every weight gets its gradient in full.grads().
  TrainSession(const ModelConfig& config, const ModelWeights& weights, FullParams& full, Backend& backend,
               BackwardMode backward = BackwardMode::f16);
  ~TrainSession();

  // Call after the weights changed (an optimizer step of full fine-tuning) and
  // were prepared again (prepare_weights): rebuilds the transposed backward
  // weights (those of the held layers: a pipeline stage's own), for this
  // session and its siblings.
  void refresh_weights();

  // A session over the same model, parameters and backend with this one's
  // settings (precision, activation options, fused LoRA, merged adapters) and
  // its own activations, sharing this one's transposed backward weights:
  // pipeline parallel keeps one per micro-batch in flight.
  std::unique_ptr<TrainSession> sibling();

  // Loss of one micro-batch and, accumulated (+=) into lora.grads(), the gradient
  // of loss_sum * grad_scale. grad_scale = 1 / (target tokens of the whole
  // optimizer step), so summing micro-batches gives the gradient of the step's
  // mean loss. `step` selects the dropout masks (counter-based: same step, same
  // masks). Rows never attend to each other (batch.seq_start restarts per row).
  // Throws invalid_input for a malformed batch (sizes, token ids, seq_start).
  LossResult forward_backward(const Batch& batch, float grad_scale, uint64_t step = 0);
  // Loss only, without dropout and without gradients (evaluation), with
  // LossResult::n_correct: the targets that are the argmax of their logits.
  LossResult forward_loss(const Batch& batch);

  // Pipeline parallel (train/trainer_pp.cpp; train_step_stage.cpp): one
  // stage's share of forward_backward for one micro-batch, through the decoder
  // layers [first, last) the weights hold (model/pipeline_stage.h).
  // forward_stage: x_in [T, hidden] is the input of layer `first` (null when
  // first is 0: the tokens are embedded); returns the output of layer last - 1,
  // which the session keeps until its next forward, or, when the weights hold
  // the head, null with the micro-batch's loss in *loss (the gradient of
  // loss_sum * grad_scale flows from it; `backward` false: evaluation, no
  // dropout, n_correct counted). backward_stage: dy is the gradient of that
  // output (null on the last stage); accumulates the stage's gradients and
  // returns the gradient of its input, valid until the next call (null when
  // first is 0). Gradient checkpointing keeps the model's segments: the part of
  // one that began on an earlier stage is recomputed from x_in (f32, so the
  // bits of one process; with bf16 activations one process recomputes it from
  // the segment's bf16 input instead, so stages then match it bit for bit only
  // when each starts a segment).
  const float* forward_stage(const Batch& batch, float grad_scale, uint64_t step, const float* x_in, LossResult* loss,
                             bool backward = true);
  const float* backward_stage(const float* dy);

  // How the forward keeps what the backward needs (TrainConfig's
  // gradient_checkpointing and activation_dtype). Call before the first step;
  // a change re-lays out the buffers at the next reserve().
  //  checkpoint_every N > 0 (and < the layer count): only the input of every Nth
  //    layer (each segment's start; segments end at the last layer, so the first
  //    may be shorter) is kept; the backward recomputes a segment's forward from
  //    it into N layer slots, then runs the segment's backward. The last segment
  //    keeps its forward activations (no recompute). Gradients are bit-identical
  //    to N = 0 (same kernels, same counter-based dropout masks). N >= the layer
  //    count is the same as 0.
  //  bf16: the kept activations are stored as bf16 and widened to f32 for the
  //    backward: with checkpointing the checkpoints, without it every layer's
  //    inputs, norm outputs, q/k/v, attention output, gate/up and dropout inputs
  //    (rstd, lse and the LoRA A x stay f32; the last layer stays f32).
  struct ActivationOptions {
    int64_t checkpoint_every = 0;
    bool bf16 = false;
  };
  void set_activation_options(const ActivationOptions& o);
  const ActivationOptions& activation_options() const { return opts_; }

  // The compute of the trained products (TrainPrecision; LoRA only: a full
  // fine-tune refuses bf16/fp16 with loom::Error(unsupported)): bf16/fp16 round
  // the LoRA products' operands (x, A, u = scale A x, B, the output gradient dy,
  // du) and sum in f32; fp16 gradients can overflow to inf (loss scaling's
  // signal, train/loss_scaler.h). Call before the first step.
  void set_precision(TrainPrecision p);
  TrainPrecision precision() const { return precision_; }
  // q/k/v and gate/up LoRA A products as one GEMM each (default); off: one per
  // adapter (the same bits in fp32; for tests and benchmarks).
  void set_fused_lora(bool on) { fused_lora_ = on; }
  // Quantization-aware LoRA (train/qat.h): the model's matrices already hold
  // fq(W + s B A), so the adapters add nothing to the forward and nothing to
  // the input gradient; they still save A x and get their dA, dB (the
  // straight-through estimator's chain rule through W + s B A).
  void set_adapters_merged(bool on) { adapters_merged_ = on; }
  // Called by forward_backward right after layer l's backward (last layer
  // first): its gradients are final for this micro-batch. Data parallel hands
  // the layer's bucket to the all-reduce here. Empty: nothing is called.
  void set_layer_done(std::function<void(int64_t layer)> f) { layer_done_ = std::move(f); }
  // Tensor parallel (model/tensor_parallel.h): the weights and adapters are
  // rank `rank`'s shard of `ranks`; the forward sums the o and down products and
  // the backward the input gradients of q/k/v and gate/up over the ranks. The
  // o and down adapters' dropout masks are this rank's columns of one process's.
  void set_tensor_parallel(PartialSums* p, int rank, int ranks) {
    partial_ = p;
    tp_rank_ = rank;
    tp_ranks_ = ranks;
    dec_.set_partial_sums(p);
  }

  // Sizes every buffer of a step (saved activations, backward temporaries) for
  // micro-batches of up to `tokens` rows x seq_len tokens, once: smaller batches
  // (an epoch's last, evaluation) reuse them as they are. A batch larger than
  // the reserve grows them (the first step does when nothing was reserved).
  void reserve(int64_t tokens);
  int64_t reserved_tokens() const { return reserved_; }

  // Memory (train/memory.h): the buffers as allocated now, and what reserve(tokens) allocates.
  size_t activation_bytes() const { return acts_.bytes(); }
  size_t scratch_bytes() const;            // backward temporaries + index vectors
  size_t transposed_bytes() const;         // the backward's W^T copies
  size_t activation_bytes_for(int64_t tokens) const;
  size_t scratch_bytes_for(int64_t tokens) const;
  const Workspace& workspace() const { return *ws_; }
  // The largest ops of a step of `tokens` rows (what reserve() sizes the workspace for).
  WorkspaceShape workspace_shape(int64_t tokens) const;

 private:
  struct LayerActs {
    float *x, *rstd1, *xn1, *q, *k, *v, *att, *lse, *xmid, *rstd2, *xn2, *gate, *up;
    std::array<float*, kLoraTargetCount> ax{};  // scale * A x (dropped x), [T, r]
    std::array<float*, kLoraTargetCount> xd{};  // dropped adapter input (dropout > 0 only)
  };
  // bf16 copies of one layer's large saved activations (bf16 without checkpointing).
  struct LayerRecord {
    uint16_t *x, *xn1, *q, *k, *v, *att, *xmid, *xn2, *gate, *up;
    std::array<uint16_t*, kLoraTargetCount> xd{};
  };
  class SavedAttention;
  class TrainedAdapters;  // train_step_lora.cpp
  static std::unique_ptr<LayerAdapters> make_trained_adapters(TrainSession& s);

  // The W^T copies of the backward (held layers and output): one set, shared by
  // a session and its siblings.
  struct TransposedLayer {
    WeightHandle wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  struct TransposedWeights {
    std::vector<TransposedLayer> layers;  // empty with the exact backward; a null handle: W read directly
    WeightHandle output;
  };
  // `transposed` null: the session makes its own (refresh_weights).
  TrainSession(const ModelConfig& config, const ModelWeights& weights, LoraModel* lora, FullParams* full,
               Backend& backend, BackwardMode backward, std::shared_ptr<TransposedWeights> transposed = nullptr);

  // Where the saved activations of micro-batches of up to T tokens sit, as
  // offsets (in floats) from the arena's start: activation_layout(T, nullptr)
  // only counts.
  // With checkpointing or bf16 records several layers' LayerActs share slots
  // (layer l uses slot l - segment start, or l % 2), so layers[l] aliases.
  struct ActsLayout {
    std::vector<LayerActs> layers;
    std::vector<float*> checkpoints;   // segment k's input (k < last segment): f32, or bf16 bits
    std::vector<LayerRecord> records;  // bf16 records of layers 0 .. L-2 (bf16 without checkpointing)
    float *x_final = nullptr, *rstd_final = nullptr, *xn_final = nullptr, *rope_cs = nullptr;
  };
  size_t activation_layout(int64_t T, float* base, ActsLayout* out) const;
  // The checkpoint interval in effect (0: none; N >= layers counts as none).
  int64_t segment_layers() const;
  // Segments are aligned to the last layer: the last one (never recomputed) has
  // N layers, the first L - N * (segments - 1).
  int64_t n_segments() const;
  int64_t segment_start(int64_t k) const;
  int64_t segment_of(int64_t l) const;
  // Segment k's part of the span [first, last): a pipeline stage recomputes
  // the part of a segment that starts on an earlier stage from its own input.
  int64_t segment_begin(int64_t k) const;
  int64_t segment_end(int64_t k) const;
  static LayerSpan held_layers(const ModelWeights& w);
  // The span's layers forward (train_step.cpp).
  void forward_layers(int64_t T, bool dropout, uint64_t step, bool backward);
  bool bf16_records() const { return opts_.bf16 && segment_layers() == 0 && c_.n_layers > 1; }
  // The (float*, bf16*, count) pairs of layer l's record, and the two directions.
  using RecordField = std::tuple<float*, uint16_t*, int64_t>;
  std::array<RecordField, 10 + kLoraTargetCount> record_fields(int64_t l, int64_t T) const;
  void save_record(int64_t l, int64_t T);
  void load_record(int64_t l, int64_t T);
  void backward_segments(int64_t T, bool dropout, uint64_t step);
  size_t work_floats(int64_t T) const;
  size_t bt_floats() const;

  LossResult run(const Batch& batch, float grad_scale, uint64_t step, bool backward);
  void set_positions(const Batch& batch);
  LossResult loss_and_head_backward(const Batch& batch, float grad_scale, bool backward);
  struct Stage {  // of the micro-batch forward_stage ran, for backward_stage
    bool dropout = false;
    uint64_t step = 0;
    std::vector<int32_t> tokens;  // full fine-tuning's first stage: the embedding's backward reads them
  } stage_;
  void check_batch(const Batch& batch) const;
  // x_next: where the layer's output goes (the next layer's input, or a spill).
  void forward_layer(int64_t l, int64_t T, bool dropout, uint64_t step, float* x_next);
  float* next_input(int64_t l);
  void backward_layer(int64_t l, int64_t T, bool dropout, uint64_t step, float* dx);
  // train_step_lora.cpp. y [T, out] += scale * B (A x) for the adapters of one
  // point of the layer (jobs over the same x); saves what their backward needs.
  void lora_forward(int64_t l, std::span<const AdapterJob> jobs, int64_t T, bool dropout, uint64_t step);
  void lora_dropout(float* dst, const float* src, int64_t l, LoraTarget t, int64_t T, uint64_t step);
  // From each adapter's dy [T, out] (adapters over the same x): dA +=, dB +=,
  // dx [T, in] += (dx nullptr: not needed).
  struct LoraGrad {
    LoraTarget target;
    const float* dy;
  };
  void lora_backward(int64_t l, std::span<const LoraGrad> grads, const float* x, float* dx, int64_t T,
                     bool dropout, uint64_t step);
  void lora_forward_b(int64_t l, LoraTarget t, float* y, int64_t T);
  void lora_backward_b(int64_t l, LoraTarget t, const float* dy, int64_t T);
  const float* lora_operand(float* dst, const float* src, int64_t n);
  // The LoRA scratch (not saved): rounded operands, a group's stacked A products.
  struct LoraWork {
    float *xr = nullptr, *dyr = nullptr, *bq = nullptr, *cat = nullptr, *a = nullptr, *ga = nullptr;
    size_t floats = 0;
  };
  LoraWork lora_work_layout(int64_t T, float* base) const;
  size_t lora_work_floats(int64_t T) const;
  void reserve_lora_work(int64_t T);

  // dx [T, in] (+)= dy [T, out] s W of layer L's frozen projection t, s its
  // output scale (Wt: W's transpose, or null).
  void input_grad(const LayerWeights& L, LoraTarget t, const DeviceWeight* Wt, const float* dy, float* dx,
                  int64_t T, bool accumulate = false);

  const ModelConfig& c_;
  const ModelWeights& w_;
  LoraModel* lora_ = nullptr;  // exactly one of lora_ and full_ is set
  FullParams* full_ = nullptr;
  Decoder dec_;
  Backend& be_;
  BackwardMode backward_;
  std::unique_ptr<Workspace> ws_;
  std::unique_ptr<SavedAttention> attention_;
  std::unique_ptr<LayerAdapters> adapters_;
  int64_t reserved_ = 0;  // tokens the buffers are sized for
  int64_t tokens_ = 0;    // of the current run
  bool dropout_ = false;  // of the current run
  uint64_t step_ = 0;     // of the current run
  ActivationOptions opts_;
  DeviceBuffer acts_;  // every saved activation, carved into layers_ and the views below
  std::vector<LayerActs> layers_;
  std::vector<float*> checkpoints_;
  std::vector<LayerRecord> records_;
  std::shared_ptr<TransposedWeights> wt_;  // never null
  // The layers this session runs: those the weights hold (all, or a pipeline
  // stage's); only they get activation buffers.
  LayerSpan span_;
  // x_final_: the last layer's output, the head's input; on a stage without
  // the head, the stage's output (rstd_final_ and xn_final_ null).
  float *x_final_ = nullptr, *rstd_final_ = nullptr, *xn_final_ = nullptr, *rope_cs_ = nullptr;
  DeviceBuffer work_;  // backward / temporary buffers (not saved)
  DeviceBuffer bt_;    // a LoRA B transposed (the widest)
  TrainPrecision precision_ = TrainPrecision::fp32;
  bool fused_lora_ = true;
  bool adapters_merged_ = false;
  std::function<void(int64_t)> layer_done_;
  PartialSums* partial_ = nullptr;
  int tp_rank_ = 0, tp_ranks_ = 1;
  DeviceBuffer lora_work_;  // carved into lw_
  LoraWork lw_;
  float *dxn_ = nullptr, *dq_ = nullptr, *dk_ = nullptr, *dv_ = nullptr, *datt_ = nullptr, *dff_ = nullptr,
        *dup_ = nullptr, *dgate_ = nullptr, *dres_ = nullptr, *tmp_ = nullptr, *dax_ = nullptr;
  std::vector<int32_t> pos_, seq_start_;
};

}  // namespace loom
