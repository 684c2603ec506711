#include "tokenizer/tokenizer_gguf.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

// GGUF's token types (llama.cpp's llama_token_type).
enum : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

const std::string kMetaspace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

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

bool is_byte_piece(std::string_view t) {
  const auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
  return t.size() == 6 && t.substr(0, 3) == "<0x" && hex(t[3]) && hex(t[4]) && t[5] == '>';
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  for (size_t at = 0;;) {
    const size_t hit = s.find(from, at);
    out.append(s.substr(at, hit == std::string_view::npos ? std::string_view::npos : hit - at));
    if (hit == std::string_view::npos) return out;
    out.append(to);
    at = hit + from.size();
  }
}

void check_fits(const TokenizerSpec& spec, int64_t n_vocab, const std::string& source) {
  if (n_vocab < static_cast<int64_t>(spec.vocab.size()))
    fail(ErrorKind::invalid_input, "{}: the tokenizer has {} tokens, more than the model's {} embedding rows",
         source, spec.vocab.size(), n_vocab);
}

// tokenizer.ggml.tokens and token_type, `n_vocab` long: ids the tokenizer
// lacks become "[PAD<id>]" of type unused, as the converter writes them. A
// SentencePiece vocabulary also marks its unknown and <0xXX> byte tokens, and
// writes the ▁ of a non-special added token matched in the normalized text as
// a space, as the converter does: llama.cpp matches user-defined tokens in the
// raw text, where that ▁ was a space.
std::pair<gguf::Array, gguf::Array> token_list(const TokenizerSpec& spec, int64_t n_vocab, bool spm) {
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
    int32_t type = a ? (a->special ? kControl : kUserDefined) : in_vocab ? kNormal : kUnused;
    if (spm && id == spec.unk_id)
      type = kUnknown;
    else if (spm && type == kNormal && is_byte_piece(text))
      type = kByte;
    else if (spm && type == kUserDefined && a->normalized)
      text = replace_all(text, kMetaspace, " ");
    tokens.items.push_back({gguf::ValueType::string, std::move(text)});
    types.items.push_back({gguf::ValueType::i32, int64_t{type}});
  }
  return {std::move(tokens), std::move(types)};
}

// Whether a SentencePiece-style pipeline puts ▁ before the text (SentencePiece's
// add_dummy_prefix, GGUF's add_space_prefix); nullopt when the pipeline is not
// one llama.cpp's "llama" tokenizer reproduces: spaces as ▁ through either a
// Metaspace pre-tokenizer that does not split, or the older Prepend("▁") +
// Replace(" ", "▁") normalizer, and nothing else.
std::optional<bool> spm_space_prefix(const TokenizerSpec& spec) {
  if (spec.normalizers.empty() && spec.pre_tokenizers.size() == 1) {
    const PreTokenizerStep& m = spec.pre_tokenizers.front();
    if (m.kind != PreTokenizerStep::Kind::metaspace || m.replacement != kMetaspace || m.split) return std::nullopt;
    return m.prepend_scheme != PrependScheme::never;
  }
  if (!spec.pre_tokenizers.empty()) return std::nullopt;
  int prepends = 0, replaces = 0;
  for (const NormalizerStep& n : spec.normalizers) {
    if (n.kind == NormalizerStep::Kind::prepend && n.pattern == kMetaspace)
      ++prepends;
    else if (n.kind == NormalizerStep::Kind::replace && !n.pattern_is_regex && n.pattern == " " &&
             n.content == kMetaspace)
      ++replaces;
    else
      return std::nullopt;
  }
  if (prepends > 1 || replaces != 1) return std::nullopt;
  return prepends == 1;
}

// Refuses what llama.cpp's SentencePiece tokenizer cannot do the same way.
void check_spm_expressible(const TokenizerSpec& spec, const std::string& source) {
  if (!spm_space_prefix(spec))
    fail(ErrorKind::unsupported,
         "{}: the tokenizer's normalizer / pre-tokenizer is not SentencePiece's (spaces as \u2581 by a Metaspace "
         "that does not split, or by Prepend + Replace), which is all llama.cpp's \"llama\" tokenizer does",
         source);
  if (spec.ignore_merges)
    fail(ErrorKind::unsupported, "{}: the tokenizer sets ignore_merges, which llama.cpp's \"llama\" tokenizer lacks",
         source);
  // llama.cpp spells every character it cannot merge as <0xXX> tokens and
  // aborts on a byte that has none; an <unk> fallback cannot be written.
  std::vector<bool> has(256, false);
  for (const std::string& t : spec.vocab)
    if (is_byte_piece(t)) has[std::stoul(t.substr(3, 2), nullptr, 16)] = true;
  const auto missing = std::count(has.begin(), has.end(), false);
  if (!spec.byte_fallback || missing > 0)
    fail(ErrorKind::unsupported,
         "{}: the tokenizer {} (llama.cpp's \"llama\" tokenizer falls back to the 256 <0xXX> byte tokens)", source,
         spec.byte_fallback ? fmt::format("lacks {} of the <0xXX> byte tokens", missing) : "has no byte fallback");
}

// tokenizer.ggml.scores for a SentencePiece vocabulary. llama.cpp's SPM
// tokenizer (src/llama-vocab.cpp) merges, over and over, the adjacent pair
// whose concatenation is a token with the highest score (leftmost first), and
// loom reads such a file back by ordering every split of every token by the
// token's score (load_gguf.cpp, merges_from_scores). So a piece that merge
// rank k makes gets -k (the first merge that makes it, when several do), as
// SentencePiece's own BPE trainer scores pieces, and both readers replay the
// merges in their order. Every other token (characters, bytes, specials,
// added and unused ids) gets a score below all merges, distinct by id:
// SentencePiece gives bytes and specials 0, but it never merges into them,
// while llama.cpp ignores token types when merging, so a 0 would let such a
// token, were it spelled by two pieces, win over every real merge. Scores the
// tokenizer was read with (a GGUF source) are written back as they were.
std::vector<float> spm_scores(const TokenizerSpec& spec, int64_t n_vocab, const std::string& source) {
  const size_t n = spec.vocab.size();
  std::vector<float> scores;
  if (spec.scores.size() == n) {
    scores = spec.scores;
  } else {
    // f32 holds every integer up to 2^24 exactly; beyond, scores would tie.
    if (spec.merges.size() + static_cast<size_t>(n_vocab) > (size_t{1} << 24))
      fail(ErrorKind::unsupported, "{}: {} merges and {} tokens are too many for exact f32 scores", source,
           spec.merges.size(), n_vocab);
    std::unordered_map<std::string, size_t> id_of;  // the last of duplicates, as llama.cpp's token_to_id
    for (size_t i = 0; i < n; ++i)
      if (!spec.vocab[i].empty()) id_of[spec.vocab[i]] = i;
    std::vector<int64_t> rank(n, -1);
    for (size_t r = 0; r < spec.merges.size(); ++r) {
      const auto it = id_of.find(spec.merges[r].first + spec.merges[r].second);
      if (it != id_of.end() && rank[it->second] < 0) rank[it->second] = static_cast<int64_t>(r);
    }
    scores.resize(n);
    const auto n_merges = static_cast<int64_t>(spec.merges.size());
    for (size_t i = 0; i < n; ++i)
      scores[i] = static_cast<float>(rank[i] >= 0 ? -rank[i] : -(n_merges + static_cast<int64_t>(i)));
  }
  // Ids past the vocabulary (added tokens, padding) go below everything.
  const float lowest = n == 0 ? 0.0f : *std::min_element(scores.begin(), scores.end());
  for (int64_t id = static_cast<int64_t>(n); id < n_vocab; ++id)
    scores.push_back(lowest - 1.0f - static_cast<float>(id - static_cast<int64_t>(n)));
  return scores;
}

void set_byte_level_vocab(gguf::Writer& w, const TokenizerSpec& spec, int64_t n_vocab, const std::string& source) {
  const auto pre = gguf_pre_name(spec);
  if (!pre)
    fail(ErrorKind::unsupported,
         "{}: the tokenizer's pre-tokenizer matches none llama.cpp names (gpt2, llama-bpe, qwen2, smollm, dbrx)",
         source);
  check_fits(spec, n_vocab, source);
  auto [tokens, types] = token_list(spec, n_vocab, false);
  std::vector<std::string> merges;
  merges.reserve(spec.merges.size());
  for (const auto& [a, b] : spec.merges) merges.push_back(a + " " + b);
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", *pre);
  w.set("tokenizer.ggml.tokens", {gguf::ValueType::array, std::move(tokens)});
  w.set("tokenizer.ggml.token_type", {gguf::ValueType::array, std::move(types)});
  w.set_string_array("tokenizer.ggml.merges", merges);
}

// As convert_hf_to_gguf.py's _set_vocab_sentencepiece: model "llama", pre
// "default", tokens, scores and types, no merges (llama.cpp does not read them).
void set_spm_vocab(gguf::Writer& w, const TokenizerSpec& spec, int64_t n_vocab, const std::string& source) {
  check_spm_expressible(spec, source);
  check_fits(spec, n_vocab, source);
  auto [tokens, types] = token_list(spec, n_vocab, true);
  gguf::Array scores{gguf::ValueType::f32, {}};
  for (float s : spm_scores(spec, n_vocab, source)) scores.items.push_back({gguf::ValueType::f32, double{s}});
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string("tokenizer.ggml.pre", "default");
  w.set("tokenizer.ggml.tokens", {gguf::ValueType::array, std::move(tokens)});
  w.set("tokenizer.ggml.scores", {gguf::ValueType::array, std::move(scores)});
  w.set("tokenizer.ggml.token_type", {gguf::ValueType::array, std::move(types)});
  w.set_bool("tokenizer.ggml.add_space_prefix", *spm_space_prefix(spec));
}

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
  if (spec.kind == TokenizerKind::byte_level_bpe)
    set_byte_level_vocab(w, spec, n_vocab, source);
  else if (spec.kind == TokenizerKind::spm_bpe)
    set_spm_vocab(w, spec, n_vocab, source);
  else
    fail(ErrorKind::unsupported,
         "{}: a {} tokenizer cannot be written to GGUF (loom writes byte-level BPE vocabularies: Llama 3, Qwen2, "
         "SmolLM2; and SentencePiece-style ones: Llama 2, Mistral, TinyLlama)",
         source, tok.kind_name());
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
