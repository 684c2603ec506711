// The peak microbenchmark and its cache (peak.h).
#include "profile/peak.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/cache_dir.h"
#include "core/error.h"
#include "core/huge_page_buffer.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "io/file_write.h"
#include "kernels/backend.h"
#include "kernels/quant_blocks.h"
#include "kernels/quantize.h"
#include "model/quantize_base.h"

namespace loom {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// 2: every op measured with the op itself (`op`, `precision` in each entry);
// 1 held the forward matmul only.
constexpr int kCacheFormat = 2;

constexpr BackwardPrecision kPrecisions[] = {BackwardPrecision::exact, BackwardPrecision::f16,
                                             BackwardPrecision::int8, BackwardPrecision::bf16};

const char* precision_name(BackwardPrecision p) {
  switch (p) {
    case BackwardPrecision::exact:
      return "exact";
    case BackwardPrecision::f16:
      return "f16";
    case BackwardPrecision::int8:
      return "int8";
    case BackwardPrecision::bf16:
      return "bf16";
  }
  return "?";
}

// Seconds of each of repeated calls after one warm-up: at least 3, and at
// least `min_seconds` in all.
template <typename F>
std::vector<double> pass_seconds(F&& fn, double min_seconds) {
  fn();
  std::vector<double> passes;
  double total = 0;
  while (passes.size() < 3 || total < min_seconds) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    passes.push_back(std::max(s, 1e-9));
    total += s;
  }
  return passes;
}

// The fastest of them: a peak is what the machine can do, so the best run
// counts, not the mean.
template <typename F>
double best_seconds(F&& fn, double min_seconds) {
  const std::vector<double> passes = pass_seconds(fn, min_seconds);
  return *std::min_element(passes.begin(), passes.end());
}

// Sum of n 64-bit words: four independent 256-bit accumulators and a software
// prefetch ahead, as the decode kernels read their weights (kernels/cpu/
// panel_kernels.h). A plain scalar loop leaves DRAM idle between misses and
// reported 39 GB/s on a machine whose f32 decode streams 58: the bandwidth
// floor must be what the machine can read, not what a naive loop reads.
uint64_t sum_words(const uint64_t* p, size_t n) {
  // 1.5 KB ahead (the AVX-512 decode kernels' distance). A loop of loads alone
  // read as fast with 768 bytes (the AVX2 kernels') on an AMD Zen 2: 32.3 against
  // 32.5 GB/s; only loops with work between the loads cared.
  constexpr size_t kAhead = 1536 / sizeof(uint64_t);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {  // 128 bytes: two cache lines a step
    __builtin_prefetch(p + i + kAhead, 0, 3);
    __builtin_prefetch(p + i + kAhead + 8, 0, 3);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  uint64_t acc = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) acc += p[i];
  return acc;
}

}  // namespace

ReadBandwidth measure_read_bandwidth(ThreadPool& pool, size_t bytes, double min_seconds) {
  const size_t n = std::max<size_t>(bytes / sizeof(uint64_t), 1024);
  // In huge pages, as the CPU backend's packed weights are (HugePageArena), so
  // the floor and the decode it bounds read the same kind of memory.
  HugePageBuffer mem(n * sizeof(uint64_t));
  auto* buf = reinterpret_cast<uint64_t*>(mem.data());
  // Written by the threads that read it (first touch), and not zero: zero pages
  // could all map one physical page.
  pool.parallel_for(static_cast<int64_t>(n), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) buf[i] = static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull;
  });
  std::vector<uint64_t> sums(static_cast<size_t>(pool.size()) * 8);  // a cache line per thread
  std::vector<double> passes = pass_seconds(
      [&] {
        pool.run([&](int ti, int tn) {
          const size_t b = n * static_cast<size_t>(ti) / static_cast<size_t>(tn);
          const size_t e = n * static_cast<size_t>(ti + 1) / static_cast<size_t>(tn);
          sums[static_cast<size_t>(ti) * 8] = sum_words(buf + b, e - b);
        });
      },
      min_seconds);
  volatile uint64_t sink = 0;
  for (uint64_t v : sums) sink = sink + v;
  std::sort(passes.begin(), passes.end());
  const double gb = static_cast<double>(n * sizeof(uint64_t)) / 1e9;
  return {gb / passes.front(), gb / passes[passes.size() / 2]};
}

double measure_read_gbps(ThreadPool& pool, size_t bytes, double min_seconds) {
  return measure_read_bandwidth(pool, bytes, min_seconds).best_gbps;
}

namespace {

std::vector<float> random_floats(size_t n, uint64_t seed) {
  CounterRng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.next_double() * 2 - 1);
  return v;
}

// `rows` x `cols` of src in `type`, as stored in a file.
std::vector<uint8_t> make_weight(ThreadPool& pool, DType type, const std::vector<float>& src, int64_t rows,
                                 int64_t cols) {
  std::vector<uint8_t> out(static_cast<size_t>(rows) * dtype_row_bytes(type, cols));
  if (type == DType::nf4) {
    Tensor t = make_tensor(const_cast<float*>(src.data()), DType::f32, {rows, cols});
    quantize_matrix(t, DType::nf4, out.data());
  } else if (type == DType::i8_ch) {
    std::vector<float> scales(static_cast<size_t>(rows), 1.0f / 127);
    quantize_rows_i8_ch(src.data(), rows, cols, scales.data(), nullptr, out.data());
  } else if (!is_iq_grid(type)) {
    quantize_rows(pool, type, src.data(), out.data(), rows, cols, nullptr);
  } else {
    // The grid types (iq1_s .. iq3_s): their quantizers search per group (seconds
    // for a matrix this size, and some need an importance vector), while any
    // index, sign and scale bits are a valid block, so src's bits serve, with each
    // superblock's f16 d set to 2^-10 (finite products; iq1_m keeps d in the top
    // nibbles of its four u16 scales at byte 48).
    std::memcpy(out.data(), src.data(), std::min(out.size(), src.size() * sizeof(float)));
    const size_t bb = dtype_traits(type).block_bytes;
    for (size_t at = 0; at + bb <= out.size(); at += bb) {
      if (type == DType::iq1_m) {
        set_iq1_m_d(out.data() + at, 0x1400);
        continue;
      }
      out[at] = 0x00;
      out[at + 1] = 0x14;
    }
  }
  return out;
}

// The same rows repeated until the matrix holds about `bytes` (rows are
// independent, so repeats are as valid as fresh ones and cost no quantizing).
std::vector<uint8_t> tile_rows(const std::vector<uint8_t>& base, size_t row_bytes, int64_t base_rows,
                               int64_t out_rows) {
  std::vector<uint8_t> out(static_cast<size_t>(out_rows) * row_bytes);
  for (int64_t r = 0; r < out_rows; ++r)
    std::copy_n(base.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(r % base_rows) * row_bytes),
                row_bytes, out.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(r) * row_bytes));
  return out;
}

// An entry as the profiler records the op: `flops` its FLOPs, `weight_bytes`
// the weight bytes it counts, `s` the best call's seconds.
GemmPeak entry(const char* op, DType dtype, const char* regime, const char* precision, int64_t T, int64_t N,
               int64_t K, double flops, double weight_bytes, double s) {
  GemmPeak p;
  p.op = op;
  p.dtype = dtype_name(dtype);
  p.regime = regime;
  p.precision = precision;
  p.T = T;
  p.N = N;
  p.K = K;
  p.gflops = flops / s / 1e9;
  p.gbps = weight_bytes / s / 1e9;
  p.seconds = s;
  return p;
}

double product_flops(int64_t T, int64_t N, int64_t K) {
  return 2.0 * static_cast<double>(T) * static_cast<double>(N) * static_cast<double>(K);
}

// `weight` is released once prepared (the backend packs its own copy), so a
// large decode weight is held once.
GemmPeak measure_product(Backend& be, Workspace& ws, DType type, std::vector<uint8_t>&& weight, int64_t rows,
                         int64_t cols, int64_t T, const char* regime, double min_seconds) {
  const Tensor W = make_tensor(weight.data(), type, {rows, cols});
  const size_t stored = W.nbytes();
  const WeightHandle h = be.prepare_weight(W, "peak");
  std::vector<uint8_t>().swap(weight);
  const std::vector<float> x = random_floats(static_cast<size_t>(T * cols), 7);
  std::vector<float> y(static_cast<size_t>(T * rows));
  const double s = best_seconds([&] { be.matmul(ws, *h, x.data(), cols, y.data(), rows, T); }, min_seconds);
  return entry("matmul", type, regime, "", T, rows, cols, product_flops(T, rows, cols),
               static_cast<double>(stored), s);
}

// The backward's input gradient dx [T, cols] = dy [T, rows] W over W {rows,
// cols} of each type, at each precision the trainer passes: exact reads W as
// stored; the others go through prepare_transposed's W^T (null where the
// backend reads W itself). Recorded as the profiler records it (the W^T's
// dtype, else W's; N = cols, K = rows); a (dtype, precision) already measured
// is not measured again (f16's W^T of every quantized type is the same f16 kernel).
void measure_backward_input(Backend& be, Workspace& ws, ThreadPool& pool, const PeakOptions& opt,
                            const PeakProgress& progress, PeakTable& t) {
  const int64_t rows = opt.train_rows, cols = opt.train_cols, T = opt.batch_rows;
  const std::vector<float> src = random_floats(static_cast<size_t>(rows * cols), 3);
  const std::vector<float> dy = random_floats(static_cast<size_t>(T * rows), 9);
  std::vector<float> dx(static_cast<size_t>(T * cols));
  if (progress) progress("linear_backward_input");
  for (DType type : opt.dtypes) {
    std::vector<uint8_t> weight = make_weight(pool, type, src, rows, cols);
    const Tensor W = make_tensor(weight.data(), type, {rows, cols});
    for (BackwardPrecision p : kPrecisions) {
      const WeightHandle Wt =
          p == BackwardPrecision::exact ? nullptr : be.prepare_transposed(W, p, "peak", nullptr, &ws);
      const DType recorded = Wt ? Wt->dtype() : type;
      if (t.find("linear_backward_input", dtype_name(recorded), "batch", precision_name(p))) continue;
      const double s =
          best_seconds([&] { be.linear_backward_input(ws, W, Wt.get(), p, dy.data(), dx.data(), T, false); },
                       opt.min_seconds);
      t.gemm.push_back(entry("linear_backward_input", recorded, "batch", precision_name(p), T, cols, rows,
                             product_flops(T, rows, cols),
                             static_cast<double>(Wt ? Wt->nbytes() : W.nbytes()), s));
    }
  }
}

// dW [rows, cols] += dy^T x (f32; the profiler counts dW read and written),
// and matmul_dense over an f32 W {rows, cols} that is not prepared.
void measure_f32_ops(Backend& be, Workspace& ws, const PeakOptions& opt, const PeakProgress& progress,
                     PeakTable& t) {
  const int64_t N = opt.train_rows, K = opt.train_cols, T = opt.batch_rows;
  if (progress) progress("linear_backward_weight, matmul_dense");
  const std::vector<float> dy = random_floats(static_cast<size_t>(T * N), 13);
  const std::vector<float> x = random_floats(static_cast<size_t>(T * K), 17);
  std::vector<float> dW(static_cast<size_t>(N * K));
  const double sw = best_seconds(
      [&] { be.linear_backward_weight(ws, dy.data(), x.data(), dW.data(), T, N, K); }, opt.min_seconds);
  t.gemm.push_back(entry("linear_backward_weight", DType::f32, "batch", "", T, N, K, product_flops(T, N, K),
                         2.0 * sizeof(float) * static_cast<double>(N * K), sw));
  std::vector<float> w = random_floats(static_cast<size_t>(N * K), 19);
  const Tensor W = make_tensor(w.data(), DType::f32, {N, K});
  std::vector<float> y(static_cast<size_t>(T * N));
  const double sd = best_seconds([&] { be.matmul_dense(ws, W, x.data(), y.data(), T); }, opt.min_seconds);
  t.gemm.push_back(entry("matmul_dense", DType::f32, "batch", "", T, N, K, product_flops(T, N, K),
                         static_cast<double>(W.nbytes()), sd));
}

// The fused output projection + cross-entropy as a training step calls it:
// every row labelled, dh set, dW null (a frozen output), W^T from
// prepare_transposed at each precision. The profiler counts the product twice
// (logits, and dh).
void measure_loss(Backend& be, Workspace& ws, ThreadPool& pool, const PeakOptions& opt,
                  const PeakProgress& progress, PeakTable& t) {
  const int64_t V = opt.loss_vocab, T = opt.batch_rows;
  if (progress) progress("loss");
  std::vector<int32_t> labels(static_cast<size_t>(T));
  CounterRng rng(23);
  for (int32_t& l : labels)
    l = static_cast<int32_t>(rng.next_double() * static_cast<double>(V)) % static_cast<int32_t>(V);
  for (DType type : opt.loss_dtypes) {
    const int64_t block = dtype_block_size(type);
    const int64_t H = (opt.loss_hidden + block - 1) / block * block;
    const std::vector<float> src = random_floats(static_cast<size_t>(V * H), 29);
    std::vector<uint8_t> weight = make_weight(pool, type, src, V, H);
    const Tensor W = make_tensor(weight.data(), type, {V, H});
    const WeightHandle prepared = be.prepare_weight(W, "peak");
    const std::vector<float> h = random_floats(static_cast<size_t>(T * H), 31);
    std::vector<float> dh(static_cast<size_t>(T * H));
    for (BackwardPrecision p : kPrecisions) {
      const WeightHandle Wt =
          p == BackwardPrecision::exact ? nullptr : be.prepare_transposed(W, p, "peak", nullptr, &ws);
      LossOp op;
      op.W = &W;
      op.W_prepared = prepared.get();
      op.precision = p;
      op.Wt = Wt.get();
      op.h = h.data();
      op.labels = labels.data();
      op.T = T;
      op.grad_scale = 1.0f / static_cast<float>(T);
      op.dh = dh.data();
      const double s = best_seconds([&] { be.cross_entropy(ws, op); }, opt.min_seconds);
      t.gemm.push_back(entry("loss", type, "batch", precision_name(p), T, V, H, 2 * product_flops(T, V, H),
                             static_cast<double>(W.nbytes()), s));
    }
  }
}

std::string hex16(uint64_t v) { return fmt::format("{:016x}", v); }

// What differs between a cached key and the wanted one, for the note.
std::string key_difference(const PeakKey& had, const PeakKey& want) {
  std::string d;
  auto add = [&](const std::string& s) { d += (d.empty() ? "" : ", ") + s; };
  if (had.cpu != want.cpu) add(fmt::format("CPU ('{}', here '{}')", had.cpu, want.cpu));
  if (had.threads != want.threads) add(fmt::format("thread count ({}, here {})", had.threads, want.threads));
  if (had.build != want.build) add("loom build");
  if (had.cpu_mask != want.cpu_mask)
    add(fmt::format("LOOM_CPU ('{}', here '{}')", had.cpu_mask, want.cpu_mask));
  return d;
}

double positive(const json& o, const char* key, const std::string& at) {
  const auto v = o.find(key);
  if (v == o.end() || !v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < 0)
    fail(ErrorKind::invalid_input, "{}: \"{}\" must be a number >= 0", at, key);
  return v->get<double>();
}

std::string text(const json& o, const char* key, const std::string& at) {
  const auto v = o.find(key);
  if (v == o.end() || !v->is_string()) fail(ErrorKind::invalid_input, "{}: \"{}\" must be a string", at, key);
  return v->get<std::string>();
}

}  // namespace

std::string PeakKey::hash() const {
  const std::string all = fmt::format("{}\n{}\n{}\n{}", cpu, threads, build, cpu_mask);
  return hex16(fnv1a64(all));
}

bool op_has_precision(std::string_view op) { return op == "linear_backward_input" || op == "loss"; }

const GemmPeak* PeakTable::find(std::string_view op, std::string_view dtype, std::string_view regime,
                                std::string_view precision) const {
  for (const GemmPeak& g : gemm)
    if (g.op == op && g.dtype == dtype && g.regime == regime && g.precision == precision) return &g;
  return nullptr;
}

const GemmPeak* PeakTable::find_class(std::string_view op, std::string_view dtype, std::string_view regime,
                                      std::string_view precision) const {
  if (!op_has_precision(op)) return find(op, dtype, regime);
  if (const GemmPeak* p = find(op, dtype, regime, precision.empty() ? "exact" : precision)) return p;
  return op == "linear_backward_input" ? find(op, dtype, regime, "exact") : nullptr;
}

std::vector<DType> PeakOptions::peak_dtypes_default() {
  return {DType::f32,     DType::f16,    DType::bf16,   DType::q8_0,    DType::q4_0,   DType::q4_1,
          DType::q5_0,    DType::q5_1,   DType::q2_k,   DType::q3_k,    DType::q4_k,   DType::q5_k,
          DType::q6_k,    DType::iq4_nl, DType::iq4_xs, DType::iq2_xxs, DType::iq2_xs, DType::iq2_s,
          DType::iq3_xxs, DType::iq3_s,  DType::iq1_s,  DType::iq1_m,   DType::tq2_0,  DType::mxfp4,
          DType::nvfp4,   DType::q1_0,   DType::nf4,    DType::i8_ch};
}

// The output projections of GGUF files: q8_0 (small models, tied to the
// embedding), q6_k (llama.cpp's K-quant files), f16 and bf16 (unquantized).
std::vector<DType> PeakOptions::loss_dtypes_default() {
  return {DType::q8_0, DType::q6_k, DType::f16, DType::bf16};
}

PeakOptions quick_peak_options() {
  PeakOptions o;
  o.read_bytes = size_t{1} << 20;
  o.decode_bytes = size_t{256} << 10;
  o.batch_rows = 16;
  o.rows = 32;
  o.cols = 256;
  o.train_rows = 64;
  o.train_cols = 256;
  o.loss_vocab = 128;
  o.loss_hidden = 64;
  o.min_seconds = 0;
  o.dtypes = {DType::f32, DType::q4_0};
  o.loss_dtypes = {DType::q8_0};
  return o;
}

PeakTable measure_peak(ThreadPool& pool, const PeakKey& key, const PeakOptions& opt,
                       const PeakProgress& progress, Backend* backend) {
  const auto t0 = Clock::now();
  PeakTable t;
  t.key = key;
  if (progress) progress("memory read bandwidth");
  t.read_gbps = measure_read_gbps(pool, opt.read_bytes, opt.min_seconds);
  std::unique_ptr<Backend> own = backend ? nullptr : make_backend(kCpu, pool);
  Backend* be = backend ? backend : own.get();
  const auto ws = be->make_workspace();
  const std::vector<float> src = random_floats(static_cast<size_t>(opt.rows * opt.cols), 1);
  for (DType type : opt.dtypes) {
    if (progress) progress(fmt::format("matmul {}", dtype_name(type)));
    std::vector<uint8_t> base = make_weight(pool, type, src, opt.rows, opt.cols);
    const size_t row_bytes = dtype_row_bytes(type, opt.cols);
    const int64_t decode_rows =
        std::max<int64_t>(opt.rows, static_cast<int64_t>(opt.decode_bytes / row_bytes) / 16 * 16);
    std::vector<uint8_t> big = tile_rows(base, row_bytes, opt.rows, decode_rows);
    t.gemm.push_back(measure_product(*be, *ws, type, std::move(base), opt.rows, opt.cols, opt.batch_rows,
                                     "batch", opt.min_seconds));
    t.gemm.push_back(
        measure_product(*be, *ws, type, std::move(big), decode_rows, opt.cols, 1, "decode", opt.min_seconds));
  }
  measure_backward_input(*be, *ws, pool, opt, progress, t);
  measure_f32_ops(*be, *ws, opt, progress, t);
  measure_loss(*be, *ws, pool, opt, progress, t);
  t.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return t;
}

std::string default_peak_cache_dir() { return user_cache_dir(); }

std::string peak_cache_path(const std::string& dir, const PeakKey& key) {
  return (std::filesystem::path(dir) / ("peak-" + key.hash() + ".json")).string();
}

std::string peak_to_json(const PeakTable& t) {
  json o;
  o["loom_peak"] = kCacheFormat;
  o["key"] = {
      {"cpu", t.key.cpu}, {"threads", t.key.threads}, {"build", t.key.build}, {"cpu_mask", t.key.cpu_mask}};
  o["read_gbps"] = t.read_gbps;
  o["seconds"] = t.seconds;
  json g = json::array();
  for (const GemmPeak& p : t.gemm)
    g.push_back({{"op", p.op},
                 {"dtype", p.dtype},
                 {"regime", p.regime},
                 {"precision", p.precision},
                 {"T", p.T},
                 {"N", p.N},
                 {"K", p.K},
                 {"gflops", p.gflops},
                 {"gbps", p.gbps},
                 {"seconds", p.seconds}});
  o["gemm"] = std::move(g);
  return o.dump(1) + "\n";
}

PeakTable peak_from_json(std::string_view text_in, const std::string& path) {
  json o;
  try {
    o = json::parse(text_in);
  } catch (const json::exception& e) {
    fail(ErrorKind::invalid_input, "{}: not JSON ({})", path, e.what());
  }
  if (!o.is_object() || !o.contains("loom_peak") || !o["loom_peak"].is_number_integer())
    fail(ErrorKind::invalid_input, "{}: not a loom peak file of format {}", path, kCacheFormat);
  if (o["loom_peak"] != kCacheFormat)
    fail(ErrorKind::invalid_input, "{}: a peak of format {} (another loom's), this loom measures format {}",
         path, o["loom_peak"].get<int64_t>(), kCacheFormat);
  PeakTable t;
  const auto k = o.find("key");
  if (k == o.end() || !k->is_object()) fail(ErrorKind::invalid_input, "{}: no \"key\" object", path);
  t.key.cpu = text(*k, "cpu", path + ": key");
  t.key.threads = static_cast<int64_t>(positive(*k, "threads", path + ": key"));
  t.key.build = text(*k, "build", path + ": key");
  t.key.cpu_mask = text(*k, "cpu_mask", path + ": key");
  t.read_gbps = positive(o, "read_gbps", path);
  t.seconds = positive(o, "seconds", path);
  const auto g = o.find("gemm");
  if (g == o.end() || !g->is_array() || g->empty())
    fail(ErrorKind::invalid_input, "{}: no \"gemm\" list", path);
  for (size_t i = 0; i < g->size(); ++i) {
    const json& e = (*g)[i];
    const std::string at = fmt::format("{}: gemm[{}]", path, i);
    if (!e.is_object()) fail(ErrorKind::invalid_input, "{}: not an object", at);
    GemmPeak p;
    p.op = text(e, "op", at);
    p.dtype = text(e, "dtype", at);
    p.regime = text(e, "regime", at);
    p.precision = text(e, "precision", at);
    p.T = static_cast<int64_t>(positive(e, "T", at));
    p.N = static_cast<int64_t>(positive(e, "N", at));
    p.K = static_cast<int64_t>(positive(e, "K", at));
    p.gflops = positive(e, "gflops", at);
    p.gbps = positive(e, "gbps", at);
    p.seconds = positive(e, "seconds", at);
    if (p.gflops <= 0) fail(ErrorKind::invalid_input, "{}: \"gflops\" must be > 0", at);
    t.gemm.push_back(std::move(p));
  }
  return t;
}

CachedPeak cached_peak(ThreadPool& pool, const PeakKey& key, const std::string& path, bool remeasure,
                       const PeakOptions& opt, const PeakProgress& progress) {
  CachedPeak c;
  c.path = path;
  std::error_code ec;
  if (!remeasure && !path.empty() && std::filesystem::exists(path, ec)) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    try {
      PeakTable t = peak_from_json(ss.str(), path);
      if (t.key == key) {
        c.table = std::move(t);
        return c;
      }
      c.note = fmt::format("{}: measured for another {}; measured again", path, key_difference(t.key, key));
    } catch (const Error& e) {
      c.note = fmt::format("{}; measured again", e.what());
    }
  }
  c.table = measure_peak(pool, key, opt, progress);
  c.measured = true;
  if (!path.empty()) {
    try {
      write_file_atomic(path, peak_to_json(c.table));
    } catch (const Error& e) {
      c.note += (c.note.empty() ? "" : "; ") + fmt::format("not cached: {}", e.what());
    }
  }
  return c;
}

}  // namespace loom
