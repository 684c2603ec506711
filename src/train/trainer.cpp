// The Trainer's steps. One optimizer step = grad_accum micro-batches whose
// gradients are scaled by 1 / (target tokens of the whole step), so the step
// follows the exact token mean of its loss, then AdamW with clipping and the
// LR schedule.
#include "train/trainer.h"

#include "train/qat.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>

#include "core/cpu_budget.h"
#include "core/error.h"
#include "core/failpoints.h"
#include "io/file_write.h"
#include "kernels/profiling_backend.h"
#include "train/checkpoint.h"
#include "train/qat.h"
#include "train/train_log.h"
#include "train/train_metrics.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string format_count(int64_t n) {
  if (n >= 1000000000) return fmt::format("{:.2f}B", static_cast<double>(n) / 1e9);
  if (n >= 1000000) return fmt::format("{:.2f}M", static_cast<double>(n) / 1e6);
  if (n >= 1000) return fmt::format("{:.1f}K", static_cast<double>(n) / 1e3);
  return fmt::format("{}", n);
}

// `s` as one shell word: as it is when it holds only characters no shell treats specially, else in
// single quotes.
std::string shell_word(const std::string& s) {
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) ||
           std::string_view("_./=:,+-@%").find(ch) != std::string_view::npos;
  });
  if (plain) return s;
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : std::string("null"); }

nlohmann::json json_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

// metrics_file is opened with fopen, which creates no folder: a dry run checks
// its folder exists and is writable.
void check_metrics_file_dry_run(const TrainConfig& c) {
  if (c.metrics_file.empty()) return;
  std::error_code ec;
  if (std::filesystem::is_directory(c.metrics_file, ec))
    fail(ErrorKind::io, "{}: metrics_file '{}' is a folder; give a file path", c.source, c.metrics_file);
  const std::filesystem::path dir = std::filesystem::path(c.metrics_file).parent_path();
  const std::string folder = dir.empty() ? "." : dir.string();
  if (!std::filesystem::is_directory(folder, ec))
    fail(ErrorKind::io, "{}: metrics_file '{}' cannot be written: {}", c.source, c.metrics_file, std::strerror(ENOENT));
  check_writable_dry_run(folder, fmt::format("{}: metrics_file", c.source), /*in_parent=*/false);
}

// Everything the run will write is checked before the model loads, so a bad
// output_dir or cache_dir never costs a whole run at the end. `dry_run`
// (check()): the same without creating anything.
void check_outputs(const TrainConfig& c, const std::vector<std::string>& keep, bool dry_run) {
  const std::string where = fmt::format("{}: output_dir", c.source);
  for (const auto& [input, key] : {std::pair{c.model, "model"}, {c.train_file, "data.train"}, {c.eval_file, "data.eval"},
                             {c.cache_dir, "data.cache_dir"}, {c.metrics_file, "metrics_file"}})
    if (!input.empty() && path_within(input, c.output_dir))
      fail(ErrorKind::invalid_input, "{} '{}' holds the {} '{}'; writing the output would replace it", where,
           c.output_dir, key, input);
  check_folder_replaceable(c.output_dir, c.overwrite, where, "--overwrite (or overwrite: true)", keep);
  const std::string cache_where = fmt::format("{}: data.cache_dir", c.source);
  if (dry_run) {
    check_writable_dry_run(c.output_dir, where, /*in_parent=*/true);
    if (!c.cache_dir.empty()) check_writable_dry_run(c.cache_dir, cache_where, /*in_parent=*/false);
    check_metrics_file_dry_run(c);
    return;
  }
  check_folder_writable(c.output_dir, where);
  if (!c.cache_dir.empty()) check_dir_writable(c.cache_dir, cache_where);
}

// The chat template the data is rendered with: data.chat_template, else the model's own (if any).
// A data.chat_template chosen by name whose control markers are no tokens of this model (llama3's on
// SmolLM2): each is trained as several pieces of text, so the adapter learns to spell "<|eot_id|>" and
// never ends its turn with the token generation stops at.
std::optional<ConfigWarning> template_marker_advice(const Tokenizer& tok, const TrainConfig& c) {
  const auto kind = chat_template_kind_from_name(c.chat_template);
  if (!kind) return std::nullopt;  // the model's own template (or none)
  const std::optional<std::string> m = chat_marker_not_a_token(*kind, tok);
  if (!m) return std::nullopt;
  return ConfigWarning{
      "data.chat_template", 0,
      fmt::format("data.chat_template {}: '{}' is no token of this model (it is {} pieces of text): "
                  "the adapter learns to spell it and never ends its turns; use the model's own "
                  "template (leave data.chat_template out) or one whose markers its vocabulary has",
                  c.chat_template, *m, tok.encode(*m, false, true).size())};
}

std::optional<ChatTemplate> data_chat_template(const Model& model, const TrainConfig& c) {
  return resolve_chat_template(model.tokenizer(), c.chat_template, model.chat_template_text(),
                               fmt::format("{}: data.chat_template", c.source));
}

DataOptions data_options(const TrainConfig& c) {
  DataOptions d;
  d.format = c.format;
  d.seq_len = c.seq_len;
  d.pack = c.pack;
  d.train_on_prompt = c.train_on_prompt;
  d.skip_bad_lines = c.skip_bad_lines;
  d.seed = c.seed;
  d.eval_fraction = c.eval_file.empty() ? c.eval_fraction : 0;
  d.eval_file = c.eval_file;
  d.cache_dir = c.cache_dir;
  return d;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

// The checkpoint folder, and the top-level entry of output_dir it occupies
// (finish() carries it into the new output folder). It may be neither
// output_dir itself nor above it.
std::string resolve_checkpoint_dir(const TrainConfig& c, std::vector<std::string>& keep) {
  namespace fs = std::filesystem;
  const std::string dir = c.checkpoint_dir.empty() ? (fs::path(c.output_dir) / "checkpoints").string() : c.checkpoint_dir;
  if (path_within(c.output_dir, dir))
    fail(ErrorKind::invalid_input, "{}: checkpoint_dir '{}' is output_dir '{}' or holds it; writing the output would "
         "replace the checkpoints: use a sub-folder (the default: <output_dir>/checkpoints) or another folder",
         c.source, dir, c.output_dir);
  if (path_within(dir, c.output_dir)) {
    std::error_code ec;
    const fs::path rel = fs::weakly_canonical(fs::absolute(dir), ec)
                             .lexically_relative(fs::weakly_canonical(fs::absolute(c.output_dir), ec));
    if (!rel.empty() && rel.begin()->string() != "..") keep.push_back(rel.begin()->string());
  }
  return dir;
}

// Content hashes of the inputs that decide what the run computes.
std::vector<std::pair<std::string, std::string>> input_hashes(const TrainConfig& c) {
  std::vector<std::pair<std::string, std::string>> h = {{"model", hash_path(c.model)},
                                                        {"data.train", hash_path(c.train_file)}};
  if (!c.eval_file.empty()) h.emplace_back("data.eval", hash_path(c.eval_file));
  return h;
}

}  // namespace

namespace {
// The matrices' type for the profile metadata: the first held layer's (a
// pipeline stage holds only its own).
std::string model_type(const ModelWeights& w) {
  for (const LayerWeights& L : w.layers)
    if (L.held()) return dtype_name(L.w_up.dtype);
  return "";
}

TrainLogOptions log_options(const TrainConfig& c, std::FILE* console) {
  TrainLogOptions o;
  o.console = console;
  o.console_json = c.log_format == TrainConfig::LogFormat::json;
  o.log_file = c.log_file;
  o.log_interval = c.log_interval;
  return o;
}
}  // namespace

Trainer::Trainer(TrainConfig config, std::FILE* log, TrainHooks hooks, TrainRuntime runtime)
    : c_(std::move(config)), hooks_(std::move(hooks)), rt_(std::move(runtime)), log_(std::make_unique<TrainLog>(log_options(c_, log))) {}

Trainer::~Trainer() = default;

void Trainer::setup() {
  prepare(/*dry_run=*/false);
  reserve_step_buffers();
  t0_ = Clock::now();
  last_checkpoint_time_ = t0_;
  if (resume_state_) load_checkpoint(resume_path_);
  if (rt_.metrics) start_metrics();
}

void Trainer::prepare(bool dry_run) {
  LOOM_ASSERT(!model_);  // once
  dry_run_ = dry_run;
  pool_ = std::make_unique<ThreadPool>(resolve_thread_count(c_.threads, "threads"));  // 0: the default
  backend_ = make_backend(c_.device, *pool_);  // first: a device this build lacks writes nothing
  if (rt_.tracer) backend_ = make_profiling_backend(std::move(backend_), *rt_.tracer, *pool_);
  const TraceScope setup_trace(tracer(), "setup");  // loading, packing, W^T for the backward
  prepare_resume();  // before any output is opened: a refused resume changes nothing
  agree_resume();    // data parallel: every rank resumes from rank 0's checkpoint
  open_outputs();
  check_options();
  check_tensor_parallel();    // trainer_tp.cpp
  check_pipeline_parallel();  // trainer_pp.cpp
  setup_rank_groups();        // trainer_dist.cpp
  load_model();
  {
    const TraceScope data_trace(tracer(), "data");  // reading and tokenizing (or the token cache)
    load_data();
  }
  session_ = params_->make_session(*model_, *backend_, c_.backward);
  setup_tensor_parallel();
  if (c_.qat.enabled()) {
    qat_spec_ = qat_spec(c_.qat, model_->config());  // a group that fits nothing fails now
    maybe_start_qat(0);  // qat.start_step 0: from the start (an eval at step 0 sees the quantized weights too)
  }
  setup_precision();
  session_->set_activation_options(
      {c_.gradient_checkpointing, c_.activation_dtype == TrainConfig::ActivationDType::bf16});
  build_optimizer();
  res_.total_params = model_->parameter_count() + params_->added_params();
  // Full fine-tuning in stages trains every weight, each stage's arena a part.
  res_.trainable_params = c_.dist.pp > 1 && params_->split_into_stages() ? res_.total_params : params_->count();
  log_start();
  log_advice();
  setup_data_parallel();      // trainer_dist.cpp; nothing for one process
  setup_pipeline_parallel();  // trainer_pp.cpp
  micro_.resize(static_cast<size_t>(c_.grad_accum));
  estimate_memory();  // against memory_limit (trainer_memory.cpp)
  fill_profile_metadata();
}

// Combinations this build refuses, before the model loads.
void Trainer::check_options() const {
  if (rt_.checkpoint_adapters && c_.method != TrainMethod::lora)
    fail(ErrorKind::invalid_input, "{}: adapters at checkpoints: method: full writes no adapter", c_.source);
  if (c_.method == TrainMethod::full && c_.precision != TrainPrecision::fp32)
    fail(ErrorKind::unsupported, "{}: precision: {} with method: full is not built yet (full fine-tuning's products "
         "run in fp32); use precision: fp32, or method: lora", c_.source, train_precision_name(c_.precision));
  if (c_.method == TrainMethod::full && (c_.lora_plus_ratio || c_.mlp_lr))
    fail(ErrorKind::invalid_input, "{}: optim.lora_plus_ratio and optim.mlp_lr apply to method: lora only", c_.source);
  if (c_.qat.enabled() && c_.quantize_base != TrainConfig::BaseQuant::none)
    fail(ErrorKind::invalid_input, "{}: qat trains against the quantized export of W + s B A in f32; it does not go "
         "with quantize_base: {} (leave quantize_base: none)", c_.source, base_quant_name(c_.quantize_base));
}

void Trainer::load_model() {
  std::vector<std::string> notes;
  TrainableModel tm = load_trainable_model(c_, *backend_, *pool_, &notes, c_.dist.tp > 1 ? tp_rank() : 0,
                                          c_.dist.pp > 1 ? stage() : 0);
  for (const std::string& n : notes) log_->record(LogLevel::info, "model", n);
  model_ = std::move(tm.model);
  params_ = std::move(tm.params);
  if (c_.seq_len > model_->config().max_context)
    fail(ErrorKind::invalid_input, "{}: data.seq_len {} exceeds the model's context length {}", c_.source, c_.seq_len,
         model_->config().max_context);
}

// Settings that commonly make a fine-tune's output meaningless
// (config_advice.h): a warning record each, at the start of every run.
void Trainer::log_advice() {
  advice_ = advise_config(c_, model_->config());
  for (ConfigWarning& w : advise_data(c_, data_->train.stats)) advice_.push_back(std::move(w));
  if (auto w = template_marker_advice(model_->tokenizer(), c_)) advice_.push_back(std::move(*w));
  // epochs: a step bigger than the data reads it several times over, however few epochs were asked for.
  const int64_t rows = data_->train.rows.rows(), per_step = data_ranks() * c_.grad_accum * c_.batch_size;
  if (c_.epochs > 0 && rows > 0) {
    const double passes = static_cast<double>(total_steps_ * per_step) / static_cast<double>(rows);
    if (passes > 1.5 * c_.epochs)
      advice_.push_back(
          {"epochs", c_.epochs,
           fmt::format("epochs {:g}: a step reads {} rows ({} x {} x {}: ranks x grad_accum x "
                       "batch_size) and the data has {}, so the run's {} step{} read it {:.1f} times; "
                       "lower batch_size or grad_accum, or give steps",
                       c_.epochs, per_step, data_ranks(), c_.grad_accum, c_.batch_size, rows, total_steps_,
                       total_steps_ == 1 ? "" : "s", passes)});
  }
  for (const ConfigWarning& w : advice_)
    log_->record(LogLevel::warning, "config", fmt::format("{}: {}", c_.source, w.message),
                 {{"advice", {{"key", w.key}, {"value", w.value}}}});
}

// What `loom profile advise` reads besides the events: the config's keys (as
// run_identity names them, plus those that do not change a run's numbers), the
// model's shape and the memory estimate by arena.
void Trainer::fill_profile_metadata() const {
  if (!rt_.profile_metadata) return;
  nlohmann::json config = nlohmann::json::object();
  for (const auto& [k, v] : run_identity(c_)) config[k] = v;
  config["threads"] = pool_->size();
  config["gradient_checkpointing"] = c_.gradient_checkpointing;
  config["data.cache_dir"] = c_.cache_dir;
  config["ranks"] = world();
  const ModelConfig& m = model_->config();
  nlohmann::json memory = nlohmann::json::object();
  for (const MemoryArena& a : mem_estimate_.arenas) memory[a.name] = a.bytes;
  memory["other"] = mem_estimate_.other;
  memory["total"] = mem_estimate_.total;
  const nlohmann::json out = {
      {"model", {{"path", c_.model}, {"name", m.name}, {"layers", m.n_layers}, {"hidden", m.hidden},
                 {"type", model_type(model_->weights())},
                 {"params", res_.total_params}, {"trainable_params", res_.trainable_params}}},
      {"config", config},
      {"memory", memory},
      {"tokens_per_step", c_.batch_size * c_.grad_accum * c_.seq_len * data_ranks()}};
  *rt_.profile_metadata = out.dump();
}

void Trainer::start_metrics() {
  rt_.metrics->on_start(std::filesystem::path(c_.model).filename().string(),
                        c_.method == TrainMethod::full ? "full" : "lora", total_steps_, steps_done());
  const std::string url = rt_.metrics->endpoint();
  if (!url.empty())
    log_->record(LogLevel::info, "metrics",
                 fmt::format("metrics: Prometheus at {}metrics, live curves at {}", url, url),
                 {{"metrics", {{"url", url}}}});
}

void Trainer::open_outputs() {
  on_root("open the outputs", [&] { open_root_outputs(); });
}

void Trainer::open_root_outputs() {
  check_outputs(c_, output_keep_, dry_run_);
  for (const std::string& w : c_.warnings) log_->record(LogLevel::warning, "config", w);
  if (!resume_state_) {  // a new run: checkpoints of an earlier one must not mix with its own
    const std::vector<std::string> old = list_checkpoints(checkpoint_dir_);
    if (!old.empty() && !c_.overwrite)
      fail(ErrorKind::invalid_input, "{}: checkpoint_dir '{}' holds checkpoints of an earlier run (newest: {}): pass "
           "--resume to continue that run, or --overwrite to start over (they are then removed)",
           c_.source, checkpoint_dir_, std::filesystem::path(old.front()).filename().string());
    if (dry_run_) return;  // check(): what a run would remove stays
    for (const std::string& p : old) std::filesystem::remove_all(p);
    if (!old.empty())
      log_->record(LogLevel::warning, "checkpoint",
                   fmt::format("--overwrite: removed {} checkpoints of an earlier run from {}", old.size(),
                               checkpoint_dir_),
                   {{"checkpoint", {{"dir", checkpoint_dir_}, {"removed", old.size()}}}});
  }
  // metrics_file: one JSON object per optimizer step and per evaluation (loss curves, benchmarks).
  if (c_.metrics_file.empty() || dry_run_) return;
  rewrite_metrics(resume_state_ ? resume_state_->metrics_text : std::string());
}

// metrics_file from scratch with `text` (a checkpoint's lines, so a resumed
// run's file reads as if it had never stopped).
void Trainer::rewrite_metrics(const std::string& text) {
  if (c_.metrics_file.empty()) return;
  metrics_.reset(std::fopen(c_.metrics_file.c_str(), "w"));
  if (!metrics_ || std::fwrite(text.data(), 1, text.size(), metrics_.get()) != text.size() ||
      std::fflush(metrics_.get()) != 0)
    fail(ErrorKind::io, "{}: metrics_file '{}' cannot be written: {}", c_.source, c_.metrics_file,
         std::strerror(errno));
}

void Trainer::load_data() {
  const std::optional<ChatTemplate> tmpl = data_chat_template(*model_, c_);
  DataOptions opt = data_options(c_);
  opt.cache_read_only = dry_run_;
  data_.emplace(prepare_train_data(c_.train_file, model_->tokenizer(), tmpl ? &*tmpl : nullptr, opt));
  const DataStats& st = data_->train.stats;
  log_->record(LogLevel::info, "data", fmt::format("train data: {}: {}", c_.train_file, format_data_stats(st)),
               {{"data", {{"file", c_.train_file}, {"samples", st.samples}, {"lines", st.lines},
                          {"skipped", st.skipped}, {"truncated", st.truncated}, {"dropped", st.dropped},
                          {"tokens", st.tokens}, {"rows", data_->train.rows.rows()},
                          {"cache", cache_status_name(data_->train_cache.status)}}}});
  // data.skip_bad_lines: say which lines were left out and why (the first few).
  for (const std::string& why : st.skipped_examples)
    log_->record(LogLevel::warning, "data", "skipped: " + why, {{"skipped_line", why}});
  if (const int64_t unlisted = st.skipped - static_cast<int64_t>(st.skipped_examples.size()); unlisted > 0)
    log_->record(LogLevel::warning, "data", fmt::format("skipped: {} more bad lines not listed", unlisted),
                 {{"skipped_unlisted", unlisted}});
  if (data_->eval)
    log_->record(LogLevel::info, "data",
                 fmt::format("eval data: {} samples, {} rows{}", data_->eval->n_samples, data_->eval->rows.rows(),
                             c_.eval_file.empty() ? " (split from the train file)" : " from " + c_.eval_file),
                 {{"eval_data", {{"file", c_.eval_file.empty() ? c_.train_file : c_.eval_file},
                                 {"samples", data_->eval->n_samples}, {"rows", data_->eval->rows.rows()}}}});
}

void Trainer::build_optimizer() {
  loader_ = std::make_unique<DataLoader>(data_->train, data_->pad_id, c_.batch_size, /*shuffle=*/true, c_.seed);
  total_steps_ = c_.steps;
  if (total_steps_ == 0) {
    const double micro = c_.epochs * static_cast<double>(loader_->batches_per_epoch());
    total_steps_ = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(micro / static_cast<double>(c_.grad_accum))));
  }
  LrSchedule sched{.kind = c_.schedule, .warmup_steps = c_.warmup_steps, .total_steps = total_steps_};
  AdamWConfig adam = c_.adam;
  adam.sparse_gradients =
      data_ranks() > 1 && c_.dist.sync.compression == GradCompression::topk && c_.dist.lazy_adam;
  if (adam.sparse_gradients && c_.optimizer != OptimizerKind::adamw)
    fail(ErrorKind::invalid_input, "{}: dist.compression topk with optim.kind {}: the lazy moments of dist.lazy_adam "
         "(the default) need optim.kind adamw; set dist.lazy_adam: false for the plain update", c_.source,
         optimizer_kind_name(c_.optimizer));
  opt_ = std::make_unique<AdamW>(*backend_, adam, params_->param_groups(c_),
                                 static_cast<size_t>(params_->count()), sched, c_.optimizer, params_->tensor_spans(),
                                 zero_shard());
}

void Trainer::log_start() {
  const ModelConfig& mc = model_->config();
  log_->record(LogLevel::info, "model",
               fmt::format("model: {} ({} layers, hidden {}), {} parameters; {}: {} trainable ({:.3f}%); backward {}",
                           c_.model, mc.n_layers, mc.hidden, format_count(res_.total_params), params_->describe(),
                           format_count(res_.trainable_params),
                           100.0 * static_cast<double>(res_.trainable_params) /
                               static_cast<double>(res_.total_params),
                           backward_mode_name(c_.backward)),
               {{"model", {{"path", c_.model}, {"layers", mc.n_layers}, {"hidden", mc.hidden},
                           {"parameters", res_.total_params}, {"trainable_parameters", res_.trainable_params},
                           {"method", params_->describe()}, {"backward", backward_mode_name(c_.backward)}}}});
  log_->record(LogLevel::info, "start",
               fmt::format("training: {} steps of {} x {} rows x {} tokens ({} rows per epoch)", total_steps_,
                           c_.grad_accum, c_.batch_size, c_.seq_len, data_->train.rows.rows()),
               {{"total_steps", total_steps_}, {"grad_accum", c_.grad_accum}, {"batch_size", c_.batch_size},
                {"seq_len", c_.seq_len}, {"rows_per_epoch", data_->train.rows.rows()}});
}

int64_t Trainer::loss_tokens(int64_t local) {
  if (data_ranks() > 1) {  // the step's mean is over every rank's tokens
    double n = static_cast<double>(local);
    data_comm_->allreduce_sum(std::span<double>(&n, 1));
    local = static_cast<int64_t>(n);
  }
  if (!hooks_.loss_tokens) return local;
  const int64_t n = hooks_.loss_tokens(*this, local);
  if (n < 0 || (local > 0 && n < 1))
    fail(ErrorKind::invalid_input, "TrainHooks::loss_tokens returned {} for a step with {} local target tokens "
         "(must be >= 1)", n, local);
  return n;
}

StepReport Trainer::train_step() {
  LOOM_ASSERT(opt_);  // setup() ran
  const auto ts = Clock::now();
  const int64_t step = steps_done();
  current_step_ = step + 1;  // for the record of an error that ends the run
  maybe_start_qat(step);
  update_compression(step);  // trainer_dist.cpp: dense steps first
  TraceScope step_trace(tracer(), "step", {{"step", static_cast<double>(step + 1)}});
  // Peek the whole step first: the gradient scale needs its total target tokens.
  StepReport r;
  {
    TraceScope data_trace(tracer(), "data");
    load_step_batches(r);  // this rank's micro-batches (trainer_dist.cpp)
    data_trace.arg("tokens", static_cast<double>(r.target_tokens));
  }
  r.loss_tokens = loss_tokens(r.target_tokens);
  params_->zero_grads();
  double loss_sum = 0;
  const int64_t input_before = input_tokens_;
  const int64_t tp_bytes_before = tp_sums_ ? tp_sums_->wire_bytes() : 0, tp_sums_before = tp_sums_ ? tp_sums_->calls() : 0;
  step_pp_bytes_ = 0;
  if (r.loss_tokens > 0) {
    float scale = 1.0f / static_cast<float>(r.loss_tokens);
    if (scaler_) scale *= scaler_->scale();  // fp16: a power of two, exact
    loss_sum = backward_step(scale, step);  // data parallel: gradients summed over the ranks on return
  }
  if (tp_sums_) {  // this step's forward and backward sums (and the adapters' gradient sum)
    step_tp_bytes_ = tp_sums_->wire_bytes() - tp_bytes_before;
    step_tp_sums_ = tp_sums_->calls() - tp_sums_before;
  }
  if (data_ranks() > 1) {  // the step's loss and tokens over every rank
    double v[2] = {loss_sum, static_cast<double>(input_tokens_ - input_before)};
    data_comm_->allreduce_sum(std::span<double>(v, 2));
    loss_sum = v[0];
    input_tokens_ = input_before + static_cast<int64_t>(v[1]);
    r.target_tokens = r.loss_tokens;
  }
  // fp16: the gradients back to their true size before the check, clipping and AdamW (GradScaler.unscale_).
  if (scaler_) {
    const std::span<float> g = params_->grads();
    backend_->scale(g.data(), scaler_->inv_scale(), static_cast<int64_t>(g.size()));
  }
  r.step = step + 1;
  r.loss = r.target_tokens > 0 ? loss_sum / static_cast<double>(r.target_tokens) : std::nan("");
  inject_step_faults(r);  // LOOM_FAILPOINTS site "step" (a test facility)
  params_->before_update();  // a pruned model's masked gradients
  if (hooks_.after_backward) hooks_.after_backward(*this, params_->grads());
  // A NaN or inf in the loss or a gradient: nothing is applied (trainer_faults.cpp).
  double grad_norm = 0;
  if (const std::optional<NonFiniteStep> bad = check_finite(r, grad_norm)) {
    // An fp16 overflow at a loss scale of at least 1 is loss scaling at work;
    // a non-finite loss, or gradients that overflow even unscaled, are faults.
    r = scaler_ && !bad->loss && scaler_->scale() >= 1.0f ? loss_scale_skip(r, *bad, ts) : skip_step(r, *bad, ts);
    current_step_ = 0;
    return r;
  }
  faults_.bad_in_a_row = 0;
  if (scaler_) {
    scaler_->update(false);
    if (rt_.metrics) rt_.metrics->on_loss_scale(scaler_->scale(), false);
  }
  r.lr = opt_->current_lr(0);
  TraceScope optimizer_trace(tracer(), "optimizer", {{"params", static_cast<double>(params_->params().size())}});
  r.grad_norm = opt_->step(params_->params(), params_->grads(), grad_norm).grad_norm;
  gather_zero_params();  // dist.zero 1: each rank updated its part
  params_->after_update(*model_, *session_, *backend_);
  res_.step_losses.push_back(r.loss);
  res_.trained_tokens += r.target_tokens;
  r.input_tokens = input_tokens_;
  r.step_seconds = seconds_since(ts);
  train_seconds_ += r.step_seconds;
  const double tok_s = train_seconds_ > 0 ? static_cast<double>(input_tokens_) / train_seconds_ : 0;
  const double elapsed = seconds_since(t0_);
  const double eta = elapsed / static_cast<double>(r.step) * static_cast<double>(total_steps_ - r.step);
  log_->step({.step = r.step, .total = total_steps_, .loss = r.loss, .lr = r.lr, .grad_norm = r.grad_norm,
              .tokens_per_s = tok_s, .elapsed_s = elapsed, .eta_s = eta, .tokens = input_tokens_});
  write_metrics_step(r, tok_s);
  if (rt_.metrics) rt_.metrics->on_step(r, total_steps_, tok_s, eta);
  // memory_alarm: a checkpoint at the top threshold (data parallel: any rank's crossing).
  if (agree_any(watch_memory())) write_checkpoint("memory_alarm");
  if (hooks_.after_optimizer_step) hooks_.after_optimizer_step(*this, r);
  current_step_ = 0;
  return r;
}

void Trainer::write_metrics_step(const StepReport& r, double tok_s) {
  if (!metrics_) return;
  std::fprintf(metrics_.get(),
               "{\"step\":%lld,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,\"target_tokens\":%lld,"
               "\"input_tokens\":%lld,\"step_seconds\":%.4f,\"elapsed_seconds\":%.3f,\"tokens_per_s\":%.2f",
               static_cast<long long>(r.step), json_number(r.loss).c_str(), json_number(r.lr).c_str(),
               json_number(r.grad_norm).c_str(), static_cast<long long>(r.target_tokens),
               static_cast<long long>(r.input_tokens), r.step_seconds, seconds_since(t0_), tok_s);
  if (data_ranks() > 1)  // data parallel: what rank 0 sent for the gradients, and how long it waited at the step's end
    std::fprintf(metrics_.get(),
                 ",\"ranks\":%d,\"wire_bytes\":%lld,\"uncompressed_wire_bytes\":%lld,\"comm_seconds\":%.4f,"
                 "\"comm_wait_seconds\":%.4f",
                 world(), static_cast<long long>(sync_stats_.wire_bytes),
                 static_cast<long long>(sync_stats_.uncompressed_wire_bytes), sync_stats_.comm_seconds,
                 sync_stats_.wait_seconds);
  if (tp_sums_)  // tensor parallel: what rank 0 sent for its sums this step
    std::fprintf(metrics_.get(), ",\"tp_wire_bytes\":%lld,\"tp_sums\":%lld", static_cast<long long>(step_tp_bytes_),
                 static_cast<long long>(step_tp_sums_));
  if (c_.dist.pp > 1)  // pipeline: what the stages of rank 0's pipeline sent to each other this step
    std::fprintf(metrics_.get(), ",\"pp_wire_bytes\":%lld", static_cast<long long>(step_pp_bytes_));
  std::fputs("}\n", metrics_.get());
  std::fflush(metrics_.get());
}

std::optional<double> Trainer::evaluate() {
  LOOM_ASSERT(opt_);  // setup() ran
  if (!data_->eval) return std::nullopt;
  TraceScope eval_trace(tracer(), "eval");
  // data parallel: each rank a share; pipeline parallel: through the stages
  const LossResult sum = c_.dist.pp > 1 ? eval_pipeline(*data_->eval) : eval_shard(*data_->eval);
  EvalReport e;
  e.step = steps_done();
  e.tokens = sum.n_tokens;
  const auto n = static_cast<double>(sum.n_tokens);
  e.loss = sum.n_tokens > 0 ? sum.loss_sum / n : std::nan("");
  e.accuracy = sum.n_tokens > 0 ? static_cast<double>(sum.n_correct) / n : std::nan("");
  const double loss = e.loss;
  res_.eval_losses.push_back(loss);
  res_.eval_accuracies.push_back(e.accuracy);
  evals_.push_back({e.step, loss, e.accuracy});
  res_.final_eval_loss = loss;
  log_->record(LogLevel::info, "eval",
               fmt::format("eval at step {}: loss {:.4f} (ppl {:.2f}), token accuracy {:.2f}%", e.step, loss,
                           std::exp(loss), 100 * e.accuracy),
               {{"step", e.step}, {"eval_loss", json_or_null(loss)}, {"eval_accuracy", json_or_null(e.accuracy)},
                {"eval_tokens", e.tokens}},
               "metric");
  if (metrics_) {
    std::fprintf(metrics_.get(),
                 "{\"step\":%lld,\"eval_loss\":%s,\"eval_accuracy\":%s,\"eval_tokens\":%lld,"
                 "\"elapsed_seconds\":%.3f}\n",
                 static_cast<long long>(e.step), json_number(loss).c_str(), json_number(e.accuracy).c_str(),
                 static_cast<long long>(e.tokens), seconds_since(t0_));
    std::fflush(metrics_.get());
  }
  if (rt_.metrics)
    rt_.metrics->on_eval(e.step, loss, std::isfinite(e.accuracy) ? std::optional<double>(e.accuracy) : std::nullopt);
  if (hooks_.at_evaluation) hooks_.at_evaluation(*this, e);
  return loss;
}

TrainResult Trainer::finish() {
  LOOM_ASSERT(opt_);  // setup() ran
  res_.steps = steps_done();
  res_.tokens_per_s = train_seconds_ > 0 ? static_cast<double>(input_tokens_) / train_seconds_ : 0;
  FolderWriteOptions out_opt;
  out_opt.overwrite = c_.overwrite;
  out_opt.what = "output_dir";
  out_opt.force = "--overwrite (or overwrite: true)";
  out_opt.keep = output_keep_;  // the checkpoints stay (hard links into the new folder)
  if (tp_sums_ && data_rank() == 0) {  // rank 0 writes the whole model's adapters (every group holds the same)
    params_->gather_tensor_parallel(*tp_comm_, tp_full_config_);
    if (is_root()) model_->reshape(tp_full_config_);
  }
  if (c_.dist.pp > 1 && data_rank() == 0) params_->gather_pipeline(*pp_comm_, *model_);  // full: rank 0's is whole
  on_root("write the output", [&] { params_->write_output(*model_, c_, out_opt); });
  res_.adapter_dir = c_.output_dir;
  if (rt_.metrics) rt_.metrics->on_finish();
  const std::string out = std::filesystem::absolute(c_.output_dir).lexically_normal().string();
  log_->record(LogLevel::info, "finish",
               fmt::format("trained {} steps ({} target tokens) in {}, {:.0f} tokens/s; {} written to {}", res_.steps,
                           res_.trained_tokens, format_duration(seconds_since(t0_)), res_.tokens_per_s,
                           params_->output_kind(), out),
               {{"steps", res_.steps}, {"target_tokens", res_.trained_tokens},
                {"tokens_per_s", res_.tokens_per_s}, {"output_dir", out}});
  if (is_root() && c_.method == TrainMethod::lora && hooks_.after_adapter_written)
    hooks_.after_adapter_written(*this, {out, steps_done(), /*final=*/true});
  return res_;
}

// ---- checkpoints and resume ------------------------------------------------

void Trainer::prepare_resume() {
  checkpoint_dir_ = resolve_checkpoint_dir(c_, output_keep_);
  if (!rt_.resume) return;
  std::string path = *rt_.resume;
  if (path.empty()) {  // the latest good one
    std::vector<SkippedCheckpoint> skipped;
    const std::optional<std::string> good = latest_good_checkpoint(checkpoint_dir_, skipped);
    for (const SkippedCheckpoint& s : skipped)
      log_->record(LogLevel::warning, "resume", fmt::format("resume: skipped checkpoint {}: {}", s.path, s.reason),
                   {{"checkpoint", {{"path", s.path}, {"skipped", s.reason}}}}, "alert");
    if (!good) {
      if (!skipped.empty())
        fail(ErrorKind::invalid_input, "--resume: no good checkpoint in {} ({} skipped, see above)", checkpoint_dir_,
             skipped.size());
      log_->record(LogLevel::warning, "resume",
                   fmt::format("resume: no checkpoint in {} yet: starting from step 0", checkpoint_dir_),
                   {{"checkpoint", {{"dir", checkpoint_dir_}}}});
      return;
    }
    path = *good;
  } else if (std::string why = verify_checkpoint(path); !why.empty()) {
    fail(ErrorKind::invalid_input, "--resume {}: not a good checkpoint: {}", path, why);
  }
  CheckpointState st = read_checkpoint_state(path);
  check_run_identity(st.identity, run_identity(c_), path);
  if (c_.steps > 0 && st.step > c_.steps)  // (with epochs the count is known only after the data)
    fail(ErrorKind::invalid_input,
         "--resume {}: the checkpoint is at step {}, past this run's {} steps: nothing is "
         "left to train (raise steps to train on from it)",
         path, st.step, c_.steps);
  input_hashes_ = input_hashes(c_);
  for (const auto& [key, was] : st.input_hashes)
    for (const auto& [k, now] : input_hashes_)
      if (k == key && now != was)
        fail(ErrorKind::invalid_input, "--resume {}: the content of {} changed since the checkpoint (hash {} then, {} "
             "now): the run cannot go on on other inputs", path, key, was, now);
  resume_path_ = path;
  resume_state_ = std::move(st);
}

void Trainer::load_checkpoint(const std::string& path) {
  LOOM_ASSERT(opt_);
  if (std::string why = verify_checkpoint(path); !why.empty())
    fail(ErrorKind::invalid_input, "checkpoint {}: not a good checkpoint: {}", path, why);
  CheckpointState st = path == resume_path_ && resume_state_ ? std::move(*resume_state_) : read_checkpoint_state(path);
  resume_state_.reset();
  if (static_cast<int64_t>(st.step_losses.size()) != st.step || st.shuffle_seed != c_.seed)
    fail(ErrorKind::invalid_input, "checkpoint {}: its history ({} step losses, seed {}) does not fit step {} of "
         "this run (seed {})", path, st.step_losses.size(), st.shuffle_seed, st.step, c_.seed);
  if (tp_sums_)
    load_tensor_parallel_arenas(path);  // trainer_tp.cpp: each rank its shard of the whole model's
  else
    load_checkpoint_arenas(path, params_->params(), *opt_);
  restore_compression_state(path, st.world_size, st.tensor_parallel);
  params_->after_update(*model_, *session_, *backend_);  // full: the backend's copies of the weights
  restore_faults(st.faults);
  if (scaler_) {
    if (!st.loss_scaler)
      fail(ErrorKind::invalid_input, "checkpoint {}: no loss scaler state, but precision is fp16", path);
    scaler_->restore(*st.loss_scaler);
  }
  loader_->seek(st.cursor);
  res_.step_losses = std::move(st.step_losses);
  evals_ = std::move(st.evals);
  res_.eval_losses.clear();
  res_.eval_accuracies.clear();
  for (const EvalPoint& e : evals_) {
    res_.eval_losses.push_back(e.loss);
    res_.eval_accuracies.push_back(e.accuracy);
  }
  res_.final_eval_loss = evals_.empty() ? std::nullopt : std::optional<double>(evals_.back().loss);
  res_.trained_tokens = st.trained_tokens;
  input_tokens_ = st.input_tokens;
  train_seconds_ = st.train_seconds;
  t0_ = Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(st.elapsed_seconds));
  last_checkpoint_time_ = Clock::now();
  if (metrics_) rewrite_metrics(st.metrics_text);
  last_checkpoint_ = path;
  log_->record(LogLevel::info, "resume",
               fmt::format("resumed from {} at step {} of {} (written for: {})", path, st.step, total_steps_,
                           st.reason),
               {{"step", st.step}, {"checkpoint", {{"path", path}, {"reason", st.reason}}}});
  if (st.world_size != data_ranks())  // the cursor is global: the rows re-shard over the data ranks there are now
    log_->record(LogLevel::warning, "resume",
                 fmt::format("resume: the checkpoint was written by {} data-parallel rank{}, this run has {}: a step "
                             "now takes {} x {} x {} rows instead of {} x {} x {}", st.world_size,
                             st.world_size == 1 ? "" : "s", data_ranks(), data_ranks(), c_.grad_accum, c_.batch_size,
                             st.world_size, c_.grad_accum, c_.batch_size),
                 {{"world_size", data_ranks()}, {"checkpoint_world_size", st.world_size}});
  if (st.tensor_parallel != c_.dist.tp)  // the checkpoint holds the whole model's arenas: any split reads them
    log_->record(LogLevel::info, "resume",
                 fmt::format("resume: the checkpoint was written with dist.tp {}, this run splits its adapters and "
                             "optimizer state over dist.tp {}", st.tensor_parallel, c_.dist.tp),
                 {{"tensor_parallel", c_.dist.tp}, {"checkpoint_tensor_parallel", st.tensor_parallel}});
  if (st.schedule.kind != LrScheduleKind::constant && st.schedule.total_steps != total_steps_)
    log_->record(LogLevel::warning, "resume",
                 fmt::format("resume: the {} schedule now spans {} steps instead of {}: the learning rate from here "
                             "on differs from the original run's", lr_schedule_name(st.schedule.kind), total_steps_,
                             st.schedule.total_steps),
                 {{"total_steps", total_steps_}, {"checkpoint_total_steps", st.schedule.total_steps}});
}

CheckpointState Trainer::checkpoint_state(std::string_view reason) {
  if (input_hashes_.empty()) input_hashes_ = input_hashes(c_);
  CheckpointState st;
  st.step = steps_done();
  st.cursor = loader_->cursor();
  st.shuffle_seed = c_.seed;
  st.dropout_seed = c_.lora.seed;
  st.schedule = opt_->schedule();
  st.faults = faults_;
  if (scaler_) st.loss_scaler = scaler_->state();
  st.reason = std::string(reason);
  st.world_size = data_ranks();  // what the rows are split over
  st.tensor_parallel = c_.dist.tp;
  st.identity = run_identity(c_);
  st.config_text = c_.text;
  st.input_hashes = input_hashes_;
  st.step_losses = res_.step_losses;
  st.evals = evals_;
  st.trained_tokens = res_.trained_tokens;
  st.input_tokens = input_tokens_;
  st.train_seconds = train_seconds_;
  st.elapsed_seconds = seconds_since(t0_);
  if (metrics_) {
    std::fflush(metrics_.get());
    st.metrics_text = read_text_file(c_.metrics_file);
  }
  return st;
}

void Trainer::write_checkpoint(std::string_view reason) {
  LOOM_ASSERT(opt_);
  if (c_.dist.pp > 1 && params_->split_into_stages())  // a signal's or memory alarm's (check_pipeline_full)
    fail(ErrorKind::unsupported, "{}: a checkpoint ({}) of full fine-tuning with dist.pp cannot be written yet (each "
         "stage holds only its tensors)", c_.source, reason);
  const int64_t step = steps_done();
  const auto stage = [&](std::string_view s) {
    if (s == "files_written") fail_point(rt_.failpoints, "checkpoint_write", step);
  };
  TraceScope checkpoint_trace(tracer(), "checkpoint");
  CheckpointWriteInfo info;
  std::vector<AdamW::StatePart> parts = opt_->state_parts();
  const std::vector<std::vector<char>> whole = gather_zero_state(parts);  // dist.zero 1: every rank's part
  std::vector<std::vector<float>> tp_whole;
  const std::span<const float> params = gather_tensor_parallel_state(parts, tp_whole);  // dist.tp: the whole model's
  std::vector<float> residuals, q;
  const std::vector<AdamW::StatePart> extra = gather_compression_state(residuals, q);  // dist.compression
  on_root("write a checkpoint", [&] {
    info = loom::write_checkpoint(checkpoint_dir_, checkpoint_state(reason), params, opt_->kind(), parts, stage,
                                  extra);
  });
  broadcast_text(info.path);  // every rank rolls back to / resumes from the same folder
  last_checkpoint_ = info.path;
  checkpoint_trace.arg("bytes", static_cast<double>(info.bytes));
  last_checkpoint_time_ = Clock::now();
  const bool adapter = rt_.checkpoint_adapters && !reason.starts_with("signal");  // a stop should be quick
  if (!is_root()) {  // the pruning and the record are rank 0's
    if (adapter) write_checkpoint_adapter();
    return;
  }
  const std::vector<std::string> pruned = prune_checkpoints(checkpoint_dir_, c_.keep_checkpoints);
  if (rt_.metrics) rt_.metrics->on_checkpoint(info.seconds);
  nlohmann::json removed = nlohmann::json::array();
  for (const std::string& p : pruned) removed.push_back(std::filesystem::path(p).filename().string());
  log_->record(LogLevel::info, "checkpoint",
               fmt::format("checkpoint at step {} ({}): {} ({:.2f} MiB in {:.2f} s){}", steps_done(), reason,
                           info.path, static_cast<double>(info.bytes) / (1024.0 * 1024.0), info.seconds,
                           pruned.empty() ? "" : fmt::format("; removed {}", removed.size())),
               {{"step", steps_done()},
                {"checkpoint", {{"path", info.path}, {"reason", reason}, {"bytes", info.bytes},
                                {"seconds", info.seconds}, {"removed", removed}}}});
  if (adapter) write_checkpoint_adapter();
}

std::string Trainer::checkpoint_adapter_dir() const {
  return (std::filesystem::absolute(checkpoint_dir_) / "latest-adapter").lexically_normal().string();
}

// One stable folder, replaced whole: a server told to load it can always read a complete adapter there, also
// when it reloads it after an LRU eviction long after pruning removed the checkpoint it came from.
void Trainer::write_checkpoint_adapter() {
  TraceScope trace(tracer(), "checkpoint_adapter");
  TrainConfig c = c_;
  c.output_dir = checkpoint_adapter_dir();
  FolderWriteOptions opt;
  opt.what = "the checkpoint's adapter folder (latest-adapter)";
  if (tp_sums_) {  // the whole model's adapter from the shards (a collective of rank 0's group), rank 0 writes it
    std::vector<float> whole;
    if (data_rank() == 0) params_->gather_tensor_parallel_array(*tp_comm_, params_->params(), whole);
    on_root("write the checkpoint's adapter",
            [&] { params_->write_whole_output(whole, tp_full_config_, c, opt); });
  } else {
    on_root("write the checkpoint's adapter", [&] { params_->write_output(*model_, c, opt); });
  }
  if (!is_root()) return;
  log_->record(LogLevel::info, "checkpoint_adapter",
               fmt::format("adapter of step {} written to {}", steps_done(), c.output_dir),
               {{"step", steps_done()}, {"adapter_dir", c.output_dir}});
  if (hooks_.after_adapter_written) hooks_.after_adapter_written(*this, {c.output_dir, steps_done(), false});
}

bool Trainer::checkpoint_due() {
  const int64_t s = steps_done();
  if (c_.checkpoint_interval > 0 && s > 0 && s % c_.checkpoint_interval == 0) return true;
  if (c_.checkpoint_minutes <= 0) return false;
  const bool due = seconds_since(last_checkpoint_time_) >= 60.0 * c_.checkpoint_minutes;
  return agree_any(is_root() && due);  // rank 0's clock
}

// QAT from qat.start_step on (also right after a resume past it).
void Trainer::maybe_start_qat(int64_t step) {
  if (!c_.qat.enabled() || params_->qat_started() || step < c_.qat.start_step) return;
  params_->start_qat(*model_, *session_, *backend_, qat_spec_);
  log_->record(LogLevel::info, "qat",
               fmt::format("qat: from step {}, the forward multiplies the weights as int{} {} stores them", step + 1,
                           c_.qat.bits, c_.qat.symmetric ? "sym" : "asym"));
}

bool Trainer::evaluated_at(int64_t step) const {
  return std::any_of(evals_.begin(), evals_.end(), [&](const EvalPoint& e) { return e.step == step; });
}

TrainResult Trainer::stop(int sig) {
  write_checkpoint(fmt::format("signal {}", signal_name(sig)));
  res_.steps = steps_done();
  res_.stopped_by_signal = sig;
  res_.checkpoint = last_checkpoint_;
  // The command to continue: this config with the same --set overrides (without them another run's
  // output_dir and checkpoints could be the ones resumed), from this checkpoint.
  std::string again = "loom train " + shell_word(c_.source);
  for (const std::string& o : c_.overrides) again += " --set " + shell_word(o);
  again += " --resume " + shell_word(last_checkpoint_);
  log_->record(
      LogLevel::warning, "stop",
      fmt::format("stopped by {} after step {} of {}: checkpoint {}; continue with {}", signal_name(sig),
                  steps_done(), total_steps_, last_checkpoint_, again),
      {{"step", steps_done()}, {"signal", signal_name(sig)}, {"checkpoint", {{"path", last_checkpoint_}}}});
  return res_;
}

// An evaluation the schedule asks for after `step` steps (eval_at_start,
// eval_interval); resumed runs redo one their checkpoint was written before.
static bool eval_due(const TrainConfig& c, int64_t step, int64_t total) {
  if (step == 0) return c.eval_at_start;
  return c.eval_interval > 0 && step % c.eval_interval == 0 && step < total;
}

namespace {

TrainResult run_trainer(Trainer& t, const TrainConfig& config) {
  t.setup();
  if (eval_due(config, t.steps_done(), t.total_steps()) && !t.evaluated_at(t.steps_done())) t.evaluate();
  while (t.steps_done() < t.total_steps()) {
    if (const int sig = t.stop_requested()) return t.stop(sig);
    if (t.train_step().skipped) continue;  // not applied: no evaluation or checkpoint is due
    if (eval_due(config, t.steps_done(), t.total_steps())) t.evaluate();
    if (t.checkpoint_due()) t.write_checkpoint(config.checkpoint_interval > 0 &&
                                                       t.steps_done() % config.checkpoint_interval == 0
                                                   ? "interval"
                                                   : "minutes");
  }
  if (const int sig = t.stop_requested()) return t.stop(sig);
  t.evaluate();
  return t.finish();
}

}  // namespace

TrainResult run_training(const TrainConfig& config, std::FILE* log, TrainHooks hooks, TrainRuntime runtime) {
  Trainer t(config, log, std::move(hooks), std::move(runtime));
  // Whatever ends the run is an error record first (what, which step, which
  // checkpoint to resume from); the app then exits with the kind's code.
  try {
    return run_trainer(t, config);
  } catch (Error& e) {
    t.log_failure(e);
    throw;
  } catch (const std::bad_alloc&) {
    Error e(ErrorKind::internal, "out of memory (std::bad_alloc)");
    t.log_failure(e);
    throw e;
  } catch (const std::exception& e) {
    Error err(ErrorKind::internal, e.what());
    t.log_failure(err);
    throw err;
  }
}

}  // namespace loom
