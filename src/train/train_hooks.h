// The Trainer's hooks: where data-parallel all-reduce, checkpoints, metrics and
// memory alarms plug into the training loop without touching it. Passed in
// explicitly (run_training / Trainer); an empty hook does nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

namespace loom {

class Trainer;

// What one optimizer step did, given to after_optimizer_step.
struct StepReport {
  int64_t step = 0;           // optimizer steps done, this one included (1-based)
  double loss = 0;            // mean loss over the step's local target tokens (NaN: none)
  double lr = 0;              // learning rate of the first parameter group for this update
  double grad_norm = 0;       // global gradient norm before clipping
  int64_t target_tokens = 0;  // local target tokens of the step's micro-batches
  int64_t loss_tokens = 0;    // the count the gradients were divided by (TrainHooks::loss_tokens)
  int64_t input_tokens = 0;   // rows * seq_len of every micro-batch so far
  double step_seconds = 0;    // the step's wall time (hooks not included)
  // A non-finite loss or gradient: nothing was applied and the step counter did
  // not advance (train/faults.h); `step` is the number it ran as.
  bool skipped = false;
};

// One evaluation over the eval split, given to at_evaluation.
struct EvalReport {
  int64_t step = 0;     // optimizer steps done when it ran
  double loss = 0;      // mean loss over the split's target tokens (NaN: none)
  // Token accuracy: the share of target tokens whose largest logit is the
  // target's (ties: the lowest token id wins, as torch.argmax); NaN: none.
  double accuracy = 0;
  int64_t tokens = 0;   // target tokens of the split
};

// An adapter folder the trainer wrote whole, given to after_adapter_written.
struct AdapterWritten {
  std::string path;    // absolute
  int64_t step = 0;    // optimizer steps done
  bool final = false;  // output_dir at the end of the run; else the checkpoint's adapter
};

struct TrainHooks {
  // The token count that normalises this step's loss: every micro-batch's
  // gradient is scaled by 1 / count. Called once per step, before the
  // micro-batches run, with the local count; data-parallel ranks return the
  // all-reduced sum. Unset: the local count. Must be >= 1 when local > 0.
  std::function<int64_t(Trainer&, int64_t local_tokens)> loss_tokens;
  // After the step's micro-batches accumulated their gradients, before
  // clipping and the optimizer update. The arena may be changed in place
  // (where the gradient all-reduce goes).
  std::function<void(Trainer&, std::span<float> grads)> after_backward;
  // After the optimizer update and its follow-up (full: weights repacked), and
  // after the step was logged: checkpoints (Trainer::optimizer(), loader()
  // cursor), metrics, memory alarms.
  std::function<void(Trainer&, const StepReport&)> after_optimizer_step;
  // After each evaluation (logged, in metrics_file), with its loss and token accuracy.
  std::function<void(Trainer&, const EvalReport&)> at_evaluation;
  // Rank 0 only, LoRA only: after an adapter folder was written whole: the
  // output folder at the end of the run, and with TrainRuntime::
  // checkpoint_adapters the adapter of each checkpoint (not of a stop
  // signal's). Where publishing to a server plugs in (apps/train_publish.h).
  std::function<void(Trainer&, const AdapterWritten&)> after_adapter_written;
};

}  // namespace loom
