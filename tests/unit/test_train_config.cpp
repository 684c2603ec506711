// `loom train` YAML config: defaults, every key's type and range check, unknown
// keys, --set overrides, and error messages naming the key and file:line.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "expect_error.h"
#include "train/train_config.h"

namespace loom {
namespace {

using test_util::expect_error;

const std::string kMinimal =
    "model: m.gguf\n"
    "data:\n"
    "  train: t.jsonl\n"
    "steps: 10\n"
    "output_dir: out\n";

TrainConfig parse(const std::string& yaml, std::vector<std::string> sets = {}) {
  return parse_train_config(yaml, "cfg.yaml", sets);
}

void expect_bad(const std::string& yaml, const std::vector<std::string>& needles, std::vector<std::string> sets = {}) {
  SCOPED_TRACE(yaml);
  expect_error([&] { parse(yaml, sets); }, ErrorKind::invalid_input, needles);
}

TEST(TrainConfig, MinimalGetsDefaults) {
  const TrainConfig c = parse(kMinimal);
  EXPECT_EQ(c.model, "m.gguf");
  EXPECT_EQ(c.train_file, "t.jsonl");
  EXPECT_EQ(c.steps, 10);
  EXPECT_EQ(c.output_dir, "out");
  EXPECT_EQ(c.seq_len, 512);
  EXPECT_TRUE(c.pack);
  EXPECT_FALSE(c.train_on_prompt);
  EXPECT_FALSE(c.skip_bad_lines);
  EXPECT_EQ(c.lora.r, 8);
  EXPECT_DOUBLE_EQ(c.lora.alpha, 16);
  EXPECT_DOUBLE_EQ(c.lora.dropout, 0.05);
  for (bool t : c.lora.targets) EXPECT_TRUE(t);
  EXPECT_DOUBLE_EQ(c.lr, 2e-4);
  EXPECT_DOUBLE_EQ(c.weight_decay, 0);
  EXPECT_DOUBLE_EQ(c.adam.max_grad_norm, 1.0);
  EXPECT_FALSE(c.lora_plus_ratio);
  EXPECT_FALSE(c.mlp_lr);
  EXPECT_EQ(c.grad_accum, 1);
  EXPECT_EQ(c.format, DataFormat::auto_detect);
}

TEST(TrainConfig, EveryKeyRead) {
  const std::string yaml =
      "model: /m\n"
      "data:\n"
      "  train: a.jsonl\n"
      "  eval: b.jsonl\n"
      "  format: messages\n"
      "  seq_len: 77\n"
      "  pack: false\n"
      "  train_on_prompt: yes\n"
      "  skip_bad_lines: true\n"
      "  cache_dir: cache\n"
      "lora:\n"
      "  r: 4\n"
      "  alpha: 8.5\n"
      "  dropout: 0\n"
      "  target_modules: [q, v_proj, down_proj]\n"
      "  use_rslora: true\n"
      "optim:\n"
      "  lr: 1e-3\n"
      "  weight_decay: 0.01\n"
      "  betas: [0.8, 0.95]\n"
      "  eps: 1.0e-6\n"
      "  max_grad_norm: 0\n"
      "  lora_plus_ratio: 16\n"
      "  mlp_lr: 5e-4\n"
      "schedule:\n"
      "  kind: cosine\n"
      "  warmup_steps: 3\n"
      "batch_size: 3\n"
      "grad_accum: 5\n"
      "epochs: 1.5\n"
      "eval_interval: 7\n"
      "log_interval: 2\n"
      "output_dir: o\n"
      "seed: 42\n"
      "threads: 3\n";
  const TrainConfig c = parse(yaml);
  EXPECT_EQ(c.eval_file, "b.jsonl");
  EXPECT_EQ(c.format, DataFormat::messages);
  EXPECT_EQ(c.seq_len, 77);
  EXPECT_FALSE(c.pack);
  EXPECT_TRUE(c.train_on_prompt);
  EXPECT_TRUE(c.skip_bad_lines);
  EXPECT_EQ(c.cache_dir, "cache");
  EXPECT_EQ(c.lora.r, 4);
  EXPECT_DOUBLE_EQ(c.lora.alpha, 8.5);
  EXPECT_DOUBLE_EQ(c.lora.dropout, 0);
  EXPECT_TRUE(c.lora.targets_module(LoraTarget::q));
  EXPECT_FALSE(c.lora.targets_module(LoraTarget::k));
  EXPECT_TRUE(c.lora.targets_module(LoraTarget::v));
  EXPECT_TRUE(c.lora.targets_module(LoraTarget::down));
  EXPECT_FALSE(c.lora.targets_module(LoraTarget::gate));
  EXPECT_TRUE(c.lora.use_rslora);
  EXPECT_EQ(c.lora.seed, 42u);
  EXPECT_DOUBLE_EQ(c.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(c.adam.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.adam.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.adam.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.adam.max_grad_norm, 0);
  EXPECT_DOUBLE_EQ(*c.lora_plus_ratio, 16);
  EXPECT_DOUBLE_EQ(*c.mlp_lr, 5e-4);
  EXPECT_EQ(c.schedule, LrScheduleKind::cosine);
  EXPECT_EQ(c.warmup_steps, 3);
  EXPECT_EQ(c.batch_size, 3);
  EXPECT_EQ(c.grad_accum, 5);
  EXPECT_EQ(c.steps, 0);
  EXPECT_DOUBLE_EQ(c.epochs, 1.5);
  EXPECT_EQ(c.eval_interval, 7);
  EXPECT_EQ(c.log_interval, 2);
  EXPECT_EQ(c.seed, 42u);
  EXPECT_EQ(c.threads, 3);
}

TEST(TrainConfig, MemoryAndPrecisionKeys) {
  const TrainConfig d = parse(kMinimal);
  EXPECT_EQ(d.gradient_checkpointing, 0);
  EXPECT_EQ(d.activation_dtype, TrainConfig::ActivationDType::f32);
  EXPECT_EQ(d.optimizer, OptimizerKind::adamw);
  EXPECT_EQ(d.precision, TrainPrecision::fp32);
  EXPECT_EQ(d.quantize_base, TrainConfig::BaseQuant::none);
  EXPECT_EQ(parse(kMinimal + "gradient_checkpointing: true\n").gradient_checkpointing, 1);
  EXPECT_EQ(parse(kMinimal + "gradient_checkpointing: false\n").gradient_checkpointing, 0);
  EXPECT_EQ(parse(kMinimal + "gradient_checkpointing: 4\n").gradient_checkpointing, 4);
  const TrainConfig c = parse(kMinimal + "activation_dtype: bf16\noptim:\n  kind: adamw8bit\nprecision: fp16\n"
                                         "quantize_base: nf4\n");
  EXPECT_EQ(c.activation_dtype, TrainConfig::ActivationDType::bf16);
  EXPECT_EQ(c.optimizer, OptimizerKind::adamw8bit);
  EXPECT_EQ(c.precision, TrainPrecision::fp16);
  EXPECT_EQ(c.quantize_base, TrainConfig::BaseQuant::nf4);
  expect_bad(kMinimal + "gradient_checkpointing: -1\n", {"'gradient_checkpointing'", "out of range"});
  expect_bad(kMinimal + "gradient_checkpointing: often\n", {"'gradient_checkpointing'", "expected an integer"});
  expect_bad(kMinimal + "activation_dtype: f8\n", {"'activation_dtype'", "f32 or bf16"});
  expect_bad(kMinimal + "optim:\n  kind: sgd\n", {"cfg.yaml:7:3", "'optim.kind'", "adamw or adamw8bit"});
  expect_bad(kMinimal + "precision: half\n", {"'precision'", "fp32, bf16 or fp16"});
  expect_bad(kMinimal + "quantize_base: nf8\n", {"'quantize_base'", "nf4, q4_0 or q8_0"});
}

TEST(TrainConfig, UnknownKeysNamedWithLine) {
  expect_bad(kMinimal + "lerning_rate: 1\n", {"cfg.yaml:6:1", "unknown key 'lerning_rate'"});
  expect_bad(kMinimal + "optim:\n  lrr: 1\n", {"cfg.yaml:7:3", "unknown key 'optim.lrr'"});
  expect_bad(kMinimal + "data2:\n  x: 1\n", {"unknown key 'data2'"});
  expect_bad(kMinimal + "optim: 3\n", {"cfg.yaml:6:1", "'optim' must be a mapping"});
}

TEST(TrainConfig, WrongTypesNamed) {
  expect_bad(kMinimal + "batch_size: four\n", {"cfg.yaml:6:1", "'batch_size'", "expected an integer", "four"});
  expect_bad(kMinimal + "grad_accum: 1.5\n", {"'grad_accum'", "expected an integer"});
  expect_bad(kMinimal + "optim:\n  lr: fast\n", {"cfg.yaml:7:3", "'optim.lr'", "expected a number"});
  expect_bad(kMinimal + "data:\n  pack: maybe\n", {"'data.pack'", "true or false"});
  expect_bad(kMinimal + "lora:\n  target_modules: q_proj\n", {"'lora.target_modules'", "list of strings"});
  expect_bad(kMinimal + "lora:\n  target_modules: [[q]]\n", {"'lora.target_modules'", "list of strings"});
  expect_bad(kMinimal + "optim:\n  betas: 0.9\n", {"'optim.betas'", "list of numbers"});
  expect_bad(kMinimal + "optim:\n  betas: [0.9, x]\n", {"'optim.betas'", "list of numbers"});
  expect_bad(kMinimal + "epochs: [1]\n", {"'epochs'", "expected a number, got a list"});
  expect_bad(kMinimal + "seed: {a: 1}\n", {"'seed'", "got a mapping"});
}

TEST(TrainConfig, RangesAndValues) {
  expect_bad(kMinimal + "data:\n  seq_len: 1\n", {"'data.seq_len'", "out of range"});
  expect_bad(kMinimal + "data:\n  eval_fraction: 1\n", {"'data.eval_fraction'", "out of range"});
  expect_bad(kMinimal + "data:\n  format: csv\n", {"'data.format'", "unknown format 'csv'"});
  expect_bad(kMinimal + "data:\n  eval: e.jsonl\n  eval_fraction: 0.1\n", {"'data.eval_fraction'", "not both"});
  expect_bad(kMinimal + "data:\n  cache_dir: ''\n", {"'data.cache_dir'", "must not be empty"});
  expect_bad(kMinimal + "lora:\n  r: 0\n", {"'lora.r'", "out of range"});
  expect_bad(kMinimal + "lora:\n  alpha: 0\n", {"'lora.alpha'", "out of range"});
  expect_bad(kMinimal + "lora:\n  dropout: 1\n", {"'lora.dropout'", "out of range"});
  expect_bad(kMinimal + "lora:\n  target_modules: [q_proj, lm_head]\n", {"'lora.target_modules'", "lm_head"});
  expect_bad(kMinimal + "lora:\n  target_modules: []\n", {"'lora.target_modules'", "empty"});
  expect_bad(kMinimal + "optim:\n  lr: 0\n", {"'optim.lr'", "out of range"});
  expect_bad(kMinimal + "optim:\n  lr: .nan\n", {"'optim.lr'", "out of range"});
  expect_bad(kMinimal + "optim:\n  weight_decay: -1\n", {"'optim.weight_decay'"});
  expect_bad(kMinimal + "optim:\n  betas: [0.9]\n", {"'optim.betas'", "expected 2 numbers"});
  expect_bad(kMinimal + "optim:\n  betas: [0.9, 1.0]\n", {"'optim.betas'", "[0, 1)"});
  expect_bad(kMinimal + "optim:\n  eps: 0\n", {"'optim.eps'"});
  expect_bad(kMinimal + "optim:\n  max_grad_norm: -1\n", {"'optim.max_grad_norm'"});
  expect_bad(kMinimal + "optim:\n  lora_plus_ratio: 0\n", {"'optim.lora_plus_ratio'"});
  expect_bad(kMinimal + "optim:\n  mlp_lr: -1e-4\n", {"'optim.mlp_lr'"});
  expect_bad(kMinimal + "schedule:\n  kind: step\n", {"'schedule.kind'", "step"});
  expect_bad(kMinimal + "schedule:\n  warmup_steps: -1\n", {"'schedule.warmup_steps'"});
  expect_bad(kMinimal + "batch_size: 0\n", {"'batch_size'"});
  expect_bad(kMinimal + "grad_accum: 0\n", {"'grad_accum'"});
  expect_bad(kMinimal + "eval_interval: -2\n", {"'eval_interval'"});
  expect_bad(kMinimal + "log_interval: 0\n", {"'log_interval'"});
  expect_bad(kMinimal + "seed: -1\n", {"'seed'"});
  expect_bad(kMinimal + "threads: 5000\n", {"'threads'"});
  expect_bad(kMinimal + "epochs: 2\n", {"'epochs'", "not both"});
  expect_bad(kMinimal + "epochs: 0\n", {"'epochs'", "out of range"});
}

TEST(TrainConfig, RequiredKeys) {
  expect_bad("data: {train: t}\nsteps: 1\noutput_dir: o\n", {"cfg.yaml", "missing required key 'model'"});
  expect_bad("model: m\nsteps: 1\noutput_dir: o\n", {"missing required key 'data.train'"});
  expect_bad("model: m\ndata: {train: t}\nsteps: 1\n", {"missing required key 'output_dir'"});
  expect_bad("model: m\ndata: {train: t}\noutput_dir: o\n", {"'steps' or 'epochs'"});
  expect_bad("", {"missing required key 'model'"});
  expect_bad("- a\n- b\n", {"cfg.yaml", "must be a mapping"});
  expect_bad("model: [unclosed\n", {"cfg.yaml:", "invalid YAML"});
  expect_bad(kMinimal + "model: again\n", {"cfg.yaml:6:1", "'model'", "twice"});
}

TEST(TrainConfig, NullKeepsDefault) {
  const TrainConfig c = parse(kMinimal + "data:\n  seq_len:\n");
  EXPECT_EQ(c.seq_len, 512);
}

TEST(TrainConfig, FlatDottedKeysInFile) {
  const TrainConfig c = parse(kMinimal + "optim.lr: 0.5\n");
  EXPECT_DOUBLE_EQ(c.lr, 0.5);
}

TEST(TrainConfig, SetOverrides) {
  const TrainConfig c = parse(kMinimal, {"optim.lr=1e-5", "lora.target_modules=[gate, up]", "data.pack=false",
                                         "steps=3", "model=other.gguf"});
  EXPECT_DOUBLE_EQ(c.lr, 1e-5);
  EXPECT_TRUE(c.lora.targets_module(LoraTarget::gate));
  EXPECT_FALSE(c.lora.targets_module(LoraTarget::q));
  EXPECT_FALSE(c.pack);
  EXPECT_EQ(c.steps, 3);
  EXPECT_EQ(c.model, "other.gguf");
  // A --set may supply a required key.
  EXPECT_EQ(parse("model: m\ndata: {train: t}\nsteps: 1\n", {"output_dir=x"}).output_dir, "x");
}

TEST(TrainConfig, SetErrorsNamed) {
  expect_bad(kMinimal, {"--set optim.lrr=1", "unknown key 'optim.lrr'"}, {"optim.lrr=1"});
  expect_bad(kMinimal, {"--set optim=1", "unknown key 'optim'"}, {"optim=1"});
  expect_bad(kMinimal, {"--set batch_size=big", "'batch_size'", "expected an integer"}, {"batch_size=big"});
  expect_bad(kMinimal, {"--set steps", "key=value"}, {"steps"});
  expect_bad(kMinimal, {"--set =3", "key=value"}, {"=3"});
  expect_bad(kMinimal, {"--set lora.target_modules=[q", "invalid YAML"}, {"lora.target_modules=[q"});
}

TEST(TrainConfig, MissingFile) {
  expect_error([] { load_train_config("/nonexistent/cfg.yaml"); }, ErrorKind::not_found, {"/nonexistent/cfg.yaml"});
}

TEST(TrainConfig, DirectoryIsNotAConfig) {
  const std::string dir = std::string(LOOM_SOURCE_DIR) + "/tests";
  expect_error([&] { load_train_config(dir); }, ErrorKind::invalid_input, {dir, "is a directory, not a file"});
}

// The trainer evaluates exactly when data.eval or data.eval_fraction gives an eval split.
TEST(TrainConfig, EvaluationNeedsAnEvalSplit) {
  expect_bad(kMinimal + "eval_interval: 5\n", {"cfg.yaml:6:1", "'eval_interval'", "no eval split", "data.eval"});
  expect_bad(kMinimal + "eval_at_start: true\n", {"'eval_at_start'", "no eval split"});
  expect_bad(kMinimal, {"--set eval_interval=2", "no eval split"}, {"eval_interval=2"});
  EXPECT_EQ(parse(kMinimal + "eval_interval: 5\ndata.eval: e.jsonl\n").eval_interval, 5);
  EXPECT_TRUE(parse(kMinimal + "eval_at_start: true\n", {"data.eval_fraction=0.1"}).eval_at_start);
  EXPECT_EQ(parse(kMinimal + "eval_interval: 0\neval_at_start: false\n").eval_interval, 0);
}

TEST(TrainConfig, SettingsWithoutEffectWarn) {
  EXPECT_TRUE(parse(kMinimal).warnings.empty());
  const TrainConfig c = parse(kMinimal + "output_dtype: bf16\n");
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("cfg.yaml:6:1: key 'output_dtype' applies to method: full only"), std::string::npos)
      << c.warnings[0];
  EXPECT_TRUE(parse(kMinimal + "output_dtype: bf16\nmethod: full\n").warnings.empty());
  const TrainConfig w = parse(kMinimal + "schedule:\n  warmup_steps: 10\n");  // steps: 10
  ASSERT_EQ(w.warnings.size(), 1u);
  EXPECT_NE(w.warnings[0].find("schedule.warmup_steps 10 is not below steps 10"), std::string::npos)
      << w.warnings[0];
  EXPECT_TRUE(parse(kMinimal + "schedule:\n  warmup_steps: 9\n").warnings.empty());
}

// yaml-cpp would read the first of several documents and drop the rest; a tab that indents gets its cause.
TEST(TrainConfig, SecondDocumentsAndTabsAreNamed) {
  expect_bad(kMinimal + "---\nsteps: 3\n", {"cfg.yaml:6", "a second YAML document"});
  expect_bad(",", {"cfg.yaml"});  // yaml-cpp's LoadAll never returned on it (fuzz_train_config)
  expect_bad(kMinimal, {"--set data.train=", "'data.train' is required and has no value"}, {"data.train="});
  expect_bad("model: m.gguf\ndata:\n\ttrain: t.jsonl\n", {"cfg.yaml:3", "tab"});
  EXPECT_EQ(parse("---\n" + kMinimal).steps, 10);  // a leading '---' is one document
}

TEST(TrainConfig, Overwrite) {
  EXPECT_FALSE(parse(kMinimal).overwrite);
  EXPECT_TRUE(parse(kMinimal + "overwrite: true\n").overwrite);
  EXPECT_TRUE(parse(kMinimal, {"overwrite=true"}).overwrite);
  expect_bad(kMinimal + "overwrite: please\n", {"'overwrite'", "true or false"});
}

// ---- production-training keys (checkpoints, divergence, memory, metrics, logs) ----

// A --set override that must be refused (the production keys below).
void expect_bad_set(const std::vector<std::string>& sets, const std::vector<std::string>& needles) {
  expect_bad(kMinimal, needles, sets);
}

TEST(TrainProductionConfig, Defaults) {
  const TrainConfig c = parse(kMinimal);
  EXPECT_EQ(c.checkpoint_interval, 0);
  EXPECT_EQ(c.checkpoint_minutes, 0);
  EXPECT_TRUE(c.checkpoint_dir.empty());
  EXPECT_EQ(c.keep_checkpoints, 3);
  EXPECT_EQ(c.max_bad_steps, 5);
  EXPECT_EQ(c.on_divergence, TrainConfig::OnDivergence::rollback);
  EXPECT_EQ(c.memory_limit, 0);
  EXPECT_EQ(c.memory_alarm, (std::vector<double>{0.80, 0.95}));
  EXPECT_EQ(c.metrics_port, 0);
  EXPECT_EQ(c.metrics_host, "127.0.0.1");
  EXPECT_EQ(c.log_format, TrainConfig::LogFormat::text);
}

TEST(TrainProductionConfig, EveryKeyRead) {
  const TrainConfig c = parse(kMinimal + "checkpoint_interval: 50\ncheckpoint_minutes: 7.5\ncheckpoint_dir: ck\n"
                                         "keep_checkpoints: 2\nmax_bad_steps: 3\non_divergence: stop\n"
                                         "rollback_lr_factor: 0.25\nmax_rollbacks: 1\nmemory_limit: 1.5GiB\n"
                                         "memory_alarm: [0.5, 0.9]\nmetrics_port: 9100\nmetrics_host: 0.0.0.0\n"
                                         "log_file: logs/train.jsonl\nlog_format: json\n");
  EXPECT_EQ(c.checkpoint_interval, 50);
  EXPECT_DOUBLE_EQ(c.checkpoint_minutes, 7.5);
  EXPECT_EQ(c.checkpoint_dir, "ck");
  EXPECT_EQ(c.keep_checkpoints, 2);
  EXPECT_EQ(c.max_bad_steps, 3);
  EXPECT_EQ(c.on_divergence, TrainConfig::OnDivergence::stop);
  EXPECT_DOUBLE_EQ(c.rollback_lr_factor, 0.25);
  EXPECT_EQ(c.max_rollbacks, 1);
  EXPECT_EQ(c.memory_limit, int64_t{3} << 29);
  EXPECT_EQ(c.memory_alarm, (std::vector<double>{0.5, 0.9}));
  EXPECT_EQ(c.metrics_port, 9100);
  EXPECT_EQ(c.metrics_host, "0.0.0.0");
  EXPECT_EQ(c.log_file, "logs/train.jsonl");
  EXPECT_EQ(c.log_format, TrainConfig::LogFormat::json);
}

TEST(TrainProductionConfig, BadValuesNamed) {
  expect_bad_set({"on_divergence=retry"}, {"on_divergence", "retry", "rollback or stop"});
  expect_bad_set({"log_format=xml"}, {"log_format", "text or json"});
  expect_bad_set({"memory_limit=lots"}, {"memory_limit", "8GiB"});
  expect_bad_set({"memory_limit=-3G"}, {"memory_limit"});
  expect_bad_set({"memory_alarm=[0.9, 0.8]"}, {"memory_alarm", "increasing"});
  expect_bad_set({"memory_alarm=[1.5]"}, {"memory_alarm", "(0, 1]"});
  expect_bad_set({"metrics_port=70000"}, {"metrics_port", "out of range"});
  expect_bad_set({"rollback_lr_factor=1"}, {"rollback_lr_factor", "out of range"});
  expect_bad_set({"keep_checkpoints=0"}, {"keep_checkpoints", "out of range"});
  expect_bad_set({"checkpoint_interval=-1"}, {"checkpoint_interval"});
}

TEST(TrainProductionConfig, ByteSizes) {
  EXPECT_EQ(parse_byte_size("8GiB"), int64_t{8} << 30);
  EXPECT_EQ(parse_byte_size("8 gib"), int64_t{8} << 30);
  EXPECT_EQ(parse_byte_size("1.5G"), 1500000000);
  EXPECT_EQ(parse_byte_size("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_byte_size("2000000000"), 2000000000);
  EXPECT_EQ(parse_byte_size("3kb"), 3000);
  EXPECT_FALSE(parse_byte_size(""));
  EXPECT_FALSE(parse_byte_size("G"));
  EXPECT_FALSE(parse_byte_size("1.2.3G"));
  EXPECT_FALSE(parse_byte_size("4 parsecs"));
  EXPECT_FALSE(parse_byte_size("0"));
}

std::string identity_value(const TrainConfig& c, const std::string& key) {
  for (const auto& [k, v] : run_identity(c))
    if (k == key) return v;
  ADD_FAILURE() << "run_identity has no key " << key;
  return {};
}

TEST(TrainProductionConfig, RunIdentityHasWhatChangesTheRun) {
  const TrainConfig base = parse(kMinimal);
  // A change of any of these changes what the run computes.
  const std::vector<std::pair<std::string, std::string>> changes = {
      {"model", "other.gguf"}, {"data.train", "u.jsonl"}, {"data.seq_len", "64"}, {"lora.r", "16"},
      {"lora.target_modules", "[q_proj]"}, {"batch_size", "2"}, {"grad_accum", "3"}, {"seed", "7"},
      {"optim.lr", "1e-3"}, {"method", "full"}, {"schedule.kind", "cosine"}};
  for (const auto& [key, value] : changes) {
    SCOPED_TRACE(key);
    const TrainConfig changed = parse(kMinimal, {key + "=" + value});
    EXPECT_NE(identity_value(base, key), identity_value(changed, key));
  }
  // These do not: a resumed run may change them.
  const TrainConfig free = parse(kMinimal, {"steps=20", "log_interval=1", "threads=3", "checkpoint_interval=5"});
  EXPECT_EQ(run_identity(base), run_identity(free));
  for (const auto& [k, v] : run_identity(base))
    EXPECT_TRUE(k != "steps" && k != "threads" && k != "log_interval" && k != "eval_interval") << k;
}

// dist.*: the data-parallel settings (src/train/train_config.cpp read_dist_keys).
TEST(TrainDistConfig, Defaults) {
  const TrainConfig c = parse(kMinimal);
  EXPECT_EQ(c.dist.sync.bucket_bytes, size_t{25} << 20);
  EXPECT_TRUE(c.dist.sync.overlap);
  EXPECT_FALSE(c.dist.sync.deterministic);
  EXPECT_EQ(c.dist.sync.compression, GradCompression::none);
  EXPECT_DOUBLE_EQ(c.dist.sync.topk_ratio, 0.1);
  EXPECT_EQ(c.dist.sync.powersgd_rank, 4);
  EXPECT_EQ(c.dist.algorithm, CollectiveAlgorithm::automatic);
  EXPECT_DOUBLE_EQ(c.dist.timeout_s, 300);
  EXPECT_FALSE(c.dist.zero1);
}

TEST(TrainDistConfig, EveryKeyRead) {
  const TrainConfig c = parse(kMinimal + "dist:\n  bucket_mb: 0.5\n  overlap: false\n  deterministic: true\n"
                                         "  compression: powersgd\n  ratio: 0.05\n  rank: 2\n  algorithm: ring\n"
                                         "  timeout: 12.5\n  zero: 1\n");
  EXPECT_EQ(c.dist.sync.bucket_bytes, size_t{512} << 10);
  EXPECT_FALSE(c.dist.sync.overlap);
  EXPECT_TRUE(c.dist.sync.deterministic);
  EXPECT_EQ(c.dist.sync.compression, GradCompression::powersgd);
  EXPECT_DOUBLE_EQ(c.dist.sync.topk_ratio, 0.05);
  EXPECT_EQ(c.dist.sync.powersgd_rank, 2);
  EXPECT_EQ(c.dist.algorithm, CollectiveAlgorithm::ring);
  EXPECT_DOUBLE_EQ(c.dist.timeout_s, 12.5);
  EXPECT_TRUE(c.dist.zero1);
}

TEST(TrainDistConfig, EveryValueOfTheChoices) {
  const std::pair<const char*, GradCompression> compressions[] = {
      {"none", GradCompression::none}, {"topk", GradCompression::topk}, {"powersgd", GradCompression::powersgd}};
  for (const auto& [name, value] : compressions)
    EXPECT_EQ(parse(kMinimal, {std::string("dist.compression=") + name}).dist.sync.compression, value) << name;
  const std::pair<const char*, CollectiveAlgorithm> algorithms[] = {
      {"auto", CollectiveAlgorithm::automatic},
      {"ring", CollectiveAlgorithm::ring},
      {"tree", CollectiveAlgorithm::tree},
      {"rabenseifner", CollectiveAlgorithm::rabenseifner},
      {"recursive_doubling", CollectiveAlgorithm::recursive_doubling}};
  for (const auto& [name, value] : algorithms)
    EXPECT_EQ(parse(kMinimal, {std::string("dist.algorithm=") + name}).dist.algorithm, value) << name;
  // The closed ends of the ranges.
  EXPECT_DOUBLE_EQ(parse(kMinimal, {"dist.ratio=1"}).dist.sync.topk_ratio, 1.0);
  EXPECT_EQ(parse(kMinimal, {"dist.rank=1"}).dist.sync.powersgd_rank, 1);
  EXPECT_EQ(parse(kMinimal, {"dist.rank=1024"}).dist.sync.powersgd_rank, 1024);
  EXPECT_FALSE(parse(kMinimal, {"dist.zero=0"}).dist.zero1);
  EXPECT_EQ(parse(kMinimal, {"dist.bucket_mb=65536"}).dist.sync.bucket_bytes, size_t{1} << 36);
  // A bucket smaller than one float is one float.
  EXPECT_EQ(parse(kMinimal, {"dist.bucket_mb=1e-9"}).dist.sync.bucket_bytes, sizeof(float));
  // Flat dotted keys in the file, as everywhere.
  EXPECT_EQ(parse(kMinimal + "dist.compression: topk\n").dist.sync.compression, GradCompression::topk);
}

TEST(TrainDistConfig, BadValuesNamed) {
  expect_bad(kMinimal + "dist:\n  compression: gzip\n", {"cfg.yaml:7:3", "'dist.compression'", "gzip",
                                                          "none, topk or powersgd"});
  expect_bad_set({"dist.bucket_mb=0"}, {"'dist.bucket_mb'", "out of range"});
  expect_bad_set({"dist.bucket_mb=-1"}, {"'dist.bucket_mb'", "out of range"});
  expect_bad_set({"dist.bucket_mb=65537"}, {"'dist.bucket_mb'", "out of range"});
  expect_bad_set({"dist.bucket_mb=big"}, {"'dist.bucket_mb'", "expected a number"});
  expect_bad_set({"dist.overlap=maybe"}, {"'dist.overlap'", "true or false"});
  expect_bad_set({"dist.deterministic=2"}, {"'dist.deterministic'", "true or false"});
  expect_bad_set({"dist.compression=''"}, {"'dist.compression'", "must not be empty"});
  expect_bad_set({"dist.ratio=0"}, {"'dist.ratio'", "out of range (0, 1]"});
  expect_bad_set({"dist.ratio=1.5"}, {"'dist.ratio'", "out of range (0, 1]"});
  expect_bad_set({"dist.ratio=.nan"}, {"'dist.ratio'", "out of range"});
  expect_bad_set({"dist.rank=0"}, {"'dist.rank'", "out of range [1, 1024]"});
  expect_bad_set({"dist.rank=1025"}, {"'dist.rank'", "out of range [1, 1024]"});
  expect_bad_set({"dist.rank=2.5"}, {"'dist.rank'", "expected an integer"});
  expect_bad_set({"dist.algorithm=butterfly"}, {"'dist.algorithm'", "butterfly", "auto, ring, tree, rabenseifner or "
                                                                                  "recursive_doubling"});
  expect_bad_set({"dist.timeout=0"}, {"'dist.timeout'", "out of range"});
  expect_bad_set({"dist.timeout=-5"}, {"'dist.timeout'", "out of range"});
  expect_bad_set({"dist.zero=2"}, {"'dist.zero'", "out of range [0, 1]"});
  expect_bad_set({"dist.zero=-1"}, {"'dist.zero'", "out of range [0, 1]"});
  expect_bad_set({"dist.zero=true"}, {"'dist.zero'", "expected an integer"});
  expect_bad_set({"dist.buckets=1"}, {"unknown key 'dist.buckets'"});
  expect_bad(kMinimal + "dist: 3\n", {"'dist' must be a mapping"});
}

}  // namespace
}  // namespace loom
