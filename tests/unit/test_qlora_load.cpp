// QLoRA's loading paths (model/quantize_base.h, model/bnb_folder.h):
//  - quantize_base q8_0 / q4_0 of an f16 GGUF equals llama-quantize --pure byte
//    for byte (fixtures made by third_party/llama.cpp's tool);
//  - quantize_base nf4 of an f32 folder equals what transformers + bitsandbytes
//    saved for the same model (tiny_bnb), byte for byte;
//  - a bitsandbytes 4-bit folder loads as nf4 and its logits match
//    transformers' (through bnb's CPU kernels);
//  - bad folders and sources are refused with errors naming file and tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/half.h"
#include "core/thread_pool.h"
#include "io/gguf.h"
#include "io/hf_folder.h"
#include "io/safetensors.h"
#include "kernels/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/quantize_base.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "expect_error.h"
#include "temp_dir.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test_util::expect_error;

std::string fixture(const std::string& f) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/nf4/" + f; }

std::unique_ptr<Model> load(const std::string& path, std::optional<DType> q = std::nullopt) {
  Model::LoadOptions o{.tokenizer = false, .pack = false};
  o.quantize_base = q;
  return Model::load(path, o);
}

std::vector<const Tensor*> layer_mats(const ModelWeights& w) {
  std::vector<const Tensor*> v;
  for (const auto& L : w.layers)
    for (const Tensor* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) v.push_back(t);
  return v;
}

void expect_same_bytes(const Tensor& a, const Tensor& b, size_t i) {
  ASSERT_EQ(a.dtype, b.dtype) << i;
  ASSERT_EQ(a.shape_string(), b.shape_string()) << i;
  ASSERT_EQ(a.nbytes(), b.nbytes()) << i;
  EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes()), 0) << "matrix " << i << " differs";
}

class QuantizeBaseGguf : public ::testing::TestWithParam<DType> {};

TEST_P(QuantizeBaseGguf, EqualsLlamaQuantize) {
  const DType q = GetParam();
  const auto mine = load(fixture("tiny.f16.gguf"), q);
  const auto theirs = load(fixture(fmt::format("tiny.{}.gguf", dtype_name(q))));
  const auto a = layer_mats(mine->weights()), b = layer_mats(theirs->weights());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]->dtype, q);
    expect_same_bytes(*a[i], *b[i], i);
  }
  // The embedding keeps its stored type.
  EXPECT_EQ(mine->weights().token_embd.dtype, DType::f16);
}
INSTANTIATE_TEST_SUITE_P(Types, QuantizeBaseGguf, ::testing::Values(DType::q8_0, DType::q4_0),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// The 4-bit codes byte for byte. The double-quantized absmax too, but for the
// few blocks where bitsandbytes' approximate binary search (BinSearch's Direct2,
// then one left/right check) picks a code of the dynamic map that is not the
// nearest: loom takes the nearest (3 of the 5376 blocks here), a neighbouring
// code, so that block's absmax differs by one step of the map (< 2%).
TEST(QuantizeBase, Nf4EqualsBitsandbytesFolder) {
  const auto mine = load(fixture("tiny_f32"), DType::nf4);
  const auto theirs = load(fixture("tiny_bnb"));
  EXPECT_EQ(theirs->bnb_quant_type(), "nf4");
  const auto a = layer_mats(mine->weights()), b = layer_mats(theirs->weights());
  ASSERT_EQ(a.size(), b.size());
  int64_t all_bad = 0, all_blocks = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i]->dtype, DType::nf4);
    ASSERT_EQ(b[i]->dtype, DType::nf4);
    ASSERT_EQ(a[i]->nbytes(), b[i]->nbytes());
    const int64_t nb = a[i]->numel() / 64;
    const auto* x = static_cast<const uint8_t*>(a[i]->data);
    const auto* y = static_cast<const uint8_t*>(b[i]->data);
    int64_t code_diff = 0, d_bad = 0;
    for (int64_t k = 0; k < nb; ++k) {
      code_diff += std::memcmp(x + 36 * k + 4, y + 36 * k + 4, 32) != 0;
      float dx, dy;
      std::memcpy(&dx, x + 36 * k, 4);
      std::memcpy(&dy, y + 36 * k, 4);
      if (float_to_bits(dx) != float_to_bits(dy)) {
        ++d_bad;
        EXPECT_LT(std::fabs(dx - dy), 0.02f * std::fabs(dy)) << "matrix " << i << " block " << k;
      }
    }
    EXPECT_EQ(code_diff, 0) << "matrix " << i;
    EXPECT_LE(d_bad, 1) << "matrix " << i;
    all_bad += d_bad;
    all_blocks += nb;
  }
  EXPECT_LE(all_bad, 3) << "of " << all_blocks;
}

TEST(QuantizeBase, RefusesQuantizedSources) {
  expect_error([] { load(fixture("tiny.q8_0.gguf"), DType::nf4); }, ErrorKind::invalid_input,
               {"tiny.q8_0.gguf", "quantize_base nf4", "layer 0 q_proj is q8_0"});
  expect_error([] { load(fixture("tiny_bnb"), DType::q4_0); }, ErrorKind::invalid_input,
               {"tiny_bnb", "quantize_base q4_0", "is nf4"});
}

std::vector<float> all_logits(const Model& m, Backend& backend, const std::vector<int32_t>& tokens) {
  InferenceSession s(m.config(), m.weights(), backend, 64, DType::f32, 4);
  s.eval(tokens, /*all_logits=*/true);
  return s.logits();
}

TEST(BnbFolder, LogitsMatchTransformers) {
  std::ifstream in(fixture("tiny_bnb_logits.json"));
  const json ref = json::parse(in);
  const auto tokens = ref["tokens"].get<std::vector<int32_t>>();
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  const auto m = Model::load(fixture("tiny_bnb"), {.tokenizer = false, .pack = true, .backend = backend.get()});
  EXPECT_EQ(m->weights().layers[0].wq.dtype, DType::nf4);
  const std::vector<float> got = all_logits(*m, *backend, tokens);
  const int64_t V = m->config().vocab_size;
  ASSERT_EQ(got.size(), tokens.size() * static_cast<size_t>(V));
  auto max_diff = [&](const char* key) {
    double d = 0, r = 0;
    for (size_t t = 0; t < tokens.size(); ++t)
      for (int64_t v = 0; v < V; ++v) {
        const double x = ref[key][t][static_cast<size_t>(v)].get<double>();
        d = std::max(d, std::fabs(got[t * static_cast<size_t>(V) + static_cast<size_t>(v)] - x));
        r = std::max(r, std::fabs(x));
      }
    return d / r;
  };
  // Against the f32 forward of bitsandbytes' own dequantize_4bit weights: only
  // f32 summation orders differ.
  EXPECT_LT(max_diff("logits_dequantized"), 2e-5);
  // Against transformers' forward through bitsandbytes' CPU 4-bit kernels,
  // which is itself 1% (of the largest logit) off its dequantized weights'
  // f32 product on this model (max_abs_diff_bnb_vs_dequantized).
  EXPECT_LT(max_diff("logits"), 0.02);
  // Both far inside what the quantization itself moves (vs the f32 model).
  EXPECT_GT(ref["max_abs_diff_vs_f32"].get<double>(), 20 * ref["max_abs_diff_bnb_vs_dequantized"].get<double>());
}

// A copy of tiny_bnb with config.json edited and/or the safetensors file
// rewritten through `edit` (name -> (dtype, shape, bytes); erase to drop).
struct Entry {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
using Entries = std::map<std::string, Entry>;

void write_safetensors(const std::string& path, const Entries& es) {
  json header = json::object();
  std::string data;
  for (const auto& [name, e] : es) {
    header[name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {data.size(), data.size() + e.bytes.size()}}};
    data += e.bytes;
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = h.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << h << data;
}

Entries read_entries(const std::string& path) {
  const auto f = safetensors::File::open(path);
  Entries es;
  for (const auto& t : f->tensors())
    es[t.name] = {safetensors::st_dtype_name(t.st_dtype), std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim),
                  std::string(reinterpret_cast<const char*>(t.data), t.nbytes())};
  return es;
}

struct BadFolder {
  test_util::TempDir dir{"bnb_bad"};
  json config;
  Entries entries;
  BadFolder() {
    std::ifstream in(fixture("tiny_bnb/config.json"));
    config = json::parse(in);
    entries = read_entries(fixture("tiny_bnb/model.safetensors"));
  }
  std::string write() {
    std::ofstream(dir.str() + "/config.json") << config.dump(1);
    write_safetensors(dir.str() + "/model.safetensors", entries);
    return dir.str();
  }
};

const std::string kQ = "model.layers.0.self_attn.q_proj.weight";

TEST(BnbFolder, RefusesOtherQuantizations) {
  {
    BadFolder b;
    b.config["quantization_config"]["bnb_4bit_quant_type"] = "fp4";
    expect_error([&] { load(b.write()); }, ErrorKind::unsupported, {"config.json", "bnb_4bit_quant_type 'fp4'"});
  }
  {
    BadFolder b;
    b.config["quantization_config"]["load_in_8bit"] = true;
    b.config["quantization_config"]["load_in_4bit"] = false;
    expect_error([&] { load(b.write()); }, ErrorKind::unsupported, {"config.json", "8-bit bitsandbytes"});
  }
  {
    BadFolder b;
    b.config["quantization_config"]["quant_method"] = "gptq";
    expect_error([&] { load(b.write()); }, ErrorKind::unsupported, {"config.json", "quant_method 'gptq'"});
  }
}

TEST(BnbFolder, RefusesBrokenTensors) {
  {
    BadFolder b;
    b.entries.erase(kQ + ".absmax");
    expect_error([&] { load(b.write()); }, ErrorKind::invalid_input, {kQ + ".absmax"});
  }
  {
    BadFolder b;
    b.entries.erase(kQ + ".nested_absmax");
    expect_error([&] { load(b.write()); }, ErrorKind::invalid_input, {kQ + ".nested_absmax"});
  }
  {
    BadFolder b;  // the packed codes no longer fit the recorded shape
    auto& st = b.entries[kQ + ".quant_state.bitsandbytes__nf4"];
    json s = json::parse(st.bytes);
    s["shape"] = {128, 192};
    st.bytes = s.dump();
    st.shape = {static_cast<int64_t>(st.bytes.size())};
    expect_error([&] { load(b.write()); }, ErrorKind::invalid_input, {"model.safetensors", kQ, "packed 4-bit codes"});
  }
  {
    BadFolder b;  // a quant_state of another 4-bit type
    auto& st = b.entries[kQ + ".quant_state.bitsandbytes__nf4"];
    json s = json::parse(st.bytes);
    s["quant_type"] = "fp4";
    st.bytes = s.dump();
    st.shape = {static_cast<int64_t>(st.bytes.size())};
    expect_error([&] { load(b.write()); }, ErrorKind::unsupported, {kQ, "quant_type 'fp4'"});
  }
  {
    BadFolder b;  // a code table that is not NF4's
    auto& m = b.entries[kQ + ".quant_map"];
    m.bytes[4] ^= 1;
    expect_error([&] { load(b.write()); }, ErrorKind::invalid_input, {kQ + ".quant_map", "NF4 code table"});
  }
}

// LoRA training on a quantize_base base: the tiny f16 GGUF (its layers become
// q8_0 / q4_0 / nf4 at load), the loss falls; full fine-tuning is refused.
TrainConfig qlora_config(const test_util::TempDir& tmp, const std::string& quant, const std::string& method) {
  const std::string src = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/";
  return parse_train_config(
      fmt::format("model: {}\ndata:\n  train: {}\n  seq_len: 48\nlora:\n  r: 4\n  dropout: 0\noptim:\n  lr: 1e-2\n"
                  "method: {}\nbatch_size: 2\nsteps: 10\noutput_dir: {}\nseed: 3\nthreads: 2\nquantize_base: {}\n",
                  fixture("tiny.f16.gguf"), src + "train_data/text.jsonl", method, (tmp.path / "out").string(), quant),
      "test.yaml");
}

TEST(QuantizeBase, LoraTrainingLossFalls) {
  for (const char* q : {"q8_0", "q4_0", "nf4"}) {
    test_util::TempDir tmp("qlora_train");
    const TrainResult r = run_training(qlora_config(tmp, q, "lora"), nullptr);
    ASSERT_EQ(r.step_losses.size(), 10u) << q;
    for (double l : r.step_losses) EXPECT_TRUE(std::isfinite(l)) << q;
    EXPECT_LT(r.step_losses.back(), r.step_losses.front() - 0.1) << q;
  }
  test_util::TempDir tmp("qlora_full");
  expect_error([&] { run_training(qlora_config(tmp, "nf4", "full"), nullptr); }, ErrorKind::invalid_input,
               {"quantize_base: nf4", "method: lora"});
}

}  // namespace
}  // namespace loom
