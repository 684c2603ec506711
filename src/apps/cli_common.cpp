#include "apps/cli_common.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <random>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/profiling_backend.h"
#include "model/adapter_merge.h"

namespace loom::app {

bool parse_cli(CLI::App& app, int argc, char** argv, int& exit_code) {
  try {
    app.parse(argc, argv);
    return true;
  } catch (const CLI::CallForHelp& e) {
    exit_code = app.exit(e);
    return false;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "loom %s: error: %s\n", app.get_name().c_str(), e.what());
    std::fprintf(stderr, "Run 'loom %s --help' for the options.\n", app.get_name().c_str());
    exit_code = 2;
    return false;
  }
}

void add_model_flags(CLI::App& app, ModelFlags& flags) {
  app.add_option("-m,--model", flags.model_path, "a .gguf file or a Hugging Face model folder")->required();
  app.add_option("--adapter", flags.adapter_dir,
                 "a PEFT LoRA adapter folder or a llama.cpp GGUF LoRA file, merged into the weights at load");
}

void add_run_flags(CLI::App& app, ModelFlags& flags) {
  add_threads_flag(app, flags.threads);
  add_device_flag(app, flags.device);
  add_profile_flag(app, flags.profile);
}

void add_profile_flag(CLI::App& app, std::string& path) {
  app.add_option("--profile", path,
                 "record a profile (Chrome trace) into this file: loom profile report FILE (docs/profiling.md)")
      ->type_name("OUT.json");
}

LoadedModel load_model(const ModelFlags& flags) {
  LoadedModel m;
  m.pool = std::make_unique<ThreadPool>(flags.threads);
  m.backend = open_backend(flags.device, *m.pool);
  if (!flags.profile.empty()) {
    m.tracer = std::make_unique<Tracer>();
    m.backend = make_profiling_backend(std::move(m.backend), *m.tracer, *m.pool);
  }
  Model::LoadOptions load{.tokenizer = true, .pack = true, .backend = m.backend.get()};
  if (!flags.adapter_dir.empty()) load.before_pack = adapter_merge_hook(flags.adapter_dir);
  m.model = Model::load(flags.model_path, load);
  if (m.tracer) m.tracer->start();
  return m;
}

CLI::Validator all_or_some_chunks() {
  return CLI::Validator(
      [](std::string& in) -> std::string {
        int64_t n = 0;
        if (!CLI::detail::lexical_cast(in, n)) return "expected an integer (got " + in + ")";
        if (n == -1 || (n >= 1 && n <= (int64_t{1} << 30))) return {};
        return "expected -1 (all) or a count from 1 (got " + in + ")";
      },
      "-1 or INT >= 1");
}

void add_calibration_flags(CLI::App& app, int64_t& ctx, int64_t& chunks) {
  app.add_option("--calib-ctx", ctx, "calibration tokens per chunk")
      ->check(CLI::Range(int64_t{16}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--calib-chunks", chunks, "calibration chunks at most")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
}

void add_threads_flag(CLI::App& app, int& threads) {
  threads = default_thread_count();
  // More threads than this process may use are capped (with a warning) by
  // resolve_thread_count, the one rule for every command.
  app.add_option_function<int>(
         "-t,--threads", [&threads](int n) { threads = resolve_thread_count(n, "-t"); },
         "threads to use (default: physical cores; at most the CPUs this process may use)")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            int n = 0;
            if (CLI::detail::lexical_cast(in, n) && n < 1) return "thread count must be >= 1 (got " + in + ")";
            return {};
          },
          "INT >= 1"))
      ->default_str(std::to_string(threads));
}

// The value, read as a number, lies in [lo, hi] (lo excluded when lo_open);
// else "RULE (got VALUE)". Text that is no number is left to CLI11's conversion error.
static CLI::Validator number_in(double lo, bool lo_open, double hi, const std::string& rule) {
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v)) return {};
        if (std::isfinite(v) && (lo_open ? v > lo && v <= hi : v >= lo && v <= hi)) return {};
        return rule + (std::isfinite(v) || std::isnan(v) ? "" : " and finite") + " (got " + in + ")";
      },
      rule.starts_with("must be ") ? rule.substr(8) : rule);
}

void add_spec_flags(CLI::App& app, NgramSpecParams& p, const char* k_help) {
  app.add_option("--spec-ngram", p.num_draft, k_help)
      ->check(number_in(0, false, 64, "must be in [0, 64]"))->capture_default_str();
  app.add_option("--spec-ngram-max", p.max_ngram, "longest n-gram looked up for drafts")
      ->check(number_in(1, false, 64, "must be in [1, 64]"))->capture_default_str();
  app.add_option("--spec-ngram-min", p.min_ngram, "shortest n-gram looked up for drafts")
      ->check(number_in(1, false, 64, "must be in [1, 64]"))->capture_default_str();
}

void add_sampling_flags(CLI::App& app, SamplingParams& s, int64_t& seed) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  constexpr double kInt = std::numeric_limits<int32_t>::max();
  app.add_option("--temp", s.temperature, "temperature; 0 = greedy")
      ->check(number_in(0, false, kInf, "must be >= 0"))->capture_default_str();
  app.add_option("--top-k", s.top_k, "keep the k most likely tokens; 0 = all")
      ->check(number_in(0, false, kInt, "must be >= 0"))->capture_default_str();
  app.add_option("--top-p", s.top_p, "nucleus sampling threshold in (0, 1]")
      ->check(number_in(0, true, 1, "must be in (0, 1]"))->capture_default_str();
  app.add_option("--min-p", s.min_p, "drop tokens below min-p times the top probability")
      ->check(number_in(0, false, 1, "must be in [0, 1]"))->capture_default_str();
  app.add_option("--repeat-penalty", s.repeat_penalty, "penalty for repeated tokens; 1 = off")
      ->check(number_in(0, true, kInf, "must be > 0"))->capture_default_str();
  app.add_option("--repeat-last-n", s.repeat_last_n, "history the penalty looks at; -1 = all")
      ->check(number_in(-1, false, kInt, "must be >= -1"))->capture_default_str();
  app.add_option("--presence-penalty", s.presence_penalty, "OpenAI presence penalty")
      ->check(number_in(-2, false, 2, "must be in [-2, 2]"))->capture_default_str();
  app.add_option("--frequency-penalty", s.frequency_penalty, "OpenAI frequency penalty")
      ->check(number_in(-2, false, 2, "must be in [-2, 2]"))->capture_default_str();
  app.add_option("-s,--seed", seed, "random seed; -1 = random")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {  // by hand: a double would take 2^64 and the option clamp it
            int64_t v = 0;
            const auto [end, ec] = std::from_chars(in.data(), in.data() + in.size(), v);
            if (ec == std::errc::result_out_of_range)
              return "must be at most " + std::to_string(std::numeric_limits<int64_t>::max()) + " (got " +
                     in + ")";
            if (ec == std::errc() && end == in.data() + in.size() && v < -1)
              return "must be >= -1 (got " + in + ")";
            return {};  // not an integer: the option's conversion says so
          },
          ">= -1"))
      ->capture_default_str();
}

void add_length_flags(CLI::App& app, int64_t& n_predict, int64_t& ctx, const char* n_help) {
  app.add_option("-n,--n-predict", n_predict, n_help)
      ->check(number_in(-1, false, std::numeric_limits<double>::infinity(), "must be >= -1"))
      ->capture_default_str();
  add_ctx_flag(app, ctx, "context size in tokens (0 = min(model, 4096))");
}

void add_ctx_flag(CLI::App& app, int64_t& ctx, const char* help) {
  app.add_option("-c,--ctx-size", ctx, help)
      ->check(number_in(0, false, std::numeric_limits<double>::infinity(), "must be >= 0"))
      ->capture_default_str();
}

void add_kv_cache_dtype_flag(CLI::App& app, DType& dtype) {
  app.add_option_function<std::string>(
         "--kv-cache-dtype",
         [&dtype](const std::string& name) { dtype = name == "f32" ? DType::f32 : DType::f16; },
         "KV cache elements: f16 or f32")
      ->check(CLI::IsMember({"f16", "f32"}))
      ->default_str("f16");
}

uint64_t resolve_seed(int64_t seed) {
  if (seed >= 0) return static_cast<uint64_t>(seed);
  return (static_cast<uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
}

void finish_generate_options(GenerateOptions& opts, int64_t n_predict, int64_t seed) {
  opts.max_tokens = n_predict;
  opts.sampling.seed = resolve_seed(seed);
  validate_sampling(opts.sampling);
}

int64_t resolve_context(const ModelConfig& c, int64_t requested) {
  if (requested < 0) fail(ErrorKind::invalid_input, "--ctx-size must be >= 0 (got {})", requested);
  const int64_t model_max = c.max_context > 0 ? c.max_context : 4096;
  if (requested == 0) return std::min<int64_t>(model_max, 4096);
  if (requested > model_max)
    fail(ErrorKind::invalid_input, "--ctx-size {} exceeds the model's context length {}", requested, model_max);
  return requested;
}

void print_speed(const GenerateResult& r) {
  const auto n = static_cast<double>(r.tokens.size());
  std::fprintf(stderr, "\nprompt: %lld tokens in %.1f ms, %.2f tokens/s\n", static_cast<long long>(r.prompt_tokens),
               r.prompt_seconds * 1e3, r.prompt_seconds > 0 ? static_cast<double>(r.prompt_tokens) / r.prompt_seconds : 0.0);
  std::fprintf(stderr, "generation: %zu tokens in %.1f ms, %.2f tokens/s (%s)\n", r.tokens.size(),
               r.generate_seconds * 1e3, r.generate_seconds > 0 ? n / r.generate_seconds : 0.0,
               finish_reason_name(r.finish));
  if (r.draft_tokens > 0)
    std::fprintf(stderr, "speculation: %lld of %lld drafted tokens accepted (%.1f%%), %lld evaluations\n",
                 static_cast<long long>(r.accepted_tokens), static_cast<long long>(r.draft_tokens),
                 100.0 * static_cast<double>(r.accepted_tokens) / static_cast<double>(r.draft_tokens),
                 static_cast<long long>(r.forward_steps));
}

void add_device_flag(CLI::App& app, std::string& device) {
  app.add_option("--device", device, "where to compute: cpu (default), cuda[:N], npu[:N]")
      ->check([](const std::string& v) -> std::string {
        return parse_device(v) ? std::string() : "must be cpu, cuda, cuda:N, npu or npu:N, not '" + v + "'";
      });
}

std::unique_ptr<Backend> open_backend(const std::string& device, ThreadPool& pool) {
  const std::optional<Device> d = parse_device(device);
  if (!d) fail(ErrorKind::invalid_input, "--device: '{}' is not a device (cpu, cuda, cuda:N, npu, npu:N)", device);
  return make_backend(*d, pool);
}

std::string read_api_key_file(const std::string& path, const char* flag) {
  if (path.empty()) fail(ErrorKind::invalid_input, "{} is empty: give the key file's path", flag);
  std::ifstream f(path);
  if (!f) fail(ErrorKind::not_found, "{} {}: cannot read", flag, path);
  std::string key;
  std::getline(f, key);
  while (!key.empty() && (key.back() == '\r' || key.back() == ' ')) key.pop_back();
  if (key.empty()) fail(ErrorKind::invalid_input, "{} {}: the first line is empty", flag, path);
  return key;
}

}  // namespace loom::app
