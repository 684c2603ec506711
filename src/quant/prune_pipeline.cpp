#include "quant/prune_pipeline.h"

#include <fmt/format.h>

#include <filesystem>

#include "core/error.h"
#include "quant/smoothing.h"

namespace loom {
namespace {

int64_t linear_params(const ModelWeights& w) {
  int64_t n = 0;
  for (const LayerWeights& L : w.layers)
    for (LoraTarget t : kAllLoraTargets) n += target_matrix(L, t).numel();
  return n;
}

}  // namespace

PruneResult run_prune(const PruneJob& job, const std::function<void(const std::string&)>& log_fn) {
  const std::function<void(const std::string&)> log = log_fn ? log_fn : [](const std::string&) {};
  if (!job.unstructured && !job.structured.any())
    fail(ErrorKind::invalid_input, "nothing to prune: give --method magnitude|wanda and/or --heads, --channels, --layers");
  if (job.needs_calibration() && job.calib_file.empty())
    fail(ErrorKind::invalid_input, "{} needs calibration text: give --calib FILE",
         job.structured.any() ? "structured pruning (--heads, --channels, --layers)" : "--method wanda");
  ThreadPool pool(job.threads);
  auto backend = make_backend(kCpu, pool);
  PruneResult result;
  CalibrationStats stats;
  if (job.needs_calibration()) {
    CalibrationOptions opt;
    opt.n_ctx = job.calib_ctx;
    opt.max_chunks = job.calib_chunks;
    stats = calibrate_on_text(job.model_path, *backend, job.calib_file, opt, log);
    result.calib_tokens = stats.chunks * stats.chunk_size;
  }

  // A GGUF source's tokenizer is needed to write a folder's tokenizer files or
  // a GGUF's tokenizer keys; an HF folder's files are copied as they are.
  const bool gguf = !std::filesystem::is_directory(job.model_path);
  result.model = Model::load(job.model_path, {.tokenizer = gguf, .pack = false, .fold_output_scales = true});
  Model& m = *result.model;
  ModelWeights& w = m.mutable_weights();
  ModelConfig c = m.config();
  make_weights_mutable(w, c);
  result.linear_params_before = linear_params(w);
  if (job.structured.any()) {
    result.structure = prune_structure(w, c, job.structured, stats);
    m.reshape(c);
  }
  if (job.unstructured) {
    // The statistics were gathered on the unpruned shapes; wanda's row scores
    // need them per input channel, which structured pruning may have removed.
    if (job.structured.any() && job.unstructured->method == PruneMethod::wanda)
      fail(ErrorKind::invalid_input, "--method wanda together with --heads/--channels/--layers: prune the structure "
           "first, then run wanda on the result");
    result.pruned = prune_weights(pool, w, c, *job.unstructured, job.needs_calibration() ? &stats : nullptr);
    c.unstructured_pruning = fmt::format("{} {}", prune_method_name(job.unstructured->method),
                                         job.unstructured->describe());
    m.reshape(c);
  }
  result.linear_params_after = linear_params(w);
  for (const PruneReport& r : result.pruned) result.linear_zeros += r.zeros;
  return result;
}

}  // namespace loom
