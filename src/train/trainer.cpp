// run_training: one optimizer step = grad_accum micro-batches whose gradients
// are scaled by 1 / (target tokens of the whole step), so the step follows the
// exact token mean of its loss, then AdamW with clipping and the LR schedule.
#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/file_write.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "model/hf_export.h"
#include "train/full_params.h"
#include "model/peft_adapter.h"
#include "train/train_step.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string format_duration(double s) {
  const auto t = static_cast<int64_t>(std::max(0.0, s) + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, t / 60 % 60);
  return fmt::format("{}m{:02}s", t / 60, t % 60);
}

std::string format_count(int64_t n) {
  if (n >= 1000000000) return fmt::format("{:.2f}B", static_cast<double>(n) / 1e9);
  if (n >= 1000000) return fmt::format("{:.2f}M", static_cast<double>(n) / 1e6);
  if (n >= 1000) return fmt::format("{:.1f}K", static_cast<double>(n) / 1e3);
  return fmt::format("{}", n);
}

// Parameter groups over the LoRA arena: attention vs MLP adapters, A vs B
// (B flagged for LoRA+); adjacent runs of the same kind are merged.
std::vector<ParamGroup> lora_param_groups(const LoraModel& lora, const TrainConfig& c) {
  struct Run {
    size_t offset, size;
    bool mlp, b;
  };
  std::vector<Run> runs;
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot& s = lora.slot(l, t);
      if (!s.active) continue;
      const auto r = static_cast<size_t>(lora.config().r);
      const bool mlp = !lora_target_is_attention(t);
      runs.push_back({s.a_offset, r * static_cast<size_t>(s.in), mlp, false});
      runs.push_back({s.b_offset, static_cast<size_t>(s.out) * r, mlp, true});
    }
  std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) { return x.offset < y.offset; });
  std::vector<ParamGroup> groups;
  for (const Run& run : runs) {
    if (!groups.empty()) {
      ParamGroup& g = groups.back();
      if (g.offset + g.size == run.offset && g.lora_b == run.b && (g.name[0] == 'm') == run.mlp) {
        g.size += run.size;
        continue;
      }
    }
    ParamGroup g;
    g.name = fmt::format("{}.lora_{}", run.mlp ? "mlp" : "attn", run.b ? "B" : "A");
    g.offset = run.offset;
    g.size = run.size;
    g.lr = run.mlp && c.mlp_lr ? *c.mlp_lr : c.lr;
    g.weight_decay = c.weight_decay;
    g.lora_b = run.b;
    groups.push_back(g);
  }
  if (c.lora_plus_ratio) groups = apply_lora_plus(std::move(groups), *c.lora_plus_ratio);
  return groups;
}

// Mean loss over every target token of a split (no dropout, no gradients).
double evaluate(TrainSession& session, const DataSplit& split, int32_t pad_id, int64_t batch_rows) {
  DataLoader loader(split, pad_id, batch_rows, /*shuffle=*/false, 0);
  double sum = 0;
  int64_t n = 0;
  for (int64_t i = 0, nb = loader.batches_per_epoch(); i < nb; ++i) {
    const Batch b = loader.next();
    if (b.target_tokens == 0) continue;
    const LossResult r = session.forward_loss(b);
    sum += r.loss_sum;
    n += r.n_tokens;
  }
  return n > 0 ? sum / static_cast<double>(n) : std::nan("");
}

// The adapter in PEFT form: q/k B rows back in Hugging Face order when the
// model stores them permuted (llama from GGUF).
peft::AdapterTensors adapter_tensors(LoraModel& lora, const ModelConfig& model, const TrainConfig& c) {
  peft::AdapterTensors ad;
  ad.config.r = static_cast<int>(c.lora.r);
  ad.config.lora_alpha = c.lora.alpha;
  ad.config.lora_dropout = c.lora.dropout;
  ad.config.use_rslora = c.lora.use_rslora;
  ad.config.base_model_name_or_path = c.model;
  for (LoraTarget t : kAllLoraTargets)
    if (c.lora.targets_module(t)) ad.config.target_modules.push_back(t);
  const size_t r = static_cast<size_t>(c.lora.r);
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot& s = lora.slot(l, t);
      if (!s.active) continue;
      peft::LoraPair p;
      p.in = s.in;
      p.out = s.out;
      const float* a = lora.params() + s.a_offset;
      const float* b = lora.params() + s.b_offset;
      p.a.assign(a, a + r * static_cast<size_t>(s.in));
      p.b.assign(b, b + static_cast<size_t>(s.out) * r);
      if (lora_needs_qk_permutation(model) && (t == LoraTarget::q || t == LoraTarget::k))
        lora_permute_qk_rows(make_tensor(p.b.data(), DType::f32, {s.out, c.lora.r}),
                             t == LoraTarget::q ? model.n_heads : model.n_kv_heads, model.head_dim,
                             /*hf_to_model=*/false);
      ad.pairs[{static_cast<int>(l), t}] = std::move(p);
    }
  return ad;
}

class Progress {
 public:
  Progress(std::FILE* out, int64_t total, int64_t log_interval)
      : out_(out), total_(total), log_interval_(log_interval), tty_(out && isatty(fileno(out))) {}

  void step(int64_t step, double loss, double lr, double grad_norm, double tok_s, double elapsed) {
    if (!out_) return;
    const double eta = step > 0 ? elapsed / static_cast<double>(step) * static_cast<double>(total_ - step) : 0;
    if (tty_) {
      const int width = 24;
      const int fill = static_cast<int>(static_cast<double>(width) * static_cast<double>(step) / static_cast<double>(total_));
      std::fprintf(out_, "\r\033[K[%s%s] %lld/%lld loss %.4f lr %.2e %.0f tok/s ETA %s",
                   std::string(static_cast<size_t>(fill), '#').c_str(), std::string(static_cast<size_t>(width - fill), '.').c_str(),
                   static_cast<long long>(step), static_cast<long long>(total_), loss, lr, tok_s, format_duration(eta).c_str());
      std::fflush(out_);
      open_ = true;
    } else if (step % log_interval_ == 0 || step == total_ || step == 1) {
      std::fprintf(out_, "step %lld/%lld loss %.4f lr %.3e grad_norm %.3f %.0f tok/s elapsed %s ETA %s\n",
                   static_cast<long long>(step), static_cast<long long>(total_), loss, lr, grad_norm, tok_s,
                   format_duration(elapsed).c_str(), format_duration(eta).c_str());
      std::fflush(out_);
    }
  }
  // A full line (eval results, final messages); ends an open progress bar first.
  template <typename... Args>
  void line(fmt::format_string<Args...> f, Args&&... args) {
    if (!out_) return;
    if (open_) std::fputc('\n', out_);
    open_ = false;
    const std::string s = fmt::format(f, std::forward<Args>(args)...);
    std::fprintf(out_, "%s\n", s.c_str());
    std::fflush(out_);
  }

 private:
  std::FILE* out_;
  int64_t total_, log_interval_;
  bool tty_;
  bool open_ = false;
};

// Everything the run will write is checked before the model loads, so a bad
// output_dir or cache_dir never costs a whole run at the end.
void check_outputs(const TrainConfig& c) {
  const std::string where = fmt::format("{}: output_dir", c.source);
  for (const auto& [input, key] : {std::pair{c.model, "model"}, {c.train_file, "data.train"}, {c.eval_file, "data.eval"},
                             {c.cache_dir, "data.cache_dir"}, {c.metrics_file, "metrics_file"}})
    if (!input.empty() && path_within(input, c.output_dir))
      fail(ErrorKind::invalid_input, "{} '{}' holds the {} '{}'; writing the output would replace it", where,
           c.output_dir, key, input);
  check_folder_replaceable(c.output_dir, c.overwrite, where, "--overwrite (or overwrite: true)");
  check_folder_writable(c.output_dir, where);
  if (!c.cache_dir.empty()) check_dir_writable(c.cache_dir, fmt::format("{}: data.cache_dir", c.source));
}

}  // namespace

TrainResult run_training(const TrainConfig& c, std::FILE* log) {
  Progress progress(log, 1, 1);
  check_outputs(c);
  for (const std::string& w : c.warnings) progress.line("warning: {}", w);
  // metrics_file: one JSON object per optimizer step and per evaluation (loss curves, benchmarks).
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics(nullptr, &std::fclose);
  if (!c.metrics_file.empty()) {
    metrics.reset(std::fopen(c.metrics_file.c_str(), "w"));
    if (!metrics)
      fail(ErrorKind::io, "{}: metrics_file '{}' cannot be written: {}", c.source, c.metrics_file,
           std::strerror(errno));
  }
  ThreadPool pool(resolve_thread_count(c.threads, "threads"));  // 0: the default
  const bool full_ft = c.method == TrainMethod::full;
  if (full_ft && (c.lora_plus_ratio || c.mlp_lr))
    fail(ErrorKind::invalid_input, "{}: optim.lora_plus_ratio and optim.mlp_lr apply to method: lora only", c.source);
  // Full fine-tuning moves every weight into an f32 arena before packing.
  std::unique_ptr<FullParams> full;
  Model::LoadOptions lo{.tokenizer = true, .pack = true, .pool = &pool};
  if (full_ft)
    lo.before_pack = [&](ModelWeights& w, const ModelConfig& mc) { full = std::make_unique<FullParams>(w, mc, pool); };
  auto model = Model::load(c.model, lo);
  const ModelConfig& mc = model->config();
  if (c.seq_len > mc.max_context)
    fail(ErrorKind::invalid_input, "{}: data.seq_len {} exceeds the model's context length {}", c.source, c.seq_len,
         mc.max_context);
  const Tokenizer& tok = model->tokenizer();

  std::optional<ChatTemplate> tmpl;
  const std::string bos = tok.bos() >= 0 ? tok.token_text(tok.bos()) : std::string();
  const std::string eos = tok.eos() >= 0 ? tok.token_text(tok.eos()) : std::string();
  if (!c.chat_template.empty())
    tmpl = ChatTemplate::from_kind(*chat_template_kind_from_name(c.chat_template), bos, eos);
  else if (model->chat_template_text())
    tmpl = ChatTemplate::from_text(*model->chat_template_text(), bos, eos);

  DataOptions dopt;
  dopt.format = c.format;
  dopt.seq_len = c.seq_len;
  dopt.pack = c.pack;
  dopt.train_on_prompt = c.train_on_prompt;
  dopt.skip_bad_lines = c.skip_bad_lines;
  dopt.seed = c.seed;
  dopt.eval_fraction = c.eval_file.empty() ? c.eval_fraction : 0;
  dopt.eval_file = c.eval_file;
  dopt.cache_dir = c.cache_dir;
  const TrainData data = prepare_train_data(c.train_file, tok, tmpl ? &*tmpl : nullptr, dopt);
  progress.line("train data: {}: {}", c.train_file, format_data_stats(data.train.stats));
  if (data.eval)
    progress.line("eval data: {} samples, {} rows{}", data.eval->n_samples, data.eval->rows.rows(),
                  c.eval_file.empty() ? " (split from the train file)" : " from " + c.eval_file);

  std::optional<LoraModel> lora_storage;
  if (!full_ft) lora_storage.emplace(mc, c.lora);
  LoraModel* lora = lora_storage ? &*lora_storage : nullptr;
  std::optional<TrainSession> session_storage;
  if (full_ft)
    session_storage.emplace(mc, model->weights(), *full, pool, c.backward);
  else
    session_storage.emplace(mc, model->weights(), *lora, pool, c.backward);
  TrainSession& session = *session_storage;
  const int64_t n_trainable = full_ft ? full->param_count() : lora->param_count();
  float* const params = full_ft ? full->params() : lora->params();
  float* const grads = full_ft ? full->grads() : lora->grads();
  DataLoader loader(data.train, data.pad_id, c.batch_size, /*shuffle=*/true, c.seed);
  int64_t total_steps = c.steps;
  if (total_steps == 0) {
    const double micro = c.epochs * static_cast<double>(loader.batches_per_epoch());
    total_steps = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(micro / static_cast<double>(c.grad_accum))));
  }
  LrSchedule sched{.kind = c.schedule, .warmup_steps = c.warmup_steps, .total_steps = total_steps};
  AdamW opt(c.adam, full_ft ? full->param_groups(c.lr, c.weight_decay) : lora_param_groups(*lora, c),
            static_cast<size_t>(n_trainable), sched);

  TrainResult res;
  res.trainable_params = n_trainable;
  res.total_params = model->parameter_count() + (full_ft ? 0 : n_trainable);
  const std::string method = full_ft ? std::string("full fine-tuning (f32)")
                                     : fmt::format("LoRA r={} alpha={}", c.lora.r, c.lora.alpha);
  progress.line("model: {} ({} layers, hidden {}), {} parameters; {}: {} trainable ({:.3f}%); backward {}", c.model,
                mc.n_layers, mc.hidden, format_count(res.total_params), method, format_count(res.trainable_params),
                100.0 * static_cast<double>(res.trainable_params) / static_cast<double>(res.total_params),
                backward_mode_name(c.backward));
  progress.line("training: {} steps of {} x {} rows x {} tokens ({} rows per epoch)", total_steps, c.grad_accum,
                c.batch_size, c.seq_len, data.train.rows.rows());

  const auto json_number = [](double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : std::string("null"); };

  progress = Progress(log, total_steps, c.log_interval);
  const auto t0 = Clock::now();
  double train_seconds = 0;
  int64_t input_tokens = 0;
  std::vector<Batch> micro(static_cast<size_t>(c.grad_accum));
  const auto run_eval = [&](int64_t step) {
    if (!data.eval) return;
    const double loss = evaluate(session, *data.eval, data.pad_id, c.batch_size);
    res.eval_losses.push_back(loss);
    res.final_eval_loss = loss;
    progress.line("eval at step {}: loss {:.4f} (ppl {:.2f})", step, loss, std::exp(loss));
    if (metrics) {
      std::fprintf(metrics.get(), "{\"step\":%lld,\"eval_loss\":%s,\"elapsed_seconds\":%.3f}\n",
                   static_cast<long long>(step), json_number(loss).c_str(), seconds_since(t0));
      std::fflush(metrics.get());
    }
  };
  if (c.eval_at_start) run_eval(0);
  for (int64_t step = 0; step < total_steps; ++step) {
    const auto ts = Clock::now();
    // Peek the whole step first: the gradient scale needs its total target tokens.
    int64_t step_tokens = 0;
    for (Batch& b : micro) {
      b = loader.next();
      step_tokens += b.target_tokens;
    }
    if (full_ft)
      full->zero_grads();
    else
      lora->zero_grads();
    double loss_sum = 0;
    if (step_tokens > 0) {
      const float scale = 1.0f / static_cast<float>(step_tokens);
      for (const Batch& b : micro) {
        if (b.target_tokens == 0) continue;
        loss_sum += session.forward_backward(b, scale, static_cast<uint64_t>(step)).loss_sum;
        input_tokens += b.rows * b.seq_len;
      }
    }
    const double lr = opt.current_lr(0);
    const StepStats st = opt.step({params, static_cast<size_t>(n_trainable)}, {grads, static_cast<size_t>(n_trainable)});
    if (full_ft) {  // the forward multiplies packed copies: refresh them
      pack_weights(model->mutable_weights(), &pool);
      session.refresh_weights();
    }
    const double loss = step_tokens > 0 ? loss_sum / static_cast<double>(step_tokens) : std::nan("");
    if (step_tokens > 0 && !std::isfinite(loss))
      fail(ErrorKind::invalid_input, "training diverged at step {}: loss is {} (lower optim.lr?)", step + 1, loss);
    res.step_losses.push_back(loss);
    res.trained_tokens += step_tokens;
    train_seconds += seconds_since(ts);
    const double tok_s = train_seconds > 0 ? static_cast<double>(input_tokens) / train_seconds : 0;
    progress.step(step + 1, loss, lr, st.grad_norm, tok_s, seconds_since(t0));
    if (metrics) {
      std::fprintf(metrics.get(),
                   "{\"step\":%lld,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,\"target_tokens\":%lld,"
                   "\"input_tokens\":%lld,\"step_seconds\":%.4f,\"elapsed_seconds\":%.3f,\"tokens_per_s\":%.2f}\n",
                   static_cast<long long>(step + 1), json_number(loss).c_str(), json_number(lr).c_str(),
                   json_number(st.grad_norm).c_str(), static_cast<long long>(step_tokens),
                   static_cast<long long>(input_tokens), seconds_since(ts), seconds_since(t0), tok_s);
      std::fflush(metrics.get());
    }
    if (c.eval_interval > 0 && (step + 1) % c.eval_interval == 0 && step + 1 < total_steps) run_eval(step + 1);
  }
  res.steps = total_steps;
  res.tokens_per_s = train_seconds > 0 ? static_cast<double>(input_tokens) / train_seconds : 0;
  run_eval(total_steps);

  FolderWriteOptions out_opt;
  out_opt.overwrite = c.overwrite;
  out_opt.what = "output_dir";
  out_opt.force = "--overwrite (or overwrite: true)";
  if (full_ft)
    write_hf_folder(*model, c.output_dir, c.output_dtype, out_opt);
  else
    peft::write_adapter(c.output_dir, adapter_tensors(*lora, mc, c), safetensors::StDType::f32, out_opt);
  res.adapter_dir = c.output_dir;
  progress.line("trained {} steps ({} target tokens) in {}, {:.0f} tokens/s; {} written to {}", total_steps,
                res.trained_tokens, format_duration(seconds_since(t0)), res.tokens_per_s,
                full_ft ? "Hugging Face model folder" : "adapter", std::filesystem::absolute(c.output_dir).string());
  return res;
}

}  // namespace loom
