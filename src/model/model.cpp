#include "model/model.h"

#include <sys/stat.h>

#include <nlohmann/json.hpp>  // complete type for Tokenizer's optional<json> parameters

#include "io/gguf.h"
#include "io/hf_folder.h"
#include "model/bnb_folder.h"
#include "model/compressed_tensors.h"
#include "model/config_load.h"
#include "model/modelopt_folder.h"
#include "model/quantize_base.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

Model::~Model() = default;

const Tokenizer& Model::tokenizer() const {
  if (!tokenizer_) fail(ErrorKind::invalid_input, "{}: the model was loaded without a tokenizer", path_);
  return *tokenizer_;
}

std::unique_ptr<Model> Model::load(const std::string& path, const LoadOptions& options) {
  const bool with_tokenizer = options.tokenizer;
  std::unique_ptr<Model> m(new Model());
  m->path_ = path;
  if (is_directory(path)) {
    // The architecture is checked before the weights so that an unsupported
    // model says so, rather than complaining about its files.
    const std::string config_path = path + "/config.json";
    const nlohmann::json config_json = read_json_file(config_path);
    m->config_ = config_from_hf(config_json, config_path);
    const std::optional<BnbQuantConfig> bnb = bnb_quant_config(config_json, config_path);
    m->hf_ = HfFolder::open(path);
    const HfFolder& hf = *m->hf_;
    // bitsandbytes 4-bit weights become nf4 tensors; the store joins the weights below.
    // compressed-tensors INT8/INT4 weights become i8_ch / q4 / q8_0 tensors (model/compressed_tensors.h),
    // ModelOpt NVFP4 weights nvfp4 ones (model/modelopt_folder.h).
    std::vector<std::vector<uint8_t>> bnb_store;
    std::map<std::string, Tensor, std::less<>> bnb_weights;
    if (bnb) {
      bnb_weights = load_bnb_weights(hf, *bnb, bnb_store);
      m->bnb_quant_type_ = bnb->quant_type;
    } else if (const auto ct = ct_quant_config(config_json, config_path)) {
      bnb_weights = load_ct_weights(hf, *ct, bnb_store);
    } else if (const auto mo = modelopt_quant_config(config_json, config_path, path)) {
      bnb_weights = load_modelopt_weights(hf, *mo, bnb_store);  // NVFP4, with per-tensor scales (weights.h)
    }
    m->weights_ = bind_weights(
        m->config_, WeightNaming::hugging_face,
        [&hf, &bnb_weights](std::string_view name) -> std::optional<Tensor> {
          if (const auto it = bnb_weights.find(name); it != bnb_weights.end()) return it->second;
          const Tensor* t = hf.find_tensor(name);
          return t ? std::optional<Tensor>(*t) : std::nullopt;
        },
        path);
    for (auto& b : bnb_store) m->weights_.owned_bytes.push_back(std::move(b));
    const TokenizerSettings settings = hf.tokenizer_settings();
    m->chat_template_ = settings.chat_template;
    for (int64_t id : hf.generation_defaults().eos_token_ids)
      if (id >= 0 && id < m->config_.vocab_size) m->extra_eos_.push_back(static_cast<int32_t>(id));
    if (with_tokenizer) {
      const auto tj = hf.tokenizer_json_path();
      if (!tj) fail(ErrorKind::not_found, "{}: no tokenizer.json in the model folder", path);
      m->tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_tokenizer_json(*tj, hf.tokenizer_config()));
    }
  } else {
    m->gguf_ = gguf::File::open(path);
    const gguf::File& g = *m->gguf_;
    m->config_ = config_from_gguf(g);
    m->weights_ = bind_weights(
        m->config_, WeightNaming::gguf,
        [&g](std::string_view name) -> std::optional<Tensor> {
          const gguf::TensorInfo* t = g.find_tensor(name);
          return t ? std::optional<Tensor>(t->view()) : std::nullopt;
        },
        path);
    m->chat_template_ = g.opt_string("tokenizer.chat_template");
    if (with_tokenizer) m->tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_gguf(g));
  }
  if (options.stage) {  // before any copy is made of a layer this stage does not hold
    keep_stage_weights(m->weights_, *options.stage, path);
    m->stage_ = options.stage;
  }
  if (options.fold_output_scales) fold_output_scales(m->weights_);
  if (options.quantize_base) {
    if (options.dequantize)
      fail(ErrorKind::internal, "Model::load({}): quantize_base together with dequantize", path);
    // The sources are the file's read-only mapping: each is released once copied.
    quantize_base_weights(m->weights_, *options.quantize_base, path, /*release_source=*/true);
  }
  if (options.dequantize) dequantize_weights(m->weights_);
  if (options.before_pack) options.before_pack(m->weights_, m->config_);
  if (options.pack) {
    if (options.backend == nullptr) fail(ErrorKind::internal, "Model::load({}): pack without a backend", path);
    prepare_weights(m->weights_, *options.backend);
  }
  return m;
}

int64_t Model::parameter_count() const {
  const ModelConfig& c = config_;
  // The whole model's count, also for a pipeline stage (which may hold neither matrix): the config says whether tied.
  const bool tied = c.tied_embeddings || weights_.output.data == weights_.token_embd.data;
  int64_t n = c.vocab_size * c.hidden * (tied ? 1 : 2) + c.hidden;
  const int64_t per_layer = 2 * c.hidden + c.hidden * c.q_dim() * 2 + 2 * c.hidden * c.kv_dim() +
                            3 * c.hidden * c.intermediate + (c.qkv_bias ? c.q_dim() + 2 * c.kv_dim() : 0);
  return n + per_layer * c.n_layers;
}

size_t Model::weight_bytes() const {
  const ModelWeights& w = weights_;
  const size_t vec = static_cast<size_t>(config_.hidden) * sizeof(float);
  size_t n = w.token_embd.data != nullptr ? w.token_embd.nbytes() : 0;
  if (w.output.data != nullptr && w.output.data != w.token_embd.data) n += w.output.nbytes();
  if (w.output_norm != nullptr) n += vec;
  for (const auto& L : w.layers) {
    if (!L.held()) continue;
    for (const Tensor* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) n += t->nbytes();
    n += 2 * vec;  // the two norms
  }
  return n;
}

}  // namespace loom
