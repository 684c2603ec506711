// Pieces shared by the loom subcommands: CLI11 parsing with loom's exit codes,
// thread-count flag.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>

#include <memory>
#include <string>

#include "core/thread_pool.h"
#include "core/trace.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/generate.h"
#include "model/model.h"
#include "model/sampler.h"

namespace loom::app {

// Parses argv; on --help prints and returns 0 through `exit_code`, on a bad
// flag prints the reason and returns 2. Returns true when the command should run.
bool parse_cli(CLI::App& app, int argc, char** argv, int& exit_code);

// Adds "-t,--threads" (default: physical cores; >= 1, capped at the usable CPUs
// by resolve_thread_count with a warning).
void add_threads_flag(CLI::App& app, int& threads);

// A --chunks count: -1 (all) or at least 1. Zero chunks would collect or score
// nothing and write an empty result (an all-zero imatrix, a perplexity of 0).
CLI::Validator all_or_some_chunks();

// "--calib-ctx" (tokens per calibration chunk, 16 or more, as imatrix's -c) and
// "--calib-chunks" (at most this many, 1 or more) of quantize and prune.
void add_calibration_flags(CLI::App& app, int64_t& ctx, int64_t& chunks);

// Adds "--device" (cpu, cuda, cuda:N, npu, npu:N; default cpu).
void add_device_flag(CLI::App& app, std::string& device);
// The backend for a --device value, computing with `pool`. Throws invalid_input
// for a name that is no device, unsupported for a device this build lacks.
std::unique_ptr<Backend> open_backend(const std::string& device, ThreadPool& pool);

// The model flags generate and chat share: "-m,--model" (required) and
// "--adapter" (a PEFT LoRA folder merged at load) from add_model_flags, and
// "-t,--threads" and "--device" (their last options) from add_run_flags.
struct ModelFlags {
  std::string model_path, adapter_dir;
  int threads = 1;
  std::string device = "cpu";
  std::string profile;  // --profile OUT.json (apps/profile_output.h)
};
void add_model_flags(CLI::App& app, ModelFlags& flags);
void add_run_flags(CLI::App& app, ModelFlags& flags);
// What generate and chat run on. Members are destroyed model first, then the
// backend its weights live in, then the pool the backend computes with.
struct LoadedModel {
  std::unique_ptr<Tracer> tracer;  // --profile: recording from the end of the load
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<Backend> backend;  // the --device backend (open_backend)
  std::unique_ptr<Model> model;      // packed for `backend`, with its tokenizer
};
// "--profile OUT.json" for commands that run a model.
void add_profile_flag(CLI::App& app, std::string& path);
// Loads flags.model_path on flags.device with flags.threads threads, merging
// flags.adapter_dir into the weights before packing when one was given (errors
// name the adapter folder).
LoadedModel load_model(const ModelFlags& flags);

// Sampling flags shared by generate and chat (--temp, --top-k, ..., --seed), each
// range-checked like validate_sampling (a bad value: exit 2 naming the flag).
void add_sampling_flags(CLI::App& app, SamplingParams& s, int64_t& seed);
// Prompt-lookup speculation flags of generate and serve (--spec-ngram K, --spec-ngram-max,
// --spec-ngram-min), range-checked (exit 2); min <= max is validate_ngram_spec's (exit 1).
void add_spec_flags(CLI::App& app, NgramSpecParams& p, const char* k_help);
// "-n,--n-predict" (>= -1) and "-c,--ctx-size" (>= 0), range-checked.
void add_length_flags(CLI::App& app, int64_t& n_predict, int64_t& ctx, const char* n_help);
// "-c,--ctx-size" (>= 0) with `help`.
void add_ctx_flag(CLI::App& app, int64_t& ctx, const char* help);
// "--kv-cache-dtype f16|f32": the element type of the KV cache (default f16,
// as llama.cpp's --cache-type-k/-v; f32 keeps keys and values unrounded).
void add_kv_cache_dtype_flag(CLI::App& app, DType& dtype);
// -1 draws a random seed.
uint64_t resolve_seed(int64_t seed);
// Finishes generate's and chat's options from their flags: max_tokens, the seed
// (-1 draws one), and validate_sampling's range checks.
void finish_generate_options(GenerateOptions& opts, int64_t n_predict, int64_t seed);
// --ctx-size: 0 means min(model context, 4096); larger than the model is an error.
int64_t resolve_context(const ModelConfig& c, int64_t requested);
// Prompt and generation speed, to stderr.
void print_speed(const GenerateResult& r);

// The API key in the first line of `path` (trailing spaces and CR dropped), as
// `serve --api-key-file` and `train --api-key-file` read it. Throws loom::Error
// naming `flag` for an empty path, an unreadable file or an empty first line.
std::string read_api_key_file(const std::string& path, const char* flag);

}  // namespace loom::app
