#include "quant/perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "io/file_write.h"

namespace loom {

namespace {

constexpr char kMagic[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};
// Log-probs more than this many nats under the top one are stored as the minimum.
constexpr float kLogProbRange = 16.0f;

int64_t scored_per_chunk(int64_t n_ctx) { return n_ctx - 1 - n_ctx / 2; }
int64_t row_values_for(int64_t n_vocab) { return 2 * ((n_vocab + 1) / 2) + 4; }

float row_max(const float* logits, int64_t V) {
  float m = logits[0];
  for (int64_t i = 1; i < V; ++i) m = std::max(m, logits[i]);
  return m;
}

// sum(exp(l - max)) in double over float exponentials, as llama.cpp sums it.
double sum_exp(const float* logits, int64_t V, float max) {
  double s = 0.0;
  for (int64_t i = 0; i < V; ++i) s += std::exp(logits[i] - max);
  return s;
}

// Negative log-likelihood of `tok`.
double row_nll(const float* logits, int64_t V, int32_t tok) {
  const float max = row_max(logits, V);
  return -(static_cast<double>(logits[tok] - max) - std::log(sum_exp(logits, V, max)));
}

// The NLL of `tok`, and the row's log-probs encoded for the file: f32 scale,
// f32 minimum log-prob, then V u16 codes (llama.cpp's layout, 16 nats deep).
double row_nll_encoded(const float* logits, int64_t V, int32_t tok, uint16_t* out) {
  float max = logits[0], min = logits[0];
  for (int64_t i = 1; i < V; ++i) {
    max = std::max(max, logits[i]);
    min = std::min(min, logits[i]);
  }
  min = std::max(min, max - kLogProbRange);
  const auto log_sum_exp = static_cast<float>(std::log(sum_exp(logits, V, max)));
  const float min_log_prob = min - max - log_sum_exp;
  const float scale = (max - min) / 65535.0f;
  std::memcpy(out, &scale, 4);
  std::memcpy(out + 2, &min_log_prob, 4);
  uint16_t* codes = out + 4;
  if (scale != 0.0f) {
    const float inv = 1.0f / scale;
    for (int64_t i = 0; i < V; ++i)
      codes[i] = logits[i] > min ? static_cast<uint16_t>(std::lrint(inv * (logits[i] - min))) : 0;
  } else {
    std::memset(codes, 0, static_cast<size_t>(V) * sizeof(uint16_t));
  }
  if (V % 2 != 0) codes[V] = 0;
  return static_cast<double>(max + log_sum_exp - logits[tok]);
}

// One scored token against the base's encoded row: accumulates into `s`,
// returns (KL divergence, Δp).
std::pair<double, float> row_kl(const float* logits, int64_t V, const uint16_t* base, int32_t tok, ScoreSums& s) {
  float max = logits[0];
  int64_t imax = 0;
  for (int64_t i = 1; i < V; ++i)
    if (logits[i] > max) {
      max = logits[i];
      imax = i;
    }
  const auto log_sum_exp = static_cast<float>(std::log(sum_exp(logits, V, max)));
  float scale, min_log_prob;
  std::memcpy(&scale, base, 4);
  std::memcpy(&min_log_prob, base + 2, 4);
  const uint16_t* codes = base + 4;

  const float nll = max + log_sum_exp - logits[tok];
  s.nll += nll;
  s.nll2 += static_cast<double>(nll) * nll;
  const float nll_base = -(scale * codes[tok] + min_log_prob);
  s.nll_base += nll_base;
  s.nll_base2 += static_cast<double>(nll_base) * nll_base;
  s.nll_nll_base += static_cast<double>(nll) * nll_base;

  const float log_norm = max + log_sum_exp;  // log-prob of i = logits[i] - log_norm
  double kld = 0.0;
  int64_t imax_base = 0;
  float base_max = 0.0f;
  for (int64_t i = 0; i < V; ++i) {
    const float lp_base = scale * codes[i] + min_log_prob;
    if (i == 0 || lp_base > base_max) {
      base_max = lp_base;
      imax_base = i;
    }
    if (lp_base > -kLogProbRange) kld += std::exp(lp_base) * (lp_base - logits[i] + log_norm);
  }
  s.kld += kld;
  s.kld2 += kld * kld;
  ++s.count;
  if (imax == imax_base) ++s.same_top;
  const float p_diff = std::exp(-nll) - std::exp(-nll_base);
  s.p_diff += p_diff;
  const double p_diff2 = static_cast<double>(p_diff) * p_diff;
  s.p_diff2 += p_diff2;
  s.p_diff4 += p_diff2 * p_diff2;
  s.max_p_diff = std::max(s.max_p_diff, std::fabs(p_diff));
  return {kld, p_diff};
}

// Runs fn(row, sums) for rows [0, n) on the pool; the per-thread sums are
// added in thread order, so the totals do not depend on scheduling.
template <typename F>
ScoreSums score_rows(ThreadPool& pool, int64_t n, F&& fn) {
  std::vector<ScoreSums> part(static_cast<size_t>(pool.size()));
  pool.run([&](int ti, int tn) {
    const int64_t chunk = (n + tn - 1) / tn, b = chunk * ti, e = std::min(n, b + chunk);
    for (int64_t r = b; r < e; ++r) fn(r, part[static_cast<size_t>(ti)]);
  });
  ScoreSums total;
  for (const auto& p : part) total.add(p);
  return total;
}

// Evaluates one chunk from an empty cache; returns the logits of positions
// first .. n_ctx-1 (the first half yields only its last row, unused).
const float* eval_chunk(InferenceSession& session, std::span<const int32_t> chunk, int32_t bos,
                        std::vector<int32_t>& scratch) {
  const auto n_ctx = static_cast<int64_t>(chunk.size()), first = n_ctx / 2;
  scratch.assign(chunk.begin(), chunk.end());
  if (bos >= 0) scratch[0] = bos;
  session.truncate(0);
  session.eval(std::span<const int32_t>(scratch.data(), static_cast<size_t>(first)), /*all_logits=*/false);
  session.eval(std::span<const int32_t>(scratch.data() + first, static_cast<size_t>(n_ctx - first)),
               /*all_logits=*/true);
  return session.logits().data();
}

void check_context(const InferenceSession& session, int64_t n_ctx) {
  if (n_ctx < 4) fail(ErrorKind::invalid_input, "--ctx-size {} is too small: perplexity needs at least 4", n_ctx);
  if (session.n_ctx() < n_ctx)
    fail(ErrorKind::invalid_input, "the session holds {} positions, fewer than the chunk size {}", session.n_ctx(),
         n_ctx);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename T>
void write_pod(AtomicFileWriter& w, T v) {
  w.write(&v, sizeof v);
}

double percentile(const std::vector<float>& sorted, double fraction) {
  if (fraction <= 0) return sorted.front();
  if (fraction >= 1) return sorted.back();
  double p = fraction * static_cast<double>(sorted.size() - 1);
  const auto ip = static_cast<size_t>(p);
  p -= static_cast<double>(ip);
  return (1 - p) * sorted[ip] + p * sorted[std::min(ip + 1, sorted.size() - 1)];
}

double median(const std::vector<float>& sorted) {
  const size_t n = sorted.size();
  return n % 2 == 0 ? 0.5 * (sorted[n / 2] + sorted[n / 2 - 1]) : sorted[n / 2];
}

}  // namespace

void ScoreSums::add(const ScoreSums& o) {
  nll += o.nll;
  nll2 += o.nll2;
  nll_base += o.nll_base;
  nll_base2 += o.nll_base2;
  nll_nll_base += o.nll_nll_base;
  kld += o.kld;
  kld2 += o.kld2;
  p_diff += o.p_diff;
  p_diff2 += o.p_diff2;
  p_diff4 += o.p_diff4;
  max_p_diff = std::max(max_p_diff, o.max_p_diff);
  same_top += o.same_top;
  count += o.count;
}

Estimate mean_and_uncertainty(double sum, double sum2, int64_t count) {
  if (count < 1) return {};
  const double f = sum / static_cast<double>(count);
  const double var = sum2 / static_cast<double>(count) - f * f;
  return {f, var > 0 && count > 10 ? std::sqrt(var / static_cast<double>(count - 1)) : 0.0};
}

Estimate perplexity_of(double nll, double nll2, int64_t count) {
  if (count < 1) return {};
  const double mean = nll / static_cast<double>(count);
  const double var = nll2 / static_cast<double>(count) - mean * mean;
  const double ppl = std::exp(mean);
  return {ppl, var > 0 && count > 1 ? std::sqrt(var / static_cast<double>(count - 1)) * ppl : 0.0};
}

PerplexityResult compute_perplexity(InferenceSession& session, ThreadPool& pool, std::span<const int32_t> tokens,
                                    const PerplexityOptions& opt, AtomicFileWriter* save,
                                    const std::function<void(const ChunkReport&)>& on_chunk) {
  const int64_t n_ctx = opt.n_ctx, V = session.vocab_size();
  check_context(session, n_ctx);
  const auto n_tokens = static_cast<int64_t>(tokens.size());
  if (n_tokens < 2 * n_ctx)
    fail(ErrorKind::invalid_input,
         "the text tokenizes to {} tokens; perplexity with a context of {} needs at least {} (2 chunks)", n_tokens,
         n_ctx, 2 * n_ctx);
  PerplexityResult r;
  r.n_ctx = n_ctx;
  r.n_tokens = n_tokens;
  r.n_chunks = n_tokens / n_ctx;
  if (opt.max_chunks >= 0) r.n_chunks = std::min(r.n_chunks, opt.max_chunks);
  const int64_t first = n_ctx / 2, scored = scored_per_chunk(n_ctx), nv = row_values_for(V);

  std::vector<uint16_t> encoded;
  if (save != nullptr) {
    save->write(kMagic, sizeof kMagic);
    write_pod(*save, static_cast<uint32_t>(n_ctx));
    write_pod(*save, static_cast<int32_t>(V));
    write_pod(*save, static_cast<int32_t>(r.n_chunks));
    save->write(tokens.data(), static_cast<size_t>(r.n_chunks * n_ctx) * sizeof(int32_t));
    encoded.resize(static_cast<size_t>(scored * nv));
  }
  std::vector<int32_t> scratch;
  for (int64_t c = 0; c < r.n_chunks; ++c) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto chunk = tokens.subspan(static_cast<size_t>(c * n_ctx), static_cast<size_t>(n_ctx));
    const float* logits = eval_chunk(session, chunk, opt.bos, scratch);
    const int32_t* targets = chunk.data() + first + 1;
    r.sums.add(score_rows(pool, scored, [&](int64_t i, ScoreSums& s) {
      const float* row = logits + i * V;
      const double nll = save != nullptr ? row_nll_encoded(row, V, targets[i], encoded.data() + i * nv)
                                         : row_nll(row, V, targets[i]);
      s.nll += nll;
      s.nll2 += nll * nll;
      ++s.count;
    }));
    if (save != nullptr) save->write(encoded.data(), encoded.size() * sizeof(uint16_t));
    r.chunk_ppl.push_back(std::exp(r.sums.nll / static_cast<double>(r.sums.count)));
    if (on_chunk) on_chunk({c + 1, r.n_chunks, seconds_since(t0), &r.sums});
  }
  r.ppl = perplexity_of(r.sums.nll, r.sums.nll2, r.sums.count);
  return r;
}

struct LogProbFile::Stream {
  std::ifstream f;
};

LogProbFile::LogProbFile(const std::string& path) : path_(path), in_(std::make_unique<Stream>()) {
  in_->f.open(path, std::ios::binary);
  if (!in_->f) fail(ErrorKind::not_found, "{}: cannot open the base log-prob file", path);
  char magic[8];
  uint32_t n_ctx = 0;
  int32_t n_vocab = 0, n_chunks = 0;
  in_->f.read(magic, 8);
  if (!in_->f || std::memcmp(magic, kMagic, 8) != 0)
    fail(ErrorKind::invalid_input,
         "{}: not a log-prob file (no \"_logits_\" header; write one with --kl-divergence-base FILE without "
         "--kl-divergence)",
         path);
  in_->f.read(reinterpret_cast<char*>(&n_ctx), 4);
  in_->f.read(reinterpret_cast<char*>(&n_vocab), 4);
  in_->f.read(reinterpret_cast<char*>(&n_chunks), 4);
  if (!in_->f) fail(ErrorKind::invalid_input, "{}: the header ends early", path);
  if (n_ctx < 4 || n_ctx > (1u << 24) || n_vocab <= 0 || n_vocab > (1 << 24) || n_chunks <= 0 || n_chunks > (1 << 24))
    fail(ErrorKind::invalid_input, "{}: implausible header (n_ctx {}, n_vocab {}, n_chunk {})", path, n_ctx,
         n_vocab, n_chunks);
  n_ctx_ = n_ctx;
  n_vocab_ = n_vocab;
  n_chunks_ = n_chunks;
  tokens_.resize(static_cast<size_t>(n_ctx_ * n_chunks_));
  in_->f.read(reinterpret_cast<char*>(tokens_.data()), static_cast<std::streamsize>(tokens_.size() * 4));
  if (!in_->f)
    fail(ErrorKind::invalid_input, "{}: the file ends inside its {} tokens", path, tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i)
    if (tokens_[i] < 0 || tokens_[i] >= n_vocab_)
      fail(ErrorKind::invalid_input, "{}: token {} is {}, outside the vocabulary of {}", path, i, tokens_[i],
           n_vocab_);
  chunk_.resize(static_cast<size_t>(scored_per_chunk(n_ctx_) * row_values()));
}

LogProbFile::~LogProbFile() = default;

const uint16_t* LogProbFile::next_chunk() {
  if (chunks_read_ >= n_chunks_) fail(ErrorKind::invalid_input, "{}: no chunk after {}", path_, n_chunks_);
  in_->f.read(reinterpret_cast<char*>(chunk_.data()), static_cast<std::streamsize>(chunk_.size() * 2));
  if (!in_->f)
    fail(ErrorKind::invalid_input, "{}: the file ends inside the log-probs of chunk {} of {}", path_,
         chunks_read_ + 1, n_chunks_);
  ++chunks_read_;
  return chunk_.data();
}

PerplexityResult compute_kl_divergence(InferenceSession& session, ThreadPool& pool, LogProbFile& base,
                                       const PerplexityOptions& opt,
                                       const std::function<void(const ChunkReport&)>& on_chunk) {
  const int64_t V = session.vocab_size(), n_ctx = base.n_ctx();
  if (base.n_vocab() != V)
    fail(ErrorKind::invalid_input, "the base log-probs are over a vocabulary of {}, the model's is {}",
         base.n_vocab(), V);
  check_context(session, n_ctx);
  PerplexityResult r;
  r.n_ctx = n_ctx;
  r.n_chunks = base.n_chunks();
  if (opt.max_chunks >= 0) r.n_chunks = std::min(r.n_chunks, opt.max_chunks);
  r.n_tokens = r.n_chunks * n_ctx;
  const int64_t first = n_ctx / 2, scored = scored_per_chunk(n_ctx), nv = base.row_values();
  r.kld_values.resize(static_cast<size_t>(scored * r.n_chunks));
  r.p_diff_values.resize(r.kld_values.size());
  std::vector<int32_t> scratch;
  for (int64_t c = 0; c < r.n_chunks; ++c) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto chunk = std::span<const int32_t>(base.tokens()).subspan(static_cast<size_t>(c * n_ctx),
                                                                        static_cast<size_t>(n_ctx));
    const uint16_t* base_rows = base.next_chunk();
    const float* logits = eval_chunk(session, chunk, opt.bos, scratch);
    const int32_t* targets = chunk.data() + first + 1;
    float* kld_out = r.kld_values.data() + c * scored;
    float* dp_out = r.p_diff_values.data() + c * scored;
    r.sums.add(score_rows(pool, scored, [&](int64_t i, ScoreSums& s) {
      const auto [kld, dp] = row_kl(logits + i * V, V, base_rows + i * nv, targets[i], s);
      kld_out[i] = static_cast<float>(kld);
      dp_out[i] = dp;
    }));
    r.chunk_ppl.push_back(std::exp(r.sums.nll / static_cast<double>(r.sums.count)));
    if (on_chunk) on_chunk({c + 1, r.n_chunks, seconds_since(t0), &r.sums});
  }
  r.ppl = perplexity_of(r.sums.nll, r.sums.nll2, r.sums.count);
  return r;
}

KlStatistics kl_statistics(const PerplexityResult& r) {
  const ScoreSums& s = r.sums;
  const int64_t n = s.count;
  KlStatistics k;
  auto cov = [n](double a, double b, double ab) {
    if (n < 10) return 0.0;
    return (ab / n - (a / n) * (b / n)) / static_cast<double>(n - 1);
  };
  const Estimate lp = mean_and_uncertainty(s.nll, s.nll2, n);
  const Estimate lpb = mean_and_uncertainty(s.nll_base, s.nll_base2, n);
  k.ppl = {std::exp(lp.value), std::exp(lp.value) * lp.uncertainty};
  k.ppl_base = {std::exp(lpb.value), std::exp(lpb.value) * lpb.uncertainty};
  const double c = cov(s.nll, s.nll_base, s.nll_nll_base);
  k.ln_ppl_correlation = c / (lp.uncertainty * lpb.uncertainty);
  k.ln_ppl_ratio = {lp.value - lpb.value,
                    std::sqrt(lp.uncertainty * lp.uncertainty + lpb.uncertainty * lpb.uncertainty - 2.0 * c)};
  k.ppl_ratio = {std::exp(k.ln_ppl_ratio.value), std::exp(k.ln_ppl_ratio.value) * k.ln_ppl_ratio.uncertainty};
  const double ppl_cov = k.ppl.value * k.ppl_base.value * c;
  k.ppl_diff = {k.ppl.value - k.ppl_base.value,
                std::sqrt(k.ppl.uncertainty * k.ppl.uncertainty + k.ppl_base.uncertainty * k.ppl_base.uncertainty -
                          2.0 * ppl_cov)};
  k.kld = mean_and_uncertainty(s.kld, s.kld2, n);
  k.p_diff = mean_and_uncertainty(s.p_diff, s.p_diff2, n);
  const Estimate mse = mean_and_uncertainty(s.p_diff2, s.p_diff4, n);
  k.p_diff_rms = {std::sqrt(mse.value), mse.value > 0 ? 0.5 / std::sqrt(mse.value) * mse.uncertainty : 0.0};
  const double top = n > 0 ? static_cast<double>(s.same_top) / n : 0.0;
  k.same_top = {top, n > 1 ? std::sqrt(top * (1 - top) / static_cast<double>(n - 1)) : 0.0};
  if (r.kld_values.empty()) return k;
  std::vector<float> kld = r.kld_values, dp = r.p_diff_values;
  std::sort(kld.begin(), kld.end());
  std::sort(dp.begin(), dp.end());
  k.kld_max = kld.back();
  k.kld_min = kld.front();
  k.kld_median = median(kld);
  for (double f : {0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001}) k.kld_percentiles.push_back({f, percentile(kld, f)});
  k.p_diff_max = dp.back();
  k.p_diff_min = dp.front();
  k.p_diff_median = median(dp);
  for (double f : {0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001})
    k.p_diff_percentiles.push_back({f, percentile(dp, f)});
  return k;
}

}  // namespace loom
