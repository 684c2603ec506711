// `loom train --check` (Trainer::check): the run's own setup up to the first
// step, writing nothing, then what a step will read and a summary. Errors are
// the run's: a config, model or data the run would refuse fails here too.
#include <filesystem>

#include "core/error.h"
#include "io/file_write.h"
#include "train/train_log.h"
#include "train/trainer.h"

namespace loom {

StepTokens step_tokens(const DataSplit& train, int64_t rows_per_step) {
  StepTokens t;
  t.rows = rows_per_step;
  t.seq_len = train.rows.seq_len;
  t.slots = rows_per_step * t.seq_len;
  const int64_t rows = train.rows.rows();
  if (rows == 0) return t;
  int64_t tokens = 0, targets = 0;
  const SampleSet& set = *train.samples;
  for (const int64_t i : train.rows.samples) {
    tokens += set.length(i);
    for (const int32_t l : set.labels_of(i)) targets += l != kIgnoreLabel;  // a sample's first label never is
  }
  const double per_row = static_cast<double>(rows_per_step) / static_cast<double>(rows);
  t.tokens = static_cast<double>(tokens) * per_row;
  t.targets = static_cast<double>(targets) * per_row;
  return t;
}

namespace {

// "4 rows (1 x 4)", "16 rows (2 ranks x 2 x 4)": where a step's rows come from.
std::string step_rows(const StepTokens& t, int ranks, int64_t grad_accum, int64_t batch_size) {
  return ranks > 1 ? fmt::format("{} rows ({} ranks x {} x {})", t.rows, ranks, grad_accum, batch_size)
                   : fmt::format("{} rows ({} x {})", t.rows, grad_accum, batch_size);
}

}  // namespace

CheckReport Trainer::check() {
  prepare(/*dry_run=*/true);
  CheckReport r;
  r.memory = mem_estimate_;
  r.limit = mem_limit_;
  r.tokens = step_tokens(data_->train, data_ranks() * c_.grad_accum * c_.batch_size);
  r.data = data_->train.stats;
  r.total_steps = total_steps_;
  r.warnings = advice_;
  const StepTokens& t = r.tokens;
  const double fill = t.slots > 0 ? t.tokens / static_cast<double>(t.slots) : 0;
  log_->record(
      LogLevel::info, "check",
      fmt::format("tokens per step: {} x {} = {} slots; the data fills {:.1f}% of them ({} rows): about "
                  "{:.0f} tokens a step, {:.0f} of them trained",
                  step_rows(t, data_ranks(), c_.grad_accum, c_.batch_size), t.seq_len, t.slots, 100 * fill,
                  c_.pack ? "packed" : "one sample each", t.tokens, t.targets),
      {{"tokens_per_step",
        {{"rows", t.rows},
         {"seq_len", t.seq_len},
         {"slots", t.slots},
         {"tokens", t.tokens},
         {"target_tokens", t.targets}}}});
  if (resume_state_)
    log_->record(
        LogLevel::info, "check",
        fmt::format("--resume: the run would continue from {} at step {}", resume_path_, resume_state_->step),
        {{"checkpoint", {{"path", resume_path_}, {"step", resume_state_->step}}}});
  const size_t n = r.warnings.size();
  log_->record(
      LogLevel::info, "check",
      fmt::format("check: {} can start ({} steps); {} warning{} about the settings; nothing was written",
                  c_.source, total_steps_, n, n == 1 ? "" : "s"),
      {{"check", {{"warnings", n}, {"total_steps", total_steps_}}}});
  return r;
}

CheckReport run_check(TrainConfig config, std::FILE* log, TrainRuntime runtime) {
  // The run's log_file would get the check's records: it is left out, but
  // where the run would write it must be writable (TrainLog creates its folder).
  if (!config.log_file.empty()) {
    const std::filesystem::path dir = std::filesystem::path(config.log_file).parent_path();
    check_writable_dry_run(dir.empty() ? "." : dir.string(), fmt::format("{}: log_file", config.source),
                           /*in_parent=*/false);
    config.log_file.clear();
  }
  runtime.metrics = nullptr;  // no metrics server
  Trainer t(std::move(config), log, {}, std::move(runtime));
  return t.check();
}

}  // namespace loom
