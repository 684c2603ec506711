// `loom imatrix`: an importance matrix from a calibration text (as llama.cpp's
// llama-imatrix), for `loom quantize --imatrix` or llama-quantize --imatrix.
#include <cstdio>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "core/mapped_file.h"
#include "quant/imatrix.h"
#include "tokenizer/tokenizer.h"

namespace loom::app {
namespace {

int run_imatrix(int argc, char** argv) {
  CLI::App app("Compute an importance matrix from calibration text (as llama-imatrix).", "imatrix");
  ModelFlags model_flags;
  std::string text_file, out_path = "imatrix.gguf";
  ImatrixOptions opt;
  add_model_flags(app, model_flags);
  app.add_option("-f,--file", text_file, "calibration text (plain UTF-8)")->required();
  app.add_option("-o,--output", out_path, "the imatrix file to write (GGUF form)")->capture_default_str();
  app.add_option("-c,--ctx-size", opt.n_ctx, "tokens per chunk")
      ->check(CLI::Range(int64_t{16}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--chunks", opt.max_chunks, "use at most this many chunks (-1 = all)")
      ->check(all_or_some_chunks())
      ->capture_default_str();
  add_run_flags(app, model_flags);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;

  const LoadedModel loaded = load_model(model_flags);
  const Model& model = *loaded.model;
  if (opt.n_ctx > model.config().max_context)
    fail(ErrorKind::invalid_input, "a chunk of {} tokens is longer than the model's context {} (see -c)", opt.n_ctx,
         model.config().max_context);
  const Tokenizer& tok = model.tokenizer();
  opt.bos = tok.add_bos() ? tok.bos() : -1;
  const auto tokens = tok.encode(read_text_file(text_file), /*add_special=*/true, /*parse_special=*/false);
  std::fprintf(stderr, "imatrix: %zu tokens, chunks of %lld\n", tokens.size(), static_cast<long long>(opt.n_ctx));
  InferenceSession session(model.config(), model.weights(), *loaded.backend, opt.n_ctx);
  Imatrix m = compute_imatrix(session, model.config(), tokens, opt, [](int64_t c, int64_t n) {
    std::fprintf(stderr, "\rimatrix: chunk %lld/%lld", static_cast<long long>(c), static_cast<long long>(n));
  });
  std::fprintf(stderr, "\n");
  m.datasets.push_back(text_file);
  save_imatrix(m, out_path);
  std::fprintf(stderr, "imatrix: %zu entries over %lld chunks written to %s\n", m.entries.size(),
               static_cast<long long>(m.chunk_count), out_path.c_str());
  return 0;
}

}  // namespace

extern const Command kImatrixCommand = {"imatrix", run_imatrix};

}  // namespace loom::app
