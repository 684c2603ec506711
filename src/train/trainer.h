// The LoRA fine-tuning loop behind `loom train`: load the model and data, run
// optimizer steps of grad_accum micro-batches, evaluate, log progress and write
// the PEFT adapter folder.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "train/train_config.h"

namespace loom {

struct TrainResult {
  int64_t steps = 0;
  std::vector<double> step_losses;       // mean loss of every optimizer step
  std::vector<double> eval_losses;       // every evaluation, in order
  std::optional<double> final_eval_loss;
  int64_t trainable_params = 0, total_params = 0;
  int64_t trained_tokens = 0;            // target tokens seen by the loss
  double tokens_per_s = 0;               // input tokens (rows * seq_len) per second
  std::string adapter_dir;
};

// Runs the whole training described by `config`. Messages and progress go to
// `log` (nullptr: silent); a progress bar replaces log lines when `log` is a
// terminal. Throws loom::Error for bad model, data or options.
TrainResult run_training(const TrainConfig& config, std::FILE* log = stderr);

}  // namespace loom
