// `loom serve -m MODEL [--adapter NAME=DIR ...] [...]`: the OpenAI-compatible
// server (serve/http_server.h) over the continuous-batching engine
// (serve/scheduler.h). Stops cleanly on SIGINT/SIGTERM.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>
#include <string>
#include <vector>

#include "apps/cli_common.h"
#include "dist/communicator.h"
#include "apps/commands.h"
#include "apps/profile_output.h"
#include "serve/http_server.h"
#include "serve/scheduler.h"

namespace loom::app {

namespace {

// Parses "4G", "512M", "1048576" (bytes; K/M/G/T are powers of 1024) given to `flag`.
size_t parse_bytes(const std::string& s, const char* flag = "--kv-cache-memory") {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    fail(ErrorKind::invalid_input, "{} '{}': expected a size such as 2G, 512M or 1073741824", flag, s);
  }
  double mul = 1;
  const std::string unit = s.substr(pos);
  if (unit == "K" || unit == "KiB" || unit == "k") mul = 1024.0;
  else if (unit == "M" || unit == "MiB") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") mul = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TiB") mul = 1024.0 * 1024 * 1024 * 1024;
  else if (!unit.empty())
    fail(ErrorKind::invalid_input, "{} '{}': unknown unit '{}' (K, M, G or T)", flag, s, unit);
  if (!(v > 0)) fail(ErrorKind::invalid_input, "{} '{}' must be positive", flag, s);
  return static_cast<size_t>(v * mul);
}

// The signal handler only flips this; the main thread polls it (no work in the handler).
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// --itl-target-ms without --max-batch-tokens: the measured cost decides, up to this many rows a step.
constexpr int64_t kAutoMaxBatchTokens = 1024;

// The measured step cost and what it gives at the target, on stderr at start.
void print_step_cost(const CachedStepCost& sc, const ServeOptions& so, int64_t max_model_len) {
  const StepCost& c = sc.cost;
  std::string decode, prefill;
  for (size_t i = 0; i < c.decode.n.size(); ++i) decode += fmt::format(" {}:{:.1f}", c.decode.n[i], c.decode.ms[i]);
  for (size_t i = 0; i < c.prefill.n.size(); ++i) prefill += fmt::format(" {}:{:.1f}", c.prefill.n[i], c.prefill.ms[i]);
  std::fprintf(stderr, "loom serve: step cost %s%s: decode rows:ms%s; prefill tokens:ms%s; attention %.4f ms per 1k "
               "positions\n", sc.measured ? fmt::format("measured in {:.1f} s", c.seconds).c_str() : "read from cache",
               sc.path.empty() ? "" : fmt::format(" ({})", sc.path).c_str(), decode.c_str(), prefill.c_str(),
               c.attend_ms_per_kpos);
  const int64_t context = std::min<int64_t>(512, max_model_len / 2);
  int64_t shown = 0;
  for (int64_t rows : {int64_t{1}, std::min<int64_t>(16, so.max_seqs), so.max_seqs}) {
    if (rows == shown) continue;
    shown = rows;
    const StepLoad load{.decode_rows = rows, .decode_attended = static_cast<double>(context * rows)};
    const int64_t p = prefill_budget(c, load, so.itl_target_ms, so.max_batch_tokens - rows, so.block_size);
    std::fprintf(stderr, "loom serve: --itl-target-ms %g: %lld decode rows at %lld positions take %.1f ms; %lld "
                 "prefill tokens fit beside them\n", so.itl_target_ms, static_cast<long long>(rows),
                 static_cast<long long>(context), c.predict_ms(rows, 0, load.decode_attended), static_cast<long long>(p));
  }
}

int run_serve(int argc, char** argv) {
  CLI::App app("Serve a model over an OpenAI-compatible HTTP API with continuous batching and multi-LoRA.", "serve");
  ServeOptions so;
  HttpServerOptions ho;
  std::vector<std::string> adapter_specs;
  std::string api_key_file, kv_memory, log_path;
  int grace_s = 30;
  app.add_option("-m,--model", so.model_path, "GGUF file or Hugging Face model folder")->required();
  app.add_option("--served-model-name", so.model_name, "the model id clients use (default: the file name)");
  app.add_option("--adapter", adapter_specs,
                 "NAME=PATH: a PEFT LoRA adapter folder or a llama.cpp GGUF LoRA file served as model NAME "
                 "(repeatable)");
  app.add_option("--adapter-dir", so.adapter_dirs,
                 "folder that POST /v1/load_lora_adapter may load from (repeatable; none: run-time loading off)");
  app.add_option("--chat-template", so.chat_template,
                 "chatml, llama3, llama2 or mistral for /v1/chat/completions (default: from the model's metadata)")
      ->check(CLI::IsMember({"chatml", "llama3", "llama2", "mistral"}));
  app.add_option("--host", ho.host, "address to bind")->capture_default_str();
  app.add_option("--port", ho.port, "port to bind (0: any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  auto* api_key_opt =
      app.add_option("--api-key", ho.api_key, "require Authorization: Bearer KEY on every endpoint but /health");
  auto* api_key_file_opt =
      app.add_option("--api-key-file", api_key_file, "read the API key from this file (first line)");
  app.add_option("--max-seqs", so.max_seqs, "sequences decoding at once")->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--max-model-len", so.max_model_len, "context length per request (0: min(model, 4096))")
      ->capture_default_str();
  app.add_option("--kv-cache-memory", kv_memory, "bytes for the paged KV cache, e.g. 2G (default: max-seqs full "
                 "contexts, at most 2G)");
  add_kv_cache_dtype_flag(app, so.kv_dtype);
  app.add_option(
         "--lora-bits", so.lora_bits,
         "adapter storage: 16 (bf16, the default, as vLLM serves LoRA in the model's 16-bit dtype: half "
         "the memory and the bytes each decode row reads of f32), 32 (f32 as the file holds them, "
         "memory-mapped), 8 (int8, a scale per row of A and per 64 values of a column of B: half "
         "bf16's bytes, for many adapters at once) or 4 (4-bit, groups of 128; ~8x less memory per adapter)")
      ->check(CLI::IsMember({4, 8, 16, 32}))
      ->capture_default_str();
  auto* max_loras_opt =
      app.add_option("--max-loras", so.max_loras,
                     "adapters resident in memory at once (LRU; with --max-lora-memory and without this flag: "
                     "no count limit)")
          ->capture_default_str()
          ->check(CLI::Range(1, 1 << 20));
  std::string lora_memory;
  app.add_option("--max-lora-memory", lora_memory,
                 "bytes of resident adapters, e.g. 1G (LRU eviction past it; any number may be registered)");
  auto* max_batch_opt =
      app.add_option("--max-batch-tokens", so.max_batch_tokens,
                     "token rows per step (decodes + prefill chunks); with --itl-target-ms the upper limit "
                     "(default there: 1024)")
          ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--itl-target-ms", so.itl_target_ms,
                 "inter-token latency target: measure this machine's step cost at start (cached) and give each "
                 "step the prefill tokens that keep a step within it (0: the fixed --max-batch-tokens)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--step-cost-cache", so.step_cost_dir,
                 "folder of the measured step costs (default: $XDG_CACHE_HOME/loom or ~/.cache/loom; '-': none)");
  app.add_flag("--remeasure-step-cost", so.remeasure_step_cost, "measure the step cost even when it is cached");
  add_spec_flags(app, so.spec,
                 "prompt-lookup speculation: up to K drafted tokens a step (0: off)");
  app.add_option("--spec-max-batch", so.spec_max_batch,
                 "draft only in steps with at most N decoding sequences (0: always)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  int64_t header_timeout_s = 10, body_timeout_s = 60;
  app.add_option("--http-threads", ho.connections.keep_threads,
                 "idle HTTP connection threads kept for reuse (more start on demand, up to --max-connections)")
      ->capture_default_str()->check(CLI::Range(1, 65536));
  app.add_option("--max-connections", ho.connections.max_connections,
                 "open HTTP connections at most (each has a thread); more get 503")
      ->capture_default_str()->check(CLI::Range(1, 65536));
  app.add_option("--http-header-timeout", header_timeout_s,
                 "seconds a client has to send a request's line and headers (else 408, connection closed)")
      ->capture_default_str()->check(CLI::Range(1, 3600));
  app.add_option("--http-body-timeout", body_timeout_s,
                 "seconds a client has to send a request's body after its headers (else 408, connection closed)")
      ->capture_default_str()->check(CLI::Range(1, 3600));
  app.add_option("--log-file", log_path, "request log, one JSON line per request (default: stderr)");
  app.add_option("--shutdown-grace", grace_s, "seconds in-flight requests get to finish on SIGTERM/SIGINT")
      ->capture_default_str()->check(CLI::Range(0, 3600));
  add_threads_flag(app, so.threads);
  int tp = 1;
  app.add_option("--tp", tp, "tensor parallel over N ranks: start with `mpirun -np N loom serve ... --tp N`; "
                 "rank 0 serves HTTP and loads adapters, every rank holds 1/N of the heads and MLP channels and "
                 "its part of each adapter (sent by rank 0)")
      ->check(CLI::Range(1, 1024));
  std::string device = "cpu";
  add_device_flag(app, device);
  std::string profile;
  add_profile_flag(app, profile);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;

  validate_ngram_spec(so.spec);
  if (!lora_memory.empty()) {
    so.max_lora_memory = parse_bytes(lora_memory, "--max-lora-memory");
    if (max_loras_opt->count() == 0) so.max_loras = int64_t{1} << 20;
  }
  for (const std::string& spec : adapter_specs) {
    const auto eq = spec.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size())
      fail(ErrorKind::invalid_input, "--adapter '{}': expected NAME=DIR", spec);
    so.adapters.emplace_back(spec.substr(0, eq), spec.substr(eq + 1));
  }
  if (so.itl_target_ms > 0 && max_batch_opt->count() == 0) so.max_batch_tokens = kAutoMaxBatchTokens;
  ho.connections.header_timeout = std::chrono::seconds(header_timeout_s);
  ho.connections.body_timeout = std::chrono::seconds(body_timeout_s);
  // An empty key (say --api-key "$UNSET_VARIABLE") would silently mean no authentication at all.
  if (api_key_opt->count() > 0 && ho.api_key.find_first_not_of(" \t\r\n") == std::string::npos)
    fail(ErrorKind::invalid_input,
         "--api-key is empty: give a non-empty key, or leave the flag out to serve without authentication");
  if (api_key_file_opt->count() > 0) {
    if (api_key_opt->count() > 0) fail(ErrorKind::invalid_input, "give --api-key or --api-key-file, not both");
    ho.api_key = read_api_key_file(api_key_file, "--api-key-file");
  }
  if (!kv_memory.empty()) so.kv_cache_memory = parse_bytes(kv_memory);
  so.device = *parse_device(device);  // checked by add_device_flag
  std::FILE* log = stderr;
  if (!log_path.empty()) {
    log = std::fopen(log_path.c_str(), "a");
    if (!log) fail(ErrorKind::io, "--log-file {}: cannot open for appending", log_path);
  }

  // --tp: one rank of a tensor-parallel server; the ranks but 0 only follow its forward steps.
  std::unique_ptr<Communicator> comm;
  if (tp > 1) {
    if (!launched_by_mpi())
      fail(ErrorKind::invalid_input, "--tp {}: start the server with `mpirun -np {} loom serve ... --tp {}`", tp, tp, tp);
    comm = make_mpi_communicator(CollectiveAlgorithm::automatic);
    if (comm->size() != tp)
      fail(ErrorKind::invalid_input, "--tp {}: mpirun started {} ranks", tp, comm->size());
    so.tp = comm.get();
    so.report_startup_error = [](const Error& e) {
      // As main() would write it, but before the followers end.
      std::fprintf(stderr, "loom serve: error: %s\n", e.what());
      std::fflush(stderr);
    };
    if (comm->rank() != 0) {
      ServingEngine follower(so);
      follower.follow_until_stopped();
      return 0;
    }
  }
  // Always there (an op costs one atomic load more while it does not record),
  // so that POST /profile/start works on any server; --profile records from the start.
  Tracer tracer;
  so.tracer = &tracer;
  ServingEngine engine(so);
  const int threads = so.threads > 0 ? so.threads : default_thread_count();
  const nlohmann::json serve_metadata = {
      {"model", {{"path", so.model_path}, {"name", engine.model_name()}, {"layers", engine.model().config().n_layers},
                 {"type", model_weight_type(engine.model())}}},
      {"serve", {{"max_batch_tokens", so.max_batch_tokens}, {"max_seqs", so.max_seqs}, {"max_loras", so.max_loras},
                 {"max_lora_memory", so.max_lora_memory}, {"lora_bits", so.lora_bits},
                 {"kv_blocks", engine.kv_blocks()}, {"block_size", so.block_size}}}};
  ho.tracer = &tracer;
  ho.profile_metadata = [&] { return profile_metadata("serve", threads, serve_metadata).dump(); };
  if (!profile.empty()) tracer.start();
  MetricsRegistry registry;
  ServeMetrics metrics(registry);
  ho.log = log;
  ho.limits.max_model_len = engine.max_model_len();
  HttpServer server(engine, metrics, ho);
  server.start();
  std::fprintf(stderr,
               "loom serve: %s as '%s' (%lld KV blocks of %lld tokens, max %lld sequences, context %lld) on "
               "http://%s:%d%s\n",
               so.model_path.c_str(), engine.model_name().c_str(), static_cast<long long>(engine.kv_blocks()),
               static_cast<long long>(so.block_size), static_cast<long long>(so.max_seqs),
               static_cast<long long>(engine.max_model_len()), ho.host.c_str(), server.port(),
               ho.api_key.empty() ? "" : " (API key required)");
  if (const CachedStepCost* sc = engine.step_cost()) print_step_cost(*sc, so, engine.max_model_len());
  for (const AdapterInfo& a : engine.adapter_infos())
    if (a.resident)
      std::fprintf(stderr, "loom serve: adapter '%s': %.2f MiB (%s; %.2f MiB in f32)\n", a.name.c_str(),
                   static_cast<double>(a.bytes) / (1 << 20),
                   so.lora_bits == 4    ? "4-bit"
                   : so.lora_bits == 8  ? "int8"
                   : so.lora_bits == 16 ? "bf16"
                                        : "f32",
                   static_cast<double>(a.f32_bytes) / (1 << 20));
  std::fflush(stderr);

  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  while (g_stop_signal == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::fprintf(stderr, "loom serve: signal %d: stopping (in-flight requests get %d s)\n",
               static_cast<int>(g_stop_signal), grace_s);
  std::fflush(stderr);
  engine.shutdown();
  server.stop(std::chrono::seconds(grace_s));
  if (!profile.empty()) {
    tracer.stop();
    write_profile(profile, tracer, profile_metadata("serve", threads, serve_metadata));
  }
  if (log != stderr) std::fclose(log);
  std::fprintf(stderr, "loom serve: stopped\n");
  return 0;
}

}  // namespace

extern const Command kServeCommand = {"serve", run_serve};

}  // namespace loom::app
