// What `loom train` trains, LoRA adapters or every weight, behind one
// interface: the flat f32 parameter and gradient arenas AdamW updates, their
// parameter groups, the TrainSession that fills the gradients, what follows an
// optimizer update and how the result is written. The Trainer sees only this.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/file_write.h"
#include "kernels/int_quant.h"
#include "kernels/backend.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "train/optimizer.h"
#include "train/train_config.h"
#include "train/train_step.h"

namespace loom {

class TrainableParams {
 public:
  virtual ~TrainableParams() = default;

  // Same layout for both arenas; AdamW's groups index into them.
  virtual std::span<float> params() = 0;
  virtual std::span<float> grads() = 0;
  int64_t count() { return static_cast<int64_t>(params().size()); }
  virtual void zero_grads() = 0;
  // The tensor holding arena element `offset` (for messages: the first tensor
  // with a non-finite gradient): "layers.3.self_attn.q_proj.lora_B" (LoRA),
  // "model.layers.3.mlp.up_proj.weight" (full); "" past the end.
  virtual std::string tensor_at(size_t offset) const = 0;
  // LoRA: attention / MLP and A / B groups (mlp_lr, LoRA+); full: weights
  // (decay) and norms / biases (no decay).
  virtual std::vector<ParamGroup> param_groups(const TrainConfig& c) const = 0;
  // Every tensor's run of the arena (what optim.kind adamw8bit quantizes block
  // by block, and keeps in f32 under kMin8bitSize elements).
  virtual std::vector<TensorSpan> tensor_spans() const = 0;
  // Layer l's run [begin, end) of the arena (adjacent layers adjacent): data
  // parallel reduces a layer's gradients as soon as its backward is done.
  virtual std::vector<std::pair<size_t, size_t>> layer_ranges() const = 0;

  // The session that runs forward and backward into grads() (TrainSession's
  // LoRA or full constructor). Keeps references to `model`, `backend` and this.
  virtual std::unique_ptr<TrainSession> make_session(const Model& model, Backend& backend, BackwardMode mode) = 0;
  // Called after backward, before the gradient check, clipping and AdamW: a
  // pruned model's full fine-tuning zeroes the pruned weights' gradients.
  virtual void before_update() {}
  // Called after every optimizer update (and once before the first step when
  // quantization-aware training is on: train/qat.h). Full: the forward multiplies the
  // backend's prepared copies of the weights, so they are prepared again and the
  // session's transposed copies rebuilt. LoRA: nothing (adapters are read directly).
  virtual void after_update(Model& model, TrainSession& session, Backend& backend) = 0;

  // Quantization-aware training from now on (train/qat.h): the model's
  // matrices become fake-quantized, the session multiplies them, and every
  // after_update() refreshes them. Called once, before the first QAT step.
  virtual void start_qat(Model& model, TrainSession& session, Backend& backend, const IntQuantSpec& spec) = 0;
  virtual bool qat_started() const = 0;

  // Tensor parallel (dist.tp; model/tensor_parallel.h). Full fine-tuning trains
  // the shard's weights (cut before the arena takes them; shard_for_tensor_parallel
  // only records the rank) and gathers them whole on rank 0 at the end
  // (gather_tensor_parallel). LoRA: shard_for_tensor_parallel: the adapters
  // become rank `rank`'s shard of those a model of `full` shapes gets, with the
  // same initial values (A of o/down: this rank's columns; the other A whole;
  // B of q/k/v/gate/up: this rank's rows). replicated_ranges: the arena runs
  // every rank holds whole, whose gradients are partial sums over the ranks
  // (A of q/k/v/gate/up, B of o/down). gather_tensor_parallel: rank 0's
  // adapters become the whole ones, from every rank's shard (a collective).
  virtual void shard_for_tensor_parallel(const ModelConfig& full, int rank, int ranks);
  virtual std::vector<std::pair<size_t, size_t>> replicated_ranges() const { return {}; }
  // Whether those runs' gradients are partial sums (LoRA) or already alike on
  // every rank (full fine-tuning's norms, embedding and output: computed from
  // summed input gradients); either way the gradient norm counts them once.
  virtual bool replicated_grads_are_partial_sums() const { return true; }
  virtual void gather_tensor_parallel(Communicator& comm, const ModelConfig& full);
  // Checkpoints of a tensor-parallel run hold the whole model's arenas in one
  // process's layout (train/lora_tp.h, train/full_tp.h), so they resume on any rank count:
  // tensor_parallel_whole_size: the floats of such an arena;
  // gather_tensor_parallel_array: `mine`, an array of this arena's layout
  // (params, a moment), from every rank into `whole` on rank 0 (a collective);
  // take_tensor_parallel_shard: this rank's part of a whole array into `mine`.
  virtual size_t tensor_parallel_whole_size() const;
  virtual void gather_tensor_parallel_array(Communicator& comm, std::span<const float> mine,
                                            std::vector<float>& whole) const;
  virtual void take_tensor_parallel_shard(std::span<const float> whole, std::span<float> mine) const;
  // write_output of the whole model's parameters `whole` (gathered with
  // gather_tensor_parallel_array, rank 0) for a model of `full` shapes, this
  // rank's own shard untouched (the adapter of a checkpoint, mid-run). LoRA only.
  virtual void write_whole_output(std::span<const float> whole, const ModelConfig& full, const TrainConfig& c,
                                  const FolderWriteOptions& opt) const;

  // Pipeline parallel (dist.pp; train/trainer_pp.cpp), with `pp` the
  // pipeline's communicator (rank = stage). LoRA (the defaults): the adapters
  // are whole on every stage, each layer's gradients non-zero on its stage
  // only, so the Trainer all-reduces the arena over the stages and the
  // gradient norm is the stage's own. Full fine-tuning (split_into_stages;
  // train/full_pp.h): each stage holds only its tensors; after the
  // data-parallel sum the two copies of a tied embedding add their gradients
  // (sum_tied_stage_grads), the norm sums the stages' squares (that copy
  // once), and gather_pipeline makes rank 0's model the whole model at the
  // end. The last three are collectives of every stage of `pp`.
  virtual bool split_into_stages() const { return false; }
  virtual void sum_tied_stage_grads(Communicator&) {}
  virtual double stage_sum_squares(Communicator&, double local) { return local; }
  virtual void gather_pipeline(Communicator&, Model&) {}
  // Full fine-tuning: the bytes of the weights as bound before its arena took
  // them (what a pipeline stage reads of the file); 0: the model's own count.
  virtual size_t bound_weight_bytes() const { return 0; }

  // Parameters beyond the model's own (LoRA: the adapters; full: none).
  virtual int64_t added_params() const = 0;
  virtual std::string describe() const = 0;     // "LoRA r=8 alpha=16", "full fine-tuning (f32)"
  virtual const char* output_kind() const = 0;  // "adapter", "Hugging Face model folder"
  // Writes c.output_dir as a whole: a PEFT adapter folder (q/k rows of B in
  // Hugging Face order) or a Hugging Face model folder in c.output_dtype.
  virtual void write_output(const Model& model, const TrainConfig& c, const FolderWriteOptions& opt) = 0;
};

// A loaded model with the parameters c.method trains.
struct TrainableModel {
  std::unique_ptr<Model> model;
  std::unique_ptr<TrainableParams> params;
};

// Loads c.model (tokenizer, weights prepared for `backend`). LoRA lays out and
// initializes the adapters (seeded) after the load; full fine-tuning moves every
// weight into an f32 arena before they are prepared (FullParams), so the forward
// reads the weights being trained. `pool` dequantizes into that arena (and
// computes QAT's fake-quantized weights; it must outlive the result). Pruned
// weights stay zero in full fine-tuning (c.sparsity_mask). Messages for the
// run's log go to `notes`.
// `tp_rank` (with c.dist.tp > 1): the model and adapters are that rank's
// tensor-parallel shard, the model's config the shard's shapes.
// `pp_stage` (with c.dist.pp > 1): the model holds only that pipeline
// stage's weights (model/pipeline_stage.h); the config stays whole. LoRA's
// adapters stay whole (written and checkpointed whole); full fine-tuning's
// arena takes only the stage's tensors (train/full_pp.h).
TrainableModel load_trainable_model(const TrainConfig& c, Backend& backend, ThreadPool& pool,
                                    std::vector<std::string>* notes = nullptr, int tp_rank = 0, int pp_stage = 0);

}  // namespace loom
