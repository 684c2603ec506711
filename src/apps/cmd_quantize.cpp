// `loom quantize`: a GGUF model to another llama.cpp file type (Q4_K_M, Q8_0,
// F16, ...), with llama-quantize's mixes and bit-exact blocks, optionally
// weighted by an importance matrix (`loom imatrix` or llama-imatrix).
#include <cstdio>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "io/gguf.h"
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

int run_quantize(int argc, char** argv) {
  CLI::App app("Quantize a GGUF model to a llama.cpp file type (as llama-quantize).", "quantize");
  std::string model_path, out_path, type_name, imatrix_path, output_type, embd_type;
  std::vector<std::string> overrides;
  GgufQuantizeOptions opt;
  int threads = 1;
  app.add_option("-m,--model", model_path, "the input .gguf model (f32/f16/bf16 for best quality)")->required();
  app.add_option("-o,--output", out_path, "the output .gguf file")->required();
  app.add_option("--type", type_name,
                 "file type: Q4_K_M (default), Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, Q3_K_L, Q3_K_M, Q3_K_S, Q2_K, Q2_K_S, "
                 "Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, F16, BF16, F32")
      ->default_val("Q4_K_M");
  app.add_option("--imatrix", imatrix_path, "importance matrix (loom imatrix or llama-imatrix, .gguf or .dat)");
  app.add_flag("--allow-requantize", opt.allow_requantize, "allow quantizing tensors that are already quantized");
  app.add_flag("--pure", opt.plan.pure, "no mix: every quantizable tensor gets the type's default");
  bool leave_output = false;
  app.add_flag("--leave-output-tensor", leave_output, "keep output.weight as it is");
  app.add_option("--output-tensor-type", output_type, "type of output.weight");
  app.add_option("--token-embedding-type", embd_type, "type of token_embd.weight");
  app.add_option("--tensor-type", overrides, "PATTERN=TYPE: tensors whose name matches the regex get TYPE");
  add_threads_flag(app, threads);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;

  const auto ftype = file_type_from_name(type_name);
  if (!ftype) fail(ErrorKind::invalid_input, "--type {}: not a file type loom writes (see --help)", type_name);
  opt.plan.file_type = *ftype;
  opt.plan.quantize_output = !leave_output;
  if (!output_type.empty()) opt.plan.output_type = parse_tensor_type("--output-tensor-type", output_type);
  if (!embd_type.empty()) opt.plan.token_embedding_type = parse_tensor_type("--token-embedding-type", embd_type);
  opt.plan.overrides = parse_overrides(overrides);

  std::map<std::string, std::vector<float>> importance;
  if (!imatrix_path.empty()) {
    const Imatrix m = load_imatrix(imatrix_path);
    importance = m.importance();
    opt.importance = &importance;
    opt.plan.has_imatrix = true;
    opt.imatrix_file = imatrix_path;
    opt.imatrix_datasets = m.datasets;
    opt.imatrix_chunks = m.chunk_count;
    std::fprintf(stderr, "quantize: %zu importance matrix entries from %s (%lld chunks)\n", importance.size(),
                 imatrix_path.c_str(), static_cast<long long>(m.chunk_count));
  }
  const auto src = gguf::File::open(model_path);
  ThreadPool pool(threads);
  const QuantizeSummary s =
      quantize_gguf(pool, *src, out_path, opt, [](const TensorPlan& p, size_t i, size_t n) {
        std::fprintf(stderr, "[%4zu/%4zu] %-36s type %6s -> %6s%s\n", i + 1, n, p.name.c_str(), dtype_name(p.from),
                     dtype_name(p.to), p.fallback ? " (fallback: row width)" : "");
      });
  for (const auto& name : s.without_importance)
    std::fprintf(stderr, "quantize: no importance data for %s (quantized without it)\n", name.c_str());
  const double mib = 1024.0 * 1024.0;
  std::fprintf(stderr, "quantize: model size %.2f MiB (%.2f BPW) -> %.2f MiB (%.2f BPW), %lld fallbacks; wrote %s\n",
               static_cast<double>(s.bytes_in) / mib, 8.0 * static_cast<double>(s.bytes_in) / static_cast<double>(s.elements),
               static_cast<double>(s.bytes_out) / mib, 8.0 * static_cast<double>(s.bytes_out) / static_cast<double>(s.elements),
               static_cast<long long>(s.fallbacks), out_path.c_str());
  return 0;
}

}  // namespace

extern const Command kQuantizeCommand = {"quantize", run_quantize};

}  // namespace loom::app
