// `loom tokenize`: the token ids (and pieces) of a text.
#include <cstdio>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "core/mapped_file.h"
#include "model/model.h"
#include <nlohmann/json.hpp>  // complete type for Tokenizer's optional<json> parameters
#include "tokenizer/tokenizer.h"

namespace loom::app {
namespace {

int run_tokenize(int argc, char** argv) {
  CLI::App app("Print the tokens of a text.", "tokenize");
  std::string model_path, text, file;
  bool ids_only = false, no_bos = false, no_special = false;
  app.add_option("-m,--model", model_path, "a .gguf file or a Hugging Face model folder")->required();
  auto* t_opt = app.add_option("--text", text, "the text to tokenize");
  auto* f_opt = app.add_option("--file", file, "read the text from a file");
  t_opt->excludes(f_opt);
  app.add_flag("--ids", ids_only, "print only the list of ids");
  app.add_flag("--no-bos", no_bos, "do not add the model's BOS token");
  app.add_flag("--no-special", no_special, "treat special-token text as plain text");
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  if (!file.empty()) text = read_text_file(file);
  else if (t_opt->count() == 0) fail(ErrorKind::invalid_input, "give --text TEXT or --file FILE");

  auto model = Model::load(model_path, {.tokenizer = true, .pack = false});
  const Tokenizer& tok = model->tokenizer();
  const auto ids = tok.encode(text, !no_bos, !no_special);
  if (ids_only) {
    std::fputc('[', stdout);
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? ", " : "", ids[i]);
    std::puts("]");
    return 0;
  }
  for (int32_t id : ids) {
    std::string piece = tok.token_to_piece(id);
    std::string shown;
    for (unsigned char ch : piece) {
      if (ch == '\n') shown += "\\n";
      else if (ch == '\t') shown += "\\t";
      else if (ch < 0x20) shown += fmt::format("\\x{:02x}", ch);
      else shown += static_cast<char>(ch);
    }
    std::printf("%6d -> '%s'\n", id, shown.c_str());
  }
  std::fprintf(stderr, "%zu tokens\n", ids.size());
  return 0;
}

}  // namespace

extern const Command kTokenizeCommand = {"tokenize", run_tokenize};

}  // namespace loom::app
