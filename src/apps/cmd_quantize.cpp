// `loom quantize`: a GGUF model or a Hugging Face folder to a llama.cpp file
// type (Q4_K_M, Q8_0, F16, ...), with llama-quantize's mixes and bit-exact
// blocks, optionally weighted by an importance matrix (`loom imatrix` or
// llama-imatrix); `loom export` writes a merged model the same way.
#include <cstdio>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include <filesystem>

#include "io/gguf.h"
#include "model/adapter_merge.h"
#include "model/gguf_export.h"
#include "model/model.h"
#include "model/peft_adapter.h"
#include "quant/gguf_quantize.h"
#include "quant/imatrix.h"

namespace loom::app {
namespace {

DType parse_tensor_type(const std::string& flag, const std::string& name) {
  const auto t = dtype_from_name(name);
  if (!t) fail(ErrorKind::invalid_input, "{} {}: not a tensor type (e.g. q8_0, q6_k, f16)", flag, name);
  return *t;
}

std::vector<TensorTypeOverride> parse_overrides(const std::vector<std::string>& specs) {
  std::vector<TensorTypeOverride> out;
  for (const auto& s : specs) {
    const auto eq = s.rfind('=');
    if (eq == std::string::npos || eq == 0)
      fail(ErrorKind::invalid_input, "--tensor-type {}: expected PATTERN=TYPE (e.g. attn_v=q8_0)", s);
    out.push_back({s.substr(0, eq), parse_tensor_type("--tensor-type", s.substr(eq + 1))});
  }
  return out;
}

// The flags quantize and export share, and what they set.
struct QuantizeFlags {
  std::string out_path, type_name, imatrix_path, output_type, embd_type;
  std::vector<std::string> overrides;
  bool leave_output = false;
  GgufQuantizeOptions opt;
  std::map<std::string, std::vector<float>> importance;
  int threads = 1;
};

void add_quantize_flags(CLI::App& app, QuantizeFlags& f, const char* default_type) {
  app.add_option("-o,--output", f.out_path, "the output .gguf file")->required();
  app.add_option("--type", f.type_name,
                 "file type: Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, Q3_K_L, Q3_K_M, Q3_K_S, Q2_K, Q2_K_S, "
                 "Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, F16, BF16, F32")
      ->default_val(default_type);
  app.add_option("--imatrix", f.imatrix_path, "importance matrix (loom imatrix or llama-imatrix, .gguf or .dat)");
  app.add_flag("--allow-requantize", f.opt.allow_requantize, "allow quantizing tensors that are already quantized");
  app.add_flag("--pure", f.opt.plan.pure, "no mix: every quantizable tensor gets the type's default");
  app.add_flag("--leave-output-tensor", f.leave_output, "keep output.weight as it is");
  app.add_option("--output-tensor-type", f.output_type, "type of output.weight");
  app.add_option("--token-embedding-type", f.embd_type, "type of token_embd.weight");
  app.add_option("--tensor-type", f.overrides, "PATTERN=TYPE: tensors whose name matches the regex get TYPE");
  add_threads_flag(app, f.threads);
}

// Checks the flags (before any model loads) and reads the importance matrix.
void finish_quantize_flags(QuantizeFlags& f) {
  const auto ftype = file_type_from_name(f.type_name);
  if (!ftype) fail(ErrorKind::invalid_input, "--type {}: not a file type loom writes (see --help)", f.type_name);
  GgufQuantizeOptions& opt = f.opt;
  opt.plan.file_type = *ftype;
  opt.plan.quantize_output = !f.leave_output;
  if (!f.output_type.empty()) opt.plan.output_type = parse_tensor_type("--output-tensor-type", f.output_type);
  if (!f.embd_type.empty()) opt.plan.token_embedding_type = parse_tensor_type("--token-embedding-type", f.embd_type);
  opt.plan.overrides = parse_overrides(f.overrides);
  if (f.imatrix_path.empty()) return;
  const Imatrix m = load_imatrix(f.imatrix_path);
  f.importance = m.importance();
  opt.importance = &f.importance;
  opt.plan.has_imatrix = true;
  opt.imatrix_file = f.imatrix_path;
  opt.imatrix_datasets = m.datasets;
  opt.imatrix_chunks = m.chunk_count;
  std::fprintf(stderr, "quantize: %zu importance matrix entries from %s (%lld chunks)\n", f.importance.size(),
               f.imatrix_path.c_str(), static_cast<long long>(m.chunk_count));
}

void run_quantize_to_file(const GgufModelSource& src, QuantizeFlags& f) {
  ThreadPool pool(f.threads);
  const QuantizeSummary s =
      quantize_gguf(pool, src, f.out_path, f.opt, [](const TensorPlan& p, size_t i, size_t n) {
        std::fprintf(stderr, "[%4zu/%4zu] %-36s type %6s -> %6s%s\n", i + 1, n, p.name.c_str(), dtype_name(p.from),
                     dtype_name(p.to), p.fallback ? " (fallback: row width)" : "");
      });
  for (const auto& name : s.without_importance)
    std::fprintf(stderr, "quantize: no importance data for %s (quantized without it)\n", name.c_str());
  const double mib = 1024.0 * 1024.0, n = static_cast<double>(s.elements);
  std::fprintf(stderr, "quantize: model size %.2f MiB (%.2f BPW) -> %.2f MiB (%.2f BPW), %lld fallbacks; wrote %s\n",
               static_cast<double>(s.bytes_in) / mib, 8.0 * static_cast<double>(s.bytes_in) / n,
               static_cast<double>(s.bytes_out) / mib, 8.0 * static_cast<double>(s.bytes_out) / n,
               static_cast<long long>(s.fallbacks), f.out_path.c_str());
}

// A Hugging Face folder (or a model with an adapter merged) as GGUF tensors and metadata.
std::unique_ptr<Model> load_for_export(const std::string& path, const std::string& adapter_dir) {
  Model::LoadOptions load{.tokenizer = true, .pack = false};
  if (!adapter_dir.empty()) load.before_pack = adapter_merge_hook(adapter_dir);
  return Model::load(path, load);
}

int run_quantize(int argc, char** argv) {
  CLI::App app("Quantize a GGUF model or a Hugging Face folder to a llama.cpp file type (as llama-quantize).",
               "quantize");
  std::string model_path;
  QuantizeFlags f;
  app.add_option("-m,--model", model_path, "the input: a .gguf model or a Hugging Face folder (f32/f16/bf16)")
      ->required();
  add_quantize_flags(app, f, "Q4_K_M");
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  finish_quantize_flags(f);
  if (std::filesystem::is_directory(model_path)) {
    const auto model = load_for_export(model_path, "");
    run_quantize_to_file(gguf_source_of(*model, model->config().name), f);
  } else {
    const auto file = gguf::File::open(model_path);
    run_quantize_to_file(gguf_source_of(*file), f);
  }
  return 0;
}

}  // namespace

int run_export(int argc, char** argv) {
  CLI::App app("Write a model, with a LoRA adapter merged into it, as a GGUF file for llama.cpp and ollama.",
               "export");
  std::string model_path, adapter_dir;
  QuantizeFlags f;
  app.add_option("-m,--model", model_path, "the base: a .gguf file or a Hugging Face folder (a full fine-tune's)")
      ->required();
  app.add_option("--adapter", adapter_dir, "a PEFT LoRA adapter folder to merge into the weights");
  add_quantize_flags(app, f, "F16");
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  finish_quantize_flags(f);
  const auto model = load_for_export(model_path, adapter_dir);
  const std::string name = adapter_dir.empty() ? model->config().name
                                               : std::filesystem::path(adapter_dir).filename().string();
  run_quantize_to_file(gguf_source_of(*model, name), f);
  return 0;
}

int run_export_lora(int argc, char** argv) {
  CLI::App app("Write a PEFT LoRA adapter in llama.cpp's GGUF LoRA format (llama-cli --lora).", "export-lora");
  std::string adapter_dir, model_path, out_path, dtype = "f32";
  app.add_option("--adapter", adapter_dir, "the PEFT LoRA adapter folder")->required();
  app.add_option("-o,--output", out_path, "the output .gguf file")->required();
  app.add_option("-m,--model", model_path,
                 "the base model (.gguf or Hugging Face folder); default: the adapter's base_model_name_or_path");
  app.add_option("--outtype", dtype, "storage type of the adapter's tensors")
      ->check(CLI::IsMember({"f32", "f16"}))
      ->capture_default_str();
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  const peft::AdapterTensors adapter = peft::read_adapter(adapter_dir);
  if (model_path.empty()) {
    model_path = adapter.config.base_model_name_or_path;
    if (model_path.empty() || !std::filesystem::exists(model_path))
      fail(ErrorKind::invalid_input,
           "{}: base_model_name_or_path '{}' is not a file or folder here; give the base model with -m", adapter_dir,
           model_path);
  }
  const auto base = Model::load(model_path, {.tokenizer = false, .pack = false});
  write_lora_gguf(adapter, base->config(), out_path, dtype == "f16" ? DType::f16 : DType::f32);
  std::fprintf(stderr, "export-lora: %zu LoRA pairs (r %d, alpha %g%s) for %s written to %s\n", adapter.pairs.size(),
               adapter.config.r, adapter.config.lora_alpha, adapter.config.use_rslora ? ", rsLoRA" : "",
               model_path.c_str(), out_path.c_str());
  return 0;
}

extern const Command kQuantizeCommand = {"quantize", run_quantize};
extern const Command kExportCommand = {"export", run_export};
extern const Command kExportLoraCommand = {"export-lora", run_export_lora};

}  // namespace loom::app
