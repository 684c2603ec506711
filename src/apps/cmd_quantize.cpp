// `loom quantize`: a GGUF model or a Hugging Face folder to a llama.cpp file
// type (Q4_K_M, Q8_0, F16, ...), with llama-quantize's mixes and bit-exact
// blocks, optionally weighted by an importance matrix (`loom imatrix` or
// llama-imatrix); `loom export` writes a merged model the same way.
#include <cstdio>
#include <filesystem>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/quantize_output.h"
#include "io/file_write.h"
#include "io/gguf.h"
#include "model/adapter_merge.h"
#include "model/gguf_export.h"
#include "model/model.h"
#include "model/peft_adapter.h"
#include "quant/gguf_quantize.h"
#include "quant/imatrix.h"
#include "quant/int_pipeline.h"

namespace loom::app {
namespace {

// A Hugging Face folder (or a model with an adapter merged) as GGUF tensors and metadata.
std::unique_ptr<Model> load_for_export(const std::string& path, const std::string& adapter_dir) {
  Model::LoadOptions load{.tokenizer = true, .pack = false};
  if (!adapter_dir.empty()) load.before_pack = adapter_merge_hook(adapter_dir);
  return Model::load(path, load);
}

// The flags of the integer methods (--method int8|int4|awq|smoothquant).
struct IntFlags {
  std::string method = "gguf", symmetry, granularity, range = "minmax", activations, dtype = "bf16";
  int64_t group = 0;
  double percentile = 99.99;
  std::string alpha = "0.5";
  std::string calib;
  int64_t calib_ctx = 512, calib_chunks = 32;
  bool overwrite = false;
};

void add_int_flags(CLI::App& app, IntFlags& f) {
  app.add_option("--method", f.method,
                 "gguf (a llama.cpp file type, --type), or a compressed-tensors folder: int8, int4, awq, smoothquant")
      ->capture_default_str();
  app.add_option("--scheme", f.symmetry, "int8/int4: sym or asym (default: int8 sym, int4/awq asym)");
  app.add_option("--granularity", f.granularity, "int8: channel (default) or tensor; int4: group (default) or channel");
  app.add_option("--group", f.group, "int4/awq: columns per scale (default 128)")->check(CLI::Range(int64_t{8}, int64_t{1} << 20));
  app.add_option("--range", f.range, "how weight ranges are chosen: minmax, percentile, mse")->capture_default_str();
  app.add_option("--percentile", f.percentile, "--range percentile: the upper percentile")->capture_default_str();
  app.add_option("--activations", f.activations, "int8: dynamic (W8A8, per-token int8; default) or none (W8A16)");
  app.add_option("--alpha", f.alpha,
                 "smoothquant: migration strength in [0, 1], or auto (searched per layer on the calibration text)")
      ->capture_default_str();
  app.add_option("--calib", f.calib, "calibration text for awq and smoothquant (plain UTF-8)");
  add_calibration_flags(app, f.calib_ctx, f.calib_chunks);
  app.add_option("--dtype", f.dtype, "float type of the folder's other tensors and of the scales: bf16, f16, f32")
      ->capture_default_str();
  app.add_flag("--overwrite", f.overwrite, "the output folder may be replaced even if it is not a loom/PEFT output");
}

int run_int(const std::string& model_path, const QuantizeFlags& q, const IntFlags& f) {
  IntQuantizeJob job;
  job.model_path = model_path;
  job.out_dir = q.out_path;
  job.method = int_method_from_name(f.method);
  job.scheme = default_scheme(job.method);
  IntQuantSpec& spec = job.scheme.weights;
  if (!f.symmetry.empty()) {
    if (f.symmetry != "sym" && f.symmetry != "asym") fail(ErrorKind::invalid_input, "--scheme {}: expected sym or asym", f.symmetry);
    spec.symmetric = f.symmetry == "sym";
  }
  if (!f.granularity.empty()) {
    if (f.granularity == "channel") spec.group = 0;
    else if (f.granularity == "tensor") spec.group = -1;
    else if (f.granularity == "group") spec.group = spec.bits == 4 ? 128 : 128;
    else fail(ErrorKind::invalid_input, "--granularity {}: expected channel, tensor or group", f.granularity);
  }
  if (f.group > 0) spec.group = f.group;
  spec.range = range_method_from_name(f.range);
  spec.percentile = f.percentile;
  if (!(f.percentile > 50 && f.percentile <= 100))  // here, before the model loads
    fail(ErrorKind::invalid_input, "--percentile {}: expected a value in (50, 100]", f.percentile);
  if (!f.activations.empty()) {
    if (f.activations != "dynamic" && f.activations != "none")
      fail(ErrorKind::invalid_input, "--activations {}: expected dynamic or none", f.activations);
    if (spec.bits != 8 && f.activations == "dynamic")
      fail(ErrorKind::invalid_input, "--activations dynamic goes with int8 weights (W8A8)");
    job.scheme.int8_dynamic_activations = f.activations == "dynamic";
  }
  if (f.alpha == "auto") {
    job.alpha = -1;
  } else {
    try {
      size_t used = 0;
      job.alpha = std::stod(f.alpha, &used);
      if (used != f.alpha.size()) throw std::invalid_argument(f.alpha);
    } catch (const std::exception&) {
      fail(ErrorKind::invalid_input, "--alpha {}: expected a number in [0, 1] or auto", f.alpha);
    }
  }
  job.calib_file = f.calib;
  job.calib_ctx = f.calib_ctx;
  job.calib_chunks = f.calib_chunks;
  job.dtype = f.dtype == "f32" ? safetensors::StDType::f32 : f.dtype == "f16" ? safetensors::StDType::f16
                                                                          : safetensors::StDType::bf16;
  if (f.dtype != "f32" && f.dtype != "f16" && f.dtype != "bf16")
    fail(ErrorKind::invalid_input, "--dtype {}: expected bf16, f16 or f32", f.dtype);
  job.folder.overwrite = f.overwrite;
  job.folder.what = "-o";
  job.threads = q.threads;
  check_folder_replaceable(job.out_dir, f.overwrite, "-o", "--overwrite");
  check_folder_writable(job.out_dir, "-o");
  const IntQuantizeReport r = run_int_quantize(job, [](const std::string& line) {
    std::fprintf(stderr, "quantize: %s\n", line.c_str());
  });
  double worst = 0, sum = 0;
  for (const auto& l : r.linears) {
    worst = std::max(worst, l.relative_error);
    sum += l.relative_error;
  }
  std::fprintf(stderr,
               "quantize: %s, %zu linear weights (mean relative error %.4f, worst %.4f); wrote %s "
               "(compressed-tensors)\n",
               int_method_name(job.method), r.linears.size(), r.linears.empty() ? 0.0 : sum / r.linears.size(), worst,
               job.out_dir.c_str());
  return 0;
}

int run_quantize(int argc, char** argv) {
  CLI::App app("Quantize a GGUF model or a Hugging Face folder: to a llama.cpp file type (as llama-quantize), or "
               "to an INT8/INT4/AWQ/SmoothQuant compressed-tensors folder.",
               "quantize");
  std::string model_path;
  QuantizeFlags f;
  IntFlags int_flags;
  app.add_option("-m,--model", model_path, "the input: a .gguf model or a Hugging Face folder (f32/f16/bf16)")
      ->required();
  add_quantize_flags(app, f, "Q4_K_M");
  add_int_flags(app, int_flags);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  if (int_flags.method != "gguf") return run_int(model_path, f, int_flags);
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

int run_export(int argc, char** argv) {
  CLI::App app("Write a model, with a LoRA adapter merged into it, as a GGUF file for llama.cpp and ollama.",
               "export");
  std::string model_path, adapter_dir;
  QuantizeFlags f;
  app.add_option("-m,--model", model_path, "the base: a .gguf file or a Hugging Face folder (a full fine-tune's)")
      ->required();
  app.add_option("--adapter", adapter_dir,
                 "a PEFT LoRA adapter folder or a llama.cpp GGUF LoRA file to merge into the weights");
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
  check_file_writable(out_path, "-o");
  if (model_path.empty()) {
    model_path = adapter.config.base_model_name_or_path;
    if (model_path.empty() || !std::filesystem::exists(model_path))
      fail(ErrorKind::invalid_input,
           "{}: base_model_name_or_path '{}' is not a file or folder here; give the base model with -m", adapter_dir,
           model_path);
  }
  const auto base = Model::load(model_path, {.tokenizer = false, .pack = false});
  peft::check_adapter_fits(adapter, base->config(), adapter_dir);  // an error names the adapter, not -o
  write_lora_gguf(adapter, base->config(), out_path, dtype == "f16" ? DType::f16 : DType::f32);
  std::fprintf(stderr, "export-lora: %zu LoRA pairs (r %d, alpha %g%s) for %s written to %s\n", adapter.pairs.size(),
               adapter.config.r, adapter.config.lora_alpha, adapter.config.use_rslora ? ", rsLoRA" : "",
               model_path.c_str(), out_path.c_str());
  return 0;
}

}  // namespace

extern const Command kQuantizeCommand = {"quantize", run_quantize};
extern const Command kExportCommand = {"export", run_export};
extern const Command kExportLoraCommand = {"export-lora", run_export_lora};

}  // namespace loom::app
