#include "apps/quantize_output.h"

#include <cstdio>

#include "apps/cli_common.h"
#include "core/thread_pool.h"
#include "io/file_write.h"
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

}  // namespace

void add_quantize_flags(CLI::App& app, QuantizeFlags& f, const char* default_type) {
  app.add_option("-o,--output", f.out_path, "the output .gguf file")->required();
  app.add_option("--type", f.type_name,
                 "file type: Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, Q3_K_L, Q3_K_M, Q3_K_S, Q2_K, Q2_K_S, "
                 "IQ4_XS, IQ4_NL, IQ3_M, IQ3_S, IQ3_XS, IQ3_XXS, IQ2_M, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_M, IQ1_S, "
                 "Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, Q2_0, Q1_0, TQ2_0, TQ1_0, F16, BF16, F32 (IQ1_S, IQ1_M, IQ2_*, "
                 "IQ3_XXS and IQ3_XS need --imatrix)")
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
  if (!m.has_data())
    fail(ErrorKind::invalid_input,
         "{}: the importance matrix holds no data ({} chunks, every count zero); compute it over some text "
         "(loom imatrix -f TEXT)",
         f.imatrix_path, m.chunk_count);
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
  check_file_writable(f.out_path, "-o");  // before the work, not at the final rename
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

}  // namespace loom::app
