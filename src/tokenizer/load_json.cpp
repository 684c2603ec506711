// Reads a Hugging Face tokenizer.json (an untrusted file) into a TokenizerSpec.
// Every field is type-checked; anything loom does not implement exactly is
// refused with an error naming the field, rather than tokenized differently.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "io/hf_folder.h"
#include "tokenizer/loader_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

using nlohmann::json;

constexpr int64_t kMaxId = (1 << 24) - 1;
constexpr int kMaxDepth = 16;  // nested Sequence steps (the recursion is bounded for hostile files)

// A JSON value with its dotted path, for messages like
// "tokenizer.json: model.merges[3]: expected a string".
struct Node {
  const json& v;
  std::string path;
  const std::string& file;

  [[noreturn]] void error(std::string_view what) const {
    fail(ErrorKind::invalid_input, "{}: {}{}", file, path.empty() ? "" : path + ": ", what);
  }
  [[noreturn]] void unsupported(std::string_view what) const {
    fail(ErrorKind::unsupported, "{}: {}{}", file, path.empty() ? "" : path + ": ", what);
  }
  Node at(std::string_view key) const { return Node{v.at(std::string(key)), child(key), file}; }
  Node at(size_t i) const { return Node{v.at(i), fmt::format("{}[{}]", path, i), file}; }
  std::string child(std::string_view key) const {
    return path.empty() ? std::string(key) : path + "." + std::string(key);
  }

  bool has(std::string_view key) const {  // present and not null
    auto it = v.find(std::string(key));
    return it != v.end() && !it->is_null();
  }
  const json& object() const {
    if (!v.is_object()) error(fmt::format("expected an object, got {}", v.type_name()));
    return v;
  }
  const json& array() const {
    if (!v.is_array()) error(fmt::format("expected an array, got {}", v.type_name()));
    return v;
  }
  Node field(std::string_view key) const {
    object();
    if (!has(key)) error(fmt::format("missing field '{}'", key));
    return at(key);
  }
  std::string str() const {
    if (!v.is_string()) error(fmt::format("expected a string, got {}", v.type_name()));
    return v.get<std::string>();
  }
  bool boolean() const {
    if (!v.is_boolean()) error(fmt::format("expected true or false, got {}", v.type_name()));
    return v.get<bool>();
  }
  int64_t integer(int64_t lo, int64_t hi) const {
    if (!v.is_number_integer()) error(fmt::format("expected an integer, got {}", v.type_name()));
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(hi)
                               : v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      error(fmt::format("{} is outside [{}, {}]", v.dump(), lo, hi));
    return v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
  }
  std::string opt_str(std::string_view key, std::string dflt) const {
    return has(key) ? at(key).str() : dflt;
  }
  bool opt_bool(std::string_view key, bool dflt) const { return has(key) ? at(key).boolean() : dflt; }
  std::string type() const { return field("type").str(); }
};

std::string one_char(const Node& n) {
  const std::string s = n.str();
  if (!tok::utf8_valid(s) || tok::utf8_length(s) != 1) n.error("expected a single character");
  return s;
}

// {"String": "..."} or {"Regex": "..."}
std::pair<std::string, bool> pattern_of(const Node& n) {
  n.object();
  if (n.has("String")) return {n.at("String").str(), false};
  if (n.has("Regex")) return {n.at("Regex").str(), true};
  n.error("expected {\"String\": ...} or {\"Regex\": ...}");
}

PrependScheme prepend_scheme_of(const Node& n) {
  if (n.has("prepend_scheme")) {
    const std::string s = n.at("prepend_scheme").str();
    if (s == "always") return PrependScheme::always;
    if (s == "first") return PrependScheme::first;
    if (s == "never") return PrependScheme::never;
    n.at("prepend_scheme").error(fmt::format("unknown prepend scheme '{}'", s));
  }
  // Files written before prepend_scheme existed say add_prefix_space.
  return n.opt_bool("add_prefix_space", true) ? PrependScheme::always : PrependScheme::never;
}

void parse_normalizer(const Node& n, std::vector<NormalizerStep>& out, int depth = 0) {
  if (n.v.is_null()) return;
  if (depth > kMaxDepth) n.error("too deeply nested");
  const std::string type = n.type();
  if (type == "Sequence") {
    const Node list = n.field("normalizers");
    list.array();
    for (size_t i = 0; i < list.v.size(); ++i) parse_normalizer(list.at(i), out, depth + 1);
  } else if (type == "Prepend") {
    out.push_back({NormalizerStep::Kind::prepend, n.field("prepend").str(), false, {}});
  } else if (type == "Replace") {
    auto [pattern, is_regex] = pattern_of(n.field("pattern"));
    out.push_back({NormalizerStep::Kind::replace, pattern, is_regex, n.field("content").str()});
  } else if (type == "NFC") {
    out.push_back({NormalizerStep::Kind::nfc, {}, false, {}});
  } else {
    n.unsupported(fmt::format(
        "normalizer type '{}' is not supported (loom has Sequence, Prepend, Replace, NFC)", type));
  }
}

SplitBehavior behavior_of(const Node& n) {
  const std::string s = n.str();
  if (s == "Removed") return SplitBehavior::removed;
  if (s == "Isolated") return SplitBehavior::isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (s == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (s == "Contiguous") return SplitBehavior::contiguous;
  n.error(fmt::format("unknown split behavior '{}'", s));
}

void parse_pre_tokenizer(const Node& n, std::vector<PreTokenizerStep>& out, int depth = 0) {
  if (n.v.is_null()) return;
  if (depth > kMaxDepth) n.error("too deeply nested");
  const std::string type = n.type();
  PreTokenizerStep s;
  if (type == "Sequence") {
    const Node list = n.field("pretokenizers");
    list.array();
    for (size_t i = 0; i < list.v.size(); ++i) parse_pre_tokenizer(list.at(i), out, depth + 1);
    return;
  } else if (type == "ByteLevel") {
    s.kind = PreTokenizerStep::Kind::byte_level;
    s.add_prefix_space = n.opt_bool("add_prefix_space", true);
    s.use_regex = n.opt_bool("use_regex", true);
  } else if (type == "Split") {
    s.kind = PreTokenizerStep::Kind::split;
    std::tie(s.pattern, s.pattern_is_regex) = pattern_of(n.field("pattern"));
    s.behavior = behavior_of(n.field("behavior"));
    s.invert = n.opt_bool("invert", false);
  } else if (type == "Digits") {
    s.kind = PreTokenizerStep::Kind::digits;
    s.individual_digits = n.opt_bool("individual_digits", false);
  } else if (type == "Metaspace") {
    s.kind = PreTokenizerStep::Kind::metaspace;
    s.replacement = one_char(n.field("replacement"));
    s.prepend_scheme = prepend_scheme_of(n);
    s.split = n.opt_bool("split", true);
  } else {
    n.unsupported(fmt::format(
        "pre-tokenizer type '{}' is not supported (loom has Sequence, ByteLevel, Split, Digits, Metaspace)",
        type));
  }
  out.push_back(std::move(s));
}

void parse_decoder(const Node& n, std::vector<DecoderStep>& out, int depth = 0) {
  if (depth > kMaxDepth) n.error("too deeply nested");
  const std::string type = n.type();
  DecoderStep d;
  if (type == "Sequence") {
    const Node list = n.field("decoders");
    list.array();
    for (size_t i = 0; i < list.v.size(); ++i) parse_decoder(list.at(i), out, depth + 1);
    return;
  } else if (type == "ByteLevel") {
    d.kind = DecoderStep::Kind::byte_level;
  } else if (type == "Replace") {
    d.kind = DecoderStep::Kind::replace;
    std::tie(d.pattern, d.pattern_is_regex) = pattern_of(n.field("pattern"));
    d.content = n.field("content").str();
  } else if (type == "ByteFallback") {
    d.kind = DecoderStep::Kind::byte_fallback;
  } else if (type == "Fuse") {
    d.kind = DecoderStep::Kind::fuse;
  } else if (type == "Strip") {
    d.kind = DecoderStep::Kind::strip;
    d.content = one_char(n.field("content"));
    d.start = static_cast<int>(n.field("start").integer(0, 1 << 20));
    d.stop = static_cast<int>(n.field("stop").integer(0, 1 << 20));
  } else if (type == "Metaspace") {
    d.kind = DecoderStep::Kind::metaspace;
    d.replacement = one_char(n.field("replacement"));
    d.prepend_scheme = prepend_scheme_of(n);
  } else {
    n.unsupported(
        fmt::format("decoder type '{}' is not supported (loom has Sequence, ByteLevel, Replace, "
                    "ByteFallback, Fuse, Strip, "
                    "Metaspace)",
                    type));
  }
  out.push_back(std::move(d));
}

// TemplateProcessing's "single" template: special tokens around $A become BOS/EOS.
void parse_post_processor(const Node& n, std::vector<int32_t>& prefix, std::vector<int32_t>& suffix,
                          int depth = 0) {
  if (n.v.is_null()) return;
  if (depth > kMaxDepth) n.error("too deeply nested");
  const std::string type = n.type();
  if (type == "Sequence") {
    const Node list = n.field("processors");
    list.array();
    for (size_t i = 0; i < list.v.size(); ++i) parse_post_processor(list.at(i), prefix, suffix, depth + 1);
  } else if (type == "ByteLevel") {
    // Only adjusts offsets; ids are unchanged.
  } else if (type == "TemplateProcessing") {
    const Node single = n.field("single");
    const Node specials = n.field("special_tokens");
    specials.object();
    single.array();
    bool seen_a = false;
    for (size_t i = 0; i < single.v.size(); ++i) {
      const Node item = single.at(i);
      item.object();
      if (item.has("Sequence")) {
        const std::string id = item.at("Sequence").field("id").str();
        if (id != "A" || seen_a) item.unsupported("only a single $A sequence is supported");
        seen_a = true;
      } else if (item.has("SpecialToken")) {
        const Node st = item.at("SpecialToken");
        const std::string key = st.field("id").str();
        if (!specials.has(key)) st.error(fmt::format("special token '{}' is not in special_tokens", key));
        const Node entry = specials.at(key);
        const Node ids = entry.field("ids");
        ids.array();
        for (size_t k = 0; k < ids.v.size(); ++k)
          (seen_a ? suffix : prefix).push_back(static_cast<int32_t>(ids.at(k).integer(0, kMaxId)));
      } else {
        item.error("expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (!seen_a) single.error("the template has no $A sequence");
  } else {
    n.unsupported(fmt::format(
        "post-processor type '{}' is not supported (loom has TemplateProcessing, ByteLevel, Sequence)",
        type));
  }
}

void parse_model(const Node& model, TokenizerSpec& spec) {
  model.object();
  if (model.has("type") && model.at("type").str() != "BPE")
    model.at("type").unsupported(
        fmt::format("model type '{}' is not supported (only BPE)", model.at("type").str()));
  // vocab: token -> id; ids may leave holes (filled by added tokens).
  const Node vocab = model.field("vocab");
  vocab.object();
  std::vector<std::pair<int64_t, std::string>> entries;
  entries.reserve(vocab.v.size());
  int64_t max_id = -1;
  for (auto it = vocab.v.begin(); it != vocab.v.end(); ++it) {
    const Node id{it.value(), vocab.child(it.key()), vocab.file};
    entries.emplace_back(id.integer(0, kMaxId), it.key());
    max_id = std::max(max_id, entries.back().first);
  }
  if (max_id >= static_cast<int64_t>(2 * entries.size() + 1024))
    vocab.error(fmt::format("ids reach {} for only {} tokens", max_id, entries.size()));
  spec.vocab.assign(static_cast<size_t>(max_id + 1), std::string());
  for (auto& [id, text] : entries) {
    std::string& slot = spec.vocab[static_cast<size_t>(id)];
    if (!slot.empty()) vocab.error(fmt::format("id {} is given to both {:?} and {:?}", id, slot, text));
    if (text.empty()) vocab.error("empty token");
    slot = std::move(text);
  }

  const Node merges = model.field("merges");
  merges.array();
  spec.merges.reserve(merges.v.size());
  for (size_t i = 0; i < merges.v.size(); ++i) {
    const Node m = merges.at(i);
    if (m.v.is_string()) {
      const std::string s = m.str();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 >= s.size() ||
          s.find(' ', sp + 1) != std::string::npos)
        m.error(fmt::format("{:?} is not two tokens separated by one space", s));
      spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (m.v.is_array() && m.v.size() == 2) {
      std::string a = m.at(size_t{0}).str();
      std::string b = m.at(size_t{1}).str();
      spec.merges.emplace_back(std::move(a), std::move(b));
    } else {
      m.error("expected \"a b\" or [\"a\", \"b\"]");
    }
  }

  spec.byte_fallback = model.opt_bool("byte_fallback", false);
  spec.fuse_unk = model.opt_bool("fuse_unk", false);
  spec.ignore_merges = model.opt_bool("ignore_merges", false);
  if (model.has("unk_token")) spec.unk_token = model.at("unk_token").str();
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.has(key) && !model.at(key).str().empty())
      model.at(key).unsupported("subword prefixes and suffixes are not supported");
  if (model.has("dropout")) {
    const Node d = model.at("dropout");
    if (!d.v.is_number()) d.error(fmt::format("expected a number, got {}", d.v.type_name()));
    if (d.v.get<double>() > 0) d.unsupported("BPE dropout is not supported");
  }
}

}  // namespace

TokenizerSpec Tokenizer::spec_from_tokenizer_json(const nlohmann::json& j,
                                                  const std::optional<nlohmann::json>& tokenizer_config,
                                                  const std::string& name) {
  TokenizerSpec spec;
  spec.name = name;
  const Node root{j, "", name};
  root.object();
  parse_model(root.field("model"), spec);

  if (root.has("added_tokens")) {
    // Ids are assigned the way HF's AddedVocabulary does when it loads the file:
    // a content already in the model's vocabulary takes that id, a new one takes
    // the next id after the vocabulary; the "id" written in the file is not used.
    // A content listed twice keeps one entry with the later options.
    std::unordered_map<std::string_view, int32_t> model_ids;
    for (size_t i = 0; i < spec.vocab.size(); ++i)
      if (!spec.vocab[i].empty()) model_ids.emplace(spec.vocab[i], static_cast<int32_t>(i));
    const int64_t model_size = static_cast<int64_t>(model_ids.size());
    int64_t n_new = 0;
    const Node list = root.at("added_tokens");
    list.array();
    for (size_t i = 0; i < list.v.size(); ++i) {
      const Node t = list.at(i);
      AddedToken a;
      t.field("id").integer(0, kMaxId);
      a.content = t.field("content").str();
      a.special = t.opt_bool("special", false);
      a.single_word = t.opt_bool("single_word", false);
      a.lstrip = t.opt_bool("lstrip", false);
      a.rstrip = t.opt_bool("rstrip", false);
      a.normalized = t.opt_bool("normalized", !a.special);
      if (a.content.empty()) continue;  // HF ignores empty added tokens
      auto same = std::find_if(spec.added_tokens.begin(), spec.added_tokens.end(),
                               [&](const AddedToken& o) { return o.content == a.content; });
      if (same != spec.added_tokens.end()) {
        a.id = same->id;
        *same = std::move(a);
        continue;
      }
      if (auto it = model_ids.find(a.content); it != model_ids.end())
        a.id = it->second;
      else
        a.id = static_cast<int32_t>(std::min<int64_t>(model_size + n_new++, kMaxId));
      spec.added_tokens.push_back(std::move(a));
    }
  }
  if (root.has("normalizer")) parse_normalizer(root.at("normalizer"), spec.normalizers);
  if (root.has("pre_tokenizer")) parse_pre_tokenizer(root.at("pre_tokenizer"), spec.pre_tokenizers);
  spec.has_decoder = root.has("decoder");
  if (spec.has_decoder) parse_decoder(root.at("decoder"), spec.decoders);
  std::vector<int32_t> prefix, suffix;
  if (root.has("post_processor")) parse_post_processor(root.at("post_processor"), prefix, suffix);
  if (prefix.size() > 1 || suffix.size() > 1)
    root.at("post_processor").unsupported("only one special token before and after the text is supported");
  if (!prefix.empty()) {
    spec.bos_id = prefix[0];
    spec.add_bos = true;
  }
  if (!suffix.empty()) {
    spec.eos_id = suffix[0];
    spec.add_eos = true;
  }

  // tokenizer_config.json: named BOS/EOS/PAD tokens and add_*_token flags win.
  if (tokenizer_config) {
    const std::string cfg_name = name + " (tokenizer_config)";
    const TokenizerSettings st = parse_tokenizer_settings(*tokenizer_config, cfg_name);
    const auto id_of = [&](const std::optional<std::string>& text, const char* key) {
      if (!text) return int32_t{-1};
      const int32_t id = tok::find_token(spec, *text);
      if (id < 0)
        fail(ErrorKind::invalid_input, "{}: {} {:?} is not a token of {}", cfg_name, key, *text, name);
      return id;
    };
    if (st.bos_token) spec.bos_id = id_of(st.bos_token, "bos_token");
    if (st.eos_token) spec.eos_id = id_of(st.eos_token, "eos_token");
    if (st.pad_token) spec.pad_id = id_of(st.pad_token, "pad_token");
    if (st.add_bos_token) spec.add_bos = *st.add_bos_token;
    if (st.add_eos_token) spec.add_eos = *st.add_eos_token;
    if (st.chat_template) spec.chat_template = *st.chat_template;
  }
  // Without a config, name the usual BOS/EOS tokens (they are not added).
  if (spec.bos_id < 0)
    for (std::string_view t : {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"})
      if ((spec.bos_id = tok::find_token(spec, t)) >= 0) break;
  if (spec.eos_id < 0)
    for (std::string_view t : {"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"})
      if ((spec.eos_id = tok::find_token(spec, t)) >= 0) break;
  if (spec.unk_token) spec.unk_id = tok::find_token(spec, *spec.unk_token);
  tok::add_known_eog_tokens(spec);
  spec.kind = tok::infer_kind(spec);
  return spec;
}

Tokenizer Tokenizer::from_tokenizer_json(const std::string& path,
                                         const std::optional<nlohmann::json>& tokenizer_config) {
  return from_spec(spec_from_tokenizer_json(read_json_file(path), tokenizer_config, path));
}

}  // namespace loom
