// The fine-tuning loop behind `loom train`, as named steps: setup (model, data,
// trainable parameters, optimizer), train_step (grad_accum micro-batches, then
// the optimizer update), evaluate, finish (export). Hooks (train_hooks.h) plug
// in all-reduce, checkpoints and metrics; run_training composes the steps.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "core/trace.h"
#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "dist/partial_sums.h"
#include "kernels/backend.h"
#include "kernels/int_quant.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/config_advice.h"
#include "train/data.h"
#include "train/faults.h"
#include "train/loss_scaler.h"
#include "train/memory.h"
#include "train/optimizer.h"
#include "train/train_config.h"
#include "train/train_hooks.h"
#include "train/train_step.h"
#include "train/trainable.h"

namespace loom {

struct TrainResult {
  int64_t steps = 0;
  std::vector<double> step_losses;       // mean loss of every optimizer step
  std::vector<double> eval_losses;       // every evaluation, in order
  std::vector<double> eval_accuracies;   // their token accuracies (EvalReport::accuracy)
  std::optional<double> final_eval_loss;
  int64_t trainable_params = 0, total_params = 0;
  int64_t trained_tokens = 0;            // target tokens seen by the loss
  double tokens_per_s = 0;               // input tokens (rows * seq_len) per second
  std::string adapter_dir;
  // Set when a stop signal (TrainRuntime::stop_signal) ended the run early:
  // the signal number and the checkpoint written; nothing was exported.
  int stopped_by_signal = 0;
  std::string checkpoint;
};

// Tokens one optimizer step reads: rows = data ranks x grad_accum x
// batch_size, each seq_len slots long; the data fills a row with `tokens /
// rows` tokens on average (packing leaves the end of a row empty, padding
// fills short samples' rows), `targets` of them trained (labels not masked).
struct StepTokens {
  int64_t rows = 0, seq_len = 0;
  int64_t slots = 0;   // rows x seq_len
  double tokens = 0;   // rows x the train split's mean tokens per row
  double targets = 0;  // rows x its mean target tokens per row
};
// From the train split's packed rows (pad excluded).
StepTokens step_tokens(const DataSplit& train, int64_t rows_per_step);

// What `loom train --check` found (Trainer::check; also logged as records).
struct CheckReport {
  MemoryEstimate memory;
  MemoryLimit limit;
  StepTokens tokens;
  DataStats data;  // the train file's
  int64_t total_steps = 0;
  std::vector<ConfigWarning> warnings;  // advise_config + advise_data
};

class TrainLog;
class Failpoints;    // core/failpoints.h
class TrainMetrics;  // train/train_metrics.h

// What the process around the trainer supplies; none of it changes what the
// run computes. Each pointer is optional (nullptr: not used) and not owned.
struct TrainRuntime {
  // --resume: "" takes the latest good checkpoint, else the checkpoint at this path.
  std::optional<std::string> resume;
  // Set (to the signal number) by the app's SIGINT/SIGTERM/SIGUSR1 handler:
  // finish the current step, write a checkpoint, stop.
  const std::atomic<int>* stop_signal = nullptr;
  // LOOM_FAILPOINTS, parsed by the app (test facility, docs/training.md).
  const Failpoints* failpoints = nullptr;
  // The loom_train_ Prometheus series the trainer keeps up to date.
  TrainMetrics* metrics = nullptr;
  // Data parallel (dist/communicator.h): this process is rank comm->rank() of
  // comm->size(). Each rank trains on its own micro-batches of every step and
  // the gradients are summed over ranks; rank 0 alone writes logs, metrics,
  // checkpoints and the output. nullptr or size 1: one process.
  Communicator* comm = nullptr;
  // --profile (core/trace.h): the backend's ops and the trainer's phases are
  // recorded into it. nullptr: nothing is recorded.
  Tracer* tracer = nullptr;
  // Filled after setup with the run's model, config keys and memory estimate
  // as a JSON object (the trace's otherData.loom, docs/profiling.md).
  std::string* profile_metadata = nullptr;
  // LoRA: after each checkpoint (but a stop signal's), also write the adapter
  // as a PEFT folder to checkpoint_dir/latest-adapter, replaced whole each
  // time and never pruned, then call TrainHooks::after_adapter_written.
  bool checkpoint_adapters = false;
};

class Trainer {
 public:
  // Keeps a copy of `config`. Records (train_log.h) go to the console `log`
  // (nullptr: silent; a progress bar replaces step lines on a terminal; JSON
  // lines with log_format: json) and to config.log_file.
  Trainer(TrainConfig config, std::FILE* log, TrainHooks hooks = {}, TrainRuntime runtime = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Checks every output first (before the model loads), then loads the model
  // with its trainable parameters, the data, and builds the optimizer and
  // schedule; logs the advice of config_advice.h. Throws loom::Error for bad
  // model, data or options, or a memory estimate above the limit.
  void setup();
  // `loom train --check`: what setup() does up to the first step, writing
  // nothing (outputs checked read-only, no metrics file, no token cache
  // written, no step buffers reserved), then a record of the tokens per step
  // and a summary. Use instead of setup(); throws as setup() does. The
  // caller leaves log_file empty (run_check does).
  CheckReport check();
  // One optimizer step: hooks.loss_tokens, grad_accum micro-batches with
  // grad_scale = 1 / that count, hooks.after_backward, clipping + AdamW, the
  // parameters' follow-up, logging, hooks.after_optimizer_step. A non-finite
  // loss or gradient skips the update (StepReport::skipped; faults.h); after
  // max_bad_steps in a row it rolls back to the last good checkpoint or throws
  // loom::Error (diverged).
  StepReport train_step();
  // Mean loss and token accuracy over the eval split (no dropout, no
  // gradients), logged, written to metrics_file and passed to
  // hooks.at_evaluation; returns the loss, nullopt when there is no eval split.
  std::optional<double> evaluate();
  // Writes the output folder and returns the result. The checkpoint folder,
  // when it lies inside output_dir, is carried into the new folder.
  TrainResult finish();

  // Checkpoints (checkpoint.h). Writes the state after steps_done() steps to
  // checkpoint_dir()/step-N, logs it (`reason`: "interval", "minutes",
  // "signal SIGTERM", "memory_alarm", ...) and prunes to keep_checkpoints.
  // Throws loom::Error (io) when it cannot be written.
  void write_checkpoint(std::string_view reason);
  // Restores a checkpoint (verified first; throws invalid_input when it does
  // not verify or does not fit this run): parameters, moments and step,
  // loader cursor, metrics history, and metrics_file rewritten to its lines.
  // setup() calls it for --resume; rollback calls it mid-run.
  void load_checkpoint(const std::string& path);
  // Whether checkpoint_interval / checkpoint_minutes ask for one now (data
  // parallel: rank 0's clock decides for every rank).
  bool checkpoint_due();
  const std::string& checkpoint_dir() const { return checkpoint_dir_; }
  // Where TrainRuntime::checkpoint_adapters writes: checkpoint_dir/latest-adapter.
  std::string checkpoint_adapter_dir() const;
  const std::string& last_checkpoint() const { return last_checkpoint_; }  // written or loaded; "" if none
  void maybe_start_qat(int64_t step);
  bool evaluated_at(int64_t step) const;
  // The signal number TrainRuntime::stop_signal holds (0: none); data
  // parallel: the largest over the ranks, so every rank stops at the same step.
  int stop_requested();
  // Writes a checkpoint for signal `sig`, logs how to resume, and returns the
  // result with stopped_by_signal set (run_training's early return).
  TrainResult stop(int sig);

  // Memory (train/memory.h): every arena now, RSS, the limit and the alarm
  // level (valid after setup()); and the estimate setup() checked.
  MemoryReport memory_report() const;
  const MemoryEstimate& memory_estimate() const { return mem_estimate_; }

  // Faults (faults.h, trainer_faults.cpp). Non-finite steps and rollbacks so
  // far; a checkpoint keeps them and load_checkpoint gives them back through
  // restore_faults (which also sets the optimizer's lr scale).
  const FaultState& faults() const { return faults_; }
  // precision: fp16's loss scaler (train/loss_scaler.h); null otherwise.
  const LossScaler* loss_scaler() const { return scaler_ ? &*scaler_ : nullptr; }
  void restore_faults(const FaultState& f);
  // The error `e` ends the run: an error record naming what failed, the step
  // and the checkpoint to resume from; `e` is marked reported (the app prints
  // it no second time). run_training calls it for any exception.
  void log_failure(Error& e);

  int64_t steps_done() const { return opt_ ? opt_->step_count() : 0; }
  // Data parallel: this rank and the number of ranks (0 and 1 for one process).
  int rank() const { return rt_.comm ? rt_.comm->rank() : 0; }
  int world() const { return rt_.comm ? rt_.comm->size() : 1; }
  bool is_root() const { return rank() == 0; }
  // The ranks are data_ranks() groups of model_ranks() (dist.tp x dist.pp)
  // consecutive ranks: rank = data_rank * model_ranks + model_rank, and in a
  // group model_rank = stage * tp + tp_rank, so tensor parallel's four sums a
  // layer run between neighbours (one node), a pipeline's activations next,
  // the gradient sum over the groups farthest apart (Megatron-LM keeps tensor
  // parallel innermost too). The ranks of a group share its batches; the
  // groups split the data.
  int model_ranks() const { return c_.dist.tp * c_.dist.pp; }
  int model_rank() const { return rank() % model_ranks(); }
  int tp_rank() const { return model_rank() % c_.dist.tp; }
  int stage() const { return model_rank() / c_.dist.tp; }
  int data_ranks() const { return world() / model_ranks(); }
  int data_rank() const { return rank() / model_ranks(); }
  // The last step's gradient exchange (data parallel; zero for one process).
  const GradSyncStats& sync_stats() const { return sync_stats_; }
  int64_t total_steps() const { return total_steps_; }
  const TrainConfig& config() const { return c_; }
  const TrainResult& result() const { return res_; }

  // For hooks (checkpoints, all-reduce) and tests; valid after setup().
  Model& model() { return *model_; }
  const TrainData& data() const { return *data_; }
  TrainableParams& params() { return *params_; }
  AdamW& optimizer() { return *opt_; }
  DataLoader& loader() { return *loader_; }  // cursor() / seek(): where the next step starts
  TrainSession& session() { return *session_; }
  Backend& backend() { return *backend_; }
  Tracer* tracer() { return backend_ ? backend_->tracer() : nullptr; }
  TrainLog& log() { return *log_; }  // valid from construction

 private:
  using Clock = std::chrono::steady_clock;

  void prepare(bool dry_run);  // setup() and check() up to the step buffers
  void check_options() const;
  void load_model();
  void log_advice();
  void open_outputs();
  void prepare_resume();
  void rewrite_metrics(const std::string& text);
  CheckpointState checkpoint_state(std::string_view reason);
  void load_data();
  void build_optimizer();
  void log_start();
  void start_metrics();  // TrainRuntime::metrics: the run's info, and where it is served
  void write_metrics_step(const StepReport& r, double elapsed);
  // TrainRuntime::checkpoint_adapters: the adapter of the checkpoint just written, then the hook.
  void write_checkpoint_adapter();
  int64_t loss_tokens(int64_t local);
  // trainer_faults.cpp: the LOOM_FAILPOINTS site "step", the non-finite check
  // (the one place fp16 loss scaling will use too), a skipped step, and what
  // max_bad_steps in a row lead to: rollback or a diverged error.
  void inject_step_faults(StepReport& r);
  std::optional<NonFiniteStep> check_finite(const StepReport& r, double& grad_norm);
  StepReport skip_step(StepReport r, const NonFiniteStep& bad, Clock::time_point started);
  // fp16: a step whose scaled gradients overflowed, not applied; the scale halves (not a fault).
  StepReport loss_scale_skip(StepReport r, const NonFiniteStep& bad, Clock::time_point started);
  void setup_precision();
  void on_divergence(const StepReport& r, const NonFiniteStep& bad);
  [[noreturn]] void stop_diverged(const StepReport& r, const NonFiniteStep& bad, const std::string& why);
  // trainer_memory.cpp: the estimate and limit check at the end of setup()
  // (then the buffers are reserved), and the alarm check after every step.
  void estimate_memory();       // the estimate, its record, the limit check
  void reserve_step_buffers();  // then every step buffer (the run only)
  bool watch_memory();  // true: the top alarm threshold was just crossed (a checkpoint is due)
  // Data parallel (trainer_dist.cpp): the step's micro-batches of this rank,
  // the gradient exchange overlapped with the last backward, the evaluation
  // shards, and work only rank 0 does with its outcome shared.
  void setup_rank_groups();
  void setup_data_parallel();
  void update_compression(int64_t step);
  void load_step_batches(StepReport& r);
  double backward_step(float scale, int64_t step);
  void finish_reduction();
  LossResult eval_shard(const DataSplit& split);
  bool agree_any(bool local);
  void broadcast_text(std::string& text);  // rank 0's text on every rank
  void agree_resume();
  void check_tensor_parallel() const;
  // Pipeline parallel (trainer_pp.cpp).
  void check_pipeline_parallel() const;
  void setup_pipeline_parallel();
  int64_t in_flight() const;  // micro-batches a pipeline stage holds at once: min(grad_accum, S - s)
  TrainSession& stage_session(size_t micro_batch);
  double pipeline_step(float scale, int64_t step);
  void check_pipeline_full() const;
  LossResult eval_pipeline(const DataSplit& split);
  void setup_tensor_parallel();
  void sum_replicated_grads();
  double global_sum_squares(double local);
  // Tensor parallel's checkpoints (trainer_tp.cpp): the whole model's params
  // and moments gathered on rank 0 into `whole` (`parts` then point there;
  // returns the params to write), and each rank's shard read back.
  std::span<const float> gather_tensor_parallel_state(std::vector<AdamW::StatePart>& parts,
                                                       std::vector<std::vector<float>>& whole);
  void load_tensor_parallel_arenas(const std::string& path);
  void open_root_outputs();
  OptimizerShard zero_shard();
  void log_zero_shard();           // dist.zero 1: this rank's part of the arena (empty list: none)
  void gather_zero_params();             // every rank's updated part to every rank
  std::vector<std::vector<char>> gather_zero_state(std::vector<AdamW::StatePart>& parts);
  // Gradient compression's state in checkpoints: every rank's error-feedback
  // residual (world rank order) and PowerSGD's Q, gathered on rank 0 into the two
  // vectors the returned parts point at; and read back on resume.
  std::vector<AdamW::StatePart> gather_compression_state(std::vector<float>& residuals, std::vector<float>& q);
  void fill_profile_metadata() const;
  void restore_compression_state(const std::string& path, int64_t checkpoint_world, int checkpoint_tp);
  void on_root(std::string_view what, const std::function<void()>& work);
  std::vector<MemoryArena> memory_arenas(int64_t planned_tokens) const;
  // Pipeline parallel: every stage's estimate (arenas, other, total) on rank 0,
  // empty elsewhere (a collective).
  std::vector<MemoryEstimate> stage_estimates(const MemoryEstimate& e) const;

  TrainConfig c_;
  bool dry_run_ = false;  // check(): nothing is written
  std::vector<ConfigWarning> advice_;
  TrainHooks hooks_;
  TrainRuntime rt_;
  // The communicators of this rank's groups (setup_rank_groups,
  // trainer_dist.cpp): data parallel (the ranks of its model_rank(); null with
  // one data rank), tensor parallel (its data rank and stage; null without
  // dist.tp) and pipeline (its data rank and tp_rank(); null without dist.pp).
  // Each is rt_.comm itself or a split held here; declared before every user,
  // so destroyed after them.
  std::unique_ptr<Communicator> data_group_, model_group_, tp_group_, pp_group_;
  Communicator* data_comm_ = nullptr;
  Communicator* tp_comm_ = nullptr;
  Communicator* pp_comm_ = nullptr;
  std::unique_ptr<TrainLog> log_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics_{nullptr, &std::fclose};
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Backend> backend_;  // runs on pool_
  std::unique_ptr<Model> model_;
  std::unique_ptr<TrainableParams> params_;
  IntQuantSpec qat_spec_;  // qat: the scheme, group fitted to the model
  std::unique_ptr<TrainSession> session_;  // references model_ and params_
  std::optional<TrainData> data_;
  std::unique_ptr<DataLoader> loader_;  // references data_
  std::unique_ptr<AdamW> opt_;
  int64_t total_steps_ = 0;
  std::vector<Batch> micro_;
  TrainResult res_;
  Clock::time_point t0_;
  double train_seconds_ = 0;
  int64_t input_tokens_ = 0;
  FaultState faults_;
  std::optional<LossScaler> scaler_;  // precision: fp16 only
  int64_t attempt_ = 0;       // the last step attempt's number (failpoints' step)
  int64_t current_step_ = 0;  // the step train_step is running (0: none), for error records
  MemoryLimit mem_limit_;
  MemoryEstimate mem_estimate_;
  std::optional<MemoryAlarm> mem_alarm_;
  // Checkpoints: where they go, the top-level entry of output_dir they occupy
  // (carried over by finish()), the one --resume restores, the inputs' hashes.
  std::string checkpoint_dir_;
  std::vector<std::string> output_keep_;
  std::optional<CheckpointState> resume_state_;
  std::string resume_path_;
  std::string last_checkpoint_;
  Clock::time_point last_checkpoint_time_;
  std::vector<std::pair<std::string, std::string>> input_hashes_;
  std::vector<EvalPoint> evals_;
  std::unique_ptr<GradientReducer> reducer_;  // data parallel only
  std::vector<float> accum_;  // dist.deterministic with grad_accum > 1: the sum of the earlier micro-batches
  std::vector<size_t> zero_cuts_;  // dist.zero 1: data rank r updates parameters [cuts[r], cuts[r + 1])
  GradSyncStats sync_stats_;
  // Tensor parallel (dist.tp): the sums over its ranks, the whole model's shapes.
  std::unique_ptr<CommunicatorSums> tp_sums_;
  // The last step's tensor-parallel sums (this rank's bytes sent, calls) and
  // pipeline messages (bytes sent by every stage of this pipeline).
  int64_t step_tp_bytes_ = 0, step_tp_sums_ = 0, step_pp_bytes_ = 0;
  ModelConfig tp_full_config_;
  // Pipeline parallel (dist.pp): a session per micro-batch in flight but the first.
  std::vector<std::unique_ptr<TrainSession>> stage_sessions_;
};

// Runs the whole training described by `config`: setup, an evaluation at step
// 0 when eval_at_start, the steps with an evaluation every eval_interval
// steps, a final evaluation, finish. Throws loom::Error for bad model, data or
// options.
TrainResult run_training(const TrainConfig& config, std::FILE* log = stderr, TrainHooks hooks = {},
                         TrainRuntime runtime = {});

// `loom train --check`: Trainer::check() on `config`, records to `log`;
// log_file is left out (its folder checked) and no metrics server is fed.
// Throws loom::Error as run_training's setup does (not logged: the caller
// reports it).
CheckReport run_check(TrainConfig config, std::FILE* log = stdout, TrainRuntime runtime = {});

}  // namespace loom
