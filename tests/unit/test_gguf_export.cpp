// Hugging Face folders to GGUF (model/gguf_export.h + quant/gguf_quantize.h):
// the tiny Llama (llama3 RoPE scaling) and Qwen2 HF folders, given the
// tokenizer of their GGUF twins, write GGUF files whose tensors equal the
// committed GGUF fixtures byte for byte (q/k rows permuted as
// convert_hf_to_gguf.py does), whose tokenizer metadata reloads to the same
// ids, and which load and run to the same logits; the tiny Llama with a
// SentencePiece-style (Llama 2) tokenizer exports and runs the same; and PEFT
// adapters in llama.cpp's GGUF LoRA format, checked against loom's own merge.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/mapped_file.h"
#include "expect_error.h"
#include "io/gguf.h"
#include "io/hf_folder.h"
#include "io/safetensors.h"
#include "kernels/backend.h"
#include "model/adapter_merge.h"
#include "model/forward.h"
#include "model/gguf_export.h"
#include "model/model.h"
#include "model/peft_adapter.h"
#include "quant/gguf_quantize.h"
#include "safetensors_test_util.h"
#include "temp_dir.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_export.h"
#include "tokenizer/tokenizer_gguf.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
const std::string kModels = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/";
const std::string kText = "Grüße, 世界! The 3 quick foxes — naïve café; <|im_end|> 12345 \t\n done.";

// The HF folder `name` with tokenizer files made from its GGUF twin's tokenizer.
std::string hf_folder_with_tokenizer(const std::string& name, const std::string& dir) {
  const std::string out = dir + "/" + name;
  fs::create_directories(out);
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors"})
    fs::copy_file(kModels + name + "/" + f, out + "/" + f);
  const auto gguf = gguf::File::open(kModels + name + ".f32.gguf");
  write_tokenizer_files(Tokenizer::from_gguf(*gguf), std::nullopt, 256, out);
  return out;
}

std::string export_f32(const std::string& hf_dir, const std::string& out) {
  const auto model = Model::load(hf_dir, {.tokenizer = true, .pack = false});
  GgufQuantizeOptions opt;
  opt.plan.file_type = FileType::all_f32;
  ThreadPool pool(2);
  quantize_gguf(pool, gguf_source_of(*model, "tiny"), out, opt, nullptr);
  return out;
}

std::vector<float> logits_of(const std::string& path, std::span<const int32_t> tokens) {
  ThreadPool pool(1);
  auto backend = make_backend(kCpu, pool);
  auto m = Model::load(path, {.backend = backend.get()});
  InferenceSession s(m->config(), m->weights(), *backend, 64, DType::f32);
  s.eval(tokens, true);
  return s.logits();
}

class HfToGguf : public ::testing::TestWithParam<const char*> {};

TEST_P(HfToGguf, TensorsTokenizerAndLogitsEqualTheGgufTwin) {
  const std::string name = GetParam();
  test_util::TempDir dir("hf_to_gguf");
  const std::string out = export_f32(hf_folder_with_tokenizer(name, dir.str()), dir.str() + "/out.gguf");
  const auto ref = gguf::File::open(kModels + name + ".f32.gguf");
  const auto got = gguf::File::open(out);
  EXPECT_EQ(got->get_string("general.architecture"), ref->get_string("general.architecture"));
  for (const auto& r : ref->tensors()) {
    const gguf::TensorInfo* g = got->find_tensor(r.name);
    ASSERT_NE(g, nullptr) << r.name;
    ASSERT_EQ(g->dtype, r.dtype) << r.name;
    ASSERT_EQ(g->nbytes, r.nbytes) << r.name;
    if (r.name == "rope_freqs.weight") {  // computed from config.json's llama3 parameters, as the converter does
      const auto* a = reinterpret_cast<const float*>(g->data);
      const auto* b = reinterpret_cast<const float*>(r.data);
      for (size_t i = 0; i < r.nbytes / 4; ++i) EXPECT_NEAR(a[i], b[i], 1e-6 * std::fabs(b[i])) << i;
      continue;
    }
    EXPECT_EQ(std::memcmp(g->data, r.data, r.nbytes), 0) << r.name << " differs";
  }
  EXPECT_EQ(got->tensors().size(), ref->tensors().size());
  for (const char* k : {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
    EXPECT_EQ(got->get_string_array(k), ref->get_string_array(k)) << k;
  EXPECT_EQ(got->get_i32_array("tokenizer.ggml.token_type"), ref->get_i32_array("tokenizer.ggml.token_type"));
  EXPECT_EQ(got->get_string("tokenizer.ggml.pre"), ref->get_string("tokenizer.ggml.pre"));
  const Tokenizer a = Tokenizer::from_gguf(*got), b = Tokenizer::from_gguf(*ref);
  const auto ids = b.encode(kText, true, true);
  EXPECT_EQ(a.encode(kText, true, true), ids);
  EXPECT_EQ(logits_of(out, ids), logits_of(kModels + name + ".f32.gguf", ids));
}

INSTANTIATE_TEST_SUITE_P(Tiny, HfToGguf, ::testing::Values("tiny-llama", "tiny-qwen2"),
                         [](const auto& info) { return std::string(info.param) == "tiny-llama" ? "Llama" : "Qwen2"; });

// Q8_0 from the HF folder: every q8_0 tensor equals the committed
// tiny-llama.q8_0.gguf's (gguf-py's quantizer, ggml's reference), and it runs.
TEST(HfToGguf, QuantizedExportEqualsTheQ8Fixture) {
  test_util::TempDir dir("hf_to_gguf_q8");
  const std::string hf = hf_folder_with_tokenizer("tiny-llama", dir.str());
  const auto model = Model::load(hf, {.tokenizer = true, .pack = false});
  GgufQuantizeOptions opt;
  opt.plan.file_type = FileType::q8_0;
  ThreadPool pool(2);
  const std::string out = dir.str() + "/q8.gguf";
  quantize_gguf(pool, gguf_source_of(*model, "tiny"), out, opt, nullptr);
  const auto f = gguf::File::open(out);
  const auto ref = gguf::File::open(kModels + "tiny-llama.q8_0.gguf");
  EXPECT_EQ(f->get_uint("general.file_type"), 7u);
  EXPECT_EQ(f->find_tensor("blk.0.attn_norm.weight")->dtype, DType::f32);
  int same = 0;
  for (const auto& r : ref->tensors()) {
    if (r.dtype != DType::q8_0) continue;
    const gguf::TensorInfo* g = f->find_tensor(r.name);
    ASSERT_NE(g, nullptr) << r.name;
    ASSERT_EQ(g->dtype, DType::q8_0) << r.name;
    EXPECT_EQ(std::memcmp(g->data, r.data, r.nbytes), 0) << r.name;
    ++same;
  }
  EXPECT_GE(same, 12);
  const std::vector<int32_t> ids = {1, 40, 41, 42, 100, 200, 300, 7};
  for (float x : logits_of(out, ids)) ASSERT_TRUE(std::isfinite(x));
}

TEST(HfToGguf, TokenizerWithoutALlamaCppNameIsRefused) {
  const auto gguf = gguf::File::open(kModels + "tiny-llama.f32.gguf");
  TokenizerSpec spec = Tokenizer::spec_from_gguf(*gguf);
  EXPECT_EQ(gguf_pre_name(spec), "smollm");
  spec.pre_tokenizers.front().individual_digits = false;
  EXPECT_FALSE(gguf_pre_name(spec));
  const Tokenizer odd = Tokenizer::from_spec(spec);
  gguf::Writer w;
  test_util::expect_error([&] { set_gguf_tokenizer(w, odd, 320, "", "odd"); }, ErrorKind::unsupported,
                          {"odd", "pre-tokenizer"});
  // loom's own weight types have no ggml id: a GGUF file cannot carry them.
  test_util::expect_error([&] { w.add_tensor("x.weight", DType::i8_ch, {4, 32}, [](uint8_t*) {}); },
                          ErrorKind::invalid_input, {"x.weight", "i8_ch", "not a GGUF tensor type"});
}

// The tiny Llama as a Llama 2-shaped HF folder: the SentencePiece-style
// tokenizer of tests/fixtures/tokenizer/spm_style.json (1159 tokens, Prepend +
// Replace normalizer, byte fallback), its embedding and output rows tiled to
// 1160 (one padding row past the tokenizer, as models round their vocabulary up).
const std::string kLlama2Template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}";

std::string spm_hf_folder(const std::string& dir) {
  const std::string out = dir + "/tiny-llama-spm";
  fs::create_directories(out);
  nlohmann::json cfg = read_json_file(kModels + "tiny-llama/config.json");
  cfg["vocab_size"] = 1160;
  std::ofstream(out + "/config.json") << cfg.dump(2);
  std::ofstream(out + "/tokenizer_config.json")
      << nlohmann::json{{"add_bos_token", true}, {"chat_template", kLlama2Template}}.dump(2);
  fs::copy_file(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/tokenizer/spm_style.json", out + "/tokenizer.json");
  fs::copy_file(kModels + "tiny-llama/generation_config.json", out + "/generation_config.json");
  const auto st = safetensors::File::open(kModels + "tiny-llama/model.safetensors");
  std::vector<testing_util::StEntry> entries;
  for (const auto& t : st->tensors()) {
    std::string bytes(reinterpret_cast<const char*>(t.data), t.nbytes());
    std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
    if (shape.size() == 2 && shape[0] == 320) {  // embed_tokens, lm_head
      const size_t row = bytes.size() / 320;
      std::string tiled;
      for (size_t r = 0; r < 1160; ++r) tiled.append(bytes, (r % 320) * row, row);
      bytes = std::move(tiled);
      shape[0] = 1160;
    }
    entries.push_back({t.name, "F32", shape, std::move(bytes)});
  }
  testing_util::write_file(out + "/model.safetensors", testing_util::st_build(entries, {{"format", "pt"}}));
  return out;
}

// `loom export -m FOLDER` of a Llama 2-shaped folder: the file carries a GGUF
// "llama" vocabulary (scores, the padding row, add_space_prefix, the chat
// template), loads as a model whose tokenizer gives the folder's ids, and its
// logits are the folder model's.
TEST(HfToGguf, SentencePieceTokenizerFolderExportsAndRuns) {
  test_util::TempDir dir("hf_to_gguf_spm");
  const std::string hf = spm_hf_folder(dir.str());
  const std::string out = export_f32(hf, dir.str() + "/out.gguf");
  const auto f = gguf::File::open(out);
  EXPECT_EQ(f->get_string("tokenizer.ggml.model"), "llama");
  const auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 1160u);
  EXPECT_EQ(tokens.back(), "[PAD1159]");
  EXPECT_EQ(f->get_f32_array("tokenizer.ggml.scores").size(), 1160u);
  EXPECT_TRUE(f->get_bool("tokenizer.ggml.add_space_prefix"));
  EXPECT_EQ(f->get_string("tokenizer.chat_template"), kLlama2Template);
  const auto folder = Model::load(hf, {.tokenizer = true, .pack = false});
  const auto file = Model::load(out, {.tokenizer = true, .pack = false});
  // Also a text that starts with a space and a chat prompt (text after special
  // tokens): the file is read as llama.cpp reads it, the Prepend + Replace form.
  for (const std::string& text : {kText, std::string("Hello world\nline two"),
                                  std::string("def f(x):\n\treturn x**2"), std::string("  leading spaces"),
                                  std::string("<s>[INST] Hi [/INST] Hello </s><s>[INST]  again [/INST]")})
    EXPECT_EQ(file->tokenizer().encode(text, true, true), folder->tokenizer().encode(text, true, true))
        << text;
  const auto ids = folder->tokenizer().encode(kText, true, true);
  ASSERT_EQ(ids.front(), 1);
  const auto a = logits_of(out, ids), b = logits_of(hf, ids);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-4) << i;
}

// The GGUF LoRA's B rows are GGUF's q/k order: W_gguf + alpha/r * B_gguf A equals
// loom's merge of the PEFT adapter into the GGUF model, for every target.
TEST(LoraGguf, MatchesTheMergeOfThePeftAdapter) {
  const std::string adapter_dir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/peft_adapter/tiny-llama";
  const peft::AdapterTensors adapter = peft::read_adapter(adapter_dir);
  const std::string base = kModels + "tiny-llama.f32.gguf";
  const auto plain = Model::load(base, {.tokenizer = false, .pack = false});
  test_util::TempDir dir("lora_gguf");
  const std::string out = dir.str() + "/lora.gguf";
  write_lora_gguf(adapter, plain->config(), out, DType::f32);
  const auto f = gguf::File::open(out);
  EXPECT_EQ(f->get_string("general.type"), "adapter");
  EXPECT_EQ(f->get_string("adapter.type"), "lora");
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_FLOAT_EQ(static_cast<float>(f->get_float("adapter.lora.alpha")), static_cast<float>(adapter.config.lora_alpha));
  EXPECT_EQ(f->tensors().size(), 2 * adapter.pairs.size());

  Model::LoadOptions merged_opt{.tokenizer = false, .pack = false};
  merged_opt.before_pack = adapter_merge_hook(adapter_dir);
  const auto merged = Model::load(base, merged_opt);
  const double scale = adapter.config.scaling();
  const char* names[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};
  int checked = 0;
  for (const auto& [key, pair] : adapter.pairs) {
    const auto [layer, target] = key;
    const std::string n = "blk." + std::to_string(layer) + "." + names[static_cast<int>(target)] + ".weight";
    const auto* A = reinterpret_cast<const float*>(f->find_tensor(n + ".lora_a")->data);
    const auto* B = reinterpret_cast<const float*>(f->find_tensor(n + ".lora_b")->data);
    ASSERT_EQ(f->find_tensor(n + ".lora_a")->shape[0], adapter.config.r);
    const gguf::TensorInfo* w0 = plain->gguf_file()->find_tensor(n);
    const auto* W = reinterpret_cast<const float*>(w0->data);
    const LayerWeights& L = merged->weights().layers[static_cast<size_t>(layer)];
    const Tensor* tw[] = {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down};
    const auto* M = static_cast<const float*>(tw[static_cast<int>(target)]->data);
    for (int64_t o = 0; o < pair.out; ++o)
      for (int64_t i = 0; i < pair.in; ++i) {
        double d = 0;
        for (int64_t k = 0; k < adapter.config.r; ++k) d += static_cast<double>(B[o * adapter.config.r + k]) * A[k * pair.in + i];
        ASSERT_NEAR(W[o * pair.in + i] + scale * d, M[o * pair.in + i], 1e-5) << n << " row " << o << " col " << i;
      }
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(LoraGguf, RsLoraAlphaIsExpressedForLlamaCppsAlphaOverR) {
  peft::AdapterTensors a = peft::read_adapter(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/peft_adapter/tiny-llama");
  a.config.use_rslora = true;
  const auto base = Model::load(kModels + "tiny-llama.f32.gguf", {.tokenizer = false, .pack = false});
  test_util::TempDir dir("lora_gguf_rs");
  write_lora_gguf(a, base->config(), dir.str() + "/l.gguf", DType::f16);
  const auto f = gguf::File::open(dir.str() + "/l.gguf");
  const double alpha = f->get_float("adapter.lora.alpha");
  EXPECT_NEAR(alpha / a.config.r, a.config.scaling(), 1e-6);
  EXPECT_EQ(f->tensors().front().dtype, DType::f16);
  test_util::expect_error([&] { write_lora_gguf(a, base->config(), dir.str() + "/x.gguf", DType::q8_0); },
                          ErrorKind::invalid_input, {"f32 or f16"});
}

}  // namespace
}  // namespace loom
