// The peak microbenchmark and its cache (peak.h).
#include "profile/peak.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "io/file_write.h"
#include "kernels/backend.h"
#include "kernels/quantize.h"
#include "model/quantize_base.h"

namespace loom {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kCacheFormat = 1;

// The fastest of repeated calls (after one warm-up): a peak is what the machine
// can do, so the best run counts, not the mean.
template <typename F>
double best_seconds(F&& fn, double min_seconds) {
  fn();
  double best = 1e30, total = 0;
  for (int n = 0; n < 3 || total < min_seconds; ++n) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
  }
  return std::max(best, 1e-9);
}

double measure_read_gbps(ThreadPool& pool, size_t bytes, double min_seconds) {
  const size_t n = std::max<size_t>(bytes / sizeof(uint64_t), 1024);
  std::vector<uint64_t> buf(n);
  // Written by the threads that read it (first touch), and not zero: zero pages
  // could all map one physical page.
  pool.parallel_for(static_cast<int64_t>(n), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      buf[static_cast<size_t>(i)] = static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull;
  });
  std::vector<uint64_t> sums(static_cast<size_t>(pool.size()) * 8);  // a cache line per thread
  const double s = best_seconds(
      [&] {
        pool.run([&](int ti, int tn) {
          const size_t b = n * static_cast<size_t>(ti) / static_cast<size_t>(tn);
          const size_t e = n * static_cast<size_t>(ti + 1) / static_cast<size_t>(tn);
          uint64_t acc = 0;
          for (size_t i = b; i < e; ++i) acc += buf[i];
          sums[static_cast<size_t>(ti) * 8] = acc;
        });
      },
      min_seconds);
  volatile uint64_t sink = 0;
  for (uint64_t v : sums) sink = sink + v;
  return static_cast<double>(n * sizeof(uint64_t)) / s / 1e9;
}

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
  } else {
    quantize_rows(pool, type, src.data(), out.data(), rows, cols, nullptr);
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
  GemmPeak p;
  p.dtype = dtype_name(type);
  p.regime = regime;
  p.T = T;
  p.N = rows;
  p.K = cols;
  p.gflops = 2.0 * static_cast<double>(T) * static_cast<double>(rows) * static_cast<double>(cols) / s / 1e9;
  p.gbps = static_cast<double>(stored) / s / 1e9;
  return p;
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

std::string this_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string name = line.substr(colon + 1);
        name.erase(0, name.find_first_not_of(" \t"));
        if (!name.empty()) return name;
      }
    }
  return "unknown CPU";
}

const GemmPeak* PeakTable::find(std::string_view dtype, std::string_view regime) const {
  for (const GemmPeak& g : gemm)
    if (g.dtype == dtype && g.regime == regime) return &g;
  return nullptr;
}

std::vector<DType> PeakOptions::peak_dtypes_default() {
  return {DType::f32,  DType::f16,  DType::bf16, DType::q8_0, DType::q4_0,
          DType::q4_1, DType::q5_0, DType::q5_1, DType::q2_k, DType::q3_k,
          DType::q4_k, DType::q5_k, DType::q6_k, DType::nf4,  DType::i8_ch};
}

PeakOptions quick_peak_options() {
  PeakOptions o;
  o.read_bytes = size_t{1} << 20;
  o.decode_bytes = size_t{256} << 10;
  o.batch_rows = 16;
  o.rows = 32;
  o.cols = 256;
  o.min_seconds = 0;
  o.dtypes = {DType::f32, DType::q4_0};
  return o;
}

PeakTable measure_peak(ThreadPool& pool, const PeakKey& key, const PeakOptions& opt,
                       const PeakProgress& progress) {
  const auto t0 = Clock::now();
  PeakTable t;
  t.key = key;
  if (progress) progress("memory read bandwidth");
  t.read_gbps = measure_read_gbps(pool, opt.read_bytes, opt.min_seconds);
  const auto be = make_backend(kCpu, pool);
  const auto ws = be->make_workspace();
  const std::vector<float> src = random_floats(static_cast<size_t>(opt.rows * opt.cols), 1);
  for (DType type : opt.dtypes) {
    if (progress) progress(fmt::format("{} products", dtype_name(type)));
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
  t.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return t;
}

std::string default_peak_cache_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    return (std::filesystem::path(x) / "loom").string();
  if (const char* h = std::getenv("HOME"); h && *h)
    return (std::filesystem::path(h) / ".cache" / "loom").string();
  return {};
}

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
    g.push_back({{"dtype", p.dtype},
                 {"regime", p.regime},
                 {"T", p.T},
                 {"N", p.N},
                 {"K", p.K},
                 {"gflops", p.gflops},
                 {"gbps", p.gbps}});
  o["gemm"] = std::move(g);
  return o.dump(1) + "\n";
}

PeakTable peak_from_json(std::string_view text_in, const std::string& path) {
  json o;
  try {
    o = json::parse(text_in);
  } catch (const json::parse_error& e) {
    fail(ErrorKind::invalid_input, "{}: not JSON ({})", path, e.what());
  }
  if (!o.is_object() || !o.contains("loom_peak") || o["loom_peak"] != kCacheFormat)
    fail(ErrorKind::invalid_input, "{}: not a loom peak file of format {}", path, kCacheFormat);
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
    p.dtype = text(e, "dtype", at);
    p.regime = text(e, "regime", at);
    p.T = static_cast<int64_t>(positive(e, "T", at));
    p.N = static_cast<int64_t>(positive(e, "N", at));
    p.K = static_cast<int64_t>(positive(e, "K", at));
    p.gflops = positive(e, "gflops", at);
    p.gbps = positive(e, "gbps", at);
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
