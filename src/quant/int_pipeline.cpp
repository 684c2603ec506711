#include "quant/int_pipeline.h"

#include <fmt/format.h>

#include <filesystem>
#include <numeric>

#include "core/error.h"
#include "core/mapped_file.h"
#include "model/forward.h"
#include "model/model.h"
#include "quant/calibration.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

bool needs_calibration(IntMethod m) { return m == IntMethod::awq || m == IntMethod::smoothquant; }

// Activation statistics of the calibration text on the model as stored.
CalibrationStats calibrate(const IntQuantizeJob& job, Backend& backend,
                           const std::function<void(const std::string&)>& log, int64_t& tokens_used) {
  CalibrationOptions opt;
  opt.n_ctx = job.calib_ctx;
  opt.max_chunks = job.calib_chunks;
  const bool search = job.method == IntMethod::awq || (job.method == IntMethod::smoothquant && job.alpha < 0);
  opt.max_samples = search ? job.awq_samples : 0;
  CalibrationStats stats = calibrate_on_text(job.model_path, backend, job.calib_file, opt, log);
  tokens_used = stats.chunks * stats.chunk_size;
  return stats;
}

// A group size every linear weight's rows split into: the requested one, or
// the largest multiple of 32 below it that divides every input width (SmolLM2's
// 576 takes 96 for 128), so one group size serves the whole model.
int64_t fitting_group(int64_t requested, const ModelConfig& c, const std::function<void(const std::string&)>& log) {
  const int64_t g = fitting_common_group(requested, {c.hidden, c.q_dim(), c.intermediate});
  if (g == 0)
    fail(ErrorKind::invalid_input, "no group size of 32 to {} divides the input widths {}, {} and {}", requested,
         c.hidden, c.q_dim(), c.intermediate);
  if (g != requested)
    log(fmt::format("groups of {} do not divide the input widths ({}, {}, {}): using groups of {}", requested,
                    c.hidden, c.q_dim(), c.intermediate, g));
  return g;
}

}  // namespace

IntMethod int_method_from_name(const std::string& name) {
  if (name == "int8") return IntMethod::int8;
  if (name == "int4") return IntMethod::int4;
  if (name == "awq") return IntMethod::awq;
  if (name == "smoothquant") return IntMethod::smoothquant;
  fail(ErrorKind::invalid_input, "--method {}: expected gguf, int8, int4, awq or smoothquant", name);
}

const char* int_method_name(IntMethod m) {
  switch (m) {
    case IntMethod::int8: return "int8";
    case IntMethod::int4: return "int4";
    case IntMethod::awq: return "awq";
    case IntMethod::smoothquant: return "smoothquant";
  }
  return "?";
}

CompressedTensorsScheme default_scheme(IntMethod m) {
  CompressedTensorsScheme s;
  if (m == IntMethod::int4 || m == IntMethod::awq) {
    s.weights.bits = 4;
    s.weights.group = 128;
    s.weights.symmetric = false;
  } else {
    s.weights.bits = 8;
    s.weights.group = 0;
    s.weights.symmetric = true;
    s.int8_dynamic_activations = true;
  }
  return s;
}

IntQuantizeReport run_int_quantize(const IntQuantizeJob& job, const std::function<void(const std::string&)>& log_fn) {
  const std::function<void(const std::string&)> log = log_fn ? log_fn : [](const std::string&) {};
  if (needs_calibration(job.method) && job.calib_file.empty())
    fail(ErrorKind::invalid_input, "--method {} needs calibration text: give --calib FILE", int_method_name(job.method));
  if (job.method == IntMethod::smoothquant && (job.scheme.weights.bits != 8 || !job.scheme.int8_dynamic_activations))
    fail(ErrorKind::invalid_input, "--method smoothquant makes W8A8 models (int8 weights, int8 activations)");
  ThreadPool pool(job.threads);
  auto backend = make_backend(kCpu, pool);
  IntQuantizeReport report;
  CalibrationStats stats;
  if (needs_calibration(job.method)) stats = calibrate(job, *backend, log, report.calib_tokens);

  // A GGUF source's tokenizer writes the folder's tokenizer files; an HF
  // folder's files are copied as they are (and it may have none).
  const bool gguf = !std::filesystem::is_directory(job.model_path);
  auto model = Model::load(job.model_path, {.tokenizer = gguf, .pack = false, .fold_output_scales = true});
  ModelWeights& w = model->mutable_weights();
  const ModelConfig& c = model->config();
  CompressedTensorsScheme scheme = job.scheme;
  if (scheme.weights.group > 0) scheme.weights.group = fitting_group(scheme.weights.group, c, log);
  auto on_smooth = [&](const SmoothReport& r) { report.smoothing.push_back(r); };
  if (job.method == IntMethod::smoothquant && job.alpha < 0) {
    make_weights_mutable(w, c);
    apply_smoothquant_search(*backend, w, c, stats, {0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}, on_smooth);
    double mean = 0;
    for (const auto& r : report.smoothing) mean += r.ratio / static_cast<double>(report.smoothing.size());
    log(fmt::format("smoothquant: alpha searched per mapping ({} mappings, mean alpha {:.2f})", report.smoothing.size(),
                    mean));
  } else if (job.method == IntMethod::smoothquant) {
    make_weights_mutable(w, c);
    apply_smoothquant(w, c, stats, job.alpha, on_smooth);
    log(fmt::format("smoothquant: alpha {} folded into {} norm/weight groups", job.alpha, report.smoothing.size()));
  } else if (job.method == IntMethod::awq) {
    make_weights_mutable(w, c);
    AwqOptions opt;
    opt.spec = scheme.weights;
    opt.n_grid = job.awq_grid;
    apply_awq(*backend, w, c, stats, opt, on_smooth);
    log(fmt::format("awq: scales searched for {} mappings", report.smoothing.size()));
  }
  write_compressed_tensors_folder(*model, job.out_dir, job.dtype, scheme, job.folder,
                                  [&](const LinearQuantReport& r) { report.linears.push_back(r); });
  return report;
}

}  // namespace loom
