// Checkpoints (train/checkpoint.h): the folder written and verified as a
// whole; torn, truncated, corrupted and unfinished ones skipped with a fallback
// to the previous good one; run-identity changes refused naming the key;
// pruning; and exact resume through the Trainer (LoRA on f32 and q4_1 tiny
// models, full fine-tuning): a run stopped and resumed gives the same per-step
// losses, metrics lines and output bytes as one never stopped.
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cpu_backend_util.h"
#include "expect_error.h"
#include "temp_dir.h"
#include "train/checkpoint.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// ---- the folder format --------------------------------------------------

struct Fixture {
  test_util::TempDir tmp{"checkpoint_test"};
  test_util::CpuBackend cpu;
  std::vector<float> params = std::vector<float>(1000);
  std::unique_ptr<AdamW> opt;
  Fixture() {
    std::iota(params.begin(), params.end(), 0.5f);
    ParamGroup g;
    g.size = params.size();
    opt = std::make_unique<AdamW>(*cpu.backend, AdamWConfig{}, std::vector<ParamGroup>{g}, params.size());
  }
  std::string dir() const { return (tmp.path / "ck").string(); }
  // A checkpoint after `step` AdamW updates, with an eval loss.
  std::string write(int64_t step, std::optional<double> eval = std::nullopt) {
    std::vector<float> grads(params.size(), 0.01f);
    while (opt->step_count() < step) opt->step(params, grads);
    CheckpointState st;
    st.step = step;
    st.cursor = {1, 6};
    st.shuffle_seed = 7;
    st.identity = {{"lora.r", "8"}, {"seed", "7"}};
    st.config_text = "steps: 10\n";
    st.step_losses.assign(static_cast<size_t>(step), 2.5);
    if (step > 0) st.step_losses[0] = std::nan("");  // a step without target tokens
    if (eval) st.evals.push_back({step, *eval});
    st.metrics_text = "{\"step\":1}\n";
    st.faults = {.bad_in_a_row = 1, .skipped_steps = 3, .rollbacks = 1, .lr_scale = 0.5};
    return write_checkpoint(dir(), st, params, *opt).path;
  }
};

TEST(Checkpoint, WritesAVerifiedFolderThatLoadsBack) {
  Fixture f;
  const std::string p = f.write(3, 1.25);
  EXPECT_EQ(fs::path(p).filename(), "step-00000003");
  EXPECT_EQ(verify_checkpoint(p), "");
  for (const char* name : {"manifest.json", "params.f32", "adam_m.f32", "adam_v.f32", "state.json", "config.yaml",
                           "metrics.jsonl"})
    EXPECT_TRUE(fs::exists(fs::path(p) / name)) << name;
  const auto manifest = nlohmann::json::parse(file_bytes(fs::path(p) / "manifest.json"));
  EXPECT_EQ(manifest["format_version"], kCheckpointFormat);
  EXPECT_EQ(manifest["rank"], 0);
  EXPECT_EQ(manifest["world_size"], 1);
  EXPECT_EQ(manifest["files"].size(), 6u);

  const CheckpointState st = read_checkpoint_state(p);
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.cursor, (DataCursor{1, 6}));
  EXPECT_EQ(st.shuffle_seed, 7u);
  EXPECT_EQ(st.config_text, "steps: 10\n");
  EXPECT_EQ(st.metrics_text, "{\"step\":1}\n");
  ASSERT_EQ(st.step_losses.size(), 3u);
  EXPECT_TRUE(std::isnan(st.step_losses[0]));
  EXPECT_EQ(st.step_losses[2], 2.5);
  EXPECT_EQ(st.eval_loss(), 1.25);
  EXPECT_EQ(st.faults.skipped_steps, 3);
  EXPECT_EQ(st.faults.rollbacks, 1);
  EXPECT_EQ(st.faults.lr_scale, 0.5);

  // Into a fresh arena and optimizer: bit for bit.
  std::vector<float> params(f.params.size(), 0.f);
  ParamGroup g;
  g.size = params.size();
  AdamW opt(*f.cpu.backend, AdamWConfig{}, {g}, params.size());
  load_checkpoint_arenas(p, params, opt);
  EXPECT_EQ(params, f.params);
  EXPECT_EQ(opt.step_count(), 3);
  EXPECT_TRUE(std::equal(opt.exp_avg().begin(), opt.exp_avg().end(), f.opt->exp_avg().begin()));
  EXPECT_TRUE(std::equal(opt.exp_avg_sq().begin(), opt.exp_avg_sq().end(), f.opt->exp_avg_sq().begin()));

  // Another arena size: refused, naming the file.
  std::vector<float> small(10);
  AdamW opt_small(*f.cpu.backend, AdamWConfig{}, {}, small.size());
  test_util::expect_error([&] { load_checkpoint_arenas(p, small, opt_small); }, ErrorKind::invalid_input,
                          {"params.f32", "1000", "10"});
}

// optim.kind adamw8bit: the codes and absmax are files of the checkpoint and
// load back bit for bit; an adamw optimizer refuses them (and the reverse).
TEST(Checkpoint, Adam8bitStateLoadsBackAndAnotherKindIsRefused) {
  Fixture f;
  const size_t n = 5000 + 1000;
  f.params.resize(n, 0.25f);
  ParamGroup g;
  g.size = n;
  const std::vector<TensorSpan> tensors = {{0, 5000}, {5000, 1000}};
  f.opt = std::make_unique<AdamW>(*f.cpu.backend, AdamWConfig{}, std::vector<ParamGroup>{g}, n, LrSchedule{},
                                  OptimizerKind::adamw8bit, tensors);
  const std::string p = f.write(2);
  EXPECT_EQ(verify_checkpoint(p), "");
  for (const char* name : {"adam_m.q8", "adam_v.q8", "adam_m_absmax.f32", "adam_v_absmax.f32"})
    EXPECT_TRUE(fs::exists(fs::path(p) / name)) << name;
  EXPECT_EQ(fs::file_size(fs::path(p) / "adam_m.q8"), 5000u);
  EXPECT_EQ(fs::file_size(fs::path(p) / "adam_m.f32"), 1000u * 4);
  std::vector<float> params(n, 0.f);
  AdamW opt(*f.cpu.backend, AdamWConfig{}, {g}, n, {}, OptimizerKind::adamw8bit, tensors);
  load_checkpoint_arenas(p, params, opt);
  EXPECT_EQ(params, f.params);
  const auto a = f.opt->state_parts(), b = opt.state_parts();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(a[i].data, b[i].data, a[i].bytes), 0) << a[i].file;
  AdamW f32(*f.cpu.backend, AdamWConfig{}, {g}, n);
  test_util::expect_error([&] { load_checkpoint_arenas(p, params, f32); }, ErrorKind::invalid_input,
                          {"optim.kind adamw8bit", "uses adamw"});
  // A damaged code file is caught by the manifest's checksum.
  write_bytes(fs::path(p) / "adam_v.q8", std::string(5000, '\x07'));
  EXPECT_NE(verify_checkpoint(p).find("adam_v.q8"), std::string::npos);
}

// Each kind of damage: the newest checkpoint is skipped with the reason, the
// previous good one is taken.
TEST(Checkpoint, DamagedCheckpointsAreSkippedForThePreviousGoodOne) {
  struct Damage {
    const char* what;
    std::function<void(const fs::path&)> apply;
    const char* reason;
  };
  const std::vector<Damage> damages = {
      {"truncated", [](const fs::path& p) { fs::resize_file(p / "params.f32", 400); }, "truncated"},
      {"flipped byte",
       [](const fs::path& p) {
         std::string b = file_bytes(p / "adam_v.f32");
         b[123] = static_cast<char>(b[123] ^ 0x10);
         write_bytes(p / "adam_v.f32", b);
       },
       "checksum"},
      {"missing manifest", [](const fs::path& p) { fs::remove(p / "manifest.json"); }, "no manifest.json"},
      {"missing file", [](const fs::path& p) { fs::remove(p / "state.json"); }, "state.json is missing"},
      {"bad manifest", [](const fs::path& p) { write_bytes(p / "manifest.json", "{\"format\": "); }, "invalid JSON"},
      {"other format",
       [](const fs::path& p) {
         auto m = nlohmann::json::parse(file_bytes(p / "manifest.json"));
         m["format_version"] = kCheckpointFormat + 1;
         write_bytes(p / "manifest.json", m.dump());
       },
       "checkpoint format"},
  };
  for (const Damage& d : damages) {
    SCOPED_TRACE(d.what);
    Fixture f;
    const std::string good = f.write(2);
    const std::string bad = f.write(4);
    d.apply(bad);
    EXPECT_NE(verify_checkpoint(bad), "");
    std::vector<SkippedCheckpoint> skipped;
    const auto found = latest_good_checkpoint(f.dir(), skipped);
    ASSERT_TRUE(found);
    EXPECT_EQ(*found, good);
    ASSERT_EQ(skipped.size(), 1u);
    EXPECT_EQ(skipped[0].path, bad);
    EXPECT_NE(skipped[0].reason.find(d.reason), std::string::npos) << skipped[0].reason;
  }
}

// A writer killed mid-write leaves only its staging folder (".step-N.loom-new-PID-..."):
// never listed, never loaded, removed by the next prune once its process is gone.
TEST(Checkpoint, StagingFolderOfACrashedWriteIsIgnoredAndRemoved) {
  Fixture f;
  const std::string good = f.write(2);
  const fs::path stale = fs::path(f.dir()) / ".step-00000004.loom-new-999999999-AbCdEf";  // no such process
  fs::create_directories(stale);
  write_bytes(stale / "params.f32", "partial");
  EXPECT_EQ(list_checkpoints(f.dir()), std::vector<std::string>{good});
  std::vector<SkippedCheckpoint> skipped;
  EXPECT_EQ(latest_good_checkpoint(f.dir(), skipped), good);
  EXPECT_TRUE(skipped.empty());
  prune_checkpoints(f.dir(), 3);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(good));
}

TEST(Checkpoint, PruneKeepsTheLastNAndTheBestByEvalLoss) {
  Fixture f;
  f.write(1, 3.0);
  const std::string best = f.write(2, 1.0);
  f.write(3, 2.0);
  f.write(4);  // no evaluation in its history
  f.write(5, 2.5);
  const std::string s6 = f.write(6, 2.2);
  const std::vector<std::string> removed = prune_checkpoints(f.dir(), 2);
  EXPECT_EQ(removed.size(), 3u);
  std::vector<std::string> want = {s6, (fs::path(f.dir()) / "step-00000005").string(), best};
  EXPECT_EQ(list_checkpoints(f.dir()), want);
}

TEST(Checkpoint, NamesAndListing) {
  EXPECT_EQ(checkpoint_name(50), "step-00000050");
  EXPECT_EQ(checkpoint_step("step-00000050"), 50);
  EXPECT_EQ(checkpoint_step("step-123456789"), 123456789);
  EXPECT_FALSE(checkpoint_step("step-0050"));
  EXPECT_FALSE(checkpoint_step("step-0000005x"));
  EXPECT_FALSE(checkpoint_step(".step-00000050.loom-new-1-x"));
  EXPECT_TRUE(list_checkpoints("/nonexistent/loom/ck").empty());
}

TEST(Checkpoint, RunIdentityChangeIsRefusedNamingTheKey) {
  const RunIdentity saved = {{"model", "a.gguf"}, {"lora.r", "8"}, {"seed", "1"}};
  EXPECT_NO_THROW(check_run_identity(saved, saved, "ck/step-00000004"));
  RunIdentity now = saved;
  now[1].second = "16";
  test_util::expect_error([&] { check_run_identity(saved, now, "ck/step-00000004"); }, ErrorKind::invalid_input,
                          {"'lora.r'", "'8'", "'16'", "ck/step-00000004"});
  now = saved;
  now.emplace_back("batch_size", "4");
  test_util::expect_error([&] { check_run_identity(saved, now, "ck"); }, ErrorKind::invalid_input, {"'batch_size'"});
}

TEST(Checkpoint, HashPathCoversFileAndFolderContents) {
  test_util::TempDir tmp("checkpoint_hash");
  write_bytes(tmp.path / "a.bin", "hello");
  const std::string h1 = hash_path((tmp.path / "a.bin").string());
  EXPECT_EQ(h1.size(), 16u);
  write_bytes(tmp.path / "a.bin", "hellp");
  EXPECT_NE(hash_path((tmp.path / "a.bin").string()), h1);
  const std::string d1 = hash_path(tmp.str());
  write_bytes(tmp.path / "b.bin", "");
  EXPECT_NE(hash_path(tmp.str()), d1);
  test_util::expect_error([&] { hash_path((tmp.path / "none").string()); }, ErrorKind::not_found, {"none"});
}

// ---- exact resume through the Trainer ------------------------------------

struct RunDir {
  test_util::TempDir tmp;
  explicit RunDir(const std::string& tag) : tmp("checkpoint_run_" + tag) {
    // 13 samples, one row each (pack: false): the last micro-batch of every
    // epoch has one row, and the 10 steps below cross three epochs.
    std::ofstream f(tmp.path / "train.jsonl");
    for (int i = 0; i < 13; ++i)
      f << fmt::format("{{\"text\": \"sample {} says {} to the {} and the cat sat on mat number {}\"}}\n", i,
                       i % 3 ? "hello" : "goodbye", i % 2 ? "world" : "moon", i * 7);
  }
  std::string yaml(const std::string& model, const std::string& out, const std::string& extra = "") const {
    return fmt::format(
        "model: {}\n"
        "data:\n  train: {}\n  eval: {}\n  seq_len: 32\n  pack: false\n"
        "lora:\n  r: 4\n  dropout: 0.1\n"
        "optim:\n  lr: 5e-3\n  weight_decay: 0.01\n"
        "schedule:\n  kind: cosine\n  warmup_steps: 3\n"
        "batch_size: 3\ngrad_accum: 2\nsteps: 10\neval_interval: 3\n"
        "output_dir: {}\nmetrics_file: {}.metrics.jsonl\nseed: 5\nthreads: 2\n{}",
        model, (tmp.path / "train.jsonl").string(), src("tests/fixtures/train_data/eval.jsonl"), out, out,
        extra);
  }
};

// The metrics_file's lines with the timing fields (which differ run to run) removed.
std::vector<std::string> metrics_lines(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    for (const char* k : {"step_seconds", "elapsed_seconds", "tokens_per_s"}) j.erase(k);
    out.push_back(j.dump());
  }
  return out;
}

std::string output_bytes(const std::string& dir) {
  std::string all;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& p : files) all += p.filename().string() + ":" + file_bytes(p);
  return all;
}

struct Outcome {
  TrainResult result;
  std::vector<std::string> metrics;
  std::string output;
};

// Uninterrupted, then stopped (as by SIGTERM) after each step in `stops` and
// resumed, until done; the two must agree exactly.
void expect_exact_resume(const std::string& model, const std::string& tag, const std::string& extra,
                         const std::vector<int64_t>& stops, int resume_threads = 2,
                         const std::vector<std::string>& overrides = {}) {
  RunDir rd(tag);
  const std::string a = (rd.tmp.path / "a").string(), b = (rd.tmp.path / "b").string();
  const TrainConfig ca = parse_train_config(rd.yaml(model, a, extra), "a.yaml", overrides);
  const TrainResult ra = run_training(ca, nullptr);
  ASSERT_EQ(ra.steps, 10);

  std::string yb = rd.yaml(model, b, extra + "checkpoint_interval: 4\nkeep_checkpoints: 2\n");
  std::atomic<int> stop{0};
  int64_t stop_at = stops.front();
  TrainHooks hooks;
  hooks.after_optimizer_step = [&](Trainer&, const StepReport& r) {
    if (r.step == stop_at) stop = SIGTERM;
  };
  TrainRuntime rt;
  rt.stop_signal = &stop;
  TrainResult rb = run_training(parse_train_config(yb, "b.yaml", overrides), nullptr, hooks, rt);
  for (size_t i = 1; i <= stops.size(); ++i) {
    ASSERT_EQ(rb.stopped_by_signal, SIGTERM);
    EXPECT_EQ(rb.steps, stop_at);
    EXPECT_EQ(fs::path(rb.checkpoint).filename(), checkpoint_name(stop_at));
    stop = 0;
    stop_at = i < stops.size() ? stops[i] : -1;
    rt.resume = "";
    TrainConfig cb = parse_train_config(yb, "b.yaml", overrides);
    cb.threads = resume_threads;
    cb.log_interval = 3;  // allowed to change
    rb = run_training(cb, nullptr, hooks, rt);
  }
  ASSERT_EQ(rb.stopped_by_signal, 0);
  ASSERT_EQ(rb.step_losses.size(), ra.step_losses.size());
  for (size_t i = 0; i < ra.step_losses.size(); ++i)
    EXPECT_EQ(rb.step_losses[i], ra.step_losses[i]) << "step " << i + 1;
  EXPECT_EQ(rb.eval_losses, ra.eval_losses);
  EXPECT_EQ(rb.eval_accuracies, ra.eval_accuracies);  // kept through the checkpoints
  EXPECT_EQ(rb.trained_tokens, ra.trained_tokens);
  EXPECT_EQ(metrics_lines(b + ".metrics.jsonl"), metrics_lines(a + ".metrics.jsonl"));
  EXPECT_EQ(output_bytes(b), output_bytes(a));
  // The checkpoints survived finish()'s whole-folder write of output_dir.
  EXPECT_FALSE(list_checkpoints(b + "/checkpoints").empty());
  EXPECT_TRUE(fs::exists(b + "/adapter_config.json") || fs::exists(b + "/config.json"));
  if (ca.optimizer == OptimizerKind::adamw8bit) {  // the 8-bit moments went through the checkpoints
    const std::string ck = list_checkpoints(b + "/checkpoints").front();
    for (const char* f : {"adam_m.q8", "adam_v.q8", "adam_m_absmax.f32", "adam_v_absmax.f32"})
      EXPECT_GT(fs::file_size(ck + "/" + f), 0u) << f;
  }
}

TEST(CheckpointResume, LoraF32StoppedTwiceGivesTheSameRun) {
  expect_exact_resume(src("tests/fixtures/model/tiny-llama.f32.gguf"), "f32", "", {2, 6});
}

TEST(CheckpointResume, LoraQ4_1StoppedGivesTheSameRun) {
  expect_exact_resume(src("tests/fixtures/model/tiny-llama.q4_1.gguf"), "q41", "", {5});
}

TEST(CheckpointResume, FullFineTuneStoppedGivesTheSameModelFolder) {
  expect_exact_resume(src("tests/fixtures/model/tiny-llama.f32.gguf"), "full", "method: full\n", {3});
}

// optim.kind adamw8bit: the codes and absmax of every tensor of >= 4096
// elements (the tiny model's matrices and embedding; LoRA r=64's A and B).
TEST(CheckpointResume, Adam8bitFullFineTuneStoppedGivesTheSameModelFolder) {
  expect_exact_resume(src("tests/fixtures/model/tiny-llama.f32.gguf"), "full8", "method: full\n", {3}, 2,
                      {"optim.kind=adamw8bit"});
}

TEST(CheckpointResume, Adam8bitLoraStoppedTwiceGivesTheSameRun) {
  expect_exact_resume(src("tests/fixtures/model/tiny-llama.f32.gguf"), "lora8", "", {2, 6}, 1,
                      {"optim.kind=adamw8bit", "lora.r=64"});
}

TEST(CheckpointResume, ResumeAtAnotherThreadCountGivesTheSameRun) {
  expect_exact_resume(src("tests/fixtures/model/tiny-llama.f32.gguf"), "threads", "", {4}, /*resume_threads=*/1);
}

// Identity keys refused naming the key; steps, intervals and threads may change.
TEST(CheckpointResume, ChangedRunIdentityIsRefusedAllowedChangesAreAccepted) {
  RunDir rd("identity");
  const std::string out = (rd.tmp.path / "o").string();
  const std::string model = src("tests/fixtures/model/tiny-llama.f32.gguf");
  std::atomic<int> stop{0};
  TrainHooks hooks;
  hooks.after_optimizer_step = [&](Trainer&, const StepReport& r) {
    if (r.step == 2) stop = SIGUSR1;
  };
  TrainRuntime rt;
  rt.stop_signal = &stop;
  const TrainResult first = run_training(parse_train_config(rd.yaml(model, out), "o.yaml"), nullptr, hooks, rt);
  ASSERT_EQ(first.stopped_by_signal, SIGUSR1);
  const std::string metrics_before = file_bytes(out + ".metrics.jsonl");

  stop = 0;
  rt.resume = "";
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"lora.r", "8"}, {"batch_size", "2"}, {"seed", "6"}, {"data.seq_len", "40"}, {"optim.kind", "adamw8bit"}}) {
    SCOPED_TRACE(key);
    const TrainConfig c = parse_train_config(rd.yaml(model, out), "o.yaml", std::vector{key + "=" + value});
    test_util::expect_error([&] { run_training(c, nullptr, {}, rt); }, ErrorKind::invalid_input,
                            {"'" + key + "'", "to '" + value + "'"});
  }
  // A refused resume left the metrics file alone.
  EXPECT_EQ(file_bytes(out + ".metrics.jsonl"), metrics_before);

  const TrainConfig ok = parse_train_config(rd.yaml(model, out), "o.yaml",
                                            std::vector<std::string>{"steps=4", "eval_interval=2", "threads=1",
                                                                     "log_interval=1", "checkpoint_interval=1"});
  const TrainResult r = run_training(ok, nullptr, {}, rt);
  EXPECT_EQ(r.stopped_by_signal, 0);
  EXPECT_EQ(r.steps, 4);
  EXPECT_EQ(r.step_losses.size(), 4u);
  EXPECT_EQ(r.step_losses[0], first.step_losses[0]);
  EXPECT_EQ(r.step_losses[1], first.step_losses[1]);

  // --resume PATH of a damaged checkpoint: refused with the reason.
  TrainRuntime rt_path;
  rt_path.resume = (fs::path(out) / "checkpoints" / "step-00000004").string();
  fs::resize_file(*rt_path.resume + "/adam_m.f32", 8);
  test_util::expect_error([&] { run_training(ok, nullptr, {}, rt_path); }, ErrorKind::invalid_input,
                          {"step-00000004", "truncated"});
  // --resume (latest): the damaged one is skipped for step 3.
  TrainConfig longer = ok;
  longer.steps = 5;
  const TrainResult r5 = run_training(longer, nullptr, {}, rt);
  EXPECT_EQ(r5.steps, 5);
}

// Without --resume, checkpoints of an earlier run are refused (say --resume or
// --overwrite); with --overwrite they are removed; an output_dir holding only
// checkpoints is accepted for a resume.
TEST(CheckpointResume, EarlierCheckpointsNeedResumeOrOverwrite) {
  RunDir rd("earlier");
  const std::string out = (rd.tmp.path / "o").string();
  const std::string model = src("tests/fixtures/model/tiny-llama.f32.gguf");
  const std::string y = rd.yaml(model, out, "checkpoint_interval: 2\n");
  std::atomic<int> stop{0};
  TrainHooks hooks;
  hooks.after_optimizer_step = [&](Trainer&, const StepReport& r) {
    if (r.step == 3) stop = SIGINT;
  };
  TrainRuntime rt;
  rt.stop_signal = &stop;
  ASSERT_EQ(run_training(parse_train_config(y, "o.yaml"), nullptr, hooks, rt).stopped_by_signal, SIGINT);
  // Only checkpoints in output_dir (no adapter yet).
  EXPECT_EQ(std::distance(fs::directory_iterator(out), fs::directory_iterator()), 1);
  test_util::expect_error([&] { run_training(parse_train_config(y, "o.yaml"), nullptr); }, ErrorKind::invalid_input,
                          {"checkpoint_dir", "--resume", "--overwrite"});
  TrainConfig over = parse_train_config(y, "o.yaml");
  over.overwrite = true;
  over.steps = 1;
  over.checkpoint_interval = 0;
  run_training(over, nullptr);
  EXPECT_TRUE(list_checkpoints(out + "/checkpoints").empty());

  // checkpoint_dir may not be output_dir itself.
  TrainConfig same = parse_train_config(y, "o.yaml");
  same.checkpoint_dir = out;
  test_util::expect_error([&] { run_training(same, nullptr); }, ErrorKind::invalid_input, {"checkpoint_dir"});
}

}  // namespace
}  // namespace loom
