// The GGUF output flags `loom quantize`, `export` and `prune` share (--type,
// --imatrix, llama-quantize's overrides) and the quantize-to-file step.
#pragma once

#include <CLI/CLI.hpp>

#include <map>
#include <string>
#include <vector>

#include "model/gguf_export.h"
#include "quant/gguf_quantize.h"

namespace loom::app {

// The flags quantize and export share, and what they set.
struct QuantizeFlags {
  std::string out_path, type_name, imatrix_path, output_type, embd_type;
  std::vector<std::string> overrides;
  bool leave_output = false;
  GgufQuantizeOptions opt;
  std::map<std::string, std::vector<float>> importance;
  int threads = 1;
};

// Adds -o (required) and the type flags, --type defaulting to `default_type`.
void add_quantize_flags(CLI::App& app, QuantizeFlags& f, const char* default_type);
// Checks the flags (before any model loads) and reads the importance matrix.
void finish_quantize_flags(QuantizeFlags& f);
// Quantizes `src` to f.out_path as the flags say, with progress on stderr.
void run_quantize_to_file(const GgufModelSource& src, QuantizeFlags& f);

}  // namespace loom::app
