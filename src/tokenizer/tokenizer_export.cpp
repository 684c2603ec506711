// Tokenizer -> Hugging Face tokenizer.json / tokenizer_config.json (see
// tokenizer_export.h). The spec already mirrors HF's pipeline step by step, so
// each step is written in the JSON shape load_json.cpp and HF `tokenizers` read.
#include "tokenizer/tokenizer_export.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io/file_write.h"

namespace loom {
namespace {

using ojson = nlohmann::ordered_json;

// A list of steps is written as the step itself when there is one, as a
// Sequence when there are several (HF's own files do the same), null when none.
ojson one_or_sequence(std::vector<ojson> steps, const char* list_key) {
  if (steps.empty()) return nullptr;
  if (steps.size() == 1) return std::move(steps[0]);
  ojson seq;
  seq["type"] = "Sequence";
  seq[list_key] = std::move(steps);
  return seq;
}

ojson pattern_json(const std::string& pattern, bool is_regex) {
  ojson p;
  p[is_regex ? "Regex" : "String"] = pattern;
  return p;
}

const char* scheme_name(PrependScheme s) {
  switch (s) {
    case PrependScheme::always:
      return "always";
    case PrependScheme::first:
      return "first";
    case PrependScheme::never:
      return "never";
  }
  LOOM_ASSERT(false);
  return "";
}

const char* behavior_name(SplitBehavior b) {
  switch (b) {
    case SplitBehavior::removed:
      return "Removed";
    case SplitBehavior::isolated:
      return "Isolated";
    case SplitBehavior::merged_with_previous:
      return "MergedWithPrevious";
    case SplitBehavior::merged_with_next:
      return "MergedWithNext";
    case SplitBehavior::contiguous:
      return "Contiguous";
  }
  LOOM_ASSERT(false);
  return "";
}

ojson normalizer_json(const std::vector<NormalizerStep>& steps) {
  std::vector<ojson> out;
  for (const NormalizerStep& s : steps) {
    ojson j;
    switch (s.kind) {
      case NormalizerStep::Kind::prepend:
        j["type"] = "Prepend";
        j["prepend"] = s.pattern;
        break;
      case NormalizerStep::Kind::replace:
        j["type"] = "Replace";
        j["pattern"] = pattern_json(s.pattern, s.pattern_is_regex);
        j["content"] = s.content;
        break;
      case NormalizerStep::Kind::nfc:
        j["type"] = "NFC";
        break;
    }
    out.push_back(std::move(j));
  }
  return one_or_sequence(std::move(out), "normalizers");
}

ojson pre_tokenizer_json(const std::vector<PreTokenizerStep>& steps) {
  std::vector<ojson> out;
  for (const PreTokenizerStep& s : steps) {
    ojson j;
    switch (s.kind) {
      case PreTokenizerStep::Kind::split:
        j["type"] = "Split";
        j["pattern"] = pattern_json(s.pattern, s.pattern_is_regex);
        j["behavior"] = behavior_name(s.behavior);
        j["invert"] = s.invert;
        break;
      case PreTokenizerStep::Kind::byte_level:
        j["type"] = "ByteLevel";
        j["add_prefix_space"] = s.add_prefix_space;
        j["trim_offsets"] = true;
        j["use_regex"] = s.use_regex;
        break;
      case PreTokenizerStep::Kind::digits:
        j["type"] = "Digits";
        j["individual_digits"] = s.individual_digits;
        break;
      case PreTokenizerStep::Kind::metaspace:
        j["type"] = "Metaspace";
        j["replacement"] = s.replacement;
        j["prepend_scheme"] = scheme_name(s.prepend_scheme);
        j["split"] = s.split;
        break;
    }
    out.push_back(std::move(j));
  }
  return one_or_sequence(std::move(out), "pretokenizers");
}

ojson decoder_json(const TokenizerSpec& spec) {
  if (!spec.has_decoder) return nullptr;
  std::vector<ojson> out;
  for (const DecoderStep& d : spec.decoders) {
    ojson j;
    switch (d.kind) {
      case DecoderStep::Kind::byte_level:
        j["type"] = "ByteLevel";
        j["add_prefix_space"] = true;
        j["trim_offsets"] = true;
        j["use_regex"] = true;
        break;
      case DecoderStep::Kind::replace:
        j["type"] = "Replace";
        j["pattern"] = pattern_json(d.pattern, d.pattern_is_regex);
        j["content"] = d.content;
        break;
      case DecoderStep::Kind::byte_fallback:
        j["type"] = "ByteFallback";
        break;
      case DecoderStep::Kind::fuse:
        j["type"] = "Fuse";
        break;
      case DecoderStep::Kind::strip:
        j["type"] = "Strip";
        j["content"] = d.content;
        j["start"] = d.start;
        j["stop"] = d.stop;
        break;
      case DecoderStep::Kind::metaspace:
        j["type"] = "Metaspace";
        j["replacement"] = d.replacement;
        j["prepend_scheme"] = scheme_name(d.prepend_scheme);
        j["split"] = true;
        break;
    }
    out.push_back(std::move(j));
  }
  // An empty Sequence still counts as a decoder (tokens are concatenated),
  // unlike null, where HF joins them with spaces.
  if (out.empty()) return ojson{{"type", "Sequence"}, {"decoders", ojson::array()}};
  return one_or_sequence(std::move(out), "decoders");
}

// BOS/EOS around $A (and $B) when the tokenizer adds them, as HF's Llama files do.
ojson template_processing(const Tokenizer& tok) {
  const TokenizerSpec& s = tok.spec();
  ojson specials = ojson::object();
  const auto special = [&](int32_t id, int type_id) {
    const std::string& text = tok.token_text(id);
    specials[text] = {{"id", text}, {"ids", ojson::array({id})}, {"tokens", ojson::array({text})}};
    return ojson{{"SpecialToken", {{"id", text}, {"type_id", type_id}}}};
  };
  const auto sequence = [](const char* id, int type_id) {
    return ojson{{"Sequence", {{"id", id}, {"type_id", type_id}}}};
  };
  ojson single = ojson::array(), pair = ojson::array();
  if (s.add_bos) single.push_back(special(s.bos_id, 0));
  single.push_back(sequence("A", 0));
  if (s.add_eos) single.push_back(special(s.eos_id, 0));
  pair = single;
  if (s.add_bos) pair.push_back(special(s.bos_id, 1));
  pair.push_back(sequence("B", 1));
  if (s.add_eos) pair.push_back(special(s.eos_id, 1));
  return {{"type", "TemplateProcessing"}, {"single", single}, {"pair", pair}, {"special_tokens", specials}};
}

ojson post_processor_json(const Tokenizer& tok) {
  const TokenizerSpec& s = tok.spec();
  const bool adds = s.add_bos || s.add_eos;
  if (s.kind != TokenizerKind::byte_level_bpe) return adds ? template_processing(tok) : ojson(nullptr);
  // Byte-level files carry a ByteLevel post-processor (offsets only) as GPT-2's do.
  ojson byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  if (!adds) return byte_level;
  return {{"type", "Sequence"}, {"processors", ojson::array({byte_level, template_processing(tok)})}};
}

// model.vocab: text -> id. A text listed twice keeps its last id (the one the
// BPE model encodes to, in loom and in HF); the earlier ids become holes, as
// do unused (empty) ids. Returns the number of entries.
size_t add_vocab(const TokenizerSpec& s, ojson& vocab) {
  std::unordered_map<std::string_view, size_t> last;
  for (size_t i = 0; i < s.vocab.size(); ++i)
    if (!s.vocab[i].empty()) last[s.vocab[i]] = i;
  // Keys are unique here, so entries go straight into the underlying vector
  // (ordered_json's own insert searches linearly, quadratic for 100k tokens).
  auto& items =
      static_cast<std::vector<std::pair<const std::string, ojson>>&>(vocab.get_ref<ojson::object_t&>());
  items.reserve(last.size());
  for (size_t i = 0; i < s.vocab.size(); ++i)
    if (!s.vocab[i].empty() && last[s.vocab[i]] == i) items.emplace_back(s.vocab[i], static_cast<int64_t>(i));
  return items.size();
}

// added_tokens, by id. HF's loader (and load_json.cpp) ignores the written ids:
// a content found in the model vocabulary takes that id, any other takes the
// next id after the vocabulary; the spec's ids must come out the same.
ojson added_tokens_json(const Tokenizer& tok, size_t model_size) {
  const TokenizerSpec& s = tok.spec();
  std::unordered_map<std::string_view, int32_t> model_ids;
  for (size_t i = 0; i < s.vocab.size(); ++i)
    if (!s.vocab[i].empty()) model_ids[s.vocab[i]] = static_cast<int32_t>(i);
  std::vector<const AddedToken*> sorted;
  for (const AddedToken& t : s.added_tokens) sorted.push_back(&t);
  std::stable_sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->id < b->id; });
  ojson out = ojson::array();
  int64_t next_new = static_cast<int64_t>(model_size);
  for (const AddedToken* t : sorted) {
    const auto it = model_ids.find(t->content);
    const int64_t reloaded = it != model_ids.end() ? it->second : next_new++;
    if (reloaded != t->id)
      fail(ErrorKind::unsupported,
           "{}: {} tokenizer: added token {:?} has id {}, but a tokenizer.json can only give it id {} (ids "
           "of added tokens outside the vocabulary must follow it without gaps)",
           s.name, tok.kind_name(), t->content, t->id, reloaded);
    out.push_back({{"id", t->id},
                   {"content", t->content},
                   {"single_word", t->single_word},
                   {"lstrip", t->lstrip},
                   {"rstrip", t->rstrip},
                   {"normalized", t->normalized},
                   {"special", t->special}});
  }
  return out;
}

ojson token_or_null(const Tokenizer& tok, int32_t id) {
  return id >= 0 ? ojson(tok.token_text(id)) : ojson(nullptr);
}

}  // namespace

nlohmann::ordered_json tokenizer_json_of(const Tokenizer& tok) {
  const TokenizerSpec& s = tok.spec();
  ojson model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = s.unk_token ? ojson(*s.unk_token) : ojson(nullptr);
  model["continuing_subword_prefix"] = nullptr;
  model["end_of_word_suffix"] = nullptr;
  model["fuse_unk"] = s.fuse_unk;
  model["byte_fallback"] = s.byte_fallback;
  model["ignore_merges"] = s.ignore_merges;
  ojson vocab = ojson::object();
  const size_t model_size = add_vocab(s, vocab);
  model["vocab"] = std::move(vocab);
  // Pairs rather than "a b" strings: a SentencePiece token may hold a space.
  ojson merges = ojson::array();
  merges.get_ref<ojson::array_t&>().reserve(s.merges.size());
  for (const auto& [a, b] : s.merges) merges.push_back({a, b});
  model["merges"] = std::move(merges);

  ojson j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = added_tokens_json(tok, model_size);
  j["normalizer"] = normalizer_json(s.normalizers);
  j["pre_tokenizer"] = pre_tokenizer_json(s.pre_tokenizers);
  j["post_processor"] = post_processor_json(tok);
  j["decoder"] = decoder_json(s);
  j["model"] = std::move(model);
  return j;
}

nlohmann::ordered_json tokenizer_config_of(const Tokenizer& tok,
                                           const std::optional<std::string>& chat_template,
                                           int64_t max_length) {
  const TokenizerSpec& s = tok.spec();
  ojson c;
  c["tokenizer_class"] = "PreTrainedTokenizerFast";
  c["bos_token"] = token_or_null(tok, s.bos_id);
  c["eos_token"] = token_or_null(tok, s.eos_id);
  c["unk_token"] = token_or_null(tok, s.unk_id);
  c["pad_token"] = token_or_null(tok, s.pad_id);
  c["add_bos_token"] = s.add_bos;
  c["add_eos_token"] = s.add_eos;
  // transformers would otherwise "clean up" spaces before punctuation on decode.
  c["clean_up_tokenization_spaces"] = false;
  if (max_length > 0) c["model_max_length"] = max_length;
  const std::string& tmpl = chat_template ? *chat_template : s.chat_template;
  if (!tmpl.empty()) c["chat_template"] = tmpl;
  return c;
}

void write_tokenizer_files(const Tokenizer& tok, const std::optional<std::string>& chat_template,
                           int64_t max_length, const std::string& dir) {
  // Raw UTF-8 as HF writes it; the spec holds only valid UTF-8, so strict dumping cannot fail.
  const auto dump = [](const ojson& j) {
    return j.dump(2, ' ', false, ojson::error_handler_t::strict) + "\n";
  };
  const ojson tj = tokenizer_json_of(tok);  // before any write: a refusal leaves no half-written folder
  const ojson cfg = tokenizer_config_of(tok, chat_template, max_length);
  write_file_atomic(dir + "/tokenizer.json", dump(tj));
  write_file_atomic(dir + "/tokenizer_config.json", dump(cfg));
}

}  // namespace loom
