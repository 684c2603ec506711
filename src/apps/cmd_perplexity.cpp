// `loom perplexity`: perplexity of a model over a text file, and KL divergence
// against a base model's saved log-probs, computed and printed as llama.cpp's
// llama-perplexity does (quant/perplexity.h).
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "core/mapped_file.h"
#include "io/file_write.h"
#include "model/model.h"
#include "quant/perplexity.h"
#include "tokenizer/tokenizer.h"

namespace loom::app {
namespace {

void print_running_ppl(const ChunkReport& r) {
  if (r.chunk == 1) std::fprintf(stderr, "perplexity: %.2f seconds per pass\n", r.seconds);
  std::printf("[%lld]%.4f,", static_cast<long long>(r.chunk),
              std::exp(r.sums->nll / static_cast<double>(r.sums->count)));
  std::fflush(stdout);
}

void print_kl_chunk(const ChunkReport& r) {
  if (r.chunk == 1) {
    std::fprintf(stderr, "kl_divergence: %.2f seconds per pass\n", r.seconds);
    std::printf("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
                "Δp RMS            Same top p\n");
  }
  PerplexityResult partial;
  partial.sums = *r.sums;
  const KlStatistics k = kl_statistics(partial);
  std::printf("%4lld    %9.4f ± %9.4f    %10.5f ± %10.5f    %10.5f ± %10.5f    %6.3f ± %6.3f %%    %6.3f ± %6.3f %%\n",
              static_cast<long long>(r.chunk), k.ppl.value, k.ppl.uncertainty, k.ln_ppl_ratio.value,
              k.ln_ppl_ratio.uncertainty, k.kld.value, k.kld.uncertainty, 100 * k.p_diff_rms.value,
              100 * k.p_diff_rms.uncertainty, 100 * k.same_top.value, 100 * k.same_top.uncertainty);
  std::fflush(stdout);
}

std::string percent_label(double f) { return fmt::format("{:4.1f}%", 100 * f); }

void print_kl_statistics(const KlStatistics& k) {
  std::printf("\n====== Perplexity statistics ======\n");
  std::printf("Mean PPL(Q)                   : %10.6f ± %10.6f\n", k.ppl.value, k.ppl.uncertainty);
  std::printf("Mean PPL(base)                : %10.6f ± %10.6f\n", k.ppl_base.value, k.ppl_base.uncertainty);
  std::printf("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%\n", 100 * k.ln_ppl_correlation);
  std::printf("Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f\n", k.ln_ppl_ratio.value, k.ln_ppl_ratio.uncertainty);
  std::printf("Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f\n", k.ppl_ratio.value, k.ppl_ratio.uncertainty);
  std::printf("Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f\n", k.ppl_diff.value, k.ppl_diff.uncertainty);
  std::printf("\n====== KL divergence statistics ======\n");
  std::printf("Mean    KLD: %10.6f ± %10.6f\n", k.kld.value, k.kld.uncertainty);
  std::printf("Maximum KLD: %10.6f\n", k.kld_max);
  for (size_t i = 0; i < 4; ++i)
    std::printf("%s   KLD: %10.6f\n", percent_label(k.kld_percentiles[i].first).c_str(), k.kld_percentiles[i].second);
  std::printf("Median  KLD: %10.6f\n", k.kld_median);
  for (size_t i = 4; i < k.kld_percentiles.size(); ++i)
    std::printf("%s   KLD: %10.6f\n", percent_label(k.kld_percentiles[i].first).c_str(), k.kld_percentiles[i].second);
  std::printf("Minimum KLD: %10.6f\n", k.kld_min);
  std::printf("\n====== Token probability statistics ======\n");
  std::printf("Mean    Δp: %6.3f ± %5.3f %%\n", 100 * k.p_diff.value, 100 * k.p_diff.uncertainty);
  std::printf("Maximum Δp: %6.3f%%\n", 100 * k.p_diff_max);
  for (size_t i = 0; i < 5; ++i)
    std::printf("%s   Δp: %6.3f%%\n", percent_label(k.p_diff_percentiles[i].first).c_str(),
                100 * k.p_diff_percentiles[i].second);
  std::printf("Median  Δp: %6.3f%%\n", 100 * k.p_diff_median);
  for (size_t i = 5; i < k.p_diff_percentiles.size(); ++i)
    std::printf("%s   Δp: %6.3f%%\n", percent_label(k.p_diff_percentiles[i].first).c_str(),
                100 * k.p_diff_percentiles[i].second);
  std::printf("Minimum Δp: %6.3f%%\n", 100 * k.p_diff_min);
  std::printf("RMS Δp    : %6.3f ± %5.3f %%\n", 100 * k.p_diff_rms.value, 100 * k.p_diff_rms.uncertainty);
  std::printf("Same top p: %6.3f ± %5.3f %%\n", 100 * k.same_top.value, 100 * k.same_top.uncertainty);
}

nlohmann::json estimate_json(const Estimate& e) { return {{"value", e.value}, {"uncertainty", e.uncertainty}}; }

nlohmann::json result_json(const std::string& model, const PerplexityResult& r, const KlStatistics* k) {
  nlohmann::json j = {{"model", model},       {"n_ctx", r.n_ctx},       {"n_chunks", r.n_chunks},
                      {"n_tokens", r.n_tokens}, {"scored", r.sums.count}, {"ppl", estimate_json(r.ppl)},
                      {"chunk_ppl", r.chunk_ppl}};
  if (k != nullptr && !r.kld_values.empty()) {
    j["ppl_base"] = estimate_json(k->ppl_base);
    j["ln_ppl_ratio"] = estimate_json(k->ln_ppl_ratio);
    j["ppl_ratio"] = estimate_json(k->ppl_ratio);
    j["kld"] = estimate_json(k->kld);
    j["kld_median"] = k->kld_median;
    j["kld_max"] = k->kld_max;
    j["kld_99"] = k->kld_percentiles[1].second;
    j["p_diff_rms"] = estimate_json(k->p_diff_rms);
    j["same_top"] = estimate_json(k->same_top);
  }
  return j;
}

int run_perplexity(int argc, char** argv) {
  CLI::App app("Perplexity of a model over a text (as llama-perplexity), and KL divergence from a base model.",
               "perplexity");
  ModelFlags model_flags;
  std::string text_file, base_file, json_file;
  int64_t n_ctx = 512, chunks = -1;
  bool kl = false;
  DType kv_dtype = DType::f16;
  add_model_flags(app, model_flags);
  app.add_option("-f,--file", text_file, "the text to score (plain text, UTF-8)");
  app.add_option("-c,--ctx-size", n_ctx, "tokens per chunk; the second half of each is scored")
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--chunks", chunks, "score at most this many chunks (-1 = all)")
      ->check(all_or_some_chunks())
      ->capture_default_str();
  app.add_option("--kl-divergence-base", base_file,
                 "without --kl-divergence: save the model's log-probs here (llama.cpp's format); with it: "
                 "read the base model's log-probs from here");
  app.add_flag("--kl-divergence", kl, "compare with --kl-divergence-base (tokens come from that file; -f unused)");
  app.add_option("--json", json_file, "also write the results as JSON to this file");
  add_kv_cache_dtype_flag(app, kv_dtype);
  add_run_flags(app, model_flags);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  if (kl && base_file.empty())
    fail(ErrorKind::invalid_input, "--kl-divergence needs --kl-divergence-base FILE (the base model's log-probs)");
  if (!kl && text_file.empty()) fail(ErrorKind::invalid_input, "give the text to score with -f FILE");

  if (!json_file.empty()) check_file_writable(json_file, "--json");  // before the scoring, not after it
  if (!kl && !base_file.empty()) check_file_writable(base_file, "--kl-divergence-base");
  std::unique_ptr<LogProbFile> base;
  if (kl) base = std::make_unique<LogProbFile>(base_file);  // before the model loads: a bad file fails fast
  const int64_t chunk_len = base ? base->n_ctx() : n_ctx;
  const LoadedModel loaded = load_model(model_flags);
  const Model& model = *loaded.model;
  if (chunk_len > model.config().max_context)
    fail(ErrorKind::invalid_input, "a chunk of {} tokens is longer than the model's context {} (see -c)", chunk_len,
         model.config().max_context);
  const Tokenizer& tok = model.tokenizer();
  PerplexityOptions opt;
  opt.n_ctx = chunk_len;
  opt.max_chunks = chunks;
  opt.bos = tok.add_bos() ? tok.bos() : -1;
  InferenceSession session(model.config(), model.weights(), *loaded.backend, chunk_len, kv_dtype);

  PerplexityResult r;
  KlStatistics k;
  if (base) {
    std::fprintf(stderr, "kl_divergence: %lld chunks of %lld tokens from %s\n", static_cast<long long>(base->n_chunks()),
                 static_cast<long long>(chunk_len), base_file.c_str());
    r = compute_kl_divergence(session, *loaded.pool, *base, opt, print_kl_chunk);
    if (r.sums.count < 100) {
      std::fprintf(stderr, "kl_divergence: %lld scored tokens are too few for statistics (need 100)\n",
                   static_cast<long long>(r.sums.count));
    } else {
      k = kl_statistics(r);
      print_kl_statistics(k);
    }
  } else {
    const std::string text = read_text_file(text_file);
    const auto tokens = tok.encode(text, /*add_special=*/true, /*parse_special=*/false);
    std::fprintf(stderr, "perplexity: %zu tokens, %lld chunks of %lld, the second half of each scored\n",
                 tokens.size(), static_cast<long long>(static_cast<int64_t>(tokens.size()) / chunk_len),
                 static_cast<long long>(chunk_len));
    std::unique_ptr<AtomicFileWriter> save;
    if (!base_file.empty()) save = std::make_unique<AtomicFileWriter>(base_file);
    r = compute_perplexity(session, *loaded.pool, tokens, opt, save.get(), print_running_ppl);
    if (save) save->commit();
    std::printf("\nFinal estimate: PPL = %.4f +/- %.5f\n", r.ppl.value, r.ppl.uncertainty);
    if (save) std::fprintf(stderr, "perplexity: log-probs saved to %s\n", base_file.c_str());
  }
  if (!json_file.empty())
    write_file_atomic(json_file, result_json(model_flags.model_path, r, base ? &k : nullptr).dump(1) + "\n");
  return 0;
}

}  // namespace

extern const Command kPerplexityCommand = {"perplexity", run_perplexity};

}  // namespace loom::app
