// loom command-line entry point: dispatches to subcommands.
#include <cstdio>
#include <cstring>
#include <string>

#include "apps/commands.h"
#include "core/error.h"

namespace {

void print_usage() {
  std::fputs(
      "usage: loom <command> [options]\n\n"
      "commands:\n"
      "  info       show a model's architecture, parameters, tensor types and memory\n"
      "  tokenize   print the tokens of a text\n"
      "  generate   continue a prompt\n"
      "  chat       interactive chat using the model's chat template\n"
      "  merge      merge a LoRA adapter into a model, write a Hugging Face folder\n"
      "  train      fine-tune a model (LoRA adapter or all weights) from a YAML config\n"
      "  plot       draw training curves (loss, eval loss, token accuracy, lr, grad norm) as SVG or PNG\n"
      "  bench      measure prompt processing and generation speed\n"
      "  perplexity score a text as llama-perplexity does (KL divergence against saved logits)\n"
      "  imatrix    collect an importance matrix for quantization (llama-imatrix's format)\n"
      "  quantize   quantize to a llama.cpp file type, or to an INT8/INT4/AWQ/SmoothQuant folder\n"
      "  export     write a model (with a LoRA adapter merged) as GGUF\n"
      "  export-lora write a LoRA adapter in llama.cpp's GGUF format\n"
      "  prune      zero weights (magnitude, Wanda, N:M) or remove heads, channels and layers\n"
      "  serve      OpenAI-compatible HTTP server with continuous batching and multi-LoRA\n"
      "  profile    read a --profile trace: hot spots (report) and what to change (advise)\n\n"
      "Run 'loom <command> --help' for a command's options.\n",
      stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    print_usage();
    return argc < 2 ? 1 : 0;
  }
  const std::string cmd = argv[1];
  try {
    for (const auto& c : loom::app::commands())
      if (cmd == c.name) return c.run(argc - 1, argv + 1);
    std::fprintf(stderr, "loom: unknown command '%s' (see 'loom --help')\n", cmd.c_str());
    return 2;
  } catch (const loom::Error& e) {
    // Exit codes (docs/training.md, "Signals and exit codes"): 1 bad input,
    // 3 I/O, 4 diverged, 70 internal; 2 is the command line's (CLI11).
    if (!e.reported()) std::fprintf(stderr, "loom %s: error: %s\n", cmd.c_str(), e.what());
    return loom::error_exit_code(e.kind());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom %s: error: %s\n", cmd.c_str(), e.what());
    return 70;
  }
}
