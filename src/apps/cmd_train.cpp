// `loom train CONFIG.yaml [--set key=value ...]`: fine-tuning described by a
// YAML file (keys in docs/training.md): LoRA (method: lora) writes a PEFT
// adapter folder, full fine-tuning (method: full) a Hugging Face model folder.
// `--check` loads everything and reports (docs/profiling.md) without training.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/profile_output.h"
#include "apps/train_monitor.h"
#include "apps/train_publish.h"
#include "core/failpoints.h"
#include "core/prometheus.h"
#include "dist/communicator.h"
#include "train/train_config.h"
#include "train/train_log.h"
#include "train/train_metrics.h"
#include "train/trainer.h"

namespace loom::app {

namespace {

// SIGINT / SIGTERM / SIGUSR1 (what batch schedulers send before a time limit):
// the first one asks the trainer to finish its step, write a checkpoint and
// stop (exit 75); a second one ends the process at once with 128 + N. A signal
// handler can only reach a global.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

void on_stop_signal(int sig) {
  if (g_stop_signal.exchange(sig) != 0) ::_exit(128 + sig);
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) ::sigaction(sig, &sa, nullptr);
}

constexpr int kExitStopped = 75;  // EX_TEMPFAIL: stopped by a signal after a checkpoint; resume with --resume
// EX_UNAVAILABLE: the run is done and its adapter written, but the --publish server did not load it.
constexpr int kExitPublishFailed = 69;

struct RankArgs {
  std::optional<std::string> resume;
  const Failpoints* failpoints = nullptr;
  double metrics_linger = 0;
  std::string profile;  // --profile: the trace file (rank 0's run)
  bool check = false;
  std::optional<PublishOptions> publish;  // --publish
};

// A record made before the trainer's log exists, as the log would write it to stderr with --log-format json.
void print_ecs_line(LogLevel level, std::string_view action, std::string_view message,
                    const nlohmann::json* error = nullptr) {
  std::fprintf(stderr, "%s\n",
               TrainLog::ecs_json(level, action, message, nlohmann::json::object(), "event",
                                  std::chrono::system_clock::now(), error)
                   .c_str());
}

// --publish: checked before anything loads (the URL, the key file; the server
// asked for its models, where a wrong key or URL fails at once); then each
// adapter the trainer writes is loaded into the server in place. A failed
// publish never stops training: checkpoint publishes warn, the final one sets
// `failed` (exit 69, the adapter kept).
struct Publishing {
  std::unique_ptr<AdapterPublisher> publisher;  // rank 0 only
  bool failed = false;

  Publishing(const TrainConfig& config, const RankArgs& args, bool root) {
    if (!args.publish) return;
    if (config.method != TrainMethod::lora)
      fail(ErrorKind::invalid_input, "--publish: {} trains method: full, which writes a model folder; loom serve "
           "loads LoRA adapters only (leave --publish out, or train method: lora)", config.source);
    if (!root) return;
    publisher = std::make_unique<AdapterPublisher>(*args.publish, config.output_dir);
    if (args.check) return;  // --check contacts nothing
    if (const auto warning = publisher->probe()) console_warning(config, *warning);
    if (args.publish->every_checkpoint && config.checkpoint_interval <= 0 && config.checkpoint_minutes <= 0)
      console_warning(config,
                      "--publish-every-checkpoint without checkpoint_interval or checkpoint_minutes: "
                      "checkpoints (and their publishes) come only from memory alarms");
  }

  // A warning before the trainer's log exists: a text line, or its ECS JSON line with --log-format json.
  static void console_warning(const TrainConfig& config, const std::string& message) {
    if (config.log_format == TrainConfig::LogFormat::json)
      print_ecs_line(LogLevel::warning, "publish", message);
    else
      std::fprintf(stderr, "loom train: warning: %s\n", message.c_str());
  }

  void on_adapter(Trainer& t, const AdapterWritten& a) {
    if (!publisher) return;
    const auto t0 = std::chrono::steady_clock::now();
    const PublishOutcome r = publisher->publish(a.path);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const char* what = a.final ? "the adapter" : "the checkpoint's adapter";
    const nlohmann::json fields = {{"step", a.step},
                                   {"publish", {{"url", publisher->endpoint()}, {"name", publisher->name()},
                                                {"path", a.path}, {"final", a.final}, {"status", r.status},
                                                {"seconds", seconds}}}};
    if (r.ok) {
      t.log().record(LogLevel::info, "publish",
                     fmt::format("published {} of step {} to {} as '{}': {}", what, a.step, publisher->endpoint(),
                                 publisher->name(), r.message),
                     fields);
      return;
    }
    const std::string why = fmt::format("publishing {} of step {} ({}) to {} as '{}' failed: {}{}", what, a.step,
                                        a.path, publisher->endpoint(), publisher->name(),
                                        r.status ? fmt::format("HTTP {}: ", r.status) : "", r.message);
    if (!a.final) {
      t.log().record(LogLevel::warning, "publish", why + "; training goes on, the server keeps what it had", fields);
      return;
    }
    failed = true;
    t.log().error("publish",
                  fmt::format("{}; the adapter is saved at {}; exit {}", why, a.path, kExitPublishFailed),
                  "publish_failed", fields);
  }
};

// --check: rank 0 prints to stdout (the report is the command's output); no
// signal handlers, no metrics server, nothing written.
int check_rank(const TrainConfig& config, const RankArgs& args, Communicator* comm) {
  TrainRuntime runtime;
  runtime.resume = args.resume;
  runtime.comm = comm;
  const bool root = comm == nullptr || comm->rank() == 0;
  Publishing publishing(config, args, root);  // the flags checked, nothing contacted
  run_check(config, root ? stdout : nullptr, runtime);
  return 0;
}

// The training of this process: all of it, or one data-parallel rank's part (`comm`).
int run_rank(const TrainConfig& config, const RankArgs& args, Communicator* comm) {
  if (args.check) return check_rank(config, args, comm);
  const bool root = comm == nullptr || comm->rank() == 0;
  Publishing publishing(config, args, root);
  TrainHooks hooks;
  hooks.after_adapter_written = [&](Trainer& t, const AdapterWritten& a) { publishing.on_adapter(t, a); };
  // Bound before the model loads, so a port in use costs nothing; served until the run ends.
  MetricsRegistry registry;
  TrainMetrics metrics(registry);
  std::unique_ptr<TrainMonitor> monitor;
  TrainRuntime runtime;
  runtime.resume = args.resume;
  install_stop_handlers();
  runtime.stop_signal = &g_stop_signal;
  runtime.failpoints = args.failpoints;
  runtime.comm = comm;
  runtime.checkpoint_adapters = args.publish && args.publish->every_checkpoint;
  if (config.metrics_port > 0) {
    monitor = std::make_unique<TrainMonitor>(metrics, config.metrics_host, config.metrics_port);
    metrics.set_endpoint(monitor->url());
    runtime.metrics = &metrics;
  }
  Tracer tracer;
  std::string run_metadata = "{}";
  if (!args.profile.empty() && root) {
    runtime.tracer = &tracer;
    runtime.profile_metadata = &run_metadata;
    tracer.start();
  }
  const auto write_trace = [&] {
    if (!runtime.tracer) return;
    tracer.stop();
    nlohmann::json run = nlohmann::json::parse(run_metadata);
    const int threads = run.contains("config") ? run["config"].value("threads", 0) : 0;
    write_profile(args.profile, tracer, profile_metadata("train", threads, std::move(run)));
  };
  TrainResult result;
  try {
    result = run_training(config, root ? stderr : nullptr, std::move(hooks), runtime);
  } catch (...) {
    write_trace();  // what ran until the error is worth a look
    throw;
  }
  write_trace();
  if (result.stopped_by_signal) return kExitStopped;
  // --metrics-linger: serve the final values a while longer; a stop signal ends the wait.
  const auto linger_end = std::chrono::steady_clock::now() + std::chrono::duration<double>(args.metrics_linger);
  while (monitor && g_stop_signal == 0 && std::chrono::steady_clock::now() < linger_end)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return publishing.failed ? kExitPublishFailed : 0;
}

// With --log-format json an error no record carried yet (a bad config, --check's) is one ECS JSON line on
// stderr too, so a log shipper never meets a text line.
void report_error_as_json(Error& e) {
  if (e.reported()) return;
  const nlohmann::json err = {{"type", error_kind_name(e.kind())}, {"message", e.what()}};
  print_ecs_line(LogLevel::error, "error", e.what(), &err);
  e.set_reported();
}

// This process's part: the whole run, or under mpirun / srun one rank of a data-parallel run. Rank 0
// alone logs, serves metrics and writes; a failing rank ends every rank at once.
int run_ranks(TrainConfig& config, RankArgs& args) {
  std::unique_ptr<Communicator> comm =
      launched_by_mpi() ? make_mpi_communicator(config.dist.algorithm) : make_single_process_communicator();
  comm->set_timeout_seconds(config.dist.timeout_s);
  if (comm->size() == 1) return run_rank(config, args, nullptr);
  if (comm->rank() != 0) {
    config.metrics_file.clear();
    config.log_file.clear();
    config.metrics_port = 0;
  }
  try {
    return run_rank(config, args, comm.get());
  } catch (const Error& e) {
    comm->abort(e.what());  // rank 0 logged it already; the others print it here
  } catch (const std::exception& e) {
    comm->abort(e.what());
  }
  return 3;  // not reached: abort() ends the process
}

int run_train(int argc, char** argv) {
  CLI::App app("Fine-tune a model from a YAML config (see docs/training.md): a LoRA adapter (method: lora, the "
               "default; writes a PEFT adapter folder) or every weight (method: full; writes a Hugging Face model "
               "folder).", "train");
  std::string config_path;
  RankArgs args;
  std::vector<std::string> overrides;
  int threads = 0;
  bool overwrite = false;
  app.add_option("config", config_path, "the YAML training config")->required();
  app.add_option("--set", overrides, "override a config key, e.g. --set optim.lr=1e-4 (repeatable)")
      ->allow_extra_args(false);  // one value per --set, so the config may follow
  app.add_option("-t,--threads", threads, "threads (overrides the config's threads; default: physical cores)")
      ->check(CLI::Range(1, 1024));
  std::string device;
  add_device_flag(app, device);
  app.add_flag("--overwrite", overwrite,
               "output_dir may be a non-empty folder that is not a loom/PEFT output; it is replaced as a whole "
               "(same as overwrite: true)");
  std::string log_format;
  app.add_option("--log-format", log_format,
                 "stderr gets 'text' (the default) or 'json': one ECS JSON object per line, as log_file")
      ->check(CLI::IsMember({"text", "json"}));
  int metrics_port = -1;
  app.add_option("--metrics-port", metrics_port,
                 "serve Prometheus /metrics and the live curves page / on this port while training (the "
                 "metrics_port key; 0: off)")
      ->check(CLI::Range(0, 65535));
  double metrics_linger = 0;
  app.add_option("--metrics-linger", metrics_linger,
                 "keep serving /metrics and the page this many seconds after the run ends, so a last scrape "
                 "sees the final values (default 0)")
      ->check(CLI::Range(0.0, 86400.0));
  std::string resume_path;
  app.add_option("--profile", args.profile,
                 "record a profile of the run (rank 0) into this Chrome trace file: loom profile report FILE "
                 "(docs/profiling.md)")
      ->type_name("OUT.json");
  CLI::Option* resume = app.add_option("--resume", resume_path,
                                       "continue the run from its latest good checkpoint (in checkpoint_dir), or "
                                       "from the checkpoint folder PATH; place it after CONFIG")
                            ->expected(0, 1)
                            ->type_name("[PATH]");
  PublishOptions publish;
  CLI::Option* publish_opt =
      app.add_option("--publish", publish.url,
                     "when the run ends, load the adapter into the loom serve (or vLLM) server at this base URL "
                     "(http://HOST:PORT) through POST /v1/load_lora_adapter with load_inplace, so it serves it "
                     "without a restart; the server must read the same file system (docs/training.md, Publishing)")
          ->type_name("URL");
  app.add_option("--publish-name", publish.name,
                 "the adapter's name on the server (the requests' \"model\"; default: output_dir's folder name)")
      ->needs(publish_opt);
  app.add_option("--api-key-file", publish.api_key_file,
                 "send the key in this file's first line as 'Authorization: Bearer KEY' (the server's --api-key)")
      ->needs(publish_opt);
  app.add_flag("--publish-every-checkpoint", publish.every_checkpoint,
               "also publish after each checkpoint (its adapter: checkpoint_dir/latest-adapter); a failure there "
               "only warns")
      ->needs(publish_opt);
  app.add_flag("--check", args.check,
               "load the config, model and data as a run would and print the memory estimate, tokens per step, "
               "truncated and dropped samples and warnings about the settings; trains nothing and writes nothing "
               "(exit 0: the run can start)");
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  bool json = log_format == "json";  // then the config's log_format
  try {
    // Test facility (docs/training.md, Faults): read once, passed down; a bad spec stops here.
    const Failpoints failpoints = Failpoints::from_env();
    TrainConfig config = load_train_config(config_path, overrides);
    if (threads > 0) config.threads = threads;
    if (!device.empty()) config.device = *parse_device(device);  // checked by add_device_flag
    if (overwrite) config.overwrite = true;
    if (!log_format.empty())
      config.log_format = log_format == "json" ? TrainConfig::LogFormat::json : TrainConfig::LogFormat::text;
    json = config.log_format == TrainConfig::LogFormat::json;
    if (metrics_port >= 0) config.metrics_port = metrics_port;
    if (resume->count() > 0) args.resume = resume_path;
    args.failpoints = &failpoints;
    if (publish_opt->count() > 0) args.publish = publish;
    args.metrics_linger = metrics_linger;
    return run_ranks(config, args);
  } catch (Error& e) {
    if (json) report_error_as_json(e);
    throw;
  }
}

}  // namespace

extern const Command kTrainCommand = {"train", run_train};

}  // namespace loom::app
