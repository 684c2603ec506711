// `loom generate`: continue a prompt, print the continuation to stdout and
// the prompt/generation speed to stderr.
#include <cstdio>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/profile_output.h"
#include "core/mapped_file.h"
#include "model/generate.h"
#include "model/model.h"
#include <nlohmann/json.hpp>  // complete type for Tokenizer's optional<json> parameters
#include "tokenizer/tokenizer.h"

namespace loom::app {

namespace {

int run_generate(int argc, char** argv) {
  CLI::App app("Continue a prompt with a model.", "generate");
  std::string prompt, prompt_file;
  int64_t n_predict = 128, ctx = 0, seed = -1;
  bool no_special = false;
  GenerateOptions opts;
  DType kv_dtype = DType::f16;
  ModelFlags model_flags;
  add_model_flags(app, model_flags);
  auto* p_opt = app.add_option("-p,--prompt", prompt, "the prompt text");
  auto* f_opt = app.add_option("-f,--file", prompt_file, "read the prompt from a file");
  p_opt->excludes(f_opt);
  add_length_flags(app, n_predict, ctx, "tokens to generate; -1 = until end of text");
  app.add_option("--stop", opts.stop, "stop when this text is generated (repeatable)");
  app.add_flag("--no-special", no_special, "treat special-token text in the prompt as plain text");
  add_sampling_flags(app, opts.sampling, seed);
  add_spec_flags(app, opts.spec,
                 "prompt-lookup speculative decoding: up to K drafted tokens per step (0: off)");
  add_kv_cache_dtype_flag(app, kv_dtype);
  add_run_flags(app, model_flags);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  if (!prompt_file.empty()) prompt = read_text_file(prompt_file);
  if (prompt.empty()) fail(ErrorKind::invalid_input, "the prompt is empty: give -p TEXT or -f FILE");
  finish_generate_options(opts, n_predict, seed);
  validate_ngram_spec(opts.spec);

  const LoadedModel loaded = load_model(model_flags);
  const std::unique_ptr<Model>& model = loaded.model;
  const Tokenizer& tok = model->tokenizer();
  opts.extra_eos = model->extra_eos_ids();
  const auto ids = tok.encode(prompt, /*add_special=*/true, /*parse_special=*/!no_special);
  const int64_t n_ctx = resolve_context(model->config(), ctx);
  if (static_cast<int64_t>(ids.size()) >= n_ctx)
    fail(ErrorKind::invalid_input, "the prompt is {} tokens, longer than the context size {} (see --ctx-size)",
         ids.size(), n_ctx);
  InferenceSession session(model->config(), model->weights(), *loaded.backend, n_ctx, kv_dtype);
  const auto r = generate(session, tok, ids, opts, [](const std::string& text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return true;
  });
  std::fputc('\n', stdout);
  print_speed(r);
  if (loaded.tracer)
    write_profile(model_flags.profile, *loaded.tracer,
                  profile_metadata("generate", model_flags.threads,
                                   {{"model", {{"path", model_flags.model_path}, {"name", model->config().name},
                                               {"layers", model->config().n_layers},
                                               {"type", model_weight_type(*model)}}}}));
  return 0;
}

}  // namespace

extern const Command kGenerateCommand = {"generate", run_generate};

}  // namespace loom::app
