// All-reduce (sum of floats, in place) through loom's Communicator under MPI:
// the time per message size, the fitted latency and inverse bandwidth, and the
// bus bandwidth, as a table on rank 0 (and JSON lines with --json FILE).
//
//   mpirun --allow-run-as-root -np 2 build/bench/loom_bench_allreduce
//   mpirun ... loom_bench_allreduce --min-bytes 4 --max-bytes 64M --factor 4 --reps 20 --json out.jsonl
//
// Paths (--paths, comma-separated):
//   blocking  Communicator::allreduce_sum (the main thread's token and loss sums)
//   async     Communicator::start_allreduce_sum + Communicator::wait (what the
//             trainer's communication thread does per gradient bucket; run here
//             on the main thread, on the Communicator's duplicated channel)
//   mpi       MPI_Allreduce called directly, a reference for what the
//             Communicator's wait (test, then sleep 5 .. 200 us) adds
// One repetition: every rank enters MPI_Barrier, then times its call; the
// repetition's time is the slowest rank's. Per size: warm-up repetitions
// (untimed), then --reps timed ones; median and min over the timed ones.
// Fit: t = alpha + beta * bytes over the sizes' medians, least squares of the
// relative error (each point weighted 1 / t^2), so that the small, log-spaced
// sizes count as much as the large ones (plain least squares would fit the
// largest two sizes only and leave alpha anywhere). Bus bandwidth (NCCL-tests'
// busbw): 2 (N-1) / N * bytes / t, the bytes each rank sends and receives in a
// bandwidth-optimal all-reduce, per second.
// Not part of loom_bench (Google Benchmark): it has its own main and needs mpirun.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "dist/communicator.h"

namespace {

using loom::Communicator;

struct Options {
  size_t min_bytes = 4;
  size_t max_bytes = size_t{64} << 20;
  int factor = 4;
  int reps = 20;
  int warmup = 3;
  std::string algorithm = "auto";
  std::string paths = "blocking,async";
  std::string json;
};

// "4", "64K", "64KiB", "16M", "1G": binary multiples.
bool parse_bytes(const std::string& s, size_t& out) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) return false;
  std::string unit(end);
  for (const char* suffix : {"iB", "B"})
    if (unit.size() > 1 && unit.ends_with(suffix)) unit.resize(unit.size() - std::string(suffix).size());
  size_t mul = 1;
  if (unit.empty() || unit == "B")
    mul = 1;
  else if (unit == "k" || unit == "K")
    mul = size_t{1} << 10;
  else if (unit == "m" || unit == "M")
    mul = size_t{1} << 20;
  else if (unit == "g" || unit == "G")
    mul = size_t{1} << 30;
  else
    return false;
  out = static_cast<size_t>(v) * mul;
  return true;
}

std::string human_bytes(size_t b) {
  if (b >= (size_t{1} << 30) && b % (size_t{1} << 30) == 0) return fmt::format("{} GiB", b >> 30);
  if (b >= (size_t{1} << 20) && b % (size_t{1} << 20) == 0) return fmt::format("{} MiB", b >> 20);
  if (b >= (size_t{1} << 10) && b % (size_t{1} << 10) == 0) return fmt::format("{} KiB", b >> 10);
  return fmt::format("{} B", b);
}

// Seconds with a unit that keeps 3-4 significant digits readable.
std::string human_seconds(double s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.3f} s", s);
}

struct Row {
  size_t bytes;
  double median_s, min_s, busbw;  // busbw in bytes/s, from the median
};

struct Fit {
  double alpha = 0, beta = 0;  // s, s/byte
};

// Weighted least squares of t = alpha + beta * x, weights 1 / t^2.
Fit fit_relative(const std::vector<Row>& rows) {
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const Row& r : rows) {
    const double w = 1.0 / (r.median_s * r.median_s), x = static_cast<double>(r.bytes), y = r.median_s;
    sw += w, sx += w * x, sy += w * y, sxx += w * x * x, sxy += w * x * y;
  }
  Fit f;
  const double det = sw * sxx - sx * sx;
  if (rows.size() < 2 || det == 0) return f;
  f.beta = (sw * sxy - sx * sy) / det;
  f.alpha = (sy - f.beta * sx) / sw;
  return f;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One timed call of `path` on `data` (n floats); this rank's seconds.
double run_once(Communicator& comm, const std::string& path, std::vector<float>& data) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  if (path == "blocking") {
    comm.allreduce_sum(std::span<float>(data));
  } else if (path == "async") {
    auto r = comm.start_allreduce_sum(data.data(), data.size());
    comm.wait(*r, "all-reduce (bench)");
  } else {
    MPI_Allreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()), MPI_FLOAT, MPI_SUM,
                  MPI_COMM_WORLD);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run(const Options& o) {
  const loom::CollectiveAlgorithm* algorithm = loom::collective_algorithm_from_name(o.algorithm);
  std::unique_ptr<Communicator> comm = loom::make_mpi_communicator(*algorithm);
  comm->set_timeout_seconds(120);
  const int rank = comm->rank(), N = comm->size();
  const bool root = rank == 0;

  std::vector<std::string> paths;
  for (size_t at = 0; at <= o.paths.size();) {
    const size_t comma = std::min(o.paths.find(',', at), o.paths.size());
    paths.push_back(o.paths.substr(at, comma - at));
    at = comma + 1;
  }
  std::vector<size_t> sizes;
  for (size_t b = o.min_bytes; b <= o.max_bytes; b *= static_cast<size_t>(o.factor)) sizes.push_back(b);

  std::FILE* json = nullptr;
  if (root && !o.json.empty()) {
    json = std::fopen(o.json.c_str(), "w");
    if (!json) comm->abort(fmt::format("cannot write {}", o.json));
  }
  if (root) {
    fmt::print(
        "loom all-reduce benchmark: {}; algorithm {}; float sum in place; {} timed reps after {} warm-up "
        "per size\n",
        comm->describe(), o.algorithm, o.reps, o.warmup);
    fmt::print(
        "time of a rep = the slowest rank's (ranks aligned by MPI_Barrier); busbw = 2(N-1)/N * bytes / "
        "median, N = {}\n",
        N);
    if (json)
      fmt::print(
          json,
          "{{\"library\": \"{}\", \"ranks\": {}, \"algorithm\": \"{}\", \"reps\": {}, \"warmup\": {}}}\n",
          comm->describe(), N, o.algorithm, o.reps, o.warmup);
  }

  const double bus_factor = N > 1 ? 2.0 * (N - 1) / N : 0.0;
  int failures = 0;
  for (const std::string& path : paths) {
    std::vector<Row> rows;
    for (const size_t bytes : sizes) {
      const size_t n = bytes / sizeof(float);
      std::vector<float> data(n);
      std::vector<int64_t> ns(static_cast<size_t>(o.reps));
      for (int i = 0; i < o.warmup + o.reps; ++i) {
        // Small integers: every sum exact, the same each rep (in place, so refilled).
        std::fill(data.begin(), data.end(), static_cast<float>(rank + 1));
        const double s = run_once(*comm, path, data);
        if (i == 0 && (data.front() != N * (N + 1) / 2.0f || data.back() != N * (N + 1) / 2.0f)) {
          ++failures;
          if (root)
            fmt::print(stderr, "{} {}: wrong sum {} (expected {})\n", path, bytes, data.front(),
                       N * (N + 1) / 2);
        }
        if (i >= o.warmup) ns[static_cast<size_t>(i - o.warmup)] = static_cast<int64_t>(s * 1e9);
      }
      comm->allreduce_max(std::span<int64_t>(ns));  // per rep, the slowest rank
      std::vector<double> t(ns.size());
      for (size_t i = 0; i < ns.size(); ++i) t[i] = static_cast<double>(ns[i]) * 1e-9;
      const double med = median(t);
      rows.push_back(
          {bytes, med, *std::min_element(t.begin(), t.end()), bus_factor * static_cast<double>(bytes) / med});
    }
    if (!root) continue;
    const Fit f = fit_relative(rows);
    const char* what = path == "blocking" ? "Communicator::allreduce_sum"
                       : path == "async"  ? "Communicator::start_allreduce_sum + wait"
                                          : "MPI_Allreduce directly";
    fmt::print("\n{} ({})\n", path, what);
    fmt::print("{:>10} {:>12} {:>12} {:>13}\n", "bytes", "median", "min", "busbw GB/s");
    for (const Row& r : rows)
      fmt::print("{:>10} {:>12} {:>12} {:>13.3f}\n", human_bytes(r.bytes), human_seconds(r.median_s),
                 human_seconds(r.min_s), r.busbw / 1e9);
    fmt::print(
        "fit t = alpha + beta * bytes (least squares of the relative error over the {} medians): alpha = "
        "{:.3g} s ({}), beta = {:.4g} s/byte (1/beta = {:.3f} GB/s)\n",
        rows.size(), f.alpha, human_seconds(f.alpha), f.beta, f.beta > 0 ? 1e-9 / f.beta : 0.0);
    if (json) {
      for (const Row& r : rows)
        fmt::print(
            json,
            "{{\"path\": \"{}\", \"bytes\": {}, \"ranks\": {}, \"median_s\": {:.9g}, \"min_s\": {:.9g}, "
            "\"busbw_bytes_per_s\": {:.6g}}}\n",
            path, r.bytes, N, r.median_s, r.min_s, r.busbw);
      fmt::print(json,
                 "{{\"path\": \"{}\", \"fit\": \"least squares, relative error (weights 1/t^2), medians\", "
                 "\"alpha_s\": {:.6g}, \"beta_s_per_byte\": {:.6g}, \"sizes\": {}}}\n",
                 path, f.alpha, f.beta, rows.size());
    }
  }
  if (json) std::fclose(json);
  int64_t bad = failures;
  comm->allreduce_max(std::span<int64_t>(&bad, 1));
  if (bad != 0 && root) fmt::print(stderr, "FAIL: some all-reduce gave a wrong sum\n");
  return bad != 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string min_s = "4", max_s = "64M";
  CLI::App app("All-reduce (float sum) through loom's Communicator; run under mpirun.");
  app.add_option("--min-bytes", min_s, "smallest message (a multiple of 4; K, M, G suffixes: binary)")
      ->capture_default_str();
  app.add_option("--max-bytes", max_s, "largest message")->capture_default_str();
  app.add_option("--factor", o.factor, "each size is the previous times this")
      ->check(CLI::IsMember({2, 4}))
      ->capture_default_str();
  app.add_option("--reps", o.reps, "timed repetitions per size")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed repetitions per size first")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--algorithm", o.algorithm,
                 "dist.algorithm: auto, ring, tree, rabenseifner, recursive_doubling")
      ->check([](const std::string& s) {
        return loom::collective_algorithm_from_name(s) ? std::string() : "unknown algorithm " + s;
      })
      ->capture_default_str();
  app.add_option("--paths", o.paths, "comma-separated: blocking, async, mpi")
      ->check([](const std::string& s) {
        for (size_t at = 0; at <= s.size();) {
          const size_t comma = std::min(s.find(',', at), s.size());
          const std::string p = s.substr(at, comma - at);
          if (p != "blocking" && p != "async" && p != "mpi") return "unknown path '" + p + "'";
          at = comma + 1;
        }
        return std::string();
      })
      ->capture_default_str();
  app.add_option("--json", o.json,
                 "also write JSON lines (rank 0): a header, one per path and size, one fit per path");
  try {
    app.parse(argc, argv);
    if (!parse_bytes(min_s, o.min_bytes) || !parse_bytes(max_s, o.max_bytes))
      throw CLI::ValidationError("--min-bytes/--max-bytes", "not a size: " + min_s + " / " + max_s);
    if (o.min_bytes < 4 || o.min_bytes % 4 != 0 || o.max_bytes < o.min_bytes)
      throw CLI::ValidationError("--min-bytes/--max-bytes", "need 4 <= min <= max, min a multiple of 4");
    if (o.max_bytes / sizeof(float) > static_cast<size_t>(INT32_MAX))
      throw CLI::ValidationError("--max-bytes", "over MPI's int count of floats");
  } catch (const CLI::ParseError& e) {
    return app.exit(e);  // before MPI_Init: each rank prints and exits alike
  }
  return run(o);
}
