// `loom prune`: unstructured (magnitude, Wanda; N:M patterns) and structured
// (heads, SwiGLU channels, layers) pruning of a GGUF model or a Hugging Face
// folder, written as a Hugging Face folder or a GGUF file (quant/prune_pipeline.h).
#include <cstdio>
#include <filesystem>
#include <optional>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/quantize_output.h"
#include "io/file_write.h"
#include "model/gguf_export.h"
#include "model/hf_export.h"
#include "quant/prune_pipeline.h"

namespace loom::app {
namespace {

struct PruneFlags {
  std::string model_path, out_path, method, scope, pattern, type_name = "F16", dtype = "bf16";
  std::optional<double> sparsity;  // unset: 0.5 with --method
  PruneJob job;
  bool overwrite = false;
};

// "2:4" -> {2, 4}.
std::pair<int, int> parse_pattern(const std::string& s) {
  const auto colon = s.find(':');
  try {
    if (colon != std::string::npos) {
      size_t a = 0, b = 0;
      const int n = std::stoi(s.substr(0, colon), &a), m = std::stoi(s.substr(colon + 1), &b);
      if (a == colon && b == s.size() - colon - 1) return {n, m};
    }
  } catch (const std::exception&) {
  }
  fail(ErrorKind::invalid_input, "--pattern {}: expected N:M (e.g. 2:4)", s);
}

void make_job(PruneFlags& f) {
  PruneJob& job = f.job;
  job.model_path = f.model_path;
  if (!f.method.empty()) {
    PruneSpec spec;
    spec.method = prune_method_from_name(f.method);
    // Wanda compares within a row; the magnitude baseline of the paper within a matrix.
    spec.scope = f.scope.empty() ? (spec.method == PruneMethod::wanda ? PruneScope::row : PruneScope::matrix)
                                 : prune_scope_from_name(f.scope);
    if (!f.pattern.empty()) {
      if (f.sparsity) fail(ErrorKind::invalid_input, "give --sparsity or --pattern, not both");
      std::tie(spec.n, spec.m) = parse_pattern(f.pattern);
    } else {
      spec.sparsity = f.sparsity.value_or(0.5);
      if (!(spec.sparsity >= 0 && spec.sparsity < 1))  // here, before the model loads
        fail(ErrorKind::invalid_input, "--sparsity {}: expected a fraction in [0, 1)", spec.sparsity);
    }
    job.unstructured = spec;
  } else if (!f.pattern.empty() || f.sparsity || !f.scope.empty()) {
    fail(ErrorKind::invalid_input, "--sparsity, --pattern and --scope go with --method magnitude or wanda");
  }
}

void write_output(PruneFlags& f, const Model& m) {
  if (f.out_path.ends_with(".gguf")) {
    QuantizeFlags q;
    q.out_path = f.out_path;
    q.type_name = f.type_name;
    q.threads = f.job.threads;
    finish_quantize_flags(q);
    run_quantize_to_file(gguf_source_of(m, m.config().name), q);
    return;
  }
  const auto dtype = f.dtype == "f32" ? safetensors::StDType::f32
                     : f.dtype == "f16" ? safetensors::StDType::f16 : safetensors::StDType::bf16;
  FolderWriteOptions opt;
  opt.overwrite = f.overwrite;
  opt.what = "-o";
  write_hf_folder(m, f.out_path, dtype, opt);
  std::fprintf(stderr, "prune: wrote %s (Hugging Face folder, %s)\n", f.out_path.c_str(), f.dtype.c_str());
}

void print_report(const PruneResult& r) {
  if (r.structure) {
    const StructuredReport& s = *r.structure;
    if (s.heads_after != s.heads_before)
      std::fprintf(stderr, "prune: heads %lld -> %lld, KV heads %lld -> %lld (%s)\n",
                   static_cast<long long>(s.heads_before), static_cast<long long>(s.heads_after),
                   static_cast<long long>(s.kv_heads_before), static_cast<long long>(s.kv_heads_after),
                   s.heads_how.c_str());
    if (s.intermediate_after != s.intermediate_before)
      std::fprintf(stderr, "prune: MLP channels %lld -> %lld\n", static_cast<long long>(s.intermediate_before),
                   static_cast<long long>(s.intermediate_after));
    if (!s.removed_layers.empty()) {
      std::string list;
      for (int64_t l : s.removed_layers) list += (list.empty() ? "" : ", ") + std::to_string(l);
      std::fprintf(stderr, "prune: removed layers %s (lowest block influence)\n", list.c_str());
    }
  }
  const double before = static_cast<double>(r.linear_params_before), after = static_cast<double>(r.linear_params_after);
  std::fprintf(stderr, "prune: linear weights %.2fM -> %.2fM (%.1f%% fewer)", before / 1e6, after / 1e6,
               100.0 * (1 - after / before));
  if (!r.pruned.empty())
    std::fprintf(stderr, ", %.1f%% of them zero", 100.0 * static_cast<double>(r.linear_zeros) / after);
  std::fprintf(stderr, "\n");
}

int run_prune_command(int argc, char** argv) {
  CLI::App app("Prune a model: zero weights (magnitude, Wanda; --sparsity or an N:M --pattern) and/or remove "
               "attention heads, MLP channels and layers. Writes a Hugging Face folder or a .gguf file.",
               "prune");
  PruneFlags f;
  PruneJob& job = f.job;
  app.add_option("-m,--model", f.model_path, "the input: a .gguf model or a Hugging Face folder")->required();
  app.add_option("-o,--output", f.out_path, "the output: a folder (Hugging Face) or a file ending in .gguf")
      ->required();
  app.add_option("--method", f.method, "unstructured pruning: magnitude or wanda (needs --calib)");
  app.add_option("--sparsity", f.sparsity, "the fraction of each group's weights set to zero (default 0.5)");
  app.add_option("--pattern", f.pattern, "N:M: keep N of every M consecutive inputs of a row (2:4, 4:8)");
  app.add_option("--scope", f.scope, "where scores compete: row (wanda's default), matrix (magnitude's), global");
  app.add_option("--heads", job.structured.heads, "fraction of attention heads to remove (whole heads, GQA kept)");
  app.add_option("--channels", job.structured.channels, "fraction of MLP channels to remove");
  app.add_option("--layers", job.structured.layers, "number of decoder layers to remove");
  app.add_option("--calib", job.calib_file, "calibration text (plain UTF-8) for wanda and structured pruning");
  add_calibration_flags(app, job.calib_ctx, job.calib_chunks);
  app.add_option("--type", f.type_name, "GGUF output: the file type (F16, BF16, Q8_0, Q4_0, ...; see quantize)")
      ->capture_default_str();
  app.add_option("--dtype", f.dtype, "folder output: bf16, f16 or f32")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}))
      ->capture_default_str();
  app.add_flag("--overwrite", f.overwrite, "the output folder may be replaced even if it is not a loom/PEFT output");
  add_threads_flag(app, job.threads);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  make_job(f);
  if (!f.out_path.ends_with(".gguf")) {
    check_folder_replaceable(f.out_path, f.overwrite, "-o", "--overwrite");
    check_folder_writable(f.out_path, "-o");
  } else {
    QuantizeFlags probe;  // a bad --type fails before the model loads
    probe.type_name = f.type_name;
    finish_quantize_flags(probe);
  }
  const PruneResult r = run_prune(job, [](const std::string& line) { std::fprintf(stderr, "prune: %s\n", line.c_str()); });
  print_report(r);
  write_output(f, *r.model);
  return 0;
}

}  // namespace

extern const Command kPruneCommand = {"prune", run_prune_command};

}  // namespace loom::app
