#include "tokenizer/tokenizer_gguf.h"

#include <fmt/format.h>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

// GGUF's token types (llama.cpp's llama_token_type).
enum : int32_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };

bool same_step(const PreTokenizerStep& a, const PreTokenizerStep& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case PreTokenizerStep::Kind::split:
      return a.pattern == b.pattern && a.pattern_is_regex == b.pattern_is_regex && a.behavior == b.behavior &&
             a.invert == b.invert;
    case PreTokenizerStep::Kind::byte_level:
      return a.add_prefix_space == b.add_prefix_space && a.use_regex == b.use_regex;
    case PreTokenizerStep::Kind::digits:
      return a.individual_digits == b.individual_digits;
    case PreTokenizerStep::Kind::metaspace:
      return a.replacement == b.replacement && a.prepend_scheme == b.prepend_scheme && a.split == b.split;
  }
  return false;
}

gguf::Value u32(int64_t v) { return {gguf::ValueType::u32, static_cast<uint64_t>(v)}; }

}  // namespace

std::optional<std::string> gguf_pre_name(const TokenizerSpec& spec) {
  for (const char* name : {"smollm", "llama-bpe", "qwen2", "dbrx", "default"}) {
    TokenizerSpec candidate;
    set_byte_level_pre(candidate, name, spec.name);
    if (candidate.pre_tokenizers.size() != spec.pre_tokenizers.size()) continue;
    bool same = candidate.ignore_merges == spec.ignore_merges;
    for (size_t i = 0; same && i < spec.pre_tokenizers.size(); ++i)
      same = same_step(candidate.pre_tokenizers[i], spec.pre_tokenizers[i]);
    if (same) return std::string(name);
  }
  return std::nullopt;
}

void set_gguf_tokenizer(gguf::Writer& w, const Tokenizer& tok, int64_t n_vocab, const std::string& chat_template,
                        const std::string& source) {
  const TokenizerSpec& spec = tok.spec();
  if (spec.kind != TokenizerKind::byte_level_bpe)
    fail(ErrorKind::unsupported,
         "{}: a {} tokenizer cannot be written to GGUF yet (loom writes byte-level BPE vocabularies: Llama 3, "
         "Qwen2, SmolLM2)",
         source, tok.kind_name());
  const auto pre = gguf_pre_name(spec);
  if (!pre)
    fail(ErrorKind::unsupported,
         "{}: the tokenizer's pre-tokenizer matches none llama.cpp names (gpt2, llama-bpe, qwen2, smollm, dbrx)",
         source);
  if (n_vocab < static_cast<int64_t>(spec.vocab.size()))
    fail(ErrorKind::invalid_input, "{}: the tokenizer has {} tokens, more than the model's {} embedding rows",
         source, spec.vocab.size(), n_vocab);
  gguf::Array tokens{gguf::ValueType::string, {}}, types{gguf::ValueType::i32, {}};
  tokens.items.reserve(static_cast<size_t>(n_vocab));
  types.items.reserve(static_cast<size_t>(n_vocab));
  std::vector<const AddedToken*> added(static_cast<size_t>(n_vocab), nullptr);
  for (const AddedToken& t : spec.added_tokens)
    if (t.id >= 0 && t.id < n_vocab) added[static_cast<size_t>(t.id)] = &t;
  for (int64_t id = 0; id < n_vocab; ++id) {
    const AddedToken* a = added[static_cast<size_t>(id)];
    const bool in_vocab = id < static_cast<int64_t>(spec.vocab.size()) && !spec.vocab[static_cast<size_t>(id)].empty();
    std::string text = a ? a->content : in_vocab ? spec.vocab[static_cast<size_t>(id)] : fmt::format("[PAD{}]", id);
    const int32_t type = a ? (a->special ? kControl : kUserDefined) : in_vocab ? kNormal : kUnused;
    tokens.items.push_back({gguf::ValueType::string, std::move(text)});
    types.items.push_back({gguf::ValueType::i32, int64_t{type}});
  }
  std::vector<std::string> merges;
  merges.reserve(spec.merges.size());
  for (const auto& [a, b] : spec.merges) merges.push_back(a + " " + b);

  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", *pre);
  w.set("tokenizer.ggml.tokens", {gguf::ValueType::array, std::move(tokens)});
  w.set("tokenizer.ggml.token_type", {gguf::ValueType::array, std::move(types)});
  w.set_string_array("tokenizer.ggml.merges", merges);
  if (spec.bos_id >= 0) w.set("tokenizer.ggml.bos_token_id", u32(spec.bos_id));
  if (spec.eos_id >= 0) w.set("tokenizer.ggml.eos_token_id", u32(spec.eos_id));
  if (spec.unk_id >= 0) w.set("tokenizer.ggml.unknown_token_id", u32(spec.unk_id));
  if (spec.pad_id >= 0) w.set("tokenizer.ggml.padding_token_id", u32(spec.pad_id));
  w.set_bool("tokenizer.ggml.add_bos_token", spec.add_bos);
  w.set_bool("tokenizer.ggml.add_eos_token", spec.add_eos);
  const std::string& tmpl = chat_template.empty() ? spec.chat_template : chat_template;
  if (!tmpl.empty()) w.set_string("tokenizer.chat_template", tmpl);
}

}  // namespace loom
