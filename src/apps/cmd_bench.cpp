// `loom bench`: prompt-processing and generation speed measured the way
// llama-bench does (pp: one batch of N random tokens; tg: N single-token steps;
// both from an empty context, or after -d tokens already in it), averaged over
// repetitions.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/profile_output.h"
#include "kernels/profiling_backend.h"
#include "core/rng.h"
#include "model/forward.h"
#include "model/model.h"
#include "profile/peak.h"

namespace loom::app {
namespace {

struct Stat {
  double mean = 0, stddev = 0;
};

Stat stats(const std::vector<double>& v) {
  Stat s;
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  for (double x : v) s.stddev += (x - s.mean) * (x - s.mean);
  s.stddev = v.size() > 1 ? std::sqrt(s.stddev / static_cast<double>(v.size() - 1)) : 0;
  return s;
}

std::string json_list(const std::vector<double>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

int run_bench(int argc, char** argv) {
  CLI::App app("Measure prompt processing (pp) and generation (tg) speed in tokens/s.", "bench");
  std::string model_path;
  int64_t n_prompt = 512, n_gen = 128, reps = 5, micro_batch = 512, depth = 0;
  int threads = 1;
  bool json = false, bandwidth = true;
  DType kv_dtype = DType::f16;
  app.add_option("-m,--model", model_path, "a .gguf file or a Hugging Face model folder")->required();
  app.add_option("-p,--n-prompt", n_prompt, "prompt tokens (0 = skip pp)")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  app.add_option("-n,--n-gen", n_gen, "generated tokens (0 = skip tg)")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  app.add_option("-r,--repetitions", reps, "repetitions of each test")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("-d,--n-depth", depth,
                 "tokens already in the context before each test (llama-bench's -d): decode then "
                 "attends over them")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("-b,--batch", micro_batch, "prompt micro-batch size")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_flag("--json", json, "print one JSON object instead of a table");
  app.add_flag("!--no-bandwidth", bandwidth,
               "skip measuring the memory read bandwidth (the decode floor reported with tg)");
  add_kv_cache_dtype_flag(app, kv_dtype);
  add_threads_flag(app, threads);
  std::string device = "cpu";
  add_device_flag(app, device);
  std::string profile;
  add_profile_flag(app, profile);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  if (n_prompt == 0 && n_gen == 0) fail(ErrorKind::invalid_input, "-p 0 and -n 0: nothing to measure");

  ThreadPool pool(threads);
  Tracer tracer;  // --profile: the measured repetitions (not the warm-up)
  std::unique_ptr<Backend> backend = open_backend(device, pool);
  if (!profile.empty()) backend = make_profiling_backend(std::move(backend), tracer, pool);
  auto model = Model::load(model_path, {.tokenizer = false, .pack = true, .backend = backend.get()});
  const ModelConfig& c = model->config();
  const int64_t n_ctx = depth + std::max<int64_t>(n_prompt, n_gen) + 1;
  // Positions past the trained context would time a model nobody runs (and -d
  // of a million would ask for gigabytes of cache): refused, as --ctx-size is.
  if (c.max_context > 0 && n_ctx - 1 > c.max_context)
    fail(ErrorKind::invalid_input,
         "-d {} plus max(-p {}, -n {}) is {} positions, past the model's context length {}", depth, n_prompt,
         n_gen, n_ctx - 1, c.max_context);
  CounterRng rng(42);
  auto random_tokens = [&](int64_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(c.vocab_size));
    return t;
  };
  using clock = std::chrono::steady_clock;
  std::vector<double> pp, tg;
  // The read bandwidth, measured before and after the runs (the higher counts): on a
  // shared machine it moves with the neighbours' load.
  const bool measure_bw = bandwidth && n_gen > 0;
  ReadBandwidth bw = measure_bw ? measure_read_bandwidth(pool) : ReadBandwidth{};
  InferenceSession session(c, model->weights(), *backend, n_ctx, kv_dtype, micro_batch);
  // The context every test starts from: prefilled once (not timed), kept by truncate.
  if (depth > 0) session.eval(random_tokens(depth));
  // One warm-up of each test (page in the weights, size the scratch buffers).
  for (int64_t r = -1; r < reps; ++r) {
    if (r == 0 && !profile.empty()) tracer.start();
    if (n_prompt > 0) {
      const auto toks = random_tokens(n_prompt);
      session.truncate(depth);
      const auto t0 = clock::now();
      session.eval(toks);
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      if (r >= 0) pp.push_back(static_cast<double>(n_prompt) / s);
    }
    if (n_gen > 0) {
      const auto toks = random_tokens(n_gen);
      session.truncate(depth);
      const auto t0 = clock::now();
      for (int64_t i = 0; i < n_gen; ++i) session.eval(std::span<const int32_t>(&toks[static_cast<size_t>(i)], 1));
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      if (r >= 0) tg.push_back(static_cast<double>(n_gen) / s);
    }
  }
  if (!profile.empty()) {
    tracer.stop();
    write_profile(profile, tracer,
                  profile_metadata("bench", threads,
                                   {{"model",
                                     {{"path", model_path},
                                      {"name", c.name},
                                      {"layers", c.n_layers},
                                      {"type", model_weight_type(*model)}}},
                                    {"bench",
                                     {{"n_prompt", n_prompt},
                                      {"n_gen", n_gen},
                                      {"n_depth", depth},
                                      {"kv_cache_dtype", dtype_name(kv_dtype)},
                                      {"repetitions", reps}}}}));
  }
  const Stat spp = pp.empty() ? Stat{} : stats(pp), stg = tg.empty() ? Stat{} : stats(tg);
  // The decode floor: every weight matrix is read once per generated token (an
  // untied input embedding only one row), at most at the machine's read bandwidth.
  const ModelWeights& w = model->weights();
  const double token_bytes = static_cast<double>(model->weight_bytes() -
                                                 (w.output.data != w.token_embd.data ? w.token_embd.nbytes() : 0));
  if (measure_bw) {
    const ReadBandwidth after = measure_read_bandwidth(pool);
    bw = {std::max(bw.best_gbps, after.best_gbps), std::max(bw.median_gbps, after.median_gbps)};
  }
  const double read_gbps = bw.best_gbps, tg_gbps = stg.mean * token_bytes / 1e9;
  const double floor_fraction = read_gbps > 0 ? tg_gbps / read_gbps : 0;
  const double median_fraction = bw.median_gbps > 0 ? tg_gbps / bw.median_gbps : 0;
  if (json) {
    std::printf(
        "{\"model\": \"%s\", \"threads\": %d, \"n_prompt\": %lld, \"n_gen\": %lld, \"n_depth\": %lld, "
        "\"kv_cache_dtype\": \"%s\", \"repetitions\": %lld, "
        "\"pp_tokens_per_s\": %.3f, \"pp_stddev\": %.3f, \"tg_tokens_per_s\": %.3f, \"tg_stddev\": %.3f, "
        "\"weight_bytes_per_token\": %.0f, \"read_gbps\": %.3f, \"tg_floor_fraction\": %.4f, "
        "\"read_gbps_median\": %.3f, \"tg_floor_fraction_median\": %.4f, "
        "\"pp_samples_tokens_per_s\": %s, \"tg_samples_tokens_per_s\": %s}\n",
        model_path.c_str(), threads, static_cast<long long>(n_prompt), static_cast<long long>(n_gen),
        static_cast<long long>(depth), dtype_name(kv_dtype), static_cast<long long>(reps), spp.mean,
        spp.stddev, stg.mean, stg.stddev, token_bytes, read_gbps, floor_fraction, bw.median_gbps,
        median_fraction, json_list(pp).c_str(), json_list(tg).c_str());
  } else {
    const std::string at_depth = depth > 0 ? " @ d" + std::to_string(depth) : "";  // llama-bench's label
    std::printf("| model | threads | test | t/s |\n|---|---|---|---|\n");
    if (n_prompt > 0)
      std::printf("| %s | %d | pp%lld%s | %.2f ± %.2f |\n", model_path.c_str(), threads,
                  static_cast<long long>(n_prompt), at_depth.c_str(), spp.mean, spp.stddev);
    if (n_gen > 0)
      std::printf("| %s | %d | tg%lld%s | %.2f ± %.2f |\n", model_path.c_str(), threads,
                  static_cast<long long>(n_gen), at_depth.c_str(), stg.mean, stg.stddev);
    if (read_gbps > 0)
      std::printf(
          "tg reads %.1f MiB of weights per token: %.1f GB/s, %.0f%% of the %.1f GB/s this machine reads "
          "at best (%.0f%% of its median pass, %.1f GB/s)\n",
          token_bytes / (1 << 20), tg_gbps, 100 * floor_fraction, read_gbps, 100 * median_fraction,
          bw.median_gbps);
  }
  return 0;
}

}  // namespace

extern const Command kBenchCommand = {"bench", run_bench};

}  // namespace loom::app
