// `loom train` configuration: a YAML file (plus `--set key=value` overrides)
// read into TrainConfig, with every key and value checked; errors name the key
// and where it came from (file:line:column or the --set argument).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/device.h"
#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "io/safetensors.h"
#include "train/data.h"
#include "model/lora.h"
#include "train/optimizer.h"
#include "train/train_step.h"

namespace loom {

// What is trained: LoRA adapters on frozen weights, or every weight (f32).
enum class TrainMethod { lora, full };

struct TrainConfig {
  std::string model;  // a .gguf file or a Hugging Face folder
  TrainMethod method = TrainMethod::lora;  // method
  BackwardMode backward = default_backward_mode();  // backward: auto | exact | f16 | int8 | bf16 (train_step.h)
  std::string metrics_file;   // metrics_file: one JSON object per optimizer step (JSONL)

  // data.*
  std::string train_file;          // data.train
  std::string eval_file;           // data.eval (optional)
  double eval_fraction = 0;        // data.eval_fraction: split off the train file when data.eval is unset
  DataFormat format = DataFormat::auto_detect;  // data.format
  int64_t seq_len = 512;           // data.seq_len
  bool pack = true;                // data.pack
  bool train_on_prompt = false;    // data.train_on_prompt
  bool skip_bad_lines = false;     // data.skip_bad_lines
  std::string cache_dir;           // data.cache_dir (optional token cache)
  std::string chat_template;       // data.chat_template: chatml|llama3|llama2|mistral (default: the model's)

  // lora.* (seed comes from the top-level seed). PEFT's default dropout here.
  LoraConfig lora = [] {
    LoraConfig c;
    c.dropout = 0.05;
    return c;
  }();

  // optim.*
  double lr = 2e-4;
  double weight_decay = 0;
  AdamWConfig adam;                        // betas, eps, max_grad_norm
  std::optional<double> lora_plus_ratio;   // LoRA+: lr of B = ratio * lr
  std::optional<double> mlp_lr;            // lr of the MLP adapters (default: lr)

  // schedule.*
  LrScheduleKind schedule = LrScheduleKind::linear;
  int64_t warmup_steps = 0;

  int64_t batch_size = 4;   // rows per micro-batch
  int64_t grad_accum = 1;   // micro-batches per optimizer step
  int64_t steps = 0;        // optimizer steps; 0: from epochs
  double epochs = 0;        // passes over the training rows (may be fractional)
  int64_t eval_interval = 0;  // steps between evaluations; 0: only at the end
  bool eval_at_start = false;  // also evaluate the untrained model (step 0)
  int64_t log_interval = 10;  // steps between log lines (non-terminal output)
  std::string output_dir;
  // overwrite: output_dir may be a non-empty folder that is not a loom/PEFT
  // output; it is replaced as a whole (io/file_write.h).
  bool overwrite = false;
  // output_dtype: dtype of a full fine-tune's model.safetensors (f32, bf16, f16).
  safetensors::StDType output_dtype = safetensors::StDType::f32;
  uint64_t seed = 0;
  int threads = 0;          // 0: physical cores
  Device device = kCpu;     // which backend computes (kernels/backend.h)

  // ---- production training (docs/training.md "Running in production") ----
  // Checkpoints: every checkpoint_interval steps and/or checkpoint_minutes of
  // training (0: off); into checkpoint_dir (empty: <output_dir>/checkpoints);
  // the last keep_checkpoints are kept, plus the best by eval loss.
  int64_t checkpoint_interval = 0;
  double checkpoint_minutes = 0;
  std::string checkpoint_dir;
  int64_t keep_checkpoints = 3;
  // Non-finite loss or gradients: the step is skipped; after max_bad_steps in
  // a row, on_divergence decides: rollback to the last checkpoint with the
  // learning rate times rollback_lr_factor (at most max_rollbacks times), or stop.
  enum class OnDivergence { rollback, stop };
  int64_t max_bad_steps = 5;
  OnDivergence on_divergence = OnDivergence::rollback;
  double rollback_lr_factor = 0.5;
  int64_t max_rollbacks = 3;
  // Memory: the run is refused when the estimate exceeds memory_limit (0: the
  // cgroup limit, else the machine's available memory); memory_alarm are
  // fractions of that limit that log a record and set a metric when crossed.
  int64_t memory_limit = 0;  // bytes
  std::vector<double> memory_alarm{0.80, 0.95};
  // Observability: /metrics (Prometheus) and a live page on metrics_port
  // (0: off) at metrics_host; log_file gets ECS JSON lines; log_format says
  // what stderr gets (text, or the same JSON lines).
  int metrics_port = 0;
  std::string metrics_host = "127.0.0.1";
  std::string log_file;
  enum class LogFormat { text, json };
  LogFormat log_format = LogFormat::text;

  // ---- memory and precision levers (docs/training.md "Training bigger") ----
  // gradient_checkpointing: keep the input of every Nth layer and recompute the
  // others in the backward (0: off; `true` = 1, every layer).
  int64_t gradient_checkpointing = 0;
  // activation_dtype: how the activations kept for the backward are stored.
  enum class ActivationDType { f32, bf16 };
  ActivationDType activation_dtype = ActivationDType::f32;
  // optim.kind: AdamW with f32 moments, or block-wise 8-bit moments (bitsandbytes' AdamW8bit).
  OptimizerKind optimizer = OptimizerKind::adamw;
  // precision: compute of what is trained (LoRA products; a full fine-tune's
  // weight products); master weights and optimizer state stay f32. fp16 adds
  // dynamic loss scaling (torch GradScaler's rules).
  TrainPrecision precision = TrainPrecision::fp32;
  // quantize_base: the frozen weights of an f16/bf16/f32 model quantized at load (QLoRA).
  enum class BaseQuant { none, nf4, q4_0, q8_0 };
  BaseQuant quantize_base = BaseQuant::none;
  // qat.*: quantization-aware training (train/qat.h): the forward sees the
  // weights as `loom quantize --method int4|int8` exports them (bits 0: off).
  struct Qat {
    int bits = 0;              // qat.bits: 4 or 8
    int64_t group_size = 128;  // qat.group_size: columns per scale (0: per row); fitted as quantize fits it
    bool symmetric = true;     // qat.scheme: sym | asym
    int64_t start_step = 0;    // qat.start_step: QAT from this optimizer step on (a stage after plain training)
    bool enabled() const { return bits > 0; }
  } qat;
  // sparsity_mask: a pruned model's zeros stay zero in full fine-tuning
  // (gradients and updates masked). auto: when the model says it was pruned
  // (`loom prune`'s unstructured methods); on: the zeros of any model; off.
  enum class SparsityMask { automatic, on, off };
  SparsityMask sparsity_mask = SparsityMask::automatic;

  // dist.*: data parallel over MPI ranks (`mpirun -np N loom train`;
  // docs/training.md "Scale-out"). One process ignores them.
  struct Dist {
    GradSyncOptions sync;  // dist.bucket_mb, overlap, deterministic, compression, ratio, rank
    CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;  // dist.algorithm
    double timeout_s = 300;  // dist.timeout: a collective waiting longer ends the run (a rank died)
    bool zero1 = false;      // dist.zero: 1 shards the optimizer state over the ranks (ZeRO stage 1)
    int tp = 1;              // dist.tp: tensor parallel over this many ranks (model/tensor_parallel.h)
    int pp = 1;              // dist.pp: pipeline parallel over this many stages (train/trainer_pp.cpp)
    // dist.compression_warmup: plain all-reduce steps before the compression starts
    int64_t compression_warmup = 0;
    // dist.lazy_adam: under dist.compression topk, AdamW takes each entry's
    // gradient as the mean over the steps it waited (optimizer.h); false: the
    // zeros of the entries not sent enter the moments as gradients
    bool lazy_adam = true;
  } dist;

  std::string source;  // the config file name, for messages
  std::vector<std::string>
      overrides;       // the --set arguments as given, in order (the resume hint repeats them)
  std::string text;    // the YAML as given, each --set appended as a "# --set key=value" line (checkpoints keep it)
  std::vector<std::string> warnings;  // settings that have no effect, "file:line:col: ..."; run_training prints them
};

// Reads `path` and applies `overrides` ("a.b=value", the value read as YAML).
// Throws loom::Error (invalid_input; not_found/io for the file) naming the key
// and its location for unknown keys, wrong types, values out of range and
// missing required keys (model, data.train, output_dir, steps or epochs).
TrainConfig load_train_config(const std::string& path, std::span<const std::string> overrides = {});
// Same from YAML text; `name` stands for the file in messages.
TrainConfig parse_train_config(std::string_view yaml, const std::string& name,
                               std::span<const std::string> overrides = {});

// "8GiB", "1.5G", "512MiB", "2000000000" (bytes) -> bytes; nullopt when not a size.
std::optional<int64_t> parse_byte_size(std::string_view text);

// The keys that change what a run means (a resumed run must have the same
// values): model, method, data, LoRA shape, batch, optimizer, schedule, seed.
// Each entry is (key, value as text); compare with the checkpoint's list.
std::vector<std::pair<std::string, std::string>> run_identity(const TrainConfig& c);

const char* activation_dtype_name(TrainConfig::ActivationDType d);
const char* base_quant_name(TrainConfig::BaseQuant q);

}  // namespace loom
