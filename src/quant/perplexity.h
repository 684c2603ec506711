// Perplexity and KL divergence of a model over a text, as llama.cpp's
// llama-perplexity computes them, so numbers from the two tools compare:
// - the text is tokenized whole (BOS/EOS as the tokenizer adds them) and cut
//   into chunks of n_ctx tokens; each chunk is evaluated from an empty cache,
//   its first token replaced by BOS when the tokenizer adds one, and only the
//   second half is scored (token first+1 .. n_ctx-1 from positions
//   first .. n_ctx-2, first = n_ctx / 2), so every scored token has at least
//   n_ctx/2 tokens of context;
// - PPL = exp(mean NLL), its uncertainty sqrt(var(NLL) / (count - 1)) * PPL;
// - the log-prob file (`--kl-divergence-base`) is llama.cpp's own format:
//   "_logits_", u32 n_ctx, i32 n_vocab, i32 n_chunk, the chunks' tokens
//   (i32), then per scored position an f32 scale, an f32 minimum log-prob and
//   n_vocab (rounded up to even) u16 codes of the log-probs of the top 16 nats;
//   files either tool writes are read by the other;
// - KL divergence of the model's token distribution from the base's, the
//   change in the probability of the correct token (Δp) and how often both
//   models rank the same token first, with llama.cpp's statistics.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/forward.h"

namespace loom {

class AtomicFileWriter;

struct PerplexityOptions {
  int64_t n_ctx = 512;
  int64_t max_chunks = -1;  // -1: every whole chunk of the text
  int32_t bos = -1;         // >= 0: the first token of every chunk becomes this (the tokenizer adds BOS)
};

// Accumulated sums of one run (llama.cpp's kl_divergence_result).
struct ScoreSums {
  double nll = 0, nll2 = 0;                       // the model's negative log-likelihoods
  double nll_base = 0, nll_base2 = 0, nll_nll_base = 0;  // KL runs: the base model's, and their products
  double kld = 0, kld2 = 0;
  double p_diff = 0, p_diff2 = 0, p_diff4 = 0;
  float max_p_diff = 0;
  int64_t same_top = 0;
  int64_t count = 0;
  void add(const ScoreSums& o);
};

// A value and its uncertainty.
struct Estimate {
  double value = 0, uncertainty = 0;
};

// The statistics llama-perplexity prints after a KL-divergence run.
struct KlStatistics {
  Estimate ppl, ppl_base, ln_ppl_ratio, ppl_ratio, ppl_diff;
  double ln_ppl_correlation = 0;
  Estimate kld;
  double kld_max = 0, kld_median = 0, kld_min = 0;
  std::vector<std::pair<double, double>> kld_percentiles;  // (fraction, value): 99.9, 99, 95, 90, 10, 5, 1, 0.1 %
  Estimate p_diff;                                          // mean Δp
  double p_diff_max = 0, p_diff_median = 0, p_diff_min = 0;
  std::vector<std::pair<double, double>> p_diff_percentiles;  // 99.9 .. 0.1 %, with 75 and 25
  Estimate p_diff_rms;
  Estimate same_top;  // fraction
};

struct ChunkReport {
  int64_t chunk = 0, n_chunks = 0;  // 1-based index of the chunk just scored
  double seconds = 0;               // its evaluation time
  const ScoreSums* sums = nullptr;  // so far
};

struct PerplexityResult {
  int64_t n_chunks = 0, n_ctx = 0, n_tokens = 0;
  ScoreSums sums;
  Estimate ppl;
  std::vector<double> chunk_ppl;  // the running PPL after each chunk (llama.cpp's "[i]ppl," line)
  // KL runs only (empty otherwise): per scored token, in order.
  std::vector<float> kld_values, p_diff_values;
};

// Mean and uncertainty of a sum as llama.cpp reports them (0 below 11 values).
Estimate mean_and_uncertainty(double sum, double sum2, int64_t count);
// exp(mean NLL) with the uncertainty exp(x) * dx.
Estimate perplexity_of(double nll, double nll2, int64_t count);

// Scores `tokens` with `session` (its context must hold n_ctx), calling
// `on_chunk` after every chunk. With `save`, also writes the log-prob file
// (the caller commits it). Throws invalid_input when the text has fewer than
// 2 * n_ctx tokens, as llama-perplexity refuses it.
PerplexityResult compute_perplexity(InferenceSession& session, ThreadPool& pool, std::span<const int32_t> tokens,
                                    const PerplexityOptions& opt, AtomicFileWriter* save,
                                    const std::function<void(const ChunkReport&)>& on_chunk);

// A base model's log-prob file, read chunk by chunk.
class LogProbFile {
 public:
  // Opens and checks the header; throws invalid_input naming the file.
  explicit LogProbFile(const std::string& path);
  ~LogProbFile();
  int64_t n_ctx() const { return n_ctx_; }
  int64_t n_vocab() const { return n_vocab_; }
  int64_t n_chunks() const { return n_chunks_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }  // n_chunks * n_ctx
  // The next chunk's (n_ctx - 1 - n_ctx/2) rows of row_values() u16 each.
  const uint16_t* next_chunk();
  int64_t row_values() const { return 2 * ((n_vocab_ + 1) / 2) + 4; }

 private:
  std::string path_;
  struct Stream;
  std::unique_ptr<Stream> in_;
  int64_t n_ctx_ = 0, n_vocab_ = 0, n_chunks_ = 0, chunks_read_ = 0;
  std::vector<int32_t> tokens_;
  std::vector<uint16_t> chunk_;
};

// Evaluates the base file's tokens with `session` and compares with the base's
// log-probs. opt.n_ctx is taken from the file. Throws invalid_input when the
// vocabularies differ or the file ends early.
PerplexityResult compute_kl_divergence(InferenceSession& session, ThreadPool& pool, LogProbFile& base,
                                       const PerplexityOptions& opt,
                                       const std::function<void(const ChunkReport&)>& on_chunk);

// llama.cpp's final statistics of a KL run (needs at least 100 scored tokens).
KlStatistics kl_statistics(const PerplexityResult& r);

}  // namespace loom
