// Bucketed, overlapped gradient all-reduce with optional compression. The
// compression kernels are loops written here: they run on the communication
// thread over a bucket at a time, and their cost is small next to the wire.
#include "dist/grad_reducer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>

#include <fmt/format.h>

#include "core/error.h"
#include "core/rng.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

constexpr struct {
  GradCompression c;
  const char* name;
} kCompressions[] = {{GradCompression::none, "none"}, {GradCompression::topk, "topk"},
                     {GradCompression::powersgd, "powersgd"}};

// Top-k's payload entry: the index inside the bucket and the value.
struct SparseEntry {
  uint32_t index;
  float value;
};

// Gram-Schmidt on the columns of P [rows, r] (row-major), in double; a column
// that vanishes becomes zero (it then carries nothing, as torch's PowerSGD).
// Each column is projected out twice: after one pass a column that lay (nearly)
// in the span of the earlier ones (P of a gradient of rank < r) is float
// rounding noise that is not orthogonal to them, and normalized it would turn
// P P^T M into something other than a projection of M.
void orthonormalize_columns(float* p, int64_t rows, int64_t r) {
  for (int64_t k = 0; k < r; ++k) {
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t j = 0; j < k; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < rows; ++i) dot += static_cast<double>(p[i * r + k]) * p[i * r + j];
        for (int64_t i = 0; i < rows; ++i) p[i * r + k] -= static_cast<float>(dot) * p[i * r + j];
      }
    double norm = 0;
    for (int64_t i = 0; i < rows; ++i) norm += static_cast<double>(p[i * r + k]) * p[i * r + k];
    norm = std::sqrt(norm);
    const float inv = norm > 1e-12 ? static_cast<float>(1.0 / norm) : 0.0f;
    for (int64_t i = 0; i < rows; ++i) p[i * r + k] *= inv;
  }
}

// out [rows, r] = M [rows, cols] Q [cols, r]
void matmul_mq(const float* m, const float* q, float* out, int64_t rows, int64_t cols, int64_t r) {
  std::fill(out, out + rows * r, 0.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const float a = m[i * cols + j];
      for (int64_t k = 0; k < r; ++k) out[i * r + k] += a * q[j * r + k];
    }
}

// out [cols, r] = M^T P
void matmul_mtp(const float* m, const float* p, float* out, int64_t rows, int64_t cols, int64_t r) {
  std::fill(out, out + cols * r, 0.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const float a = m[i * cols + j];
      for (int64_t k = 0; k < r; ++k) out[j * r + k] += a * p[i * r + k];
    }
}

}  // namespace

const char* grad_compression_name(GradCompression c) {
  for (const auto& n : kCompressions)
    if (n.c == c) return n.name;
  return "?";
}

const GradCompression* grad_compression_from_name(std::string_view name) {
  for (const auto& n : kCompressions)
    if (name == n.name) return &n.c;
  return nullptr;
}

GradientReducer::GradientReducer(Communicator& comm, std::span<float> grads,
                                 std::vector<std::pair<size_t, size_t>> layer_ranges, std::vector<GradMatrix> matrices,
                                 GradSyncOptions options)
    : comm_(comm), grads_(grads), matrices_(std::move(matrices)), opt_(options) {
  LOOM_ASSERT(opt_.bucket_bytes >= sizeof(float));
  std::sort(matrices_.begin(), matrices_.end(),
            [](const GradMatrix& a, const GradMatrix& b) { return a.offset < b.offset; });
  plan_buckets(layer_ranges);
  if (opt_.compression != GradCompression::none) residual_.assign(grads_.size(), 0.0f);
  // PowerSGD pays where rank * (rows + cols) is well under rows * cols.
  compress_matrix_.assign(matrices_.size(), false);
  q_.resize(matrices_.size());
  if (opt_.compression == GradCompression::powersgd) {
    const int64_t r = opt_.powersgd_rank;
    for (size_t i = 0; i < matrices_.size(); ++i) {
      const GradMatrix& m = matrices_[i];
      if (r * (m.rows + m.cols) * 2 > m.rows * m.cols) continue;
      compress_matrix_[i] = true;
      // The first Q: the same uniform draws in [-1, 1) on every rank (seeded per matrix).
      CounterRng rng(splitmix64(opt_.seed ^ 0x9e3779b97f4a7c15ULL) + i);
      q_[i].resize(static_cast<size_t>(m.cols * r));
      for (float& v : q_[i]) v = static_cast<float>(2.0 * rng.next_double() - 1.0);
    }
  }
  for (size_t i = 0; i < matrices_.size(); ++i)
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (matrices_[i].offset >= buckets_[b].offset &&
          matrices_[i].offset + static_cast<size_t>(matrices_[i].rows * matrices_[i].cols) <=
              buckets_[b].offset + buckets_[b].size)
        buckets_[b].matrices.push_back(i);
  handed_.assign(buckets_.size(), false);
  pending_layers_.assign(buckets_.size(), 0);
  if (comm_.size() > 1) thread_ = std::thread([this] { thread_main(); });
}

GradientReducer::~GradientReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::vector<float> GradientReducer::powersgd_q() const {
  std::vector<float> out;
  for (const auto& q : q_) out.insert(out.end(), q.begin(), q.end());
  return out;
}

void GradientReducer::set_powersgd_q(std::span<const float> q) {
  size_t n = 0;
  for (const auto& v : q_) n += v.size();
  if (q.size() != n)
    fail(ErrorKind::invalid_input, "PowerSGD state: {} values, this run's matrices need {}", q.size(), n);
  size_t at = 0;
  for (auto& v : q_) {
    std::copy(q.begin() + static_cast<std::ptrdiff_t>(at), q.begin() + static_cast<std::ptrdiff_t>(at + v.size()),
              v.begin());
    at += v.size();
  }
}

size_t GradientReducer::state_bytes() const {
  size_t n = residual_.size() * sizeof(float) + scratch_.capacity();
  for (const auto& q : q_) n += q.size() * sizeof(float);
  return n;
}

void GradientReducer::plan_buckets(const std::vector<std::pair<size_t, size_t>>& layers) {
  const size_t cap = std::max<size_t>(1, opt_.bucket_bytes / sizeof(float));
  const auto L = static_cast<int64_t>(layers.size());
  bucket_of_layer_.assign(layers.size(), -1);
  bool adjacent = true;
  for (int64_t l = 0; l + 1 < L; ++l) adjacent &= layers[l].second == layers[l + 1].first;
  // Layers, last first, merged while the bucket stays under the cap (and the layers touch).
  for (int64_t l = L - 1; l >= 0; --l) {
    const auto& [lo, hi] = layers[static_cast<size_t>(l)];
    LOOM_ASSERT(lo <= hi && hi <= grads_.size());
    Bucket* last = buckets_.empty() ? nullptr : &buckets_.back();
    if (adjacent && last && last->layer_lo == l + 1 && last->size + (hi - lo) <= cap) {
      last->offset = lo;
      last->size += hi - lo;
      last->layer_lo = l;
    } else {
      buckets_.push_back({lo, hi - lo, l, l, {}});
    }
    bucket_of_layer_[static_cast<size_t>(l)] = static_cast<int64_t>(buckets_.size()) - 1;
  }
  // What no layer covers, in chunks of the cap: reduced at finish().
  std::vector<std::pair<size_t, size_t>> covered = layers;
  std::sort(covered.begin(), covered.end());
  size_t at = 0;
  auto add_gap = [&](size_t lo, size_t hi) {
    for (size_t o = lo; o < hi; o += cap) buckets_.push_back({o, std::min(cap, hi - o), -1, -1, {}});
  };
  for (const auto& [lo, hi] : covered) {
    if (lo > at) add_gap(at, lo);
    at = std::max(at, hi);
  }
  if (at < grads_.size()) add_gap(at, grads_.size());
}

void GradientReducer::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  LOOM_ASSERT(outstanding_ == 0 && queue_.empty());
  std::fill(handed_.begin(), handed_.end(), false);
  for (size_t b = 0; b < buckets_.size(); ++b)
    pending_layers_[b] = buckets_[b].layer_lo < 0 ? -1 : buckets_[b].layer_hi - buckets_[b].layer_lo + 1;
  stats_ = {};
}

void GradientReducer::layer_done(int64_t l) {
  if (!opt_.overlap || comm_.size() == 1) return;
  LOOM_ASSERT(l >= 0 && static_cast<size_t>(l) < bucket_of_layer_.size());
  const auto b = static_cast<size_t>(bucket_of_layer_[static_cast<size_t>(l)]);
  if (--pending_layers_[b] == 0) hand_over(b);
}

void GradientReducer::hand_over(size_t b) {
  if (handed_[b]) return;
  handed_[b] = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(b);
    ++outstanding_;
  }
  cv_.notify_all();
}

GradSyncStats GradientReducer::finish() {
  if (comm_.size() == 1) return {};
  const auto t0 = Clock::now();
  for (size_t b = 0; b < buckets_.size(); ++b) hand_over(b);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return outstanding_ == 0; });
  stats_.wait_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  stats_.buckets = static_cast<int64_t>(buckets_.size());
  return stats_;
}

void GradientReducer::thread_main() {
  for (;;) {
    size_t b = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
      b = queue_.front();
      queue_.pop_front();
    }
    const auto t0 = Clock::now();
    try {
      reduce(buckets_[b]);
    } catch (const std::exception& e) {
      // Every rank must stop: the others wait in this bucket's collective.
      comm_.abort(fmt::format("gradient all-reduce failed: {}", e.what()));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.comm_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      --outstanding_;
    }
    cv_.notify_all();
  }
}

void GradientReducer::count_allreduce(size_t bytes, bool compressed) {
  const double n = comm_.size();
  const auto wire = static_cast<int64_t>(2.0 * (n - 1) / n * static_cast<double>(bytes));
  stats_.wire_bytes += wire;  // only the comm thread writes stats_ while buckets are out
  if (!compressed) stats_.uncompressed_wire_bytes += wire;
}

void GradientReducer::count_allgather(size_t bytes_per_rank) {
  stats_.wire_bytes += static_cast<int64_t>(comm_.size() - 1) * static_cast<int64_t>(bytes_per_rank);
}

void GradientReducer::reduce(const Bucket& b) {
  float* g = grads_.data() + b.offset;
  if (!compression_on_) {  // dist.compression_warmup: plain sums
    count_allreduce(b.size * sizeof(float), false);
    if (opt_.deterministic)
      reduce_deterministic(g, b.size);
    else
      reduce_plain(g, b.size);
  } else if (opt_.compression == GradCompression::topk) {
    const double n = comm_.size();
    stats_.uncompressed_wire_bytes += static_cast<int64_t>(2.0 * (n - 1) / n * 4.0 * static_cast<double>(b.size));
    reduce_topk(b);
  } else if (opt_.compression == GradCompression::powersgd) {
    reduce_powersgd(b);
  } else if (opt_.deterministic) {
    // An all-gather of the bucket: (N-1) B on the wire, against the plain all-reduce's 2 (N-1)/N B.
    const double n = comm_.size();
    stats_.uncompressed_wire_bytes += static_cast<int64_t>(2.0 * (n - 1) / n * 4.0 * static_cast<double>(b.size));
    count_allgather(b.size * sizeof(float));
    reduce_deterministic(g, b.size);
  } else {
    count_allreduce(b.size * sizeof(float), false);
    reduce_plain(g, b.size);
  }
}

void GradientReducer::reduce_plain(float* g, size_t n) {
  auto r = comm_.start_allreduce_sum(g, n);
  comm_.wait(*r, "gradient all-reduce");
}

// Every rank's copy gathered, then summed in rank order: the same bits whatever
// the library's algorithm, the message size or the timing.
void GradientReducer::reduce_deterministic(float* g, size_t n) {
  const auto N = static_cast<size_t>(comm_.size());
  scratch_.resize(N * n * sizeof(float));
  auto r = comm_.start_allgather(g, scratch_.data(), n * sizeof(float));
  comm_.wait(*r, "gradient all-gather (dist.deterministic)");
  const auto* all = reinterpret_cast<const float*>(scratch_.data());
  std::memcpy(g, all, n * sizeof(float));
  for (size_t k = 1; k < N; ++k)
    for (size_t i = 0; i < n; ++i) g[i] += all[k * n + i];
}

// Top-k with error feedback, tensor by tensor (as Deep Gradient Compression
// selects per layer: one bucket-wide threshold would starve the tensors with
// small gradients, such as LoRA's A next to its B): v = g + residual; each
// tensor's ceil(ratio n) largest |v| are sent as (index, value); the residual
// keeps the rest. The sum is rebuilt in rank order.
void GradientReducer::reduce_topk(const Bucket& b) {
  float* g = grads_.data() + b.offset;
  float* residual = residual_.data() + b.offset;
  for (size_t i = 0; i < b.size; ++i) residual[i] += g[i];  // residual now holds v
  std::vector<SparseEntry> mine;
  std::vector<float> mag;
  // One tensor's run [lo, hi) of the bucket: the k-th largest magnitude, then
  // the entries above it (ties fill up to k).
  auto select = [&](size_t lo, size_t hi) {
    const size_t n = hi - lo;
    if (n == 0) return;
    const size_t k =
        std::clamp<size_t>(static_cast<size_t>(std::ceil(opt_.topk_ratio * static_cast<double>(n))), 1, n);
    mag.resize(n);
    for (size_t i = 0; i < n; ++i) mag[i] = std::fabs(residual[lo + i]);
    std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(k - 1), mag.end(), std::greater<float>());
    const float threshold = mag[k - 1];
    const size_t want = mine.size() + k;
    for (size_t i = lo; i < hi && mine.size() < want; ++i)
      if (std::fabs(residual[i]) > threshold) mine.push_back({static_cast<uint32_t>(i), residual[i]});
    for (size_t i = lo; i < hi && mine.size() < want; ++i)
      if (std::fabs(residual[i]) == threshold) mine.push_back({static_cast<uint32_t>(i), residual[i]});
  };
  size_t at = 0;  // the tensors inside the bucket, and the runs between them
  for (size_t m : b.matrices) {
    const size_t lo = matrices_[m].offset - b.offset;
    if (lo < at) continue;  // overlapping spans: the first one wins
    select(at, lo);
    at = lo + static_cast<size_t>(matrices_[m].rows * matrices_[m].cols);
    select(lo, at);
  }
  select(at, b.size);
  for (const SparseEntry& e : mine) residual[e.index] = 0;  // sent: no longer owed
  const auto N = static_cast<size_t>(comm_.size());
  const size_t k = mine.size();  // the same on every rank: it depends only on the layout
  const size_t bytes = k * sizeof(SparseEntry);
  scratch_.resize(N * bytes);
  auto r = comm_.start_allgather(mine.data(), scratch_.data(), bytes);
  comm_.wait(*r, "gradient all-gather (dist.compression topk)");
  count_allgather(bytes);
  std::fill(g, g + b.size, 0.0f);
  const auto* all = reinterpret_cast<const SparseEntry*>(scratch_.data());
  for (size_t e = 0; e < N * k; ++e) g[all[e].index] += all[e].value;
}

// PowerSGD (Vogels et al. 2019) with error feedback and warm-started Q: for
// each large matrix M = g + residual, P = sum_ranks(M Q), orthonormalized,
// Q = sum_ranks(M^T P), M ~ P Q^T; the residual keeps M - P Q^T. The rest of
// the bucket rides uncompressed in the P message.
void GradientReducer::reduce_powersgd(const Bucket& b) {
  const int64_t r = opt_.powersgd_rank;
  std::vector<size_t> comp;
  for (size_t i : b.matrices)
    if (compress_matrix_[i]) comp.push_back(i);
  // The bucket's entries outside compressed matrices, as runs.
  std::vector<std::pair<size_t, size_t>> plain;
  {
    std::vector<std::pair<size_t, size_t>> taken;
    for (size_t i : comp) taken.push_back({matrices_[i].offset, static_cast<size_t>(matrices_[i].rows * matrices_[i].cols)});
    std::sort(taken.begin(), taken.end());
    size_t at = b.offset;
    for (const auto& [o, n] : taken) {
      if (o > at) plain.push_back({at, o - at});
      at = o + n;
    }
    if (at < b.offset + b.size) plain.push_back({at, b.offset + b.size - at});
  }
  size_t p_floats = 0, q_floats = 0, plain_floats = 0;
  for (size_t i : comp) {
    p_floats += static_cast<size_t>(matrices_[i].rows * r);
    q_floats += static_cast<size_t>(matrices_[i].cols * r);
  }
  for (const auto& [o, n] : plain) plain_floats += n;
  const double N = comm_.size();
  stats_.uncompressed_wire_bytes += static_cast<int64_t>(2.0 * (N - 1) / N * 4.0 * static_cast<double>(b.size));

  std::vector<float> msg(p_floats + plain_floats);
  size_t at = 0;
  for (size_t i : comp) {  // M = g + residual, in place; P = M Q
    const GradMatrix& m = matrices_[i];
    float* g = grads_.data() + m.offset;
    float* e = residual_.data() + m.offset;
    for (int64_t j = 0; j < m.rows * m.cols; ++j) g[j] += e[j];
    matmul_mq(g, q_[i].data(), msg.data() + at, m.rows, m.cols, r);
    at += static_cast<size_t>(m.rows * r);
  }
  for (const auto& [o, n] : plain) {
    std::memcpy(msg.data() + at, grads_.data() + o, n * sizeof(float));
    at += n;
  }
  auto sum = [&](float* data, size_t n) {
    if (opt_.deterministic) {
      count_allgather(n * sizeof(float));
      reduce_deterministic(data, n);
    } else {
      count_allreduce(n * sizeof(float), true);
      reduce_plain(data, n);
    }
  };
  sum(msg.data(), msg.size());
  at = p_floats;
  for (const auto& [o, n] : plain) {
    std::memcpy(grads_.data() + o, msg.data() + at, n * sizeof(float));
    at += n;
  }
  if (comp.empty()) return;
  std::vector<float> qmsg(q_floats);
  size_t pa = 0, qa = 0;
  for (size_t i : comp) {
    const GradMatrix& m = matrices_[i];
    float* p = msg.data() + pa;
    orthonormalize_columns(p, m.rows, r);
    matmul_mtp(grads_.data() + m.offset, p, qmsg.data() + qa, m.rows, m.cols, r);
    pa += static_cast<size_t>(m.rows * r);
    qa += static_cast<size_t>(m.cols * r);
  }
  sum(qmsg.data(), qmsg.size());
  pa = qa = 0;
  for (size_t i : comp) {
    const GradMatrix& m = matrices_[i];
    const float* p = msg.data() + pa;
    const float* q = qmsg.data() + qa;
    float* g = grads_.data() + m.offset;
    float* e = residual_.data() + m.offset;
    // P Q^T approximates the sum over ranks; this rank owes its M minus its 1/N share of it.
    const float share = 1.0f / static_cast<float>(N);
    for (int64_t row = 0; row < m.rows; ++row)
      for (int64_t col = 0; col < m.cols; ++col) {
        float approx = 0;
        for (int64_t k = 0; k < r; ++k) approx += p[row * r + k] * q[col * r + k];
        e[row * m.cols + col] = g[row * m.cols + col] - share * approx;
        g[row * m.cols + col] = approx;
      }
    std::copy(q, q + m.cols * r, q_[i].begin());  // warm start for the next step
    pa += static_cast<size_t>(m.rows * r);
    qa += static_cast<size_t>(m.cols * r);
  }
}

}  // namespace loom
