// `loom info`: architecture, parameters, tensor types and memory of a model.
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>  // complete type for Tokenizer's optional<json> parameters

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace loom::app {
namespace {

void count_tensor(std::map<std::string, std::pair<int64_t, size_t>>& types, const Tensor& t) {
  auto& e = types[dtype_name(t.dtype)];
  e.first += t.numel();
  e.second += t.nbytes();
}

int run_info(int argc, char** argv) {
  CLI::App app("Show a model's architecture, parameters, tensor types and memory.", "info");
  std::string model_path;
  int64_t ctx = 0;
  DType kv_dtype = DType::f16;
  app.add_option("-m,--model", model_path, "a .gguf file or a Hugging Face model folder")->required();
  add_ctx_flag(app, ctx, "context size used for the KV-cache estimate (0 = model's)");
  add_kv_cache_dtype_flag(app, kv_dtype);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;

  // A folder without tokenizer.json still has a config and weights to describe.
  std::error_code ec;
  const bool no_tokenizer =
      std::filesystem::is_directory(model_path, ec) &&
      !std::filesystem::exists(std::filesystem::path(model_path) / "tokenizer.json", ec);
  auto model = Model::load(model_path, {.tokenizer = !no_tokenizer, .pack = false});
  const ModelConfig& c = model->config();
  const ModelWeights& w = model->weights();
  std::map<std::string, std::pair<int64_t, size_t>> types;
  count_tensor(types, w.token_embd);
  if (w.output.data != w.token_embd.data) count_tensor(types, w.output);
  for (const auto& L : w.layers)
    for (const Tensor* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) count_tensor(types, *t);

  if (c.max_context > 0 && ctx > c.max_context)
    fail(ErrorKind::invalid_input, "--ctx-size {} exceeds the model's context length {}", ctx, c.max_context);
  const int64_t n_ctx = ctx > 0 ? ctx : c.max_context;
  const auto kv_per_token = static_cast<double>(dtype_row_bytes(kv_dtype, 2 * c.n_layers * c.kv_dim()));
  std::printf("model:           %s\n", model_path.c_str());
  std::printf("format:          %s\n", model->is_gguf() ? "GGUF" : "Hugging Face folder");
  if (!c.name.empty()) std::printf("name:            %s\n", c.name.c_str());
  std::printf("architecture:    %s\n", arch_name(c.arch));
  std::printf("parameters:      %lld (%.1f M)\n", static_cast<long long>(model->parameter_count()),
              static_cast<double>(model->parameter_count()) / 1e6);
  std::printf("layers:          %lld\n", static_cast<long long>(c.n_layers));
  std::printf("hidden size:     %lld\n", static_cast<long long>(c.hidden));
  std::printf("ffn size:        %lld\n", static_cast<long long>(c.intermediate));
  std::printf("heads:           %lld (kv heads %lld, head dim %lld)\n", static_cast<long long>(c.n_heads),
              static_cast<long long>(c.n_kv_heads), static_cast<long long>(c.head_dim));
  std::printf("vocabulary:      %lld\n", static_cast<long long>(c.vocab_size));
  std::printf("context length:  %lld\n", static_cast<long long>(c.max_context));
  std::printf("rope:            theta %g, %s pairs%s\n", c.rope_theta,
              c.rope_layout == RopeLayout::interleaved ? "interleaved" : "half-split",
              c.rope_scaling.factor > 0 ? ", llama3 scaling" : "");
  std::printf("rms norm eps:    %g\n", c.rms_eps);
  if (!c.unstructured_pruning.empty()) std::printf("pruned:          %s (zeros kept by fine-tuning)\n", c.unstructured_pruning.c_str());
  std::printf("embeddings:      %s\n", c.tied_embeddings || w.output.data == w.token_embd.data ? "tied" : "separate");
  if (has_output_scales(w)) {
    int64_t scaled = 0;
    for (const auto& L : w.layers)
      for (float s : L.out_scale) scaled += s != 1.0f;
    std::printf(
        "output scales:   %lld projections (per-tensor, applied to their outputs as llama.cpp does)\n",
        static_cast<long long>(scaled));
  }
  if (model->has_tokenizer()) {
    const Tokenizer& tok = model->tokenizer();
    std::printf("tokenizer:       %s, %lld tokens\n", tok.kind_name(), static_cast<long long>(tok.vocab_size()));
  } else if (no_tokenizer) {
    std::printf("tokenizer:       none (the folder has no tokenizer.json: generate and chat need one)\n");
  }
  if (model->chat_template_text()) {
    std::string kind = "unknown (use --chat-template)";
    try {
      kind = chat_template_kind_name(detect_chat_template(*model->chat_template_text()));
    } catch (const Error&) {
    }
    std::printf("chat template:   %s\n", kind.c_str());
  } else {
    std::printf("chat template:   none in metadata\n");
  }
  std::printf("matrix types:\n");
  for (const auto& [name, e] : types)
    std::printf("  %-6s %12lld params  %9.2f MiB\n", name.c_str(), static_cast<long long>(e.first),
                static_cast<double>(e.second) / (1 << 20));
  std::printf("memory:\n");
  std::printf("  weights        %9.2f MiB\n", static_cast<double>(model->weight_bytes()) / (1 << 20));
  std::printf("  KV cache (%s) %9.2f MiB for %lld tokens (%.1f KiB per token)\n", dtype_name(kv_dtype),
              kv_per_token * static_cast<double>(n_ctx) / (1 << 20), static_cast<long long>(n_ctx),
              kv_per_token / 1024);
  return 0;
}

}  // namespace

extern const Command kInfoCommand = {"info", run_info};

}  // namespace loom::app
