// Advice before training: settings that commonly make a fine-tune's output
// meaningless (a rank too small, a learning rate too high, clipping off,
// epsilons fp16 cannot hold, samples cut by data.seq_len), checked against the
// config, the model and the data. Every run logs them at start and
// `loom train --check` prints them; docs/profiling.md ("Advice before
// training") lists each rule, its threshold and why.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "train/data.h"
#include "train/train_config.h"

namespace loom {

struct ConfigWarning {
  // The config key to change ("optim.lr", "data.seq_len", ...); "model" for a
  // value the model's own config sets (its rms_norm_eps).
  std::string key;
  double value = 0;     // the key's value now
  std::string message;  // starts with the key and value; says why and what to use instead
};

// The thresholds (docs/profiling.md gives the reasons).
inline constexpr int64_t kAdviceMinLoraRank = 8;  // lora.r below it warns
inline constexpr double kAdviceMaxLoraLr = 1e-3;  // LoRA optim.lr above it warns (5x the usual 2e-4)
inline constexpr double kAdviceMaxFullLr = 1e-4;  // full fine-tuning optim.lr above it warns (~3x 3e-5)
inline constexpr double kAdviceMaxTruncatedShare = 0.10;  // share of samples data.seq_len may cut

// The rules on the config and the model: lora.r, optim.lr (and optim.mlp_lr),
// optim.max_grad_norm, optim.eps under fp16, the model's RMSNorm eps under
// fp16. Empty when nothing is worth a warning.
std::vector<ConfigWarning> advise_config(const TrainConfig& c, const ModelConfig& model);

// The rules on the data read: data.seq_len cutting more than
// kAdviceMaxTruncatedShare of the train file's samples.
std::vector<ConfigWarning> advise_data(const TrainConfig& c, const DataStats& train);

}  // namespace loom
