// Hugging Face model folder loading. The optional files are read leniently
// (absent is fine) but strictly once present: bad JSON or a wrong type is an
// error naming the file and key, never a silent default.
#include "io/hf_folder.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/mapped_file.h"

namespace loom {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

bool is_regular_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

// Shard names come from the index file; they must stay inside the folder.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

std::optional<std::string> token_string(const json& j, const char* key, const std::string& path) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {  // serialized AddedToken
    const auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  fail(ErrorKind::invalid_input, "{}: key '{}' must be a string or an object with string 'content', found {}",
       path, key, it->type_name());
}

std::optional<bool> opt_bool(const json& j, const char* key, const std::string& path) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean())
    fail(ErrorKind::invalid_input, "{}: key '{}' must be a boolean, found {}", path, key, it->type_name());
  return it->get<bool>();
}

std::optional<int64_t> opt_int(const json& j, const char* key, const std::string& path) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer() || (it->is_number_unsigned() && it->get<uint64_t>() > INT64_MAX))
    fail(ErrorKind::invalid_input, "{}: key '{}' must be an integer, found {}", path, key, it->type_name());
  return it->get<int64_t>();
}

std::optional<double> opt_number(const json& j, const char* key, const std::string& path) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number())
    fail(ErrorKind::invalid_input, "{}: key '{}' must be a number, found {}", path, key, it->type_name());
  return it->get<double>();
}

std::optional<json> read_optional_object(const std::string& path) {
  if (!is_regular_file(path)) return std::nullopt;
  json j = read_json_file(path);
  if (!j.is_object())
    fail(ErrorKind::invalid_input, "{}: top level must be a JSON object, found {}", path, j.type_name());
  return j;
}

// Views of weight dtypes are made up front (cheap) so lookups stay const and
// thread-safe; a folder with, say, an unused U8 buffer still opens.
HfFolder::WeightRef make_ref(const safetensors::File* file, const safetensors::TensorInfo& t) {
  HfFolder::WeightRef r{file, &t, std::nullopt};
  if (t.st_dtype == safetensors::StDType::f32 || t.st_dtype == safetensors::StDType::f16 ||
      t.st_dtype == safetensors::StDType::bf16)
    r.view = t.weight_view(file->path());
  return r;
}

}  // namespace

json parse_json_text(std::string_view text, const std::string& path) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    // Recompute line/column from the byte offset so the message does not
    // depend on the library's wording.
    const size_t byte = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    size_t line = 1, col = 1;
    for (size_t i = 0; i < byte; ++i) {
      if (text[i] == '\n') { ++line; col = 1; } else { ++col; }
    }
    fail(ErrorKind::invalid_input, "{}: invalid JSON at line {}, column {} (byte {}): {}", path, line, col, byte,
         e.what());
  } catch (const json::exception& e) {  // e.g. a number literal overflowing double
    fail(ErrorKind::invalid_input, "{}: invalid JSON: {}", path, e.what());
  }
}

json read_json_file(const std::string& path) { return parse_json_text(read_text_file(path), path); }

TokenizerSettings parse_tokenizer_settings(const json& j, const std::string& path) {
  if (!j.is_object())
    fail(ErrorKind::invalid_input, "{}: top level must be a JSON object, found {}", path, j.type_name());
  TokenizerSettings s;
  if (const auto it = j.find("chat_template"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      s.chat_template = it->get<std::string>();
    } else if (it->is_array()) {  // [{"name": ..., "template": ...}, ...]
      for (const auto& e : *it) {
        if (!e.is_object() || !e.contains("name") || !e.contains("template") || !e["name"].is_string() ||
            !e["template"].is_string())
          fail(ErrorKind::invalid_input,
               "{}: key 'chat_template': list entries must be objects with string 'name' and 'template'", path);
        if (e["name"] == "default") s.chat_template = e["template"].get<std::string>();
      }
    } else {
      fail(ErrorKind::invalid_input, "{}: key 'chat_template' must be a string or a list, found {}", path,
           it->type_name());
    }
  }
  s.bos_token = token_string(j, "bos_token", path);
  s.eos_token = token_string(j, "eos_token", path);
  s.pad_token = token_string(j, "pad_token", path);
  s.add_bos_token = opt_bool(j, "add_bos_token", path);
  s.add_eos_token = opt_bool(j, "add_eos_token", path);
  return s;
}

GenerationDefaults parse_generation_defaults(const json& j, const std::string& path) {
  if (!j.is_object())
    fail(ErrorKind::invalid_input, "{}: top level must be a JSON object, found {}", path, j.type_name());
  GenerationDefaults g;
  if (const auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    const json list = it->is_array() ? *it : json::array({*it});
    for (const auto& e : list) {
      if (!e.is_number_integer() || (e.is_number_integer() && !e.is_number_unsigned() && e.get<int64_t>() < 0) ||
          (e.is_number_unsigned() && e.get<uint64_t>() > INT64_MAX))
        fail(ErrorKind::invalid_input, "{}: key 'eos_token_id' must be a non-negative integer or a list of them",
             path);
      g.eos_token_ids.push_back(e.get<int64_t>());
    }
  }
  g.bos_token_id = opt_int(j, "bos_token_id", path);
  g.pad_token_id = opt_int(j, "pad_token_id", path);
  g.temperature = opt_number(j, "temperature", path);
  g.top_p = opt_number(j, "top_p", path);
  g.top_k = opt_int(j, "top_k", path);
  g.do_sample = opt_bool(j, "do_sample", path);
  g.max_new_tokens = opt_int(j, "max_new_tokens", path);
  if (g.temperature && !(*g.temperature >= 0.0))
    fail(ErrorKind::invalid_input, "{}: key 'temperature' must be >= 0, found {}", path, *g.temperature);
  if (g.top_p && !(*g.top_p > 0.0 && *g.top_p <= 1.0))
    fail(ErrorKind::invalid_input, "{}: key 'top_p' must be in (0, 1], found {}", path, *g.top_p);
  if (g.top_k && *g.top_k < 0)
    fail(ErrorKind::invalid_input, "{}: key 'top_k' must be >= 0, found {}", path, *g.top_k);
  return g;
}

std::unique_ptr<HfFolder> HfFolder::open(const std::string& dir, bool require_weights) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(ErrorKind::not_found, "{}: not a directory", dir);
  std::unique_ptr<HfFolder> f(new HfFolder());
  f->dir_ = dir;

  const std::string config_path = f->path_of("config.json");
  if (!is_regular_file(config_path))
    fail(ErrorKind::not_found, "{}: no config.json (is this a Hugging Face model folder?)", dir);
  f->config_ = read_json_file(config_path);
  if (!f->config_.is_object())
    fail(ErrorKind::invalid_input, "{}: top level must be a JSON object, found {}", config_path,
         f->config_.type_name());

  // transformers prefers the single file when both exist; so do we.
  const std::string single = f->path_of("model.safetensors");
  const std::string index = f->path_of("model.safetensors.index.json");
  if (is_regular_file(single)) {
    f->load_single(single);
  } else if (is_regular_file(index)) {
    f->load_sharded(index);
  } else if (require_weights) {
    const bool pt = is_regular_file(f->path_of("pytorch_model.bin")) ||
                    is_regular_file(f->path_of("pytorch_model.bin.index.json"));
    fail(ErrorKind::not_found, "{}: no model.safetensors or model.safetensors.index.json{}", dir,
         pt ? " (PyTorch .bin weights are not supported; convert them to safetensors)" : "");
  }

  if (const std::string p = f->path_of("tokenizer.json"); is_regular_file(p)) f->tokenizer_json_path_ = p;
  f->tokenizer_config_ = read_optional_object(f->path_of("tokenizer_config.json"));
  f->generation_config_ = read_optional_object(f->path_of("generation_config.json"));
  return f;
}

std::string HfFolder::path_of(std::string_view file_name) const {
  return (fs::path(dir_) / fs::path(file_name)).string();
}

void HfFolder::load_single(const std::string& path) {
  shards_.push_back(safetensors::File::open(path));
  const auto* file = shards_.back().get();
  for (const auto& t : file->tensors()) weights_.emplace(t.name, make_ref(file, t));
}

void HfFolder::load_sharded(const std::string& index_path) {
  sharded_ = true;
  const json index = read_json_file(index_path);
  if (!index.is_object())
    fail(ErrorKind::invalid_input, "{}: top level must be a JSON object, found {}", index_path, index.type_name());
  const auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object())
    fail(ErrorKind::invalid_input, "{}: key 'weight_map' must be an object of tensor name -> shard file",
         index_path);
  if (wm->empty()) fail(ErrorKind::invalid_input, "{}: 'weight_map' is empty", index_path);

  std::map<std::string, std::string, std::less<>> shard_of;  // tensor -> shard file name
  std::set<std::string> shard_names;
  for (const auto& [tensor, shard] : wm->items()) {
    if (!shard.is_string())
      fail(ErrorKind::invalid_input, "{}: weight_map['{}'] must be a file name string, found {}", index_path,
           tensor, shard.type_name());
    const auto& s = shard.get_ref<const std::string&>();
    if (!is_plain_file_name(s))
      fail(ErrorKind::invalid_input, "{}: weight_map['{}'] = '{}' is not a plain file name in the folder",
           index_path, tensor, s);
    shard_of.emplace(tensor, s);
    shard_names.insert(s);
  }

  for (const auto& name : shard_names) {
    const std::string p = path_of(name);
    if (!is_regular_file(p))
      fail(ErrorKind::not_found, "{}: shard '{}' named in the weight map does not exist", index_path, name);
    shards_.push_back(safetensors::File::open(p));
    const auto* file = shards_.back().get();
    for (const auto& t : file->tensors()) {
      if (const auto it = weights_.find(t.name); it != weights_.end())
        fail(ErrorKind::invalid_input, "{}: tensor '{}' is in both '{}' and '{}'", dir_, t.name,
             it->second.file->path(), file->path());
      const auto m = shard_of.find(t.name);
      if (m == shard_of.end())
        fail(ErrorKind::invalid_input, "{}: tensor '{}' in shard '{}' is not listed in the weight map", index_path,
             t.name, name);
      if (m->second != name)
        fail(ErrorKind::invalid_input, "{}: tensor '{}' is in shard '{}' but the weight map names '{}'",
             index_path, t.name, name, m->second);
      weights_.emplace(t.name, make_ref(file, t));
    }
  }
  for (const auto& [tensor, shard] : shard_of)
    if (weights_.find(tensor) == weights_.end())
      fail(ErrorKind::invalid_input, "{}: the weight map puts tensor '{}' in '{}', which has no such tensor",
           index_path, tensor, shard);
}

std::vector<std::string> HfFolder::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(weights_.size());
  for (const auto& [name, ref] : weights_) names.push_back(name);
  return names;
}

const HfFolder::WeightRef* HfFolder::find_weight(std::string_view name) const {
  const auto it = weights_.find(name);
  return it == weights_.end() ? nullptr : &it->second;
}

const HfFolder::WeightRef& HfFolder::weight_part(std::string_view name, safetensors::StDType dt,
                                                 std::string_view owner) const {
  const WeightRef* r = find_weight(name);
  if (r == nullptr) fail(ErrorKind::invalid_input, "{}: {} has no tensor '{}'", dir_, owner, name);
  if (r->info->st_dtype != dt)
    fail(ErrorKind::invalid_input, "{}: tensor '{}' has dtype {}, expected {}", r->file->path(), name,
         safetensors::st_dtype_name(r->info->st_dtype), safetensors::st_dtype_name(dt));
  return *r;
}

const Tensor* HfFolder::find_tensor(std::string_view name) const {
  const auto it = weights_.find(name);
  if (it == weights_.end()) return nullptr;
  const WeightRef& ref = it->second;
  if (!ref.view)
    fail(ErrorKind::unsupported, "{}: tensor '{}': dtype {} is not supported for weights (F32, F16, BF16 are)",
         ref.file->path(), ref.info->name, safetensors::st_dtype_name(ref.info->st_dtype));
  return &*ref.view;
}

const Tensor& HfFolder::tensor(std::string_view name) const {
  const Tensor* t = find_tensor(name);
  if (t == nullptr) fail(ErrorKind::not_found, "{}: no tensor named '{}' in the model weights", dir_, name);
  return *t;
}

TokenizerSettings HfFolder::tokenizer_settings() const {
  TokenizerSettings s;
  if (tokenizer_config_) s = parse_tokenizer_settings(*tokenizer_config_, path_of("tokenizer_config.json"));
  // Newer transformers save the template beside the config; that file wins.
  if (const std::string p = path_of("chat_template.jinja"); is_regular_file(p)) s.chat_template = read_text_file(p);
  return s;
}

GenerationDefaults HfFolder::generation_defaults() const {
  if (!generation_config_) return {};
  return parse_generation_defaults(*generation_config_, path_of("generation_config.json"));
}

}  // namespace loom
