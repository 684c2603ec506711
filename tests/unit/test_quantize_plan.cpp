// llama-quantize's type rules (quant/quantize_plan.h) on model shapes: the
// expectations below are worked out from llama.cpp's llama_tensor_get_type;
// tests/model/test_quantize_variants.cpp checks the same rules against files
// llama-quantize wrote.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "quant/quantize_plan.h"

namespace loom {
namespace {

// A Llama-shaped tensor list: hidden H, FFN F, `layers` layers, vocab V.
std::vector<TensorInput> llama_tensors(int64_t layers, int64_t H, int64_t F, int64_t kv, int64_t V, bool tied) {
  std::vector<TensorInput> t = {{"token_embd.weight", DType::f16, {V, H}}, {"output_norm.weight", DType::f32, {H}}};
  if (!tied) t.push_back({"output.weight", DType::f16, {V, H}});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    t.push_back({p + "attn_norm.weight", DType::f32, {H}});
    t.push_back({p + "attn_q.weight", DType::f16, {H, H}});
    t.push_back({p + "attn_k.weight", DType::f16, {kv, H}});
    t.push_back({p + "attn_v.weight", DType::f16, {kv, H}});
    t.push_back({p + "attn_output.weight", DType::f16, {H, H}});
    t.push_back({p + "ffn_norm.weight", DType::f32, {H}});
    t.push_back({p + "ffn_gate.weight", DType::f16, {F, H}});
    t.push_back({p + "ffn_up.weight", DType::f16, {F, H}});
    t.push_back({p + "ffn_down.weight", DType::f16, {H, F}});
  }
  return t;
}

std::map<std::string, DType> plan_map(const std::vector<TensorPlan>& plan) {
  std::map<std::string, DType> m;
  for (const auto& p : plan) m[p.name] = p.to;
  return m;
}

TEST(QuantizePlan, Q4KMOnSmolLM2ShapeFallsBackForNarrowRows) {
  // SmolLM2-135M: 30 layers, 576 wide (not a multiple of 256), 9/3 heads, tied embeddings.
  QuantizeOptions o;
  o.file_type = FileType::q4_k_m;
  const auto plan = plan_quantization(llama_tensors(30, 576, 1536, 192, 49152, true), {30, 9, 3}, o);
  const auto m = plan_map(plan);
  EXPECT_EQ(m.at("token_embd.weight"), DType::q8_0);   // output rule on the tied embedding; 576 % 256
  EXPECT_EQ(m.at("output_norm.weight"), DType::f32);
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q8_0);  // use_more_bits: q6_k -> q8_0 fallback
  EXPECT_EQ(m.at("blk.3.attn_v.weight"), DType::q5_0);  // q4_k -> q5_0 fallback
  EXPECT_EQ(m.at("blk.5.attn_v.weight"), DType::q8_0);  // (5 - 3) % 3 == 2
  EXPECT_EQ(m.at("blk.27.attn_v.weight"), DType::q8_0); // the last eighth
  EXPECT_EQ(m.at("blk.0.attn_q.weight"), DType::q5_0);
  EXPECT_EQ(m.at("blk.4.ffn_down.weight"), DType::q4_k);  // 1536 wide: a k-quant fits
  EXPECT_EQ(m.at("blk.5.ffn_down.weight"), DType::q6_k);
  EXPECT_EQ(m.at("blk.4.ffn_gate.weight"), DType::q5_0);
  int fallbacks = 0;
  for (const auto& p : plan) fallbacks += p.fallback;
  EXPECT_GT(fallbacks, 100);
  EXPECT_EQ(plan.front().name, "output_norm.weight");  // no-layer tensors first, by name
  EXPECT_EQ(plan[2].name, "blk.0.attn_k.weight");
}

TEST(QuantizePlan, KMixesOnA256MultipleShape) {
  // A 7B-like shape: 32 layers of 4096, MHA (n_gqa 1), separate output.
  const auto t = llama_tensors(32, 4096, 11008, 4096, 32000, false);
  QuantizeOptions o;
  o.file_type = FileType::q3_k_m;
  auto m = plan_map(plan_quantization(t, {32, 32, 32}, o));
  EXPECT_EQ(m.at("output.weight"), DType::q6_k);
  EXPECT_EQ(m.at("token_embd.weight"), DType::q3_k);
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q5_k);
  EXPECT_EQ(m.at("blk.1.attn_v.weight"), DType::q5_k);
  EXPECT_EQ(m.at("blk.2.attn_v.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.1.ffn_down.weight"), DType::q5_k);  // i < 32 / 16
  EXPECT_EQ(m.at("blk.2.ffn_down.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.0.attn_output.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.0.ffn_up.weight"), DType::q3_k);
  EXPECT_EQ(m.at("blk.0.ffn_down.weight"), DType::q5_k);  // ffn_down's 11008 = 43 x 256
  o.file_type = FileType::q2_k;
  m = plan_map(plan_quantization(t, {32, 32, 32}, o));
  EXPECT_EQ(m.at("blk.7.attn_v.weight"), DType::q3_k);  // n_gqa < 4
  EXPECT_EQ(m.at("blk.7.ffn_down.weight"), DType::q3_k);
  EXPECT_EQ(m.at("blk.7.attn_output.weight"), DType::q3_k);
  EXPECT_EQ(m.at("blk.7.attn_q.weight"), DType::q2_k);
  m = plan_map(plan_quantization(t, {32, 32, 8}, o));  // GQA 4: attn_v gets q4_k
  EXPECT_EQ(m.at("blk.7.attn_v.weight"), DType::q4_k);
  o.file_type = FileType::q4_k_s;
  m = plan_map(plan_quantization(t, {32, 32, 32}, o));
  EXPECT_EQ(m.at("blk.3.attn_v.weight"), DType::q5_k);
  EXPECT_EQ(m.at("blk.4.attn_v.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.3.ffn_down.weight"), DType::q5_k);  // i < n / 8
  EXPECT_EQ(m.at("blk.4.ffn_down.weight"), DType::q4_k);
  o.file_type = FileType::q4_0;
  o.has_imatrix = true;
  m = plan_map(plan_quantization(t, {32, 32, 32}, o));
  EXPECT_EQ(m.at("blk.3.ffn_down.weight"), DType::q4_1);
  EXPECT_EQ(m.at("blk.4.ffn_down.weight"), DType::q4_0);
}

// IQ3_XS / IQ3_S / IQ3_M on a 256-multiple shape (a 1B-like Llama: 16 layers of
// 2048, GQA 4, FFN 8192), as llama_tensor_get_type chooses.
TEST(QuantizePlan, Iq3MixesOnA256MultipleShape) {
  const auto t = llama_tensors(16, 2048, 8192, 512, 128256, false);
  QuantizeOptions o;
  o.file_type = FileType::iq3_xs;
  o.has_imatrix = true;
  auto m = plan_map(plan_quantization(t, {16, 32, 8}, o));
  EXPECT_EQ(m.at("output.weight"), DType::q6_k);
  EXPECT_EQ(m.at("token_embd.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("blk.0.attn_q.weight"), DType::iq3_xxs);
  EXPECT_EQ(m.at("blk.0.attn_k.weight"), DType::iq3_xxs);
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q4_k);  // n_gqa >= 4
  EXPECT_EQ(m.at("blk.0.attn_output.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("blk.1.ffn_gate.weight"), DType::iq3_s);  // the first eighth (16 / 8 = 2 layers)
  EXPECT_EQ(m.at("blk.2.ffn_gate.weight"), DType::iq3_xxs);
  EXPECT_EQ(m.at("blk.13.ffn_up.weight"), DType::iq3_xxs);
  EXPECT_EQ(m.at("blk.14.ffn_up.weight"), DType::iq3_s);  // the last eighth
  EXPECT_EQ(m.at("blk.0.ffn_down.weight"), DType::iq3_s);
  m = plan_map(plan_quantization(t, {16, 32, 32}, o));  // MHA: attn_v keeps the default
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::iq3_s);
  o.file_type = FileType::iq3_s;
  m = plan_map(plan_quantization(t, {16, 32, 8}, o));
  EXPECT_EQ(m.at("blk.0.attn_q.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.5.ffn_gate.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("blk.0.ffn_down.weight"), DType::iq3_s);
  m = plan_map(plan_quantization(t, {16, 32, 32}, o));
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::iq3_s);
  o.file_type = FileType::iq3_m;
  m = plan_map(plan_quantization(t, {16, 32, 32}, o));
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q4_k);  // whatever the GQA
  EXPECT_EQ(m.at("blk.0.attn_output.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.1.ffn_down.weight"), DType::q4_k);  // i < n / 8
  EXPECT_EQ(m.at("blk.2.ffn_down.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("blk.2.attn_q.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("output.weight"), DType::q6_k);
  const auto llama70b = llama_tensors(80, 8192, 28672, 1024, 128256, false);
  m = plan_map(plan_quantization(llama70b, {.n_layers = 80, .n_heads = 64, .n_kv_heads = 8, .is_70b = true}, o));
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q5_k);  // the 70B rule lifts q4_k
  // Rows the grids do not fit fall back to iq4_nl (llama.cpp's tensor_type_fallback).
  m = plan_map(plan_quantization(llama_tensors(2, 576, 1536, 192, 49152, true), {2, 9, 3}, o));
  EXPECT_EQ(m.at("blk.0.attn_q.weight"), DType::iq4_nl);
  EXPECT_EQ(m.at("blk.0.ffn_down.weight"), DType::iq3_s);  // 1536 wide; i < 2 / 8 holds for no layer
  EXPECT_EQ(m.at("blk.1.ffn_down.weight"), DType::iq3_s);
}

// IQ3_XXS and the IQ2 and IQ1 file types on the 1B-like shape (GQA 4), as
// llama_tensor_get_type chooses: the IQ2 family has its own short chain.
TEST(QuantizePlan, Iq2AndIq3XxsMixesOnA256MultipleShape) {
  const auto t = llama_tensors(16, 2048, 8192, 512, 128256, false);
  QuantizeOptions o;
  o.has_imatrix = true;
  o.file_type = FileType::iq3_xxs;
  auto m = plan_map(plan_quantization(t, {16, 32, 8}, o));
  EXPECT_EQ(m.at("output.weight"), DType::q5_k);
  EXPECT_EQ(m.at("token_embd.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("blk.0.attn_q.weight"), DType::iq2_s);
  EXPECT_EQ(m.at("blk.0.attn_k.weight"), DType::iq2_s);
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.0.attn_output.weight"), DType::iq3_s);
  EXPECT_EQ(m.at("blk.0.ffn_down.weight"), DType::iq3_xxs);
  EXPECT_EQ(m.at("blk.0.ffn_gate.weight"), DType::iq3_xxs);
  o.has_imatrix = false;
  m = plan_map(plan_quantization(t, {16, 32, 32}, o));
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::iq3_s);  // MHA without an imatrix
  EXPECT_EQ(m.at("blk.1.ffn_down.weight"), DType::q4_k);
  EXPECT_EQ(m.at("blk.2.ffn_down.weight"), DType::q3_k);
  o.has_imatrix = true;
  m = plan_map(plan_quantization(t, {16, 32, 32}, o));
  EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::iq3_xxs);
  for (FileType ft : {FileType::iq2_xxs, FileType::iq2_xs, FileType::iq2_s, FileType::iq2_m, FileType::iq1_s,
                      FileType::iq1_m}) {
    SCOPED_TRACE(file_type_name(ft));
    o.file_type = ft;
    const bool s_or_m = ft == FileType::iq2_s || ft == FileType::iq2_m;
    const bool iq1 = ft == FileType::iq1_s || ft == FileType::iq1_m;
    const DType base = ft == FileType::iq2_xxs ? DType::iq2_xxs
                       : ft == FileType::iq2_m ? DType::iq2_s
                       : ft == FileType::iq1_s ? DType::iq1_s
                       : ft == FileType::iq1_m ? DType::iq1_m
                                               : DType::iq2_xs;
    m = plan_map(plan_quantization(t, {16, 32, 8}, o));
    EXPECT_EQ(m.at("output.weight"), DType::q5_k);
    EXPECT_EQ(m.at("token_embd.weight"), s_or_m ? DType::iq3_s : DType::q2_k);
    EXPECT_EQ(m.at("blk.0.attn_v.weight"), DType::q4_k);  // GQA 4
    EXPECT_EQ(m.at("blk.1.ffn_down.weight"), s_or_m ? DType::iq3_s : DType::q2_k);  // the first eighth
    EXPECT_EQ(m.at("blk.2.ffn_down.weight"), base);
    EXPECT_EQ(m.at("blk.0.attn_output.weight"), s_or_m ? DType::iq3_s : iq1 ? DType::iq2_xxs : base);
    EXPECT_EQ(m.at("blk.5.attn_q.weight"), base);
    EXPECT_EQ(m.at("blk.5.ffn_up.weight"), base);
    m = plan_map(plan_quantization(t, {16, 32, 32}, o));
    EXPECT_EQ(m.at("blk.0.attn_v.weight"), s_or_m ? DType::iq3_s : DType::q2_k);
  }
  // Rows the grids do not fit: IQ4_NL.
  o.file_type = FileType::iq2_xxs;
  m = plan_map(plan_quantization(llama_tensors(2, 576, 1536, 192, 49152, true), {2, 9, 3}, o));
  EXPECT_EQ(m.at("blk.0.attn_q.weight"), DType::iq4_nl);
  EXPECT_EQ(m.at("blk.0.ffn_down.weight"), DType::iq2_xxs);
  EXPECT_EQ(m.at("token_embd.weight"), DType::q8_0);  // tied: the output's rule; 576 % 256
}

// llama-quantize's tensor_requires_imatrix.
TEST(QuantizePlan, ImportanceIsRequiredForTheLowBitGridsAndQ2KS) {
  const TensorPlan xxs{"blk.0.attn_q.weight", DType::f16, DType::iq3_xxs, true};
  EXPECT_TRUE(plan_requires_importance(xxs, FileType::iq3_xs));
  EXPECT_FALSE(plan_requires_importance({"blk.0.attn_q.weight", DType::f16, DType::iq3_s, true}, FileType::iq3_xs));
  EXPECT_FALSE(plan_requires_importance({"token_embd.weight", DType::f16, DType::iq3_xxs, true}, FileType::iq3_xs));
  EXPECT_FALSE(plan_requires_importance({"output.weight", DType::f16, DType::iq3_xxs, true}, FileType::iq3_xs));
  EXPECT_TRUE(plan_requires_importance({"blk.0.ffn_up.weight", DType::f16, DType::q2_k, true}, FileType::q2_k_s));
  EXPECT_FALSE(plan_requires_importance({"blk.0.ffn_up.weight", DType::f16, DType::q2_k, true}, FileType::q2_k));
  EXPECT_FALSE(plan_requires_importance({"blk.0.ffn_up.weight", DType::iq3_xxs, DType::iq3_xxs, true},
                                        FileType::iq3_xs));  // kept as it is
  for (DType d : {DType::iq2_xxs, DType::iq2_xs, DType::iq2_s})
    EXPECT_TRUE(plan_requires_importance({"blk.3.ffn_down.weight", DType::f16, d, true}, FileType::iq2_m));
}

TEST(QuantizePlan, PureOverridesAndPlainTypes) {
  const auto t = llama_tensors(4, 576, 1536, 192, 49152, true);
  QuantizeOptions o;
  o.file_type = FileType::q6_k;
  o.pure = true;
  auto m = plan_map(plan_quantization(t, {4, 9, 3}, o));
  EXPECT_EQ(m.at("token_embd.weight"), DType::q8_0);  // pure still falls back: 576 % 256
  EXPECT_EQ(m.at("blk.1.ffn_down.weight"), DType::q6_k);
  o.pure = false;
  o.overrides = {{"attn_(q|k)", DType::q8_0}, {"ffn_down", DType::f16}};
  o.token_embedding_type = DType::q4_0;
  m = plan_map(plan_quantization(t, {4, 9, 3}, o));
  EXPECT_EQ(m.at("blk.2.attn_q.weight"), DType::q8_0);
  EXPECT_EQ(m.at("blk.2.attn_k.weight"), DType::q8_0);
  EXPECT_EQ(m.at("blk.2.ffn_down.weight"), DType::f16);
  EXPECT_EQ(m.at("token_embd.weight"), DType::q4_0);
  o = {};
  o.file_type = FileType::bf16;
  m = plan_map(plan_quantization(t, {4, 9, 3}, o));
  EXPECT_EQ(m.at("blk.0.attn_q.weight"), DType::bf16);
  EXPECT_EQ(m.at("blk.0.attn_norm.weight"), DType::f32);
  o.overrides = {{"(", DType::q8_0}};
  o.file_type = FileType::q8_0;
  test_util::expect_error([&] { plan_quantization(t, {4, 9, 3}, o); }, ErrorKind::invalid_input, {"("});
}

// Q1_0, Q2_0, TQ1_0, TQ2_0, IQ3_XXS, IQ3_M, IQ1_S and IQ1_M files as llama-quantize wrote them
// (the GGUF battery's manifest, from a 2-layer model of hidden 256, FFN 384, 320
// tokens, untied output): every matrix of the type, the output Q6_K, the token
// embeddings Q4_K but in Q1_0, the ternary types' 384-wide ffn_down Q4_0 (IQ3's:
// IQ4_NL), IQ3_XXS's attn_q / attn_k IQ2_S, IQ1's attn_output IQ2_XXS; Q2_0 rows not a
// multiple of 64 fall back
// to q4_0, and Q1_0 ones (128) stop with the tensor named.
TEST(QuantizePlan, LowBitAndTernaryFilesAsLlamaQuantizeWroteThem) {
  std::ifstream in(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/gguf_battery/manifest.json");
  ASSERT_TRUE(in.good());
  const auto manifest = nlohmann::json::parse(in);
  const auto tensors = llama_tensors(2, 256, 384, 128, 320, false);
  for (const char* ft : {"Q1_0", "Q2_0", "TQ1_0", "TQ2_0", "IQ3_XXS", "IQ3_M", "IQ1_S", "IQ1_M"}) {
    QuantizeOptions opt;
    opt.file_type = *file_type_from_name(ft);
    opt.has_imatrix = std::string(ft).starts_with("IQ");  // the battery's IQ files were made with one
    const auto plan =
        plan_map(plan_quantization(tensors, {.n_layers = 2, .n_heads = 4, .n_kv_heads = 2}, opt));
    int checked = 0;
    for (const auto& f : manifest["files"]) {
      if (f["file_type"] != ft) continue;
      for (const auto& [name, type] : f["tensor_types"].items()) {
        if (type == "F32") continue;  // norms stay as they are
        std::string lower = type.get<std::string>();
        for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        EXPECT_EQ(dtype_name(plan.at(name)), lower) << ft << " " << name;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 16) << ft;
  }
  QuantizeOptions q2;
  q2.file_type = FileType::q2_0;
  const auto narrow = plan_map(plan_quantization(llama_tensors(1, 576, 1568, 192, 320, false), {}, q2));
  EXPECT_EQ(narrow.at("blk.0.attn_q.weight"), DType::q2_0);    // 576 = 9 x 64
  EXPECT_EQ(narrow.at("blk.0.ffn_down.weight"), DType::q4_0);  // 1568 = 24.5 x 64 = 49 x 32
  QuantizeOptions q1;
  q1.file_type = FileType::q1_0;
  test_util::expect_error([&] { plan_quantization(llama_tensors(1, 576, 1536, 192, 320, false), {}, q1); },
                          ErrorKind::unsupported, {"tensor 'token_embd.weight'", "Q1_0"});
}

TEST(QuantizePlan, FileTypeNames) {
  for (FileType f : all_file_types()) EXPECT_EQ(file_type_from_name(file_type_name(f)), f);
  EXPECT_EQ(file_type_from_name("q4_k_m"), FileType::q4_k_m);
  EXPECT_EQ(file_type_from_name("15"), FileType::q4_k_m);
  EXPECT_EQ(file_type_default(FileType::q5_k_s), DType::q5_k);
  EXPECT_EQ(file_type_from_name("iq2_xxs"), FileType::iq2_xxs);
  EXPECT_EQ(file_type_from_name("29"), FileType::iq2_m);
  EXPECT_EQ(file_type_default(FileType::iq2_s), DType::iq2_xs);  // llama.cpp's IQ2_S file is mostly IQ2_XS
  EXPECT_EQ(file_type_from_name("IQ1_S"), FileType::iq1_s);
  EXPECT_FALSE(file_type_from_name("Q4_K_X"));
  EXPECT_FALSE(file_type_from_name("4"));
}

}  // namespace
}  // namespace loom
