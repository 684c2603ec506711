// Pieces shared by the loom subcommands: CLI11 parsing with loom's exit codes,
// thread-count flag.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>

#include "model/config.h"
#include "model/generate.h"
#include "model/sampler.h"

namespace loom::app {

// Parses argv; on --help prints and returns 0 through `exit_code`, on a bad
// flag prints the reason and returns 2. Returns true when the command should run.
bool parse_cli(CLI::App& app, int argc, char** argv, int& exit_code);

// Adds "-t,--threads" (default: physical cores; >= 1, capped at the usable CPUs
// by resolve_thread_count with a warning).
void add_threads_flag(CLI::App& app, int& threads);

// Sampling flags shared by generate and chat (--temp, --top-k, ..., --seed), each
// range-checked like validate_sampling (a bad value: exit 2 naming the flag).
void add_sampling_flags(CLI::App& app, SamplingParams& s, int64_t& seed);
// "-n,--n-predict" (>= -1) and "-c,--ctx-size" (>= 0), range-checked.
void add_length_flags(CLI::App& app, int64_t& n_predict, int64_t& ctx, const char* n_help);
// "-c,--ctx-size" (>= 0) with `help`.
void add_ctx_flag(CLI::App& app, int64_t& ctx, const char* help);
// -1 draws a random seed.
uint64_t resolve_seed(int64_t seed);
// --ctx-size: 0 means min(model context, 4096); larger than the model is an error.
int64_t resolve_context(const ModelConfig& c, int64_t requested);
// Prompt and generation speed, to stderr.
void print_speed(const GenerateResult& r);

}  // namespace loom::app
