// End-to-end LoRA training on the tiny llama fixture: the loss falls on a tiny
// repeated dataset, evaluation runs, and the adapter folder reads back (PEFT form).
#include <gtest/gtest.h>

#include "kernels/backend.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "temp_dir.h"
#include "model/model.h"
#include "core/thread_pool.h"
#include "model/peft_adapter.h"
#include "train/train_step.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

// One folder per test of this file.
struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("trainer_test") {}
};

TrainConfig tiny_config(const TempDir& tmp) {
  const std::string yaml = fmt::format(
      "model: {}\n"
      "data:\n"
      "  train: {}\n"
      "  eval: {}\n"
      "  seq_len: 48\n"
      "lora:\n"
      "  r: 4\n"
      "  dropout: 0\n"
      "optim:\n"
      "  lr: 1e-2\n"
      "  mlp_lr: 5e-3\n"
      "  lora_plus_ratio: 4\n"
      "schedule:\n"
      "  kind: constant\n"
      "batch_size: 2\n"
      "grad_accum: 2\n"
      "steps: 12\n"
      "eval_interval: 6\n"
      "output_dir: {}\n"
      "seed: 3\n"
      "threads: 2\n",
      src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
      src("tests/fixtures/train_data/eval.jsonl"), (tmp.path / "adapter").string());
  return parse_train_config(yaml, "test.yaml");
}

TEST(Trainer, LossFallsAndAdapterReadsBack) {
  TempDir tmp;
  const TrainConfig c = tiny_config(tmp);
  const TrainResult r = run_training(c, nullptr);
  ASSERT_EQ(r.steps, 12);
  ASSERT_EQ(r.step_losses.size(), 12u);
  for (double l : r.step_losses) EXPECT_TRUE(std::isfinite(l));
  // The same few rows again and again: the adapter must fit them.
  EXPECT_LT(r.step_losses.back(), r.step_losses.front() - 0.1);
  ASSERT_EQ(r.eval_losses.size(), 2u);  // step 6 and the end
  ASSERT_TRUE(r.final_eval_loss);
  EXPECT_TRUE(std::isfinite(*r.final_eval_loss));
  EXPECT_GT(r.trainable_params, 0);
  EXPECT_GT(r.total_params, r.trainable_params);
  EXPECT_GT(r.trained_tokens, 0);
  EXPECT_GT(r.tokens_per_s, 0);

  const peft::AdapterTensors ad = peft::read_adapter(r.adapter_dir);
  EXPECT_EQ(ad.config.r, 4);
  EXPECT_DOUBLE_EQ(ad.config.lora_alpha, 16);
  EXPECT_EQ(ad.config.base_model_name_or_path, c.model);
  EXPECT_EQ(ad.config.target_modules.size(), 7u);
  EXPECT_EQ(ad.pairs.size(), 2u * 7u);
  auto model = Model::load(c.model, {.tokenizer = false, .pack = false});
  peft::check_adapter_fits(ad, model->config(), r.adapter_dir);
  // Loaded back into the model's row order (q/k permuted for a GGUF llama), the
  // adapter gives the eval loss the trainer measured: the file is in PEFT order.
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto packed = Model::load(c.model, {.tokenizer = true, .pack = true, .backend = &backend});
  ASSERT_TRUE(lora_needs_qk_permutation(packed->config()));
  LoraModel lora(packed->config(), c.lora);
  for (const auto& [key, pair] : ad.pairs) {
    const LoraSlot& s = lora.slot(key.first, key.second);
    std::copy(pair.a.begin(), pair.a.end(), lora.params() + s.a_offset);
    std::copy(pair.b.begin(), pair.b.end(), lora.params() + s.b_offset);
  }
  lora_permute_qk_rows(lora, lora.params(), packed->config(), /*hf_to_model=*/true);
  DataOptions dopt;
  dopt.seq_len = c.seq_len;
  dopt.shuffle = false;
  const TrainData data = prepare_train_data(c.eval_file, packed->tokenizer(), nullptr, dopt);
  TrainSession session(packed->config(), packed->weights(), lora, backend);
  double sum = 0;
  int64_t n = 0;
  DataLoader loader(data.train, data.pad_id, c.batch_size, /*shuffle=*/false, 0);
  for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
    const LossResult lr = session.forward_loss(loader.next());
    sum += lr.loss_sum;
    n += lr.n_tokens;
  }
  ASSERT_GT(n, 0);
  EXPECT_NEAR(sum / static_cast<double>(n), *r.final_eval_loss, 1e-4);

  // Training moved B away from its zero init.
  const peft::LoraPair* q = ad.find(1, LoraTarget::q);
  ASSERT_NE(q, nullptr);
  double norm = 0;
  for (float v : q->b) norm += static_cast<double>(v) * v;
  EXPECT_GT(norm, 0);
}

TEST(Trainer, SameSeedSameLosses) {
  TempDir tmp;
  TrainConfig c = tiny_config(tmp);
  c.steps = 3;
  c.eval_file.clear();
  c.lora.dropout = 0.1;
  const TrainResult a = run_training(c, nullptr);
  const TrainResult b = run_training(c, nullptr);
  EXPECT_EQ(a.step_losses, b.step_losses);
  EXPECT_FALSE(a.final_eval_loss);
}

TEST(Trainer, BadDataNamesFile) {
  TempDir tmp;
  TrainConfig c = tiny_config(tmp);
  c.train_file = src("tests/fixtures/train_data/bad_json.jsonl");
  test_util::expect_error([&] { run_training(c, nullptr); }, ErrorKind::invalid_input, {"bad_json.jsonl:3"});
  c = tiny_config(tmp);
  c.seq_len = 100000;
  test_util::expect_error([&] { run_training(c, nullptr); }, ErrorKind::invalid_input, {"data.seq_len"});
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// method: full trains every weight; the output is a Hugging Face folder whose
// weights (loaded back, q/k in HF order from the GGUF's permuted rows) give the
// trained model's eval loss, and metrics_file has one JSON line per step.
TEST(Trainer, FullFineTuneWritesAModelFolderThatReloads) {
  TempDir tmp;
  std::vector<std::string> overrides = {"method=full", "optim.lr=1e-3", "eval_interval=0", "eval_at_start=true",
                                        "metrics_file=" + (tmp.path / "metrics.jsonl").string(),
                                        "output_dir=" + (tmp.path / "full").string()};
  std::string yaml = fmt::format(
      "model: {}\ndata:\n  train: {}\n  eval: {}\n  seq_len: 48\nbatch_size: 2\nsteps: 8\nthreads: 2\n"
      "output_dir: x\n",
      src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
      src("tests/fixtures/train_data/eval.jsonl"));
  const TrainConfig c = parse_train_config(yaml, "full.yaml", overrides);
  const TrainResult r = run_training(c, nullptr);
  ASSERT_EQ(r.eval_losses.size(), 2u);
  EXPECT_LT(r.eval_losses[1], r.eval_losses[0]);
  EXPECT_EQ(r.trainable_params, r.total_params);
  EXPECT_LT(r.step_losses.back(), r.step_losses.front());

  // The exported folder evaluates to the final eval loss of the run.
  std::string yaml2 = fmt::format(
      "model: {}\ndata:\n  train: {}\n  eval: {}\n  seq_len: 48\nbatch_size: 2\nsteps: 1\nthreads: 2\n"
      "eval_at_start: true\noutput_dir: {}\nmethod: full\noptim:\n  lr: 1e-9\n",
      (tmp.path / "full").string(), src("tests/fixtures/train_data/text.jsonl"),
      src("tests/fixtures/train_data/eval.jsonl"), (tmp.path / "again").string());
  const TrainResult again = run_training(parse_train_config(yaml2, "again.yaml"), nullptr);
  EXPECT_NEAR(again.eval_losses[0], r.eval_losses[1], 1e-4 * r.eval_losses[1]);

  std::ifstream m(tmp.path / "metrics.jsonl");
  int steps = 0, evals = 0;
  for (std::string line; std::getline(m, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("eval_loss")) ++evals;
    if (j.contains("loss")) {
      ++steps;
      EXPECT_EQ(j["step"].get<int>(), steps);
      EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
    }
  }
  EXPECT_EQ(steps, 8);
  EXPECT_EQ(evals, 2);
}

TEST(Trainer, FullFineTuneRejectsLoraOnlyOptions) {
  TempDir tmp;
  std::string yaml = fmt::format(
      "model: {}\ndata:\n  train: {}\nsteps: 1\nmethod: full\noptim:\n  lora_plus_ratio: 4\noutput_dir: {}\n",
      src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
      (tmp.path / "x").string());
  test_util::expect_error([&] { run_training(parse_train_config(yaml, "bad.yaml"), nullptr); },
                          ErrorKind::invalid_input, {"bad.yaml", "lora_plus_ratio", "method: lora"});
}

// Every output is checked before the model loads: the model path below does not exist,
// so any error about the model would mean the check came too late.
TEST(Trainer, OutputsAreCheckedBeforeTraining) {
  TempDir tmp;
  const auto config = [&](const std::vector<std::string>& sets) {
    std::vector<std::string> all = {"model=" + (tmp.path / "missing.gguf").string()};
    all.insert(all.end(), sets.begin(), sets.end());
    return parse_train_config(fmt::format("data:\n  train: {}\nsteps: 1\noutput_dir: {}\n",
                                          src("tests/fixtures/train_data/text.jsonl"), (tmp.path / "out").string()),
                              "t.yaml", all);
  };
  std::ofstream(tmp.path / "file") << "x";
  const std::string file = (tmp.path / "file").string();
  using test_util::expect_error;
  expect_error([&] { run_training(config({"output_dir=" + file}), nullptr); }, ErrorKind::invalid_input,
               {"t.yaml: output_dir", file, "exists and is not a folder"});
  expect_error([&] { run_training(config({"output_dir=" + file + "/sub/out"}), nullptr); }, ErrorKind::io,
               {"t.yaml: output_dir", "cannot create its parent folder"});
  expect_error([&] { run_training(config({"data.cache_dir=" + file}), nullptr); }, ErrorKind::io,
               {"t.yaml: data.cache_dir", "exists and is not a folder"});
  expect_error([&] { run_training(config({"data.cache_dir=" + file + "/c"}), nullptr); }, ErrorKind::io,
               {"t.yaml: data.cache_dir", "cannot create the folder"});
  // A folder that cannot be written in (as root, chmod does not stop writes: /sys/kernel does).
  fs::create_directories(tmp.path / "ro");
  fs::permissions(tmp.path / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  for (const std::string& ro : {(tmp.path / "ro").string(), std::string("/sys/kernel")}) {
    if (!fs::is_directory(ro) || std::ofstream(ro + "/.probe")) {  // writable after all (root): nothing to test
      fs::remove(ro + "/.probe");
      continue;
    }
    expect_error([&] { run_training(config({"data.cache_dir=" + ro}), nullptr); }, ErrorKind::io,
                 {"t.yaml: data.cache_dir", ro, "cannot write files"});
  }
  fs::permissions(tmp.path / "ro", fs::perms::owner_all);
  // A non-empty folder that is not a loom/PEFT output is refused unless overwrite: true.
  fs::create_directories(tmp.path / "notes");
  std::ofstream(tmp.path / "notes" / "my-notes.txt") << "keep";
  const std::string notes = "output_dir=" + (tmp.path / "notes").string();
  expect_error([&] { run_training(config({notes}), nullptr); }, ErrorKind::invalid_input,
               {"t.yaml: output_dir", "my-notes.txt", "--overwrite (or overwrite: true)"});
  // With overwrite the check passes and the run gets as far as the missing model.
  expect_error([&] { run_training(config({notes, "overwrite=true"}), nullptr); }, ErrorKind::not_found,
               {"missing.gguf"});
  EXPECT_TRUE(fs::exists(tmp.path / "notes" / "my-notes.txt"));  // nothing written before training
  // The output folder must not hold an input.
  expect_error([&] { run_training(config({"output_dir=" + src("tests/fixtures/train_data")}), nullptr); },
               ErrorKind::invalid_input, {"holds the data.train"});
  expect_error([&] { run_training(config({"metrics_file=" + (tmp.path / "out" / "m.jsonl").string()}), nullptr); },
               ErrorKind::invalid_input, {"holds the metrics_file"});
}

TEST(Trainer, OverwriteReplacesAForeignFolderAndWarningsArePrinted) {
  TempDir tmp;
  TrainConfig c = tiny_config(tmp);
  c.steps = 1;
  c.eval_interval = 0;
  c.output_dir = (tmp.path / "notes").string();
  fs::create_directories(c.output_dir);
  std::ofstream(tmp.path / "notes" / "my-notes.txt") << "keep";
  c.overwrite = true;
  c.warnings = {"cfg.yaml:3:1: a warning"};
  char* text = nullptr;
  size_t size = 0;
  std::FILE* log = open_memstream(&text, &size);
  run_training(c, log);
  std::fclose(log);
  const std::string out(text, size);
  std::free(text);
  EXPECT_NE(out.find("warning: cfg.yaml:3:1: a warning"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(tmp.path / "notes" / "my-notes.txt"));
  EXPECT_EQ(peft::read_adapter(c.output_dir).config.r, 4);
  // Its own output is replaced without overwrite.
  c.overwrite = false;
  c.lora.r = 2;
  run_training(c, nullptr);
  EXPECT_EQ(peft::read_adapter(c.output_dir).config.r, 2);
}

}  // namespace
}  // namespace loom
