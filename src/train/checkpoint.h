// Training checkpoints: everything a run needs to go on exactly where it
// stopped, in one folder <checkpoint_dir>/step-<8 digits> written as a whole
// (io/file_write.h: staged sibling, every file fsynced, renamed into place,
// parent fsynced) with a manifest.json of every file's size and FNV-1a 64
// checksum written last. Resume lists the step-* folders newest first and
// loads the first that verifies; a torn, truncated or mismatching one is
// skipped (and said why). Format: docs/training.md "Checkpoints and resume".
//
// Data-parallel room: one writer rank (rank 0) writes the folder, every rank
// reads it; the manifest records the writer's rank and the world size.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "train/data.h"
#include "train/faults.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"

namespace loom {

// Bumped when the folder layout or a file's meaning changes; a checkpoint of
// another format is skipped (never half-read).
inline constexpr int kCheckpointFormat = 1;

using RunIdentity = std::vector<std::pair<std::string, std::string>>;  // train_config.h run_identity()

// One evaluation of the history: after `step` optimizer steps.
struct EvalPoint {
  int64_t step = 0;
  double loss = 0;
  double accuracy = std::numeric_limits<double>::quiet_NaN();  // token accuracy (absent in older checkpoints)
};

// The small part of a checkpoint (state.json), besides the f32 arenas.
struct CheckpointState {
  int64_t step = 0;            // optimizer steps done (AdamW's step count)
  DataCursor cursor;           // where the next step's first micro-batch starts
  uint64_t shuffle_seed = 0;   // the loader's per-epoch permutation seed
  // Dropout masks are counter-based: a function of (lora seed, step x grad_accum + micro-batch, adapter
  // stream, element), so the step number is the whole RNG state; recorded to
  // say so and checked on load.
  uint64_t dropout_seed = 0;
  LrSchedule schedule;         // kind, warm-up, total steps; its position is `step`
  FaultState faults;           // non-finite steps, rollbacks and the learning-rate scale they left
  std::optional<LossScalerState> loss_scaler;  // fp16's loss scale and growth tracker (absent otherwise)
  std::string reason;          // "interval", "minutes", "signal SIGTERM", "memory_alarm", ...
  RunIdentity identity;        // run_identity(config) of the run that wrote it
  std::string config_text;     // the YAML as given (config.yaml in the folder)
  // Content hashes (hash_path) of the base model and data files: key -> hex.
  std::vector<std::pair<std::string, std::string>> input_hashes;
  // Metrics so far.
  std::vector<double> step_losses;  // every optimizer step (NaN: no target token)
  std::vector<EvalPoint> evals;
  int64_t trained_tokens = 0, input_tokens = 0;
  double train_seconds = 0, elapsed_seconds = 0;
  std::string metrics_text;  // metrics_file's lines up to this step (metrics.jsonl)
  int rank = 0, world_size = 1;  // world_size: the data-parallel ranks the rows were split over
  // dist.tp of the run that wrote it (its arenas are the whole model's all the same).
  int tensor_parallel = 1;

  // The latest evaluation at or before `step` (what "best by eval loss" uses).
  std::optional<double> eval_loss() const;
};

struct CheckpointWriteInfo {
  std::string path;
  int64_t bytes = 0;
  double seconds = 0;
};

// Writes <dir>/step-<st.step> (replacing one of the same step) from `params`
// and `opt`'s moments. `on_stage` (optional) is called at "files_written"
// (before the manifest), "manifest_written" and "renamed", for fault
// injection. Throws loom::Error (io) naming the folder.
CheckpointWriteInfo write_checkpoint(const std::string& dir, const CheckpointState& st, std::span<const float> params,
                                     const AdamW& opt,
                                     const std::function<void(std::string_view stage)>& on_stage = {});
// The same from whole (unsharded) state parts: ZeRO-1's rank 0 writes the
// parts it gathered from every rank. `extra`: more files of the run's state
// (data parallel's gradient-compression state), checksummed like the others.
CheckpointWriteInfo write_checkpoint(const std::string& dir, const CheckpointState& st, std::span<const float> params,
                                     OptimizerKind kind, std::span<const AdamW::StatePart> parts,
                                     const std::function<void(std::string_view stage)>& on_stage = {},
                                     std::span<const AdamW::StatePart> extra = {});

// "step-00000050" for 50; the step of such a name, or nullopt for any other name.
std::string checkpoint_name(int64_t step);
std::optional<int64_t> checkpoint_step(std::string_view name);

// Every step-* folder of `dir`, newest (highest step) first; none when `dir` is missing.
std::vector<std::string> list_checkpoints(const std::string& dir);

// Verifies a checkpoint folder without loading it: manifest present and
// parseable, format, every file present with its size and checksum, the
// required files listed. Returns "" when good, else why not.
std::string verify_checkpoint(const std::string& path);

struct SkippedCheckpoint {
  std::string path, reason;
};
// The newest checkpoint of `dir` that verifies; the bad ones met first are
// appended to `skipped`.
std::optional<std::string> latest_good_checkpoint(const std::string& dir, std::vector<SkippedCheckpoint>& skipped);

// Reads state.json (+ config.yaml, metrics.jsonl) of a verified checkpoint.
CheckpointState read_checkpoint_state(const std::string& path);
// Loads the arenas of a verified checkpoint into `params` and `opt`
// (moments and step count); sizes must match (throws invalid_input).
void load_checkpoint_arenas(const std::string& path, std::span<float> params, AdamW& opt);

// The same for one tensor-parallel rank: the files hold the whole model's
// arenas (`whole_size` floats each; optim.kind adamw only), and `take` copies
// this rank's part of such an array into the run's.
void load_checkpoint_arenas(const std::string& path, std::span<float> params, AdamW& opt, size_t whole_size,
                            const std::function<void(std::span<const float> whole, std::span<float> mine)>& take);

// Throws invalid_input when `now` differs from the checkpoint's `saved`
// identity, naming the first differing key and both values.
void check_run_identity(const RunIdentity& saved, const RunIdentity& now, const std::string& checkpoint);

// Removes all but the newest `keep` checkpoints of `dir` and the best one by
// eval loss, and staging folders left by crashed writers. Returns the paths removed.
std::vector<std::string> prune_checkpoints(const std::string& dir, int64_t keep);

// Content hash of a file, or of every regular file of a folder (names and
// bytes, sorted by name): 16 hex digits of FNV-1a 64. Throws naming the path.
std::string hash_path(const std::string& path);

}  // namespace loom
