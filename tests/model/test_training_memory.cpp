// The memory estimate made before step 1 (train/memory.h) against the RSS a
// default-model LoRA run reaches: SmolLM2-135M Q4_1, r=8 on all seven modules,
// micro-batches of 2 x 512 tokens (bench/bench_train_vs_peft.py's shape).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "train/memory.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

const std::string kRoot = std::string(LOOM_SOURCE_DIR) + "/";
const std::string kModel = kRoot + "models/SmolLM2-135M-Instruct.Q4_1.gguf";

TEST(TrainingDefaultModel, MemoryEstimateMatchesRss) {
  if (!std::ifstream(kModel).good()) GTEST_SKIP() << kModel << " is missing: run scripts/fetch_model";
  const fs::path dir = fs::temp_directory_path() / ("loom_memory_model_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "train.jsonl");
    for (int i = 0; i < 6; ++i) {  // samples longer than seq_len: every row is 512 tokens
      std::string text;
      for (int w = 0; w < 700; ++w) text += fmt::format("word{} ", (w * 7 + i) % 97);
      f << nlohmann::json{{"text", text}}.dump() << "\n";
    }
  }
  const std::string yaml = fmt::format(
      "model: {}\ndata:\n  train: {}\n  seq_len: 512\nlora:\n  r: 8\n  dropout: 0\nbatch_size: 2\n"
      "steps: 3\noutput_dir: {}\nthreads: 2\n",
      kModel, (dir / "train.jsonl").string(), (dir / "out").string());
  const int64_t rss0 = process_rss_bytes();
  int64_t rss1 = 0;
  MemoryEstimate e;
  {
    Trainer t(parse_train_config(yaml, "default.yaml"), nullptr);
    t.setup();
    e = t.memory_estimate();
    for (int s = 0; s < 3; ++s) t.train_step();
    rss1 = process_rss_bytes();
    const MemoryReport r = t.memory_report();
    std::printf("estimate: %s\nmeasured RSS after 3 steps: %s (before setup %s); accounted arenas %s\n",
                format_memory_estimate(e).c_str(), format_bytes(rss1).c_str(), format_bytes(rss0).c_str(),
                format_bytes(r.accounted).c_str());
    for (const MemoryArena& a : r.arenas) std::printf("  %-17s %s\n", a.name.c_str(), format_bytes(a.bytes).c_str());
  }
  fs::remove_all(dir);
  std::printf("estimate %lld bytes, RSS %lld bytes: %+.2f%%\n", static_cast<long long>(e.total),
              static_cast<long long>(rss1), 100.0 * static_cast<double>(e.total - rss1) / static_cast<double>(rss1));
  // The total the run peaks at, within 5%; and the growth from before setup within 10%.
  EXPECT_LE(std::abs(static_cast<double>(e.total - rss1)), 0.05 * static_cast<double>(rss1))
      << "estimate " << e.total << " vs RSS " << rss1;
  EXPECT_LE(std::abs(static_cast<double>((e.total - rss0) - (rss1 - rss0))), 0.10 * static_cast<double>(rss1 - rss0))
      << "growth: estimated " << e.total - rss0 << ", measured " << rss1 - rss0;
}

}  // namespace
}  // namespace loom
