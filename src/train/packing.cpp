// Samples -> rows -> micro-batches (see data.h): eval split, seeded shuffles,
// greedy packing, and the resumable DataLoader.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "train/data.h"

namespace loom {
namespace {

// Independent random streams derived from the one user seed.
constexpr uint64_t kStreamEvalSplit = 1;
constexpr uint64_t kStreamPackOrder = 2;
constexpr uint64_t kStreamEpochBase = 1000;

uint64_t bounded(uint64_t x, uint64_t n) {  // x * n / 2^64: uniform in [0, n)
  return static_cast<uint64_t>((static_cast<unsigned __int128>(x) * n) >> 64);
}

int32_t pad_token(const Tokenizer& tok) {
  if (tok.spec().pad_id >= 0) return tok.spec().pad_id;
  if (tok.eos() >= 0) return tok.eos();
  return 0;
}

DataSplit make_split(std::shared_ptr<const SampleSet> samples, std::vector<int64_t> order, const DataStats& stats,
                     const DataOptions& opt, bool shuffle) {
  if (shuffle) {
    const std::vector<int64_t> p = seeded_permutation(static_cast<int64_t>(order.size()), opt.seed, kStreamPackOrder);
    std::vector<int64_t> shuffled(order.size());
    for (size_t i = 0; i < order.size(); ++i) shuffled[i] = order[p[i]];
    order = std::move(shuffled);
  }
  DataSplit s;
  s.rows = pack_samples(*samples, order, opt.seq_len, opt.pack);
  s.samples = std::move(samples);
  s.stats = stats;
  s.n_samples = static_cast<int64_t>(order.size());
  return s;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

}  // namespace

namespace {
// Into `p` (its memory reused): identity, then shuffled unless !shuffle.
void fill_order(std::vector<int64_t>& p, int64_t n, bool shuffle, uint64_t seed, uint64_t stream) {
  p.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  if (!shuffle) return;
  CounterRng rng(splitmix64(seed) ^ splitmix64(stream * 0x632be59bd9b4e019ull + 1));
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[bounded(rng.next_u64(), static_cast<uint64_t>(i) + 1)]);
}
}  // namespace

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, uint64_t stream) {
  std::vector<int64_t> p;
  fill_order(p, n, true, seed, stream);
  return p;
}

PackedRows pack_samples(const SampleSet& set, std::span<const int64_t> order, int64_t seq_len, bool pack) {
  PackedRows r;
  r.seq_len = seq_len;
  int64_t used = 0;  // tokens in the open row
  for (int64_t i : order) {
    const int64_t n = set.length(i);
    LOOM_ASSERT(n >= 1 && n <= seq_len);
    if (used > 0 && (!pack || used + n > seq_len)) {
      r.row_offsets.push_back(static_cast<int64_t>(r.samples.size()));
      used = 0;
    }
    r.samples.push_back(i);
    used += n;
  }
  if (used > 0) r.row_offsets.push_back(static_cast<int64_t>(r.samples.size()));
  return r;
}

TrainData prepare_train_data(const std::string& train_path, const Tokenizer& tok, const ChatTemplate* tmpl,
                             const DataOptions& opt) {
  if (opt.seq_len < 2) fail(ErrorKind::invalid_input, "seq_len must be at least 2, got {}", opt.seq_len);
  if (!(opt.eval_fraction >= 0 && opt.eval_fraction < 1))
    fail(ErrorKind::invalid_input, "eval fraction must be in [0, 1), got {}", opt.eval_fraction);
  if (opt.eval_count < 0) fail(ErrorKind::invalid_input, "eval count must not be negative, got {}", opt.eval_count);
  if (!opt.eval_file.empty() && (opt.eval_count > 0 || opt.eval_fraction > 0))
    fail(ErrorKind::invalid_input, "give either an eval file or an eval split (fraction / count), not both");

  TrainData d;
  d.pad_id = pad_token(tok);
  DataStats stats;
  auto train = std::make_shared<const SampleSet>(load_jsonl_dataset(train_path, tok, tmpl, opt, stats, d.train_cache));
  const int64_t n = train->size();

  if (!opt.eval_file.empty()) {
    DataStats eval_stats;
    auto eval = std::make_shared<const SampleSet>(
        load_jsonl_dataset(opt.eval_file, tok, tmpl, opt, eval_stats, d.eval_cache));
    const int64_t ne = eval->size();
    d.eval = make_split(std::move(eval), iota(ne), eval_stats, opt, false);
    d.train = make_split(train, iota(n), stats, opt, opt.shuffle);
    return d;
  }
  const int64_t n_eval = opt.eval_count > 0 ? opt.eval_count : std::llround(opt.eval_fraction * static_cast<double>(n));
  if (n_eval >= n)
    fail(ErrorKind::invalid_input, "{}: an eval split of {} samples leaves none of the {} samples for training",
         train_path, n_eval, n);
  if (n_eval == 0) {
    if (opt.eval_fraction > 0)
      fail(ErrorKind::invalid_input, "{}: eval fraction {} of {} samples is no sample; use a larger fraction",
           train_path, opt.eval_fraction, n);
    d.train = make_split(train, iota(n), stats, opt, opt.shuffle);
    return d;
  }
  // Eval samples are a seeded choice, kept in file order; training gets the rest.
  std::vector<int64_t> p = seeded_permutation(n, opt.seed, kStreamEvalSplit);
  std::vector<int64_t> eval_ids(p.begin(), p.begin() + n_eval), train_ids(p.begin() + n_eval, p.end());
  std::sort(eval_ids.begin(), eval_ids.end());
  std::sort(train_ids.begin(), train_ids.end());
  d.eval = make_split(train, std::move(eval_ids), stats, opt, false);
  d.train = make_split(train, std::move(train_ids), stats, opt, opt.shuffle);
  return d;
}

void fill_batch(const DataSplit& split, std::span<const int64_t> row_ids, int32_t pad_id, Batch& out) {
  const int64_t T = split.rows.seq_len;
  const size_t n = row_ids.size() * static_cast<size_t>(T);
  out.rows = static_cast<int64_t>(row_ids.size());
  out.seq_len = T;
  out.tokens.assign(n, pad_id);
  out.targets.assign(n, kIgnoreLabel);
  out.positions.assign(n, 0);
  out.seq_start.resize(n);
  out.target_tokens = 0;
  const SampleSet& set = *split.samples;
  for (size_t r = 0; r < row_ids.size(); ++r) {
    const int64_t row = row_ids[r];
    LOOM_ASSERT(row >= 0 && row < split.rows.rows());
    const size_t base = r * static_cast<size_t>(T);
    int32_t t = 0;
    for (int64_t k = split.rows.row_offsets[row]; k < split.rows.row_offsets[row + 1]; ++k) {
      const auto ids = set.ids_of(split.rows.samples[k]);
      const auto labels = set.labels_of(split.rows.samples[k]);
      const int32_t start = t;
      for (size_t i = 0; i < ids.size(); ++i, ++t) {
        out.tokens[base + t] = ids[i];
        out.positions[base + t] = static_cast<int32_t>(i);
        out.seq_start[base + t] = start;
        if (i + 1 < ids.size() && labels[i + 1] != kIgnoreLabel) {
          out.targets[base + t] = labels[i + 1];
          ++out.target_tokens;
        }
      }
    }
    LOOM_ASSERT(t <= T);
    for (; t < T; ++t) out.seq_start[base + t] = t;
  }
}

DataLoader::DataLoader(const DataSplit& split, int32_t pad_id, int64_t batch_rows, bool shuffle, uint64_t seed,
                       DataCursor start)
    : split_(split), pad_id_(pad_id), batch_rows_(batch_rows), shuffle_(shuffle), seed_(seed) {
  if (batch_rows < 1) fail(ErrorKind::invalid_input, "batch size must be at least 1 row, got {}", batch_rows);
  if (split.rows.rows() == 0) fail(ErrorKind::invalid_input, "the data split has no rows");
  seek(start);
}

void DataLoader::seek(DataCursor c) {
  if (c.epoch < 0 || c.index < 0 || c.index >= split_.rows.rows())
    fail(ErrorKind::invalid_input, "data cursor (epoch {}, index {}) is outside the data ({} rows per epoch)",
         c.epoch, c.index, split_.rows.rows());
  cursor_ = c;
}

int64_t DataLoader::batches_per_epoch() const { return (split_.rows.rows() + batch_rows_ - 1) / batch_rows_; }

void DataLoader::load_order() {
  if (order_epoch_ == cursor_.epoch) return;
  const int64_t n = split_.rows.rows();
  fill_order(order_, n, shuffle_, seed_, kStreamEpochBase + static_cast<uint64_t>(cursor_.epoch));
  order_epoch_ = cursor_.epoch;
}

Batch DataLoader::next() {
  Batch b;
  next(b);
  return b;
}

void DataLoader::next(Batch& out) {
  load_order();
  const int64_t n = split_.rows.rows();
  const int64_t take = std::min(batch_rows_, n - cursor_.index);
  const auto full = static_cast<size_t>(batch_rows_ * split_.rows.seq_len);
  for (std::vector<int32_t>* v : {&out.tokens, &out.targets, &out.positions, &out.seq_start}) v->reserve(full);
  fill_batch(split_, std::span<const int64_t>(order_).subspan(cursor_.index, take), pad_id_, out);
  cursor_.index += take;
  if (cursor_.index == n) cursor_ = {cursor_.epoch + 1, 0};
}

void DataLoader::skip() {
  const int64_t n = split_.rows.rows();
  cursor_.index += std::min(batch_rows_, n - cursor_.index);
  if (cursor_.index == n) cursor_ = {cursor_.epoch + 1, 0};
}

size_t Batch::capacity_bytes() const {
  return (tokens.capacity() + targets.capacity() + positions.capacity() + seq_start.capacity()) * sizeof(int32_t);
}

}  // namespace loom
